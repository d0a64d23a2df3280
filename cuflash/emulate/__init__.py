"""Run cuflash's CUDA kernels on the CPU, unchanged: the kernel test bed for machines without a GPU.

The kernel source that CuPy would compile is compiled with g++ against a small shim (``kernels/emulate/``), the
threads of each block run as cooperative fibers, and every inline PTX wrapper of ``kernels/arch.cuh`` has an
emulated twin following the PTX ISA fragment layouts. This is test infrastructure, not a CPU backend for users
(that is the NumPy backend). See ``kernels/emulate/README.md``.

Environment variables: ``CUFLASH_EMULATE_SCHEDULE`` (forward|reverse|random), ``CUFLASH_EMULATE_SEED``,
``CUFLASH_EMULATE_STACK_KIB`` (fiber stack, default 256), ``CUFLASH_EMULATE_CACHE`` (library cache directory),
``CUFLASH_EMULATE_DEBUG=1`` (build with -O0 -g), ``CUFLASH_EMULATE_PCH=0`` (no precompiled shim),
``CUFLASH_EMULATE_CXX`` (compiler).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..cuda.launch import LaunchSpec
from ._build import CompileError, build, cache_dir, compile_log
from ._runner import SCHEDULES, BankStats, EmulationError, Library
from ._toolchain import find

__all__ = ["launch", "available", "compile", "BankStats", "EmulationError", "CompileError", "sanitizer_env", "cache_dir",
           "compile_log", "SCHEDULES", "requires_emulation", "skip_unless_available"]

MAX_THREADS_PER_BLOCK = 1024
MAX_SHARED_BYTES = 227 * 1024  # opt-in maximum per block on sm_90 (sm_80: 163 KiB)

_libraries: dict[Path, Library] = {}
_by_spec: dict[tuple, Library] = {}  # skips hashing the source on repeated launches of one kernel


def available() -> tuple[bool, str]:
    """(True, description of the toolchain) or (False, why emulated kernels cannot run here)."""
    tc, reason = find()
    return tc is not None, reason


def requires_emulation():
    """A pytest mark that skips, with the reason, where emulated kernels cannot run.

    ``pytestmark = [pytest.mark.emulate, cuflash.emulate.requires_emulation()]``
    """
    import pytest

    ok, reason = available()
    return pytest.mark.skipif(not ok, reason=f"CPU emulation unavailable: {reason}")


def skip_unless_available() -> None:
    """Inside a test or fixture: pytest.skip with the reason where emulated kernels cannot run."""
    import pytest

    ok, reason = available()
    if not ok:
        pytest.skip(f"CPU emulation unavailable: {reason}")


def _require_toolchain():
    tc, reason = find()
    if tc is None:
        raise RuntimeError(f"cuflash.emulate is not available: {reason}")
    return tc


def _asan_loaded() -> bool:
    try:
        return "libasan" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def compile(spec: LaunchSpec, *, sanitize: bool = False) -> Library:  # noqa: A001 - mirrors the CUDA backend
    """Build (or fetch from the cache) and load the library for ``spec``'s kernel; returns it."""
    if sanitize and not _asan_loaded():
        raise RuntimeError("sanitize=True needs AddressSanitizer's runtime loaded first: run the process with "
                           "cuflash.emulate.sanitizer_env() (LD_PRELOAD=libasan.so)")
    debug = os.environ.get("CUFLASH_EMULATE_DEBUG", "") not in ("", "0")
    key = (spec.source, spec.name_expression, tuple(spec.options), sanitize, debug)
    if key not in _by_spec:
        path = build(_require_toolchain(), spec.source, spec.name_expression, tuple(spec.options), sanitize=sanitize,
                     debug=debug)
        if path not in _libraries:
            _libraries[path] = Library(path)
        _by_spec[key] = _libraries[path]
    return _by_spec[key]


def _dims(name: str, value) -> tuple[int, int, int]:
    dims = tuple(int(v) for v in value) + (1,) * (3 - len(tuple(value)))
    if len(dims) != 3 or any(d < 1 for d in dims):
        raise ValueError(f"{name} must be 1 to 3 positive integers, got {value!r}")
    return dims


def _schedule(schedule: str | None) -> int:
    name = schedule or os.environ.get("CUFLASH_EMULATE_SCHEDULE") or "forward"
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name]


def launch(spec: LaunchSpec, *, schedule: str | None = None, seed: int | None = None, sanitize: bool = False,
           stack_kib: int | None = None) -> BankStats:
    """Run ``spec`` on the CPU. NumPy arrays in ``spec.args`` are the device buffers and are written in place.

    Returns the launch's shared-memory :class:`BankStats` (bank conflicts of its ldmatrix and cp.async).

    schedule: order in which a block's threads run between barriers ("forward", "reverse", "random"), default
        from ``CUFLASH_EMULATE_SCHEDULE`` or "forward"; blocks follow the same order. seed: for "random"
        (default ``CUFLASH_EMULATE_SEED`` or 0). sanitize: AddressSanitizer + UBSan build (the process must
        have been started with :func:`sanitizer_env`). stack_kib: fiber stack size.
    Raises TypeError when an argument does not match the kernel's parameter type, EmulationError when the
    kernel fails (device assert, deadlock, divergent barrier, ...), CompileError when g++ rejects the source.
    """
    grid, block = _dims("grid", spec.grid), _dims("block", spec.block)
    threads = block[0] * block[1] * block[2]
    if threads > MAX_THREADS_PER_BLOCK:
        raise ValueError(f"block {block} has {threads} threads; CUDA allows {MAX_THREADS_PER_BLOCK}")
    if not 0 <= spec.shared_bytes <= MAX_SHARED_BYTES:
        raise ValueError(f"shared_bytes={spec.shared_bytes} outside [0, {MAX_SHARED_BYTES}]")
    seed = int(os.environ.get("CUFLASH_EMULATE_SEED", "0")) if seed is None else int(seed)
    stack = int(stack_kib or os.environ.get("CUFLASH_EMULATE_STACK_KIB") or 256) * 1024
    lib = compile(spec, sanitize=sanitize)
    return lib.launch(spec.args, grid, block, int(spec.shared_bytes), _schedule(schedule), seed & (2**64 - 1),
                      stack)


def sanitizer_env(base: dict | None = None) -> dict:
    """Environment for a subprocess that may call ``launch(..., sanitize=True)``: libasan preloaded."""
    import subprocess

    env = dict(os.environ if base is None else base)
    tc = _require_toolchain()
    libasan = subprocess.run([tc.cxx, "-print-file-name=libasan.so"], capture_output=True, text=True,
                             check=True).stdout.strip()
    env["LD_PRELOAD"] = libasan
    # Python itself leaks by design; report errors once and stop, so the parent sees a failed process.
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:halt_on_error=1:exitcode=86"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1:exitcode=87"
    return env
