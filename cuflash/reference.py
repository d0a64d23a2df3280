"""Float64 reference attention: FlashAttention's Algorithm 0, materializing S and P.

The oracle of every test. It is naive on purpose and shares no code with the backends except
the visibility rule (:meth:`cuflash.problem.Problem.visible_mask`). Inputs of any supported
dtype are upcast to float64 (on the host); results are float64 NumPy arrays.

``compute_dtype`` runs the same naive algorithm in another dtype: with the input's own dtype it
is the "naive same-dtype computation" whose error against float64 sets the test tolerances
(:func:`cuflash.testing.assert_attention_close`). ``compute_dtype="tf32"`` is the naive TF32
computation, the yardstick of the CUDA kernels' ``precision="tf32"``: float32 throughout, with the
inputs of every matrix product rounded to TF32 (:func:`round_tf32`) and the products summed in
float32. ``np.longdouble`` (x86-64: 64-bit significands) is the reference the float64 kernels are
measured against, so that the naive float64 computation has an error to compare with.
"""
from __future__ import annotations

import numpy as np

from . import _layout
from ._fp import ignore_fp_errors
from .problem import as_float, check_backward, make_problem, stats_dtype


#: ``compute_dtype`` of the naive TF32 computation
TF32 = "tf32"


def round_tf32(x):
    """float32 values rounded to TF32 as ``cvt.rna.tf32.f32`` does (10 mantissa bits, ties away from zero; the
    largest finite values round to infinity; infinities and NaN unchanged). Returns float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    finite = (u & 0x7F800000) != 0x7F800000
    r = np.where(finite, (u + np.uint32(0x1000)) & np.uint32(0xFFFFE000), u).astype(np.uint32)
    return r.view(np.float32)


def _compute_dtype(compute_dtype):
    if isinstance(compute_dtype, str) and compute_dtype == TF32:
        return np.dtype(np.float32)
    if compute_dtype is None:  # np.dtype(None) is float64: a None meaning "the inputs' dtype" computed in float64
        raise TypeError("compute_dtype must be a real floating-point dtype (or 'tf32'), got None")
    dt = np.dtype(compute_dtype)
    if dt.kind != "f" and dt.name != "bfloat16":  # a complex or integer reference computes something else
        raise TypeError(f"compute_dtype must be a real floating-point dtype (or 'tf32'), got {dt}")
    return dt


def _grouped(p, dtype):
    """q as (B, Hkv, G, Sq, D) and k, v as (B, Hkv, 1, Sk, D), in ``dtype`` on the host."""
    b, sq, hq, d = p.q.shape
    hkv = p.heads_kv
    q = p.host_float(p.q, dtype).transpose(0, 2, 1, 3).reshape(b, hkv, p.group, sq, d)
    k = p.host_float(p.k, dtype).transpose(0, 2, 1, 3)[:, :, None]
    v = p.host_float(p.v, dtype).transpose(0, 2, 1, 3)[:, :, None]
    return q, k, v


def _env(p, score=None):
    """The modifier variables over the grouped (B, Hkv, G, Sq, Sk) score layout (query head h = hkv·G + g)."""
    len_q, len_k = p.lengths
    col = lambda x: np.asarray(x).reshape(-1, 1, 1, 1, 1)  # noqa: E731
    env = dict(b=col(np.arange(p.batch)), q_len=col(len_q), kv_len=col(len_k),
               h=np.arange(p.heads_q).reshape(1, p.heads_kv, p.group, 1, 1),
               q_idx=np.arange(p.seqlen_q).reshape(1, 1, 1, -1, 1),
               kv_idx=np.arange(p.seqlen_k).reshape(1, 1, 1, 1, -1))
    if score is not None:
        env["score"] = score
    return env


def _host_values(p):
    return {n: (v.get() if hasattr(v, "get") else v) for n, v in p.mods.values.items()}


def _scores(p, q, k):
    """``(S before the score modifier, S after it, visibility)``: S = scale·QKᵀ, every step rounded to q's
    dtype; visibility is the element rule, the BlockMask and the mask modifier, (B, Hkv|1, G|1, Sq, Sk)."""
    r = _rounder(q.dtype)
    s = r(q.dtype.type(p.scale) * _mm(q, np.swapaxes(k, -1, -2)))
    keep = p.visible_mask()  # (B, Hq|1, Sq, Sk); a BlockMask rule's floats in the inputs' working precision
    heads = (1, 1) if keep.shape[1] == 1 else (p.heads_kv, p.group)
    keep = keep.reshape((keep.shape[0],) + heads + keep.shape[2:])
    s_mod = s
    if p.mods is not None:
        values = _host_values(p)
        if p.mods.score is not None:
            # an expression that reads none of score, b, h (``"q_idx * 0.1"``) has fewer axes than S
            s_mod = r(np.array(np.broadcast_to(p.mods.score.evaluate(_env(p, s), values, q.dtype), s.shape)))
        if p.mods.mask is not None:
            # in the working precision of the inputs, whatever the compute dtype: the mask defines the problem
            keep = keep & p.mods.mask.evaluate(_env(p), values, stats_dtype(p.dtype))
    return s, s_mod, keep


def _probabilities(p, q, k):
    """P = softmax(S) with invisible entries at -inf, and lse per row (natural log).

    Every intermediate is rounded to q's dtype, so with ``compute_dtype`` = the input dtype this
    is the naive same-dtype computation (libraries such as ml_dtypes compute some ops wider).
    """
    r = _rounder(q.dtype)
    _, s, keep = _scores(p, q, k)
    s = np.where(keep, s, s.dtype.type(-np.inf))
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, s.dtype.type(0))  # rows that see nothing: no (-inf) - (-inf)
    e = r(np.exp(r(s - m_safe)))
    l = r(_sum(e, -1, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        one = l.dtype.type(1)
        seen = l != 0  # not `l > 0`: a NaN sum must propagate, not pass for "sees no key"
        # keep: a row with a NaN sum (it sees a NaN score) still has P = 0 where it sees nothing
        prob = r(np.where(seen & keep, e / np.where(seen, l, one), l.dtype.type(0)))
        lse = r(np.where(seen, m_safe + np.log(np.where(seen, l, one)), l.dtype.type(-np.inf))[..., 0])
    # A row with a +inf score (lse = +inf): beside it every finite score's weight vanishes, and the infinite ones are
    # inf/inf = NaN, which is what exp(S - lse) gives, as FlashAttention's backward recomputes P from the saved lse.
    # e / l said NaN also for every finite score whose exp overflows: a NaN pattern that hung on the dtype's range.
    top = np.isposinf(m)
    prob = np.where(top & keep, np.where(np.isposinf(s), s.dtype.type(np.nan), s.dtype.type(0)), prob)
    return prob, lse


def _mm(a, b):
    """``a @ b`` as the naive computation in ``a``'s dtype does it: for 16-bit floats the products are summed
    in float32 and rounded once (what NumPy's own float16 matmul does, element by element), here through
    float32 BLAS: 8x faster for float16 and far more for ml_dtypes' bfloat16, with the same rounding. In the
    naive TF32 computation (:data:`TF32`) the inputs are rounded to TF32 and the exact products summed in float32."""
    if _TF32_MODE[0] and a.dtype == np.float32:
        return round_tf32(a) @ round_tf32(b)
    if a.dtype.itemsize == 2:
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(a.dtype)
    return a @ b


def _sum(x, axis, keepdims=False):
    """``x.sum(axis)`` as the naive computation in ``x``'s dtype does it, as :func:`_mm` sums: 16-bit floats summed
    in float32 and rounded once. NumPy sums ml_dtypes' bfloat16 in bfloat16 (a row of 1000 ones sums to 256), so the
    naive baseline the 2x/3x rule scales was off by orders of magnitude on long rows, and an all-zero bfloat16
    output passed check_forward at 1024 keys."""
    if x.dtype.itemsize == 2:
        return x.sum(axis=axis, keepdims=keepdims, dtype=np.float32).astype(x.dtype)
    return x.sum(axis=axis, keepdims=keepdims)


def _mm_seen(a, b):
    """``a @ b`` (as :func:`_mm`) in which a zero of ``a`` contributes nothing, even against an infinity or NaN
    in ``b``. ``a`` is P or dS, zero where an element is invisible, so a key that a row does not see, or a query
    row past its sequence, cannot reach a result through IEEE's ``0 * inf = NaN``. Naively: the product of the
    finite part, then each non-finite element of ``b`` added, times its factors, where its factor is nonzero.
    ``a`` is (..., M, K) with every leading dimension full; ``b`` (..., K, D) may broadcast over some."""
    finite = np.isfinite(b)
    r = _mm(a, np.where(finite, b, b.dtype.type(0)))
    for *lead, j, c in zip(*np.nonzero(~finite)):
        at = tuple(slice(None) if n == 1 else slice(x, x + 1) for x, n in zip(lead, b.shape[:-2]))
        f = a[at][..., j]
        with np.errstate(invalid="ignore", over="ignore"):
            r[at + (slice(None), c)] += np.where(f != 0, f * b[tuple(lead) + (j, c)], 0)
    return r


_TF32_MODE = [False]  # set while a naive TF32 computation runs (the reference is single-threaded NumPy code)


class _tf32_mode:
    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.prev, _TF32_MODE[0] = _TF32_MODE[0], self.on

    def __exit__(self, *exc):
        _TF32_MODE[0] = self.prev


def _rounder(dtype):
    return lambda x: np.asarray(x).astype(dtype, copy=False)


def _ungroup(x, p):
    """(B, Hkv, G, S, D) → (B, S, Hq, D)."""
    b, hkv, g, s, d = x.shape
    return x.reshape(b, hkv * g, s, d).transpose(0, 2, 1, 3)


def _bshd(options, *arrays):
    """``(layout, arrays in cuflash's bshd layout)``, ``layout`` taken out of ``options`` (as cuflash.attention)."""
    layout = _layout.check_layout(options.pop("layout", "bshd"))
    return layout, [_layout.to_bshd(a, layout) for a in arrays]


def _problem(options, q, k, v, **rows):
    """``(layout, problem, rows, dv)`` of cuflash.attention's arguments: a value head dim of v's own zero-padded as
    the API pads it (:func:`cuflash._layout.pad_head_dims`; exact: the zero columns add exact zeros), ``rows``
    (name -> ``dout``, ``out``: q's shape with v's head dim, checked as the API checks them, or None) padded alike,
    and ``dv`` v's head dim to cut results to (else None). The reference refused such a v, which cuflash.attention
    takes."""
    for name, r in rows.items():
        if hasattr(r, "shape") and hasattr(q, "shape") and hasattr(v, "shape"):
            want = tuple(q.shape[:-1]) + tuple(v.shape[-1:])
            if tuple(r.shape) != want:  # a wider one was cut silently, another a bare reshape error
                raise ValueError(f"{name} must have shape {want} (q's shape with v's head_dim), got "
                                 f"{tuple(r.shape)}")
    names = tuple(rows)
    layout, (q, k, v, *rows) = _bshd(options, q, k, v, *rows.values())
    q, k, v, kw, dv = _layout.pad_head_dims(q, k, v, options)
    if dv is not None and v.shape[-1] != dv:  # v was padded
        rows = [r if not hasattr(r, "shape") else _layout.pad_last(r, v.shape[-1], name)
                for name, r in zip(names, rows)]
    return layout, make_problem(q, k, v, **kw), rows, dv


@ignore_fp_errors
def attention(q, k, v, *, return_lse=False, dropout_mask=None, dropout_p=0.0, compute_dtype=np.float64, **options):
    """Float64 attention with every cuflash option (``**options``: those of :func:`cuflash.attention`).

    ``dropout_mask`` (bool, broadcastable to ``(..., heads, Sq, Sk)``) and ``dropout_p`` apply
    dropout explicitly: ``P`` is multiplied by the mask and by ``1/(1 - p)`` after normalization.
    Returns ``out`` (in ``layout``; and ``lse``, ``(..., heads, Sq)``) in ``compute_dtype`` (float64 by default).
    """
    layout, p, _, dv = _problem(options, q, k, v)
    keep = _dropout_mask(p, dropout_mask, dropout_p)
    with _tf32_mode(isinstance(compute_dtype, str) and compute_dtype == TF32):
        qg, kg, vg = _grouped(p, _compute_dtype(compute_dtype))
        prob, lse = _probabilities(p, qg, kg)
        prob = _apply_dropout(prob, keep, dropout_p)
        out = p.unflatten(_ungroup(_mm_seen(prob, vg), p), p.q.shape[1:])
        out = _layout.from_bshd(out if dv is None else out[..., :dv], layout)
    lse = p.unflatten(lse.reshape(p.batch, p.heads_q, p.seqlen_q), (p.heads_q, p.seqlen_q))
    return (out, lse) if return_lse else out


@ignore_fp_errors
def attention_backward(dout, q, k, v, out=None, lse=None, *, dropout_mask=None, dropout_p=0.0,
                       compute_dtype=np.float64, return_dbias=False, **options):
    """Analytic float64 gradients ``(dq, dk, dv)`` of :func:`attention` (and ``dbias`` with ``return_dbias``).

    dP = dO Vᵀ, D = rowsum(dO∘O), dS = P∘(dP − D) (the gradient of the modified score),
    dS₀ = dS · d(score modifier)/d(score), dQ = scale·dS₀ K, dK = scale·dS₀ᵀQ, dV = PᵀdO, with dK, dV
    summed over the query heads of a group; dbias = dS · d(score modifier)/d(bias), summed over the
    dimensions the bias broadcasts. ``dout`` is checked as :func:`cuflash.attention_backward` checks it;
    ``out``/``lse`` are accepted for signature parity and checked, not used: the reference recomputes everything.
    """
    layout, p, (dout, out), dv = _problem(options, q, k, v, dout=dout, out=out)
    # dout is checked as cuflash.attention_backward checks it whether or not out and lse are given (a masked dout
    # lost its mask, an int one or a list was computed with): a missing out or lse gets a stand-in that passes
    if lse is None:
        lse = p.xp.zeros(p.batch_shape + (p.heads_q, p.seqlen_q), stats_dtype(p.dtype))
    check_backward(p, dout, dout if out is None else out, lse, layout)
    keep = _dropout_mask(p, dropout_mask, dropout_p)
    with _tf32_mode(isinstance(compute_dtype, str) and compute_dtype == TF32):
        grads = _backward(p, dout, keep, dropout_p, _compute_dtype(compute_dtype), return_dbias)
    d = None if dv is None else q.shape[-1]  # q's own head dim (q is an array: the problem took it)
    dq, dk, dv_ = grads[:3] if dv is None else (grads[0][..., :d], grads[1][..., :d], grads[2][..., :dv])
    return tuple(_layout.from_bshd(g, layout) for g in (dq, dk, dv_)) + tuple(grads[3:])


def _backward(p, dout, keep, dropout_p, compute_dtype, return_dbias):
    qg, kg, vg = _grouped(p, compute_dtype)
    prob, _ = _probabilities(p, qg, kg)
    pd = _apply_dropout(prob, keep, dropout_p)
    r = _rounder(qg.dtype)
    b, sq, hq, d = p.q.shape
    do = p.host_float(dout, qg.dtype).reshape(b, sq, hq, d).transpose(0, 2, 1, 3).reshape(qg.shape)
    o = _mm_seen(pd, vg)
    dv = _mm_seen(np.swapaxes(pd, -1, -2), do)
    with np.errstate(invalid="ignore"):  # an unseen row or key may make dP NaN: it meets P = 0 below
        dpd = _mm(do, np.swapaxes(vg, -1, -2))
    # d(P∘Z/(1-p))/dP: a dropped element's dP contributes nothing, an infinite one (0 * inf) neither
    dprob = _apply_dropout(dpd, keep, dropout_p, drop_nonfinite=True)
    big_d = r(_sum(r(do * o), -1, keepdims=True))
    with np.errstate(invalid="ignore"):  # dP - D of an unseen row or key may be inf or NaN; it meets P = 0
        ds = r(np.where(prob != 0, prob * r(dprob - big_d), 0))
    ds0, dbias = ds, None
    if p.mods is not None and p.mods.score is not None:
        s0 = _scores(p, qg, kg)[0]
        values = _host_values(p)
        ds0 = r(_times_seen(ds, p.mods.dscore.evaluate(_env(p, s0), values, qg.dtype)))
        if p.mods.dbias is not None:
            dbias = _reduce_bias(p, r(_times_seen(ds, p.mods.dbias.evaluate(_env(p, s0), values, qg.dtype))))
    scale = qg.dtype.type(p.scale)
    dq = r(scale * _mm_seen(ds0, kg))
    dk = r(scale * _mm_seen(np.swapaxes(ds0, -1, -2), qg))
    shape_q, shape_k = p.q.shape[1:], p.k.shape[1:]
    grads = (p.unflatten(_ungroup(dq, p), shape_q),
             p.unflatten(_ungroup(_sum(dk, 2, keepdims=True), p), shape_k),
             p.unflatten(_ungroup(_sum(dv, 2, keepdims=True), p), shape_k))
    if return_dbias:
        if dbias is None:
            raise ValueError("return_dbias needs bias=")
        grads += (dbias,)
    return grads


def _times_seen(ds, factor):
    """``ds * factor`` where ``ds`` is nonzero, else 0: a modifier's derivative at a score that a row does not see
    (from a key it does not see, possibly NaN) must not reach dS."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(ds != 0, ds * factor, 0)


def _reduce_bias(p, ds):
    """dS (B, Hkv, G, Sq, Sk) summed over what the caller's bias broadcasts, in its shape."""
    full = p.batch_shape + (p.heads_q, p.seqlen_q, p.seqlen_k)
    ds = np.broadcast_to(ds, (p.batch, p.heads_kv, p.group, p.seqlen_q, p.seqlen_k)).reshape(full)
    shape = (1,) * (len(full) - len(p.mods.bias_shape)) + tuple(p.mods.bias_shape)
    axes = tuple(i for i, (s, t) in enumerate(zip(shape, full)) if s == 1 and t != 1)
    return _sum(ds, axes, keepdims=True).reshape(p.mods.bias_shape)


@ignore_fp_errors
def term_magnitudes(q, k, v, dout=None, *, dropout_mask=None, dropout_p=0.0, **options):
    """The magnitude of the terms each result is summed from, in float64, times the condition of ``exp``.

    ``out = P V`` sums terms ``P_ij V_j``; the lse sums ``exp`` of scores ``S_ij``; ``dQ = scale·dS K``, ``dK =
    scale·dSᵀ Q``, ``dV = Pᵀ dO`` (and dK, dV over a group's heads). Roundings scale with the terms, not with the
    results, which may cancel to ~0: the largest term, plus the sum of all terms' magnitudes weighted by the statistics'
    rounding in the input's (:func:`_magnitude`: fully for float32 and float64 inputs, 2^-13 of it for float16 and 2^-16
    for bfloat16, whose sums run in float32; a dS term's size counts, exactly, what rounding the output to the input's
    dtype moves D = rowsum(dO∘O) by). Every term also goes through ``P = exp(S - m)`` (or, in FlashAttention's backward,
    ``exp(S - lse)`` from the saved lse), whose relative condition number is ``|S - m|``: a rounding of the arithmetic
    grows by up to ``max|S| + max|lse|`` on its way (S before and after a score modifier, and for S itself the magnitude
    of its own terms, ``scale·|q|·|k|``, which it may cancel far below). That arithmetic runs in the statistics' dtype
    (float32 below float64: every backend upcasts 16-bit inputs), so each magnitude carries ``cond = 1 + (max|S| +
    max|lse|) · eps(stats) / eps(input)``, in roundings of the input's dtype: ``1 + max|S| + max|lse|`` for float32 and
    float64 inputs, about 1 for 16-bit ones. A score modifier's backward factor ``|d(mod)/d(score)|`` multiplies the
    gradients' terms; dropout bounds the kept terms by ``1/(1 - dropout_p)`` (the mask itself only removes terms). The
    lse's own terms are ``m`` and ``log l``, computed and kept in the statistics' dtype: its magnitude is
    ``(1 + max|S| + max|lse|) · eps(stats) / eps(input)``.
    :func:`cuflash.testing.assert_attention_close` puts its floor at two roundings of these. Returns a dict with keys
    ``out``, ``lse`` and, given ``dout``, ``dq``, ``dk``, ``dv`` (and ``dbias`` with ``bias=``).
    """
    _, p, (dout,), _ = _problem(options, q, k, v, dout=dout)
    _check_dropout_p(dropout_p)  # 1.0 gave infinite magnitudes, -1 smaller ones, as attention's own check refuses
    keep = None if dropout_mask is None else _dropout_mask(p, dropout_mask, dropout_p)  # checked too
    qg, kg, vg = _grouped(p, np.dtype(np.float64))
    prob, lse = _probabilities(p, qg, kg)
    s0, s1, _ = _scores(p, qg, kg)
    # S = scale q·k is itself a sum whose terms may cancel (keys and queries of 1e4 whose score is 68): its rounding
    # scales with scale·|q|·|k|, not with |S|
    with np.errstate(invalid="ignore", over="ignore"):
        s_terms = abs(p.scale) * _mm(np.abs(qg), np.swapaxes(np.abs(kg), -1, -2))
    s = np.where(prob > 0, np.maximum(np.maximum(np.abs(s0), np.abs(s1)), s_terms), 0.0)  # -inf: inf * 0 is NaN
    exponent = s.max(initial=0) + np.abs(lse[np.isfinite(lse)]).max(initial=0)
    ratio = rounding(stats_dtype(p.dtype)) / rounding(p.element_type or p.dtype)  # bits: bfloat16
    cond = 1.0 + exponent * ratio
    slope = 1.0
    if p.mods is not None and p.mods.score is not None:
        dscore = np.broadcast_to(p.mods.dscore.evaluate(_env(p, s0), _host_values(p)), prob.shape)  # may be 0-d
        slope = float(np.abs(dscore[prob > 0]).max(initial=0))
    # _mm_seen: a NaN or infinity no row sees (padding past seqlens) must not reach a magnitude as 0 * inf
    pv = _mm_seen(prob, np.abs(vg))  # the terms of out, P|V|
    mags = {"out": _magnitude(prob, vg, ratio, pv)}
    if dout is not None:
        b, sq, hq, d = p.q.shape
        do = p.host_float(dout, np.float64).reshape(b, sq, hq, d).transpose(0, 2, 1, 3).reshape(qg.shape)
        # dS = P∘(dP − D) cancels (exactly, for a single key), and so may the sums dP = dO·Vᵀ and
        # D = rowsum(dO∘O): the magnitudes of all their terms bound the rounding.
        with np.errstate(invalid="ignore", over="ignore"):
            dp_terms = np.abs(do) @ np.swapaxes(np.abs(vg), -1, -2)
            # the terms of dP and D, |O| <= P|V| (times 1/(1 - p) with dropout, below)
            sums = dp_terms + (np.abs(do) * pv).sum(axis=-1, keepdims=True)
            ds_all = np.where(prob > 0, prob * sums, 0.0)
            # one term of dQ or dK: dS = P (dP - D) itself, the roundings of its sums dP and D (in the statistics'
            # dtype: float32 for 16-bit inputs, whose products are exact there) and what the rounding of the output
            # to the input's dtype, which D reads, moves D by (exactly)
            eps = rounding(p.element_type or p.dtype)
            if dropout_p and keep is None:  # the output's rounding and dS bounded only
                d_rounded = 0.5 * eps * (sums - dp_terms) / (1.0 - dropout_p)
                dp_minus_d = sums / (1.0 - dropout_p)
            else:
                z = 1.0 if keep is None else keep / (1.0 - dropout_p)
                dropped = _mm_seen(np.where(prob > 0, prob * z, 0.0), vg)  # the output the backward reads
                d_rounded = (np.abs(do) * np.abs(dropped - _rounded(dropped, eps))).sum(axis=-1, keepdims=True)
                dp_minus_d = (do @ np.swapaxes(vg, -1, -2)) * z - (do * dropped).sum(axis=-1, keepdims=True)
            # (the floor is two roundings of a magnitude: d_rounded, already an error, enters in roundings)
            ds = np.where(prob > 0, prob * (np.abs(dp_minus_d) + ratio * sums + d_rounded / eps), 0.0)
        if p.mods is not None and p.mods.bias_shape is not None:
            mags["dbias"] = (ds.max(initial=0) + ratio * ds_all.max(initial=0)) * float(np.abs(
                p.mods.dbias.evaluate(_env(p, s0), _host_values(p))).max(initial=1))
        ds, ds_all = ds * slope, ds_all * slope
        ds_t, prob_t = np.swapaxes(ds, -1, -2), np.swapaxes(prob, -1, -2)
        mags["dq"] = abs(p.scale) * _magnitude(ds, kg, ratio, _mm_seen(ds_all, np.abs(kg)))
        # dK and dV sum over the query heads of their kv head's group
        mags["dk"] = abs(p.scale) * _magnitude(ds_t, qg, ratio, _mm_seen(np.swapaxes(ds_all, -1, -2), np.abs(qg)),
                                               group=True)
        mags["dv"] = _magnitude(prob_t, do, ratio, _mm_seen(prob_t, np.abs(do)), group=True)
    # in long double: times cond, a magnitude near float64's largest (V of 1e308) would overflow to inf, a bound
    # that passes anything (cuflash.testing refuses it)
    mags = {name: np.longdouble(x) * cond / (1.0 - dropout_p) for name, x in mags.items()}
    # the lse is the statistics' own result (float32 for 16-bit inputs, never rounded to them): its roundings are
    # the statistics' (ratio of the input's), where 1 + exponent input roundings let a float16 lse 0.1 off pass
    mags["lse"] = (1.0 + exponent) * ratio
    return mags


def _rounded(x, eps):
    """``x`` (float64) rounded to the nearest number with the precision ``eps`` (one ulp at 1.0), to even on a tie;
    the exponent range is not modelled (no subnormals, no overflow)."""
    mant, exp = np.frexp(x)
    bits = 1 - round(np.log2(eps))  # significand bits, the leading one included
    return np.ldexp(np.round(np.ldexp(mant, bits)), exp - bits)


def _magnitude(a, b, ratio, terms, group=False):
    """The magnitude of ``a @ b`` (``a >= 0``, grouped (B, Hkv, G, M, K); ``b`` (B, Hkv, G|1, K, D)) for the rule's
    floor: its largest term (:func:`_largest_term`; ``a``: each term's own size and error) plus ``ratio`` (the
    statistics' rounding in the input's) times the sum of all terms' magnitudes (``terms``, per result; with ``group``,
    summed over a kv head's group of query heads too, as dK and dV sum): every term carries a rounding of its own into
    the sum, in the statistics' dtype. For float32 and float64 inputs that sum weighs fully; for 16-bit ones, whose sums
    run in float32, the largest term decides (the sum alone set the floor at up to 11% of the largest float16 gradient,
    and dk 10% off passed; the roundings of 16-bit terms, P and dS rounded before a tensor-core product, are the naive
    computation's too, whose error the rule allows)."""
    return _largest_term(a, b) + ratio * (terms.sum(axis=2) if group else terms).max(initial=0)


def _largest_term(a, b):
    """``max |a_ij b_jc|`` over every term of the product ``a @ b`` (``a >= 0``, (..., M, K); ``b`` (..., K, D), which
    may broadcast over the leading dimensions of ``a``): a zero of ``a`` (a key a row does not see, a row past its
    sequence) contributes nothing, even against an infinity or NaN of ``b``, as in :func:`_mm_seen`. (Called under
    :func:`term_magnitudes`' ignore_fp_errors.)"""
    rows = np.abs(b).max(axis=-1, initial=0)  # NaN where a row holds one
    return np.where(a > 0, a * rows[..., None, :], 0.0).max(initial=0)


def rounding(dtype) -> float:
    """One ulp at 1.0 (machine epsilon) of ``dtype``: the size of one rounding, relative (bfloat16: 2**-7).
    Also :func:`cuflash.testing.rounding`, the unit of the tolerance rule."""
    if isinstance(dtype, str) and dtype == "bfloat16":  # the name, without ml_dtypes imported (NumPy knows it not)
        return 2.0 ** -7
    return 2.0 ** -7 if np.dtype(dtype).name == "bfloat16" else float(np.finfo(dtype).eps)


def _check_dropout_p(dropout_p):
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.integer, np.floating)) \
            or not 0.0 <= as_float(dropout_p) < 1.0:  # as the float it computes with (longdouble 1 - 2**-60 is 1.0)
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")


def _dropout_mask(p, mask, dropout_p):
    """``dropout_mask`` as the ``(B, Hkv, G, Sq, Sk)`` boolean view that multiplies P (None without one), checked
    with ``dropout_p`` before anything is computed."""
    _check_dropout_p(dropout_p)
    if mask is None:
        if dropout_p:
            raise ValueError("the reference needs an explicit dropout_mask when dropout_p > 0")
        return None
    if isinstance(mask, np.ma.MaskedArray) or np.asarray(mask).dtype != np.bool_:  # 2.0 would double the output
        raise TypeError(f"dropout_mask must be a plain boolean array (True: kept), got "
                        f"{type(mask).__name__} of dtype {np.asarray(mask).dtype}")
    want = p.batch_shape + (p.heads_q, p.seqlen_q, p.seqlen_k)
    try:
        m = np.broadcast_to(np.asarray(mask), want)
    except ValueError:  # NumPy's "operands could not be broadcast together" named neither the argument nor the shape
        raise ValueError(f"dropout_mask must be broadcastable to (..., heads, seqlen_q, seqlen_k) = {want}, got shape "
                         f"{np.shape(mask)}") from None
    return m.reshape(p.batch, p.heads_kv, p.group, p.seqlen_q, p.seqlen_k)


def _apply_dropout(x, m, dropout_p, drop_nonfinite=False):
    """``x`` (P, or dP in the backward) times the checked mask ``m`` of :func:`_dropout_mask` and ``1/(1 - p)``."""
    if m is None:
        return x
    if not drop_nonfinite:  # P: a NaN probability (its row sees a NaN score) stays NaN, dropped or not
        return _rounder(x.dtype)(x * m / x.dtype.type(1.0 - float(dropout_p)))
    with np.errstate(invalid="ignore"):
        return _rounder(x.dtype)(np.where(m, x * m / x.dtype.type(1.0 - float(dropout_p)), x.dtype.type(0)))
