"""Backward dropout helpers shared by the emulated and the GPU backward tests
(tests/test_kernels_emulated_bwd_dropout.py, tests/test_gpu_bwd_dropout.py): the keep-mask read back through dV."""
from __future__ import annotations

import numpy as np

import cuflash
from cuflash.problem import visible

from dropout_cases import SEED


def check_dv_keep_mask(run, *, batch, sq, sk, hq, hkv, d, window, p, seed=SEED):
    """Read the backward's keep-mask back from ``run(q, k, v, dout, **options) -> (dq, dk, dv)`` (NumPy results,
    forward included) and hold it bit for bit to :func:`cuflash.dropout_mask`.

    With q = k = 0, P is uniform over the keys a query sees and dV[j] = sum_i (P o Z)[i, j] dO[i] / (1-p).
    dO[b, i, h, :] is one-hot at column (i mod w) + w (h mod G), w = d / G for G query heads per kv head; under a
    window no wider than w each key is seen by at most one query of each residue, so dV[b, j, h // G, c] != 0
    exactly when key j is kept for that query of query head h: the mask element by element, per query head.
    """
    g = hq // hkv
    w = d // g
    assert window[0] + window[1] + 1 <= w, "a key must be seen by at most w queries"
    q = np.zeros((batch, sq, hq, d), np.float16)
    k = np.zeros((batch, sk, hkv, d), np.float16)
    v = np.random.default_rng(1).standard_normal((batch, sk, hkv, d)).astype(np.float16)
    i, j = np.arange(sq), np.arange(sk)
    dout = np.zeros((batch, sq, hq, d), np.float16)
    for h in range(hq):
        dout[:, i, h, i % w + w * (h % g)] = 1
    _, _, dv = run(q, k, v, dout, window=window, dropout_p=p, seed=seed)
    dv = np.asarray(dv)

    vis = visible(i[:, None], j[None, :], sq, sk, window[0], window[1])  # (Sq, Sk)
    keep = cuflash.dropout_mask((batch, hq, sq, sk), seed=seed, p=p) & vis
    expected = np.zeros(dv.shape, bool)
    bb, hh, ii, jj = np.nonzero(keep)
    cols = ii % w + w * (hh % g)
    expected[bb, jj, hh // g, cols] = True
    got = dv != 0
    assert np.array_equal(got, expected), \
        f"{int((got != expected).sum())} of {int(vis.sum()) * batch * hq} keep bits differ"
    # kept entries are 1 / (n_visible(i) (1 - p)): the 1/(1-p) applied once to dV
    n_vis = vis.sum(axis=1)
    np.testing.assert_allclose(dv[bb, jj, hh // g, cols].astype(np.float64), 1.0 / (n_vis[ii] * (1.0 - p)),
                               rtol=2 ** -9)
