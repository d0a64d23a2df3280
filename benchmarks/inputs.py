"""The arrays of a case on its device."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cases import Case


@dataclass
class Inputs:
    """Arrays of one case on its device: q ``(B, Sq, H, d)``, k, v ``(B, Sk, H, d)``, dout like q."""

    xp: object
    q: object
    k: object
    v: object
    dout: object
    block_mask: object = None


def array_module(device: str):
    """``cupy`` for ``"cuda"`` (imported only then), else ``numpy``."""
    if device == "cuda":
        import cupy

        return cupy
    return np


def make_inputs(case: Case, *, seed: int = 0) -> Inputs:
    """Standard-normal inputs in the case's dtype (drawn in float32, then cast), and its BlockMask."""
    xp = array_module(case.device)
    rng = xp.random.default_rng(seed)  # NumPy and CuPy Generators both draw float32 directly
    dtype = numpy_dtype(case.dtype)

    def draw(seqlen):
        return rng.standard_normal((case.batch, seqlen, case.heads, case.head_dim), dtype=np.float32).astype(dtype)

    q, k, v, dout = draw(case.seqlen_q), draw(case.seqlen_k), draw(case.seqlen_k), draw(case.seqlen_q)
    return Inputs(xp, q, k, v, dout, density_mask(case, seed=seed) if case.density is not None else None)


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype called ``name``; ``"bfloat16"`` is ml_dtypes'."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def density_mask(case: Case, *, seed: int):
    """A BlockMask keeping the same number of random key blocks in every query-block row, so that
    every row (and every thread block) does the same work."""
    from cuflash.blockmask import BlockMask

    bq, bk = case.mask_block
    nq, nk = -(-case.seqlen_q // bq), -(-case.seqlen_k // bk)
    per_row = max(1, round(case.density * nk))
    rng = np.random.default_rng(seed)
    grid = np.zeros((nq, nk), dtype=bool)
    for i in range(nq):
        grid[i, rng.choice(nk, per_row, replace=False)] = True
    return BlockMask.from_grid(grid, block=(bq, bk), seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k)
