"""Forward dropout cases shared by the emulated and the GPU kernel tests (tests/test_kernels_emulated_dropout.py,
tests/test_gpu_dropout.py): feature cases with dropout, and the read-back of the kernel's keep-mask."""
from __future__ import annotations

import numpy as np

import cuflash
from cuflash.blockmask import BlockMask
from cuflash.problem import visible

from fwd_cases import make_case

SEED = 0x9E3779B97F4A7C15  # both 32-bit halves nonzero: seed_lo and seed_hi both reach the kernel


def dropout_case(*shape, p, seed, **options):
    """make_case (whose own ``seed`` draws the arrays) with ``dropout_p=p, seed=seed`` among the options."""
    case = make_case(*shape, **options)
    case.options.update(dropout_p=p, seed=seed)
    return case


def dropout_feature_cases():
    """(id, Case) with dropout: the mask features that change which rows/keys/tiles a block visits."""
    rng = np.random.default_rng(5)
    c = []
    c.append(("plain_p0.5", dropout_case(2, 64, 64, 2, 2, 64, p=0.5, seed=SEED)))
    c.append(("ragged_p0.1", dropout_case(1, 113, 203, 2, 2, 32, p=0.1, seed=7)))
    c.append(("causal_long_q_p0.9", dropout_case(1, 200, 77, 2, 1, 64, causal=True, p=0.9, seed=2**64 - 1)))
    c.append(("window_causal", dropout_case(1, 129, 140, 2, 2, 64, causal=True, window=(70, None), p=0.3,
                                            seed=11)))
    c.append(("gqa_mqa", dropout_case(2, 65, 65, 8, 1, 64, causal=True, p=0.2, seed=SEED)))
    c.append(("seqlens_batch3", dropout_case(3, 100, 130, 2, 1, 128, causal=True, p=0.25, seed=3,
                                             seqlens_q=np.array([100, 37, 0], np.int32),
                                             seqlens_k=np.array([130, 64, 5], np.int32))))
    grid = rng.random((2, 1, 10, 7)) < 0.5
    c.append(("blockmask_finer_than_tile", dropout_case(2, 150, 200, 2, 1, 64, causal=True, p=0.4, seed=SEED,
                                                        block_mask=BlockMask(grid, block=(16, 32), seqlen_q=150,
                                                                             seqlen_k=200))))
    grid = np.zeros((1, 2, 9, 3), bool)
    grid[0, 0, [0, 5]], grid[0, 1, [0, 5, 8]] = True, True
    c.append(("blockmask_per_head", dropout_case(1, 129, 40, 2, 1, 32, p=0.5, seed=19, block_mask=BlockMask(
        grid, block=(16, 16), seqlen_q=129, seqlen_k=40))))
    c.append(("odd_head_dim_59", dropout_case(1, 70, 90, 2, 2, 59, window=(20, 5), p=0.5, seed=23)))
    return c


def one_hot_problem(batch, sq, sk, hq, hkv, d):
    """q = k = 0 (every visible key gets the same probability) and v[b, j, h, j % d] = 1, float16."""
    q = np.zeros((batch, sq, hq, d), np.float16)
    k = np.zeros((batch, sk, hkv, d), np.float16)
    v = np.zeros((batch, sk, hkv, d), np.float16)
    v[:, np.arange(sk), :, np.arange(sk) % d] = 1
    return q, k, v


def check_keep_mask(run, *, batch, sq, sk, hq, hkv, d, window, p, seed=SEED, numpy_too=True):
    """Read the keep-mask back from ``run(q, k, v, **options) -> (out, lse)`` (NumPy results) and hold it
    bit for bit to :func:`cuflash.dropout_mask` (and to the NumPy backend's zero pattern when ``numpy_too``).

    With q = k = 0 and v one-hot in ``j % d``, under a window no wider than ``d`` (so ``j % d`` is one-to-one on
    the keys a row sees), ``out[b, i, h, j % d]`` is ``keep[b, h, i, j] / (n_visible(i) (1 - p))``.
    """
    assert window[0] + window[1] + 1 <= d, "a row must see at most d keys"
    q, k, v = one_hot_problem(batch, sq, sk, hq, hkv, d)
    out, lse = run(q, k, v, window=window, dropout_p=p, seed=seed)

    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    vis = visible(i, j, sq, sk, window[0], window[1])                    # (Sq, Sk)
    col = np.broadcast_to(j % d, vis.shape)
    got = np.asarray(out).astype(np.float32).transpose(0, 2, 1, 3)        # (B, Hq, Sq, d)
    at = np.take_along_axis(got, np.broadcast_to(col, got.shape[:2] + col.shape), axis=-1)  # (B, Hq, Sq, Sk)
    read_back = at != 0
    expected = cuflash.dropout_mask((batch, hq, sq, sk), seed=seed, p=p)
    assert np.array_equal(read_back & vis, expected & vis), \
        f"{int(((read_back != expected) & vis).sum())} of {int(vis.sum()) * batch * hq} keep bits differ"
    # columns that no visible key maps to stay zero
    hit = np.zeros((sq, d), bool)
    np.logical_or.at(hit, (np.broadcast_to(i, vis.shape)[vis], col[vis]), True)
    assert np.all(got[..., ~hit] == 0)
    # kept values are 1 / (n_visible (1 - p)): the 1/(1-p) rescale folded into the final normalization
    n_vis = vis.sum(axis=1)  # rows before the band's start (Lk < Lq moves it right) see no key
    want = np.broadcast_to(1.0 / (np.maximum(n_vis, 1)[:, None] * (1.0 - p)), at.shape)
    kept = read_back & vis
    np.testing.assert_allclose(at[kept], want[kept], rtol=2 ** -10)
    # lse is that of the undropped scores: log(n_visible)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(np.asarray(lse), np.broadcast_to(np.log(n_vis), lse.shape), rtol=1e-6)
    if numpy_too:  # the NumPy backend reads the same bits back from the same inputs
        out_np = cuflash.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                   window=window, dropout_p=p, seed=seed, backend="numpy")
        np.testing.assert_array_equal(np.asarray(out).astype(np.float32) != 0, out_np != 0)
