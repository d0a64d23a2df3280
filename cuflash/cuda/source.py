"""The kernel sources as every compiler sees them: ``kernels/<family>.cu`` with its local headers inlined.

CuPy's disk cache hashes the source string only, not headers found through ``-I``, so the string
must contain everything that changes the compiled code. The params layout checks
(:func:`cuflash.cuda.params.layout_asserts`) are appended, so CuPy at run time, the compile check
and the CPU emulator all verify the struct the kernels read against the one Python packs.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

from . import params


def _kernels_dir() -> Path:
    """``kernels/`` of a source checkout, else the copy a wheel installs as ``cuflash/_kernels``.

    Both are needed: the GPU machines run the checkout without installing it (nothing can be installed
    there), and a wheel has no checkout.
    """
    here = Path(__file__).resolve().parents[1]
    checkout = here.parent / "kernels"
    return checkout if (checkout / "flash_fwd.cu").is_file() else here / "_kernels"


KERNELS_DIR = _kernels_dir()

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_PRAGMA_ONCE = re.compile(r'^\s*#\s*pragma\s+once\s*$', re.M)


def inline_includes(path: Path) -> str:
    """``path``'s text with every local ``#include "x.cuh"`` inlined once (recursively)."""
    seen: set[str] = set()

    def expand(p: Path) -> str:
        def repl(match: re.Match) -> str:
            inc = (p.parent / match.group(1)).resolve()
            if str(inc) in seen:
                return ""
            seen.add(str(inc))
            return f"// ---- begin {match.group(1)}\n{expand(inc)}\n// ---- end {match.group(1)}\n"

        # Each header is inlined once, so its `#pragma once` has no job left (nvcc warns about it in a main file).
        return _INCLUDE.sub(repl, _PRAGMA_ONCE.sub("", p.read_text()))

    return expand(path)


@functools.lru_cache(maxsize=None)
def kernel_source(name: str) -> str:
    """The complete source of ``kernels/<name>`` (read once per process), with the params layout checks and the
    grid the launches assume of its helper kernels."""
    return inline_includes(KERNELS_DIR / name) + "\n// ---- params layout (cuflash/cuda/params.py)\n" + \
        params.layout_asserts() + _grid_asserts(name)


def _grid_asserts(name: str) -> str:
    """``static_assert``\\ s that the backward's helper kernels take the rows per block that their launches' grid
    gives them (:data:`cuflash.cuda.specs.HELPER_ROWS`): a kernel taking fewer would leave rows unwritten."""
    from . import specs

    return "".join(f'static_assert(cuflash::{constant} == {rows}, "{constant}: the grid of cuflash/cuda/specs.py '
                   f'HELPER_ROWS differs");\n'
                   for family, (constant, rows) in specs.HELPER_ROWS.items() if specs.SOURCES[family] == name)
