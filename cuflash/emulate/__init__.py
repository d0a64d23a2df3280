"""Run cuflash's CUDA kernels on the CPU, unchanged: the kernel test bed for machines without a GPU.

The kernel source that CuPy would compile is compiled with g++ against a small shim (``kernels/emulate/``), the
threads of each block run as cooperative fibers, and every inline PTX wrapper of ``kernels/arch.cuh`` has an
emulated twin following the PTX ISA fragment layouts. This is test infrastructure, not a CPU backend for users
(that is the NumPy backend). See ``kernels/emulate/README.md``.

Environment variables (parsed by :mod:`cuflash._env`): ``CUFLASH_EMULATE_SCHEDULE`` (forward|reverse|random),
``CUFLASH_EMULATE_SEED``, ``CUFLASH_EMULATE_STACK_KIB`` (fiber stack, default 256), ``CUFLASH_EMULATE_CACHE``
(library cache directory), ``CUFLASH_EMULATE_DEBUG=1`` (build with -O0 -g), ``CUFLASH_EMULATE_PCH=0`` (no
precompiled shim), ``CUFLASH_EMULATE_CXX`` (compiler), ``CUFLASH_EMULATE_HW_MATH=1`` (GPU-like fp32 rounding).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from .. import _env
from ..cuda.launch import LaunchSpec
from ._build import CompileError, build, compile_log
from ._cache import cache_dir
from ._runner import SCHEDULES, BankStats, EmulationError, Library
from ._toolchain import find

__all__ = ["launch", "available", "compile", "BankStats", "EmulationError", "CompileError", "sanitizer_env", "cache_dir",
           "compile_log", "SCHEDULES", "MIN_STACK_KIB", "requires_emulation", "skip_unless_available"]

MAX_THREADS_PER_BLOCK = 1024
MAX_SHARED_BYTES = 227 * 1024  # opt-in maximum per block on sm_90 (sm_80: 163 KiB)
MIN_STACK_KIB = _env.EMULATE_MIN_STACK_KIB  # a smaller fiber stack would overflow in the attention kernels
MAX_STACK_KIB = 1 << 20

_libraries: dict[Path, Library] = {}
_by_spec: dict[tuple, Library] = {}  # skips hashing the source on repeated launches of one kernel
# One build of a kernel at a time in the process: threads asking for the same kernel at once compiled it each (8
# compiles for 2 kernels from 4 threads); different kernels still build side by side.
_building: dict[tuple, threading.Lock] = {}
_building_lock = threading.Lock()


def _after_fork_in_child():
    """No build runs in a forked child: locks held by the parent's builds at the fork start free there."""
    global _building_lock
    _building_lock = threading.Lock()
    _building.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def available() -> tuple[bool, str]:
    """(True, description of the toolchain) or (False, why emulated kernels cannot run here): no toolchain, or no
    safe cache for the libraries it builds (``python -m cuflash`` listed the backend as available beside a
    world-writable CUFLASH_EMULATE_CACHE, which every launch then refused)."""
    try:
        tc, reason = find()
        if tc is not None:
            cache_dir()
    except ValueError as exc:  # a malformed CUFLASH_EMULATE_CXX or CUFLASH_EMULATE_CACHE: launches raise it
        return False, str(exc)
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
    debug = _env.get("CUFLASH_EMULATE_DEBUG")
    key = (spec.source, spec.name_expression, tuple(spec.options), sanitize, debug)
    cache_dir()  # every launch: a cache made unsafe (or misconfigured) since the last load is an error, not ignored
    if key not in _by_spec:
        with _building_lock:
            lock = _building.setdefault(key, threading.Lock())
        with lock:
            if key not in _by_spec:  # built by the thread that held the lock before
                path = build(_require_toolchain(), spec.source, spec.name_expression, tuple(spec.options),
                             sanitize=sanitize, debug=debug)
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
    name = schedule or _env.get("CUFLASH_EMULATE_SCHEDULE")
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name]


def _stack_bytes(stack_kib) -> int:
    """Fiber stack size: the argument, else CUFLASH_EMULATE_STACK_KIB (whose table entry enforces the limits)."""
    if stack_kib is None:
        return _env.get("CUFLASH_EMULATE_STACK_KIB") * 1024
    if isinstance(stack_kib, bool) or not isinstance(stack_kib, (int, np.integer)):
        raise TypeError(f"stack_kib must be an integer number of KiB, got {type(stack_kib).__name__}")
    if not MIN_STACK_KIB <= stack_kib <= MAX_STACK_KIB:
        raise ValueError(f"stack_kib={stack_kib} is outside [{MIN_STACK_KIB}, {MAX_STACK_KIB}]: below "
                         f"{MIN_STACK_KIB} KiB the attention kernels overflow their fiber stacks (SIGSEGV)")
    return int(stack_kib) * 1024


def _check_environment() -> None:
    """Parses every CUFLASH_EMULATE_* variable, so that a malformed one fails the next launch (a ValueError naming
    it) whether or not that launch reads it: the compiler and cache variables are otherwise read only when a
    kernel is compiled."""
    for name in _env.VARIABLES:
        if name.startswith("CUFLASH_EMULATE_"):
            _env.get(name)


def _seed(seed) -> int:
    """The "random" schedule's seed: the argument, else CUFLASH_EMULATE_SEED; an int in [0, 2**64) (-1 became
    2**64 - 1 and 2.9 became 2, silently)."""
    if seed is None:
        return _env.get("CUFLASH_EMULATE_SEED")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int in [0, 2**64) or None, got {type(seed).__name__}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64) or None, got {seed}")
    return int(seed)


def _hw_math(hw_math) -> bool:
    if hw_math is None:
        return _env.get("CUFLASH_EMULATE_HW_MATH")
    if not isinstance(hw_math, (bool, np.bool_)):  # "no" turned it on
        raise TypeError(f"hw_math must be a bool or None, got {type(hw_math).__name__}")
    return bool(hw_math)


def launch(spec: LaunchSpec, *, schedule: str | None = None, seed: int | None = None, sanitize: bool = False,
           stack_kib: int | None = None, hw_math: bool | None = None) -> BankStats:
    """Run ``spec`` on the CPU. NumPy arrays in ``spec.args`` are the device buffers and are written in place.

    Returns the launch's shared-memory :class:`BankStats` (bank conflicts of its ldmatrix and cp.async).

    schedule: order in which a block's threads run between barriers ("forward", "reverse", "random"), default
        from ``CUFLASH_EMULATE_SCHEDULE`` or "forward"; blocks follow the same order. seed: for "random"
        (default ``CUFLASH_EMULATE_SEED`` or 0). sanitize: AddressSanitizer + UBSan build (the process must
        have been started with :func:`sanitizer_env`). stack_kib: fiber stack size (default
        ``CUFLASH_EMULATE_STACK_KIB`` or 256; at least :data:`MIN_STACK_KIB`). hw_math: GPU-like fp32 (denormals
        flushed to zero, ``exp2f``/``__expf`` with the error ex2.approx.ftz.f32 may have), default
        ``CUFLASH_EMULATE_HW_MATH`` or off.
    Raises TypeError when an argument does not match the kernel's parameter type, EmulationError when the
    kernel fails (device assert, deadlock, divergent barrier, ...), CompileError when g++ rejects the source.
    Ctrl-C stops the launch at its next barrier and raises KeyboardInterrupt (the library stays usable).
    """
    grid, block = _dims("grid", spec.grid), _dims("block", spec.block)
    threads = block[0] * block[1] * block[2]
    if threads > MAX_THREADS_PER_BLOCK:
        raise ValueError(f"block {block} has {threads} threads; CUDA allows {MAX_THREADS_PER_BLOCK}")
    if not 0 <= spec.shared_bytes <= MAX_SHARED_BYTES:
        raise ValueError(f"shared_bytes={spec.shared_bytes} outside [0, {MAX_SHARED_BYTES}]")
    _check_environment()
    stack, order, seed, hw = _stack_bytes(stack_kib), _schedule(schedule), _seed(seed), _hw_math(hw_math)
    lib = compile(spec, sanitize=sanitize)
    return lib.launch(spec.args, grid, block, int(spec.shared_bytes), order, seed, stack, hw)


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
