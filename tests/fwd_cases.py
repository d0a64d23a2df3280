"""Forward-kernel cases shared by the emulated and the GPU tests: one explicit case per feature,
and cases built from them (the golden vectors: tests/golden.py)."""
from __future__ import annotations


import numpy as np

from cuflash.blockmask import BlockMask
from cuflash.testing import Case, check_forward  # noqa: F401  (re-exported for the kernel tests)



def bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def make_case(batch, sq, sk, hq, hkv, d, dtype=np.float16, seed=0, **options) -> Case:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape).astype(dtype)
              for shape in ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d), (batch, sq, hq, d))]
    return Case(*arrays, options=options)


def feature_cases(dtype=np.float16):
    """(id, Case) for every mask feature and shape awkwardness of the forward kernel."""
    rng = np.random.default_rng(1)
    c = []
    c.append(("plain_d64", make_case(2, 64, 64, 2, 2, 64, dtype)))
    c.append(("ragged_sq_ne_sk", make_case(1, 113, 203, 2, 2, 32, dtype)))
    c.append(("causal_long_q", make_case(1, 200, 77, 2, 1, 64, dtype, causal=True)))
    c.append(("causal_short_q", make_case(1, 77, 200, 2, 2, 64, dtype, causal=True)))
    c.append(("window", make_case(1, 150, 150, 2, 1, 96, dtype, window=(20, 5))))
    c.append(("window_left_only", make_case(1, 130, 130, 1, 1, 32, dtype, window=(8, None))))
    c.append(("window_causal", make_case(1, 129, 140, 2, 2, 64, dtype, causal=True, window=(70, None))))
    c.append(("gqa_mqa", make_case(2, 65, 65, 8, 1, 64, dtype, causal=True)))
    c.append(("seqlens", make_case(3, 100, 130, 2, 1, 64, dtype, causal=True,
                                   seqlens_q=np.array([100, 37, 0], np.int32),
                                   seqlens_k=np.array([130, 64, 5], np.int32))))
    c.append(("seqlens_zero_keys", make_case(2, 40, 40, 1, 1, 32, dtype,
                                             seqlens_k=np.array([0, 17], np.int32))))
    c.append(("odd_head_dim_59", make_case(1, 70, 90, 2, 2, 59, dtype, causal=True)))
    c.append(("odd_head_dim_111", make_case(1, 50, 50, 1, 1, 111, dtype)))
    c.append(("head_dim_40_in_place", make_case(1, 66, 66, 1, 1, 40, dtype, window=(3, 3))))
    c.append(("head_dim_8", make_case(1, 20, 20, 1, 1, 8, dtype)))
    c.append(("scale", make_case(1, 64, 64, 1, 1, 64, dtype, scale=0.37)))
    c.append(("negative_scale", make_case(1, 64, 80, 1, 1, 32, dtype, scale=-0.5, causal=True)))
    c.append(("zero_scale", make_case(1, 33, 47, 1, 1, 32, dtype, scale=0.0, window=(4, 4))))
    grid = rng.random((1, 2, 2, 4)) < 0.6
    grid[0, 0, 0, 0] = True
    c.append(("blockmask_tile_multiple", make_case(1, 256, 256, 2, 2, 64, dtype, block_mask=BlockMask(
        grid, block=(128, 64), seqlen_q=256, seqlen_k=256))))
    grid = rng.random((2, 1, 10, 7)) < 0.5
    c.append(("blockmask_finer_than_tile", make_case(2, 150, 200, 2, 1, 64, dtype, causal=True, block_mask=BlockMask(
        grid, block=(16, 32), seqlen_q=150, seqlen_k=200))))
    grid = rng.random((1, 1, 4, 4)) < 0.7
    c.append(("blockmask_straddling", make_case(1, 190, 190, 1, 1, 32, dtype, block_mask=BlockMask(
        grid, block=(48, 48), seqlen_q=190, seqlen_k=190))))
    grid = np.zeros((1, 2, 9, 3), bool)  # per head, with query tiles whose list is empty in one head only
    grid[0, 0, [0, 5]], grid[0, 1, [0, 5, 8]] = True, True
    c.append(("blockmask_per_head", make_case(1, 129, 40, 2, 1, 32, dtype, block_mask=BlockMask(
        grid, block=(16, 16), seqlen_q=129, seqlen_k=40))))
    grid = np.zeros((1, 1, 2, 2), bool)
    c.append(("blockmask_empty", make_case(1, 100, 100, 1, 1, 32, dtype, block_mask=BlockMask(
        grid, block=(64, 64), seqlen_q=100, seqlen_k=100))))
    return c


