"""Every ``CUFLASH_*`` environment variable in one table: its accepted values, default and meaning.

:func:`get` parses a variable's current value once (cached per raw string, so a test that changes
the environment sees the new value) and raises a ``ValueError`` naming the variable and the
accepted values when it is malformed, before any computation uses it. The README's table of
environment variables is this table (``tests`` hold them equal).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Variable:
    parse: Callable[[str], Any]  # raises ValueError with the accepted form
    accepted: str                # the accepted values, as the README and errors spell them
    default: Any
    meaning: str


def _integer(lo: int, hi: Optional[int] = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        text = raw.strip()
        if not (text.isascii() and text.isdigit()):  # int() also takes "1_000", "+4" and other scripts' digits
            raise ValueError
        value = int(text, 10)
        if value < lo or (hi is not None and value > hi):
            raise ValueError
        return value
    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.strip() not in choices:
            raise ValueError
        return raw.strip()
    return parse


#: what a yes/no variable accepts (case aside; empty is 0)
FLAG_VALUES = "0 or 1 (also true/false, yes/no, on/off; empty: 0)"


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


def _text(raw: str) -> str:
    if not raw.strip():
        raise ValueError
    return raw


def _path(raw: str) -> str:
    """A path as written, but a space or tab at either end (an editing slip: " /tmp/x" made a folder " " in the
    working directory) is refused rather than taken into the name."""
    if raw != raw.strip():
        raise ValueError
    return _text(raw)


# The smallest fiber stack the emulator accepts. The backward kernels need 12 KiB (at -O1 and -O0; 16 KiB under
# AddressSanitizer), the forward 8 KiB (kernels/emulate/README.md); 64 KiB leaves room for device printf and for
# kernels yet to come. Below the need, a launch dies of SIGSEGV in a fiber stack's guard page.
EMULATE_MIN_STACK_KIB = 64

VARIABLES: dict[str, Variable] = {
    "CUFLASH_NUM_THREADS": Variable(
        _integer(1, 1024), "an integer from 1 to 1024", None,
        "worker threads of the NumPy backend; default: the cores this process may use"),
    "CUFLASH_BLAS": Variable(
        _choice("auto", "numpy", "mkl"), "auto, numpy or mkl", "auto",
        "the NumPy backend's tile products: mkl (Intel MKL from the mkl package: pip install 'cuflash[mkl]'), "
        "numpy (NumPy's own BLAS), auto: mkl when installed and the CPU is Intel's (on AMD's it measured slower)"),
    "CUFLASH_EMULATE_ARCH": Variable(
        lambda raw: int(_choice("80", "86", "89", "90")(raw)), "80, 86, 89 or 90", 80,
        "the GPU whose compute capability and shared-memory limit pick the tile table row "
        "(and the float64 arithmetic) under backend='emulate'"),
    "CUFLASH_EMULATE_SCHEDULE": Variable(
        _choice("forward", "reverse", "random"), "forward, reverse or random", "forward",
        "order in which the emulator runs a block's threads between barriers"),
    "CUFLASH_EMULATE_SEED": Variable(
        _integer(0, 2**64 - 1), "an integer from 0 to 2**64 - 1", 0, "seed of the 'random' schedule"),
    "CUFLASH_EMULATE_STACK_KIB": Variable(
        _integer(EMULATE_MIN_STACK_KIB, 1 << 20), f"an integer from {EMULATE_MIN_STACK_KIB} to 1048576 (KiB)", 256,
        "stack of each emulated GPU thread (fiber)"),
    "CUFLASH_EMULATE_CACHE": Variable(
        _path, "a directory owned by you and writable only by you (no whitespace at either end)", None,
        "where the emulator keeps compiled kernel libraries; default ~/.cache/cuflash/emulate"),
    "CUFLASH_EMULATE_CACHE_MIB": Variable(
        _integer(0, 1 << 30), "an integer number of MiB from 0 (no limit) to 1073741824", 1024,
        "largest size of the emulator's cache; the least recently used kernel libraries go first"),
    "CUFLASH_EMULATE_DEBUG": Variable(
        _flag, FLAG_VALUES, False, "build emulated kernels with -O0 -g (for a debugger)"),
    "CUFLASH_EMULATE_PCH": Variable(
        _flag, FLAG_VALUES, True, "precompile the emulator's shim header once per toolchain"),
    "CUFLASH_EMULATE_CXX": Variable(
        _text, "a C++ compiler command", None, "the compiler of emulated kernels; default g++"),
    "CUFLASH_MPI_CUDA_AWARE": Variable(
        _flag, FLAG_VALUES, False,
        "the MPI library takes device buffers (cuflash.distributed over MPI; mpi4py cannot ask the library)"),
    "CUFLASH_EMULATE_HW_MATH": Variable(
        _flag, FLAG_VALUES, False,
        "emulate the GPU's fp32 rounding: flush denormals to zero, exp2f with ex2.approx.ftz's error"),
}


@functools.lru_cache(maxsize=None)
def _parse(name: str, raw: str):
    var = VARIABLES[name]
    try:
        return var.parse(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not valid: expected {var.accepted}") from None


def get(name: str):
    """The parsed value of ``name``, or its default when unset."""
    var = VARIABLES[name]  # KeyError: a name missing from the table is a bug in cuflash
    raw = os.environ.get(name)
    return var.default if raw is None else _parse(name, raw)


def check_all() -> None:
    """Parse every variable that is set (the command line's first step), and check that what one selects by name can
    be had (``CUFLASH_BLAS=mkl``: MKL loads): a ValueError names the first bad one. A well-formed value naming a
    missing library passed, and the command then listed the NumPy backend as available and failed in its first
    call."""
    for name in VARIABLES:
        get(name)
    if get("CUFLASH_BLAS") == "mkl":
        from .backends import _blas  # here, not at import: _blas reads this table

        _blas._chosen_mkl()


def worker_threads() -> int:
    """The NumPy backend's worker threads (and those that check a residual's arrays): ``CUFLASH_NUM_THREADS``, else the
    cores this process may use."""
    n = get("CUFLASH_NUM_THREADS")
    if n is not None:
        return n
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
