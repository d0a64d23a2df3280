"""The emulator's environment variables and limits: a bad value is a ValueError naming it, never a crash."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cuflash
import cuflash.emulate as emu
from cuflash.cuda import specs
from cuflash.backends import emulate as emulate_backend
from emu_helpers import spec

TESTS = Path(__file__).parent
ROOT = Path(emu.__file__).parents[2]


def _copy_launch(**kw):
    out = np.zeros(4, np.float32)
    emu.launch(spec("runtime_tests.cu", "copy_kernel", (np.arange(4, dtype=np.float32), out, np.int32(4))), **kw)
    return out


def _subprocess(code, **env):
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TESTS)!r})\n" + code],
                          env=full, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name,value", [
    ("CUFLASH_EMULATE_SCHEDULE", "sideways"),
    ("CUFLASH_EMULATE_SEED", "abc"),
    ("CUFLASH_EMULATE_SEED", "-1"),
    ("CUFLASH_EMULATE_STACK_KIB", "lots"),
    ("CUFLASH_EMULATE_DEBUG", "maybe"),
    ("CUFLASH_EMULATE_PCH", "2"),
    ("CUFLASH_EMULATE_CXX", "  "),
    ("CUFLASH_EMULATE_CACHE", " "),
    ("CUFLASH_EMULATE_HW_MATH", "fast"),
    ("CUFLASH_EMULATE_ARCH", "75"),
])
def test_a_malformed_variable_fails_the_launch_naming_it(monkeypatch, name, value):
    _copy_launch()  # compiled and loaded: the bad value must be noticed even when nothing is compiled
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}={value!r} is not valid: expected"):
        _copy_launch()


def test_a_malformed_compiler_variable_makes_the_emulator_unavailable_with_the_reason(monkeypatch):
    monkeypatch.setenv("CUFLASH_EMULATE_CXX", " ")
    ok, reason = emu.available()
    assert not ok and "CUFLASH_EMULATE_CXX" in reason


@pytest.mark.parametrize("cxx,why", [("/bin/true", "cannot open shared object file"),
                                     ("gcc", "undefined symbol")])
def test_a_compiler_that_builds_no_loadable_cpp_library_makes_the_emulator_unavailable(monkeypatch, cxx, why):
    """`python -m cuflash` listed the emulator as available with these (the probe only parsed the CUDA headers),
    and every launch then failed."""
    import shutil

    if shutil.which(cxx) is None:
        pytest.skip(f"no {cxx} here")
    monkeypatch.setenv("CUFLASH_EMULATE_CXX", cxx)
    ok, reason = emu.available()
    assert not ok and "builds no loadable C++ library" in reason and why in reason, reason
    assert cuflash.backends.status()["emulate"] == (False, reason)


@pytest.mark.parametrize("value", ["abc", "75"])
def test_a_bad_arch_fails_the_attention_call_not_the_import(monkeypatch, value):
    monkeypatch.setenv("CUFLASH_EMULATE_ARCH", value)
    proc = _subprocess("import cuflash.backends, cuflash.backends.emulate; print(cuflash.backends.status()['numpy'])",
                       CUFLASH_EMULATE_ARCH=value)
    assert proc.returncode == 0 and "True" in proc.stdout, proc.stderr[-3000:]
    q = np.ones((1, 8, 1, 32), np.float16)
    with pytest.raises(ValueError, match=rf"CUFLASH_EMULATE_ARCH={value!r} is not valid: expected 80, 86, 89 or 90"):
        cuflash.attention(q, q, q, backend="emulate")


def test_arch_is_read_at_each_use(monkeypatch):
    for value, cc in (("86", 86), ("90", 90), (None, 80)):
        if value is None:
            monkeypatch.delenv("CUFLASH_EMULATE_ARCH")
        else:
            monkeypatch.setenv("CUFLASH_EMULATE_ARCH", value)
        assert emulate_backend._max_smem() == specs.SMEM_LIMIT[cc]


STACK_PROBE = """
import numpy as np
import cuflash.emulate as emu
from emu_helpers import spec
try:
    emu.launch(spec("runtime_tests.cu", "copy_kernel", (np.zeros(4, np.float32), np.zeros(4, np.float32),
                                                        np.int32(4))){kwargs})
    print("launched")
except ValueError as exc:
    print("ValueError:", exc)
"""


@pytest.mark.parametrize("env,kwargs,names", [
    ({"CUFLASH_EMULATE_STACK_KIB": "1"}, "", "CUFLASH_EMULATE_STACK_KIB='1'"),
    ({}, ", stack_kib=1", "stack_kib=1"),
    ({}, f", stack_kib={emu.MIN_STACK_KIB - 1}", f"stack_kib={emu.MIN_STACK_KIB - 1}"),
])
def test_a_stack_below_the_safe_minimum_is_refused(env, kwargs, names):
    """In a subprocess: a regression would die of SIGSEGV in a fiber's guard page."""
    proc = _subprocess(STACK_PROBE.format(kwargs=kwargs), **env)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    assert "ValueError" in proc.stdout and names in proc.stdout and str(emu.MIN_STACK_KIB) in proc.stdout, \
        proc.stdout


MINIMUM_STACK_ATTENTION = """
import numpy as np
import cuflash.emulate as emu
from cuflash.backends import emulate as backend
from cuflash.problem import check_backward, make_problem
launch = emu.launch
emu.launch = lambda launch_spec, **kw: launch(launch_spec, stack_kib=emu.MIN_STACK_KIB, **kw)
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, 40, 1, 256)).astype(np.float16) for _ in range(4))
problem = make_problem(q, k, v, causal=True, dropout_p=0.1, seed=3)
out, lse = backend.forward(problem)
grads = backend.backward(problem, *check_backward(problem, dout, out, lse))
print("finite", bool(np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)))
"""


def test_the_minimum_stack_runs_the_attention_kernels():
    """Forward and backward at the widest head dim (the deepest frames), at exactly the accepted minimum; in a
    subprocess, since too small a minimum ends in SIGSEGV."""
    proc = _subprocess(MINIMUM_STACK_ATTENTION)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    assert "finite True" in proc.stdout


def test_stack_kib_must_be_an_integer():
    with pytest.raises(TypeError, match="stack_kib"):
        _copy_launch(stack_kib=128.5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(seed=-1), ValueError, r"seed must be an int in \[0, 2\*\*64\) or None, got -1"),
    (dict(seed=2**64), ValueError, "seed must be an int in"),
    (dict(seed=2.9), TypeError, "seed must be an int in .* got float"),
    (dict(seed="abc"), TypeError, "seed must be an int in .* got str"),
    (dict(seed=True), TypeError, "seed must be an int in .* got bool"),
    (dict(hw_math="no"), TypeError, "hw_math must be a bool or None, got str"),
    (dict(hw_math=1), TypeError, "hw_math must be a bool or None, got int"),
])
def test_seed_and_hw_math_are_checked(kwargs, error, match):
    """launch's seed was int() of anything, masked to 64 bits (-1 became 2**64 - 1, 2.9 became 2, "abc" a bare int()
    error), and hw_math a truth test ("no" turned the GPU-like math on), all after the kernel compiled; they are
    checked with schedule and stack_kib now."""
    with pytest.raises(error, match=match):
        _copy_launch(**kwargs)


def test_the_readme_table_is_the_variables_table():
    """The README's table of environment variables is cuflash._env.VARIABLES, row for row, and nothing in cuflash
    reads a CUFLASH_* variable around the table."""
    from pathlib import Path
    import re

    from cuflash import _env

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(CUFLASH_\w+)` \| (.+?) \| (.+?) \| (.+?) \|$", section, re.M)
    want = []
    for name, var in _env.VARIABLES.items():
        default = ("1" if var.default else "0") if isinstance(var.default, bool) else \
            ("unset" if var.default is None else str(var.default))
        want.append((name, var.accepted, default, var.meaning))
    assert rows == want
    readers = [p for p in (root / "cuflash").rglob("*.py")
               if p.name != "_env.py" and re.search(r"environ(\.get)?\(?\[?[\"']CUFLASH_", p.read_text())]
    assert readers == [], f"read CUFLASH_* variables outside cuflash._env: {readers}"


def test_a_failed_compiler_probe_is_tried_again(monkeypatch):
    """A probe that failed (a timeout on a loaded machine) is not remembered: the next launch probes again, and a
    toolchain once found is kept."""
    from cuflash.emulate import _toolchain

    real, calls = _toolchain._probe, []

    def flaky(cxx):
        calls.append(cxx)
        return (None, "timed out") if len(calls) == 1 else real(cxx)

    monkeypatch.setattr(_toolchain, "_probe", flaky)
    monkeypatch.setattr(_toolchain, "_FOUND", {})
    assert _toolchain._find("g++") == (None, "timed out")
    found = _toolchain._find("g++")
    assert found[0] is not None and _toolchain._find("g++") == found and len(calls) == 2
