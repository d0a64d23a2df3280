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
