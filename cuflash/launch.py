"""One description of a kernel launch, shared by the CUDA backend and the CPU emulator.

A :class:`LaunchSpec` is computed in one place (the launch configuration of a kernel family)
and handed unchanged either to CuPy (``cupy.RawModule`` + launch on the current stream) or to
:mod:`cuflash.emulate`, which compiles the very same source for the CPU.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

def _kernels_dir() -> Path:
    """``kernels/`` of a source checkout, else the copy a wheel installs as ``cuflash/_kernels``."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "kernels"
    return checkout if (checkout / "flash_fwd.cu").is_file() else here / "_kernels"


KERNELS_DIR = _kernels_dir()

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_PRAGMA_ONCE = re.compile(r'^\s*#\s*pragma\s+once\s*$', re.M)


def kernel_source(name: str) -> str:
    """Return ``kernels/<name>`` with every local ``#include "x.cuh"`` inlined once.

    CuPy's disk cache hashes the source string only, not headers found through ``-I``, so the
    string must contain everything that changes the compiled code.
    """
    seen: set[str] = set()

    def expand(path: Path) -> str:
        def repl(match: re.Match) -> str:
            inc = (path.parent / match.group(1)).resolve()
            if str(inc) in seen:
                return ""
            seen.add(str(inc))
            return f"// ---- begin {match.group(1)}\n{expand(inc)}\n// ---- end {match.group(1)}\n"

        # Each header is inlined once, so its `#pragma once` has no job left (nvcc warns about it in a main file).
        return _INCLUDE.sub(repl, _PRAGMA_ONCE.sub("", path.read_text()))

    return expand(KERNELS_DIR / name)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to run one kernel, for CuPy and for the emulator alike.

    Attributes
    ----------
    source : str
        Complete CUDA C++ source (local includes inlined, see :func:`kernel_source`).
    name_expression : str
        Kernel name or template instantiation, e.g. ``"cuflash::flash_fwd<__half, 64, 128, 64, 4, true>"``.
    grid, block : tuple of 3 ints
    shared_bytes : int
        Dynamic shared memory in bytes.
    args : tuple
        Kernel arguments in signature order: device buffers (CuPy arrays, or NumPy arrays for the
        emulator; the buffer's base address is passed) and NumPy scalars (``np.int32``, ``np.int64``,
        ``np.float32``, ...) whose dtype must match the parameter type. ``None`` passes a null pointer.
    options : tuple of str
        Compiler options (``-D`` macros and the like) shared by nvcc/NVRTC and the emulator's g++.
    """

    source: str
    name_expression: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple
    options: tuple[str, ...] = field(default_factory=tuple)
