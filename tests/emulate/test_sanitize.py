"""The sanitizer build catches out-of-bounds global, static shared and dynamic shared accesses.

Each case runs in a subprocess started with libasan preloaded (cuflash.emulate.sanitizer_env): an ASan report
ends that process, never the test session.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cuflash.emulate as emu

SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
import cuflash.emulate as emu
from emu_helpers import spec
out = np.zeros(32, np.float32)  # exactly 32 floats: ASan sees the byte after it
emu.launch(spec("sanitize_tests.cu", "planted_kernel", (out, np.int32(32), np.int32({mode})), shared_bytes=100),
           sanitize=True)
print("clean", float(out[0]))
"""


def _libasan_or_skip():
    ok, reason = emu.available()
    if not ok:
        pytest.skip(reason)
    try:
        env = emu.sanitizer_env()
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot locate libasan: {exc}")
    if not os.path.isabs(env["LD_PRELOAD"]) or not os.path.exists(env["LD_PRELOAD"]):
        pytest.skip(f"g++ has no libasan.so ({env['LD_PRELOAD']})")
    return env


def _run(mode):
    env = _libasan_or_skip()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(emu.__file__).parents[2]), env.get("PYTHONPATH", "")])
    code = SCRIPT.format(tests=str(Path(__file__).parent), mode=mode)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_clean_kernel_runs_under_sanitizers():
    proc = _run(0)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "clean" in proc.stdout


@pytest.mark.parametrize("mode,where", [(1, "global"), (2, "static shared"), (3, "dynamic shared")])
def test_out_of_bounds_write_is_reported(mode, where):
    proc = _run(mode)
    assert proc.returncode != 0, f"{where} overflow went unnoticed"
    assert "heap-buffer-overflow" in proc.stderr, proc.stderr[-4000:]
    assert "planted_kernel" in proc.stderr  # the report points into the kernel


def test_undefined_behaviour_is_reported():
    proc = _run(4)
    assert proc.returncode != 0
    assert "signed integer overflow" in proc.stderr, proc.stderr[-4000:]


def test_sanitize_without_preloaded_runtime_is_refused():
    _libasan_or_skip()
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("this process has ASan preloaded")
    from emu_helpers import spec
    import numpy as np

    with pytest.raises(RuntimeError, match="LD_PRELOAD"):
        emu.launch(spec("sanitize_tests.cu", "planted_kernel", (np.zeros(32, np.float32), np.int32(32),
                                                               np.int32(0)), shared_bytes=100), sanitize=True)


# The attention kernels themselves under the sanitizers: the forward, the backward (both dQ modes) with what reaches
# the most code (GQA, a padded head dim, causal, seqlens, a broadcast bias with its gradient, dropout), and a paged
# KV-cache decode split over keys with an append, each launch built with -fsanitize=address,undefined, the results
# held to the float64 reference. (The GPU's compute-sanitizer runs only when a GPU is lent; this runs everywhere.)
ATTENTION = """
import functools, sys
import numpy as np
sys.path.insert(0, {tests!r})
import cuflash, cuflash.emulate as emu
emu.launch = functools.partial(emu.launch, sanitize=True)
from cases import make_case
from emulated_support import emulated_backward, forward
from test_kvcache import Cache, check_call
import cases

rng = np.random.default_rng(0)
bias = rng.standard_normal((4, 1, 70)).astype(np.float32)
case = make_case(2, 70, 70, 4, 2, 40, np.float16, causal=True, seqlens_q=np.array([70, 51]),
                 seqlens_k=np.array([70, 66]), bias=bias)
out, lse = forward(case)
for deterministic in (False, True):
    cases.check_backward(emulated_backward(deterministic), case, out, lse)
dropped = cases.dropout_case(1, 70, 70, 2, 1, 64, np.float16, p=0.25, seed=5)
out, lse = forward(dropped)
cases.check_backward(emulated_backward(), dropped, out, lse)
cache = Cache(rng, 2, 96, 2, 64, np.float16, 16)
q = rng.standard_normal((2, 3, 4, 64)).astype(np.float16)
k_new, v_new = (rng.standard_normal((2, 3, 2, 64)).astype(np.float16) for _ in range(2))
check_call(q, cache, np.array([47, 80], np.int32), k_new, v_new, dict(causal=True, num_splits=3, backend="emulate"))
print("clean")
"""


def test_the_attention_kernels_run_clean_under_the_sanitizers():
    env = _libasan_or_skip()
    tests = Path(__file__).parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(Path(emu.__file__).parents[2]), str(tests), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", ATTENTION.format(tests=str(tests))], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr[-6000:]
