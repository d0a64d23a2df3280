"""Helpers of the emulator's own tests (a unique module name: tests/conftest.py exists too)."""
import re
from pathlib import Path

import numpy as np

from cuflash.cuda.launch import LaunchSpec

KERNELS = Path(__file__).parent / "kernels"


def _local_includes(text: str) -> str:
    """``#include "x"`` of a file beside the test kernels replaced by its text (the emulator compiles a copy of the
    source elsewhere); the others (arch.cuh, ...) resolve to kernels/."""
    def repl(m):
        path = KERNELS / m.group(1)
        return path.read_text() if path.is_file() else m.group(0)

    return re.sub(r'^#include "([^"]+)".*$', repl, text, flags=re.M)


def spec(file: str, name: str, args, grid=(1, 1, 1), block=(32, 1, 1), shared_bytes=0, options=()):
    """A LaunchSpec for a test kernel in tests/emulate/kernels/ (its `#include "arch.cuh"` resolves to kernels/)."""
    source = f'#line 1 "tests/emulate/kernels/{file}"\n' + _local_includes((KERNELS / file).read_text())
    return LaunchSpec(source, name, tuple(grid), tuple(block), shared_bytes, tuple(args),
                      tuple(options))


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (no ml_dtypes needed)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)
