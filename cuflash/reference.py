"""Float64 reference attention: FlashAttention's Algorithm 0, materializing S and P.

The oracle of every test. It is naive on purpose and shares no code with the backends except
the visibility rule (:meth:`cuflash.problem.Problem.visible_mask`). Inputs of any supported
dtype are upcast to float64 (on the host); results are float64 NumPy arrays.

``compute_dtype`` runs the same naive algorithm in another dtype: with the input's own dtype it
is the "naive same-dtype computation" whose error against float64 sets the test tolerances
(:func:`cuflash.testing.assert_attention_close`).
"""
from __future__ import annotations

import numpy as np

from .problem import check_backward, make_problem


def _grouped(p, dtype):
    """q as (B, Hkv, G, Sq, D) and k, v as (B, Hkv, 1, Sk, D), in ``dtype`` on the host."""
    b, sq, hq, d = p.q.shape
    hkv = p.heads_kv
    q = p.host_float(p.q, dtype).transpose(0, 2, 1, 3).reshape(b, hkv, p.group, sq, d)
    k = p.host_float(p.k, dtype).transpose(0, 2, 1, 3)[:, :, None]
    v = p.host_float(p.v, dtype).transpose(0, 2, 1, 3)[:, :, None]
    return q, k, v


def _probabilities(p, q, k):
    """S = scale·QKᵀ with invisible entries at -inf; P = softmax(S); lse per row (natural log).

    Every intermediate is rounded to q's dtype, so with ``compute_dtype`` = the input dtype this
    is the naive same-dtype computation (libraries such as ml_dtypes compute some ops wider).
    """
    r = _rounder(q.dtype)
    s = r(q.dtype.type(p.scale) * _mm(q, np.swapaxes(k, -1, -2)))
    keep = p.visible_mask()  # (B, Hq|1, Sq, Sk)
    heads = (1, 1) if keep.shape[1] == 1 else (p.heads_kv, p.group)
    keep = keep.reshape((keep.shape[0],) + heads + keep.shape[2:])
    s = np.where(keep, s, s.dtype.type(-np.inf))
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, s.dtype.type(0))  # rows that see nothing: no (-inf) - (-inf)
    e = r(np.exp(r(s - m_safe)))
    l = r(e.sum(axis=-1, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        one = l.dtype.type(1)
        seen = l != 0  # not `l > 0`: a NaN sum must propagate, not pass for "sees no key"
        prob = r(np.where(seen, e / np.where(seen, l, one), l.dtype.type(0)))
        lse = r(np.where(seen, m_safe + np.log(np.where(seen, l, one)), l.dtype.type(-np.inf))[..., 0])
    return prob, lse


def _mm(a, b):
    """``a @ b`` as the naive computation in ``a``'s dtype does it: for 16-bit floats the products are summed
    in float32 and rounded once (what NumPy's own float16 matmul does, element by element), here through
    float32 BLAS: 8x faster for float16 and far more for ml_dtypes' bfloat16, with the same rounding."""
    if a.dtype.itemsize == 2:
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(a.dtype)
    return a @ b


def _rounder(dtype):
    return lambda x: np.asarray(x).astype(dtype, copy=False)


def _ungroup(x, p):
    """(B, Hkv, G, S, D) → (B, S, Hq, D)."""
    b, hkv, g, s, d = x.shape
    return x.reshape(b, hkv * g, s, d).transpose(0, 2, 1, 3)


def attention(q, k, v, *, causal=False, scale=None, window=None, block_mask=None,
              seqlens_q=None, seqlens_k=None, return_lse=False, dropout_mask=None, dropout_p=0.0,
              compute_dtype=np.float64, dtype=None):
    """Float64 attention with every cuflash option; see :func:`cuflash.attention`.

    ``dropout_mask`` (bool, broadcastable to ``(..., heads, Sq, Sk)``) and ``dropout_p`` apply
    dropout explicitly: ``P`` is multiplied by the mask and by ``1/(1 - p)`` after normalization.
    Returns ``out`` (and ``lse``, ``(..., heads, Sq)``) in ``compute_dtype`` (float64 by default).
    """
    p = make_problem(q, k, v, causal=causal, scale=scale, window=window, block_mask=block_mask,
                     seqlens_q=seqlens_q, seqlens_k=seqlens_k, dtype=dtype)
    qg, kg, vg = _grouped(p, np.dtype(compute_dtype))
    prob, lse = _probabilities(p, qg, kg)
    prob = _apply_dropout(prob, p, dropout_mask, dropout_p)
    out = p.unflatten(_ungroup(_mm(prob, vg), p), p.q.shape[1:])
    lse = p.unflatten(lse.reshape(p.batch, p.heads_q, p.seqlen_q), (p.heads_q, p.seqlen_q))
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out=None, lse=None, *, causal=False, scale=None, window=None,
                       block_mask=None, seqlens_q=None, seqlens_k=None, dropout_mask=None, dropout_p=0.0,
                       compute_dtype=np.float64, dtype=None):
    """Analytic float64 gradients ``(dq, dk, dv)`` of :func:`attention`.

    dP = dO Vᵀ, D = rowsum(dO∘O), dS = P∘(dP − D), dQ = scale·dS K, dK = scale·dSᵀQ, dV = PᵀdO,
    with dK, dV summed over the query heads of a group. ``out``/``lse`` are accepted for
    signature parity and ignored: the reference recomputes everything in float64.
    """
    p = make_problem(q, k, v, causal=causal, scale=scale, window=window, block_mask=block_mask,
                     seqlens_q=seqlens_q, seqlens_k=seqlens_k, dtype=dtype)
    if out is not None and lse is not None:
        check_backward(p, dout, out, lse)
    qg, kg, vg = _grouped(p, np.dtype(compute_dtype))
    prob, _ = _probabilities(p, qg, kg)
    pd = _apply_dropout(prob, p, dropout_mask, dropout_p)
    r = _rounder(qg.dtype)
    b, sq, hq, d = p.q.shape
    do = p.host_float(dout, qg.dtype).reshape(b, sq, hq, d).transpose(0, 2, 1, 3).reshape(qg.shape)
    o = _mm(pd, vg)
    dv = _mm(np.swapaxes(pd, -1, -2), do)
    dpd = _mm(do, np.swapaxes(vg, -1, -2))
    dprob = _apply_dropout(dpd, p, dropout_mask, dropout_p)  # d(P∘Z/(1-p))/dP
    big_d = r((do * o).sum(axis=-1, keepdims=True))
    ds = r(prob * r(dprob - big_d))
    scale = qg.dtype.type(p.scale)
    dq = r(scale * _mm(ds, kg))
    dk = r(scale * _mm(np.swapaxes(ds, -1, -2), qg))
    shape_q, shape_k = p.q.shape[1:], p.k.shape[1:]
    return (p.unflatten(_ungroup(dq, p), shape_q),
            p.unflatten(_ungroup(dk.sum(axis=2, keepdims=True), p), shape_k),
            p.unflatten(_ungroup(dv.sum(axis=2, keepdims=True), p), shape_k))


def term_magnitudes(q, k, v, dout=None, *, causal=False, scale=None, window=None, block_mask=None,
                    seqlens_q=None, seqlens_k=None, dropout_mask=None, dropout_p=0.0, dtype=None):
    """Largest magnitude of the terms each result is summed from, in float64.

    ``out = P V`` sums terms ``P_ij V_j``; the lse sums ``exp`` of scores ``S_ij``; ``dQ = scale·dS K``,
    ``dK = scale·dSᵀ Q``, ``dV = Pᵀ dO``. Rounding errors scale with these, not with the results,
    which may cancel to ~0. Every term goes through ``P = exp(S - m)``, whose relative condition
    number is ``|S - m|``: an input rounding grows by up to ``1 + max|S|`` on its way, so each
    magnitude carries that factor. :func:`cuflash.testing.assert_attention_close` uses them for
    its floor.
    Dropout bounds the kept terms by ``1/(1 - dropout_p)`` (the mask itself only removes terms).
    Returns a dict with keys ``out``, ``lse`` and, given ``dout``, ``dq``, ``dk``, ``dv``.
    """
    p = make_problem(q, k, v, causal=causal, scale=scale, window=window, block_mask=block_mask,
                     seqlens_q=seqlens_q, seqlens_k=seqlens_k, dtype=dtype)
    qg, kg, vg = _grouped(p, np.dtype(np.float64))
    prob, lse = _probabilities(p, qg, kg)
    s = np.abs(p.scale * (qg @ np.swapaxes(kg, -1, -2))) * (prob > 0)
    cond = 1.0 + s.max(initial=0) + np.abs(lse[np.isfinite(lse)]).max(initial=0)
    mags = {"out": (prob @ np.abs(vg)).max(initial=0), "lse": cond}
    if dout is not None:
        b, sq, hq, d = p.q.shape
        do = p.host_float(dout, np.float64).reshape(b, sq, hq, d).transpose(0, 2, 1, 3).reshape(qg.shape)
        # dS = P∘(dP − D) cancels (exactly, for a single key), and so may the sums dP = dO·Vᵀ and
        # D = rowsum(dO∘O): the magnitudes of all their terms bound the rounding.
        dp_terms = np.abs(do) @ np.swapaxes(np.abs(vg), -1, -2)
        d_terms = (np.abs(do) * (prob @ np.abs(vg))).sum(axis=-1, keepdims=True)
        ds = prob * (dp_terms + d_terms)
        mags["dq"] = abs(p.scale) * (ds @ np.abs(kg)).max(initial=0)
        mags["dk"] = abs(p.scale) * (np.swapaxes(ds, -1, -2) @ np.abs(qg)).sum(axis=2).max(initial=0)
        mags["dv"] = (np.swapaxes(prob, -1, -2) @ np.abs(do)).sum(axis=2).max(initial=0)
    boost = cond / (1.0 - dropout_p)
    return {name: float(x) * (1 if name == "lse" else boost) for name, x in mags.items()}


def _apply_dropout(x, p, mask, dropout_p):
    if mask is None:
        if dropout_p:
            raise ValueError("the reference needs an explicit dropout_mask when dropout_p > 0")
        return x
    m = np.broadcast_to(np.asarray(mask), p.batch_shape + (p.heads_q, p.seqlen_q, p.seqlen_k))
    m = m.reshape(p.batch, p.heads_kv, p.group, p.seqlen_q, p.seqlen_k)
    return _rounder(x.dtype)(x * m / x.dtype.type(1.0 - dropout_p))
