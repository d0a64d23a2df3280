"""Invariances of attention, checked on the NumPy backend (and the reference where it matters).

Each transformed problem has the same exact answer as the original (or a known function of it),
so the backend's result on the transformed inputs is held to the tolerance rule against the
float64 reference of the *original* problem, with the naive same-dtype computation on the
transformed inputs as the baseline.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import BlockMask, reference
from cuflash.problem import make_problem
from cuflash.testing import assert_attention_close, attention_cases, reference_dtype, rounding

N_EXAMPLES = settings.default.max_examples
NO_MASKS = dict(causal=False, window=False, seqlens=False, block_mask=False)


def REF(x):
    """The reference's compute_dtype for inputs like ``x`` (long double for float64)."""
    return reference_dtype(x.dtype)


def forward(q, k, v, **options):
    return cuflash.attention(q, k, v, return_lse=True, backend="numpy", **options)


def backward(dout, q, k, v, out, lse, **options):
    return cuflash.attention_backward(dout, q, k, v, out, lse, backend="numpy", **options)


def naive(q, k, v, dout=None, **options):
    """The naive computation in the input dtype: (out, lse) or (dq, dk, dv)."""
    if dout is None:
        return reference.attention(q, k, v, return_lse=True, compute_dtype=q.dtype, **options)
    return reference.attention_backward(dout, q, k, v, compute_dtype=q.dtype, **options)


# ----------------------------------------------------------------------------- permutations
@given(case=attention_cases(dtypes=("float32", "float64"), **NO_MASKS), data=st.data())
def test_permuting_keys_and_values_together(case, data):
    sk = case.k.shape[-3]
    perm = np.asarray(data.draw(st.permutations(range(sk)), label="perm"))
    kp, vp = case.k[..., perm, :, :], case.v[..., perm, :, :]
    opts = case.options
    ref, ref_lse = reference.attention(case.q, case.k, case.v, return_lse=True, compute_dtype=REF(case.q), **opts)
    mags = reference.term_magnitudes(case.q, case.k, case.v, case.dout, **opts)
    out, lse = forward(case.q, kp, vp, **opts)
    base, base_lse = naive(case.q, kp, vp, **opts)
    assert_attention_close(out, ref, base, name="out", magnitude=mags["out"])
    assert_attention_close(lse, ref_lse, base_lse, name="lse", magnitude=mags["lse"])
    # gradients follow the permutation: dk of the permuted problem is dk[perm]
    dq, dk, dv = backward(case.dout, case.q, kp, vp, out, lse, **opts)
    rdq, rdk, rdv = reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=REF(case.q), **opts)
    bdq, bdk, bdv = naive(case.q, kp, vp, case.dout, **opts)
    assert_attention_close(dq, rdq, bdq, mult=3, name="dq", magnitude=mags["dq"])
    assert_attention_close(dk, rdk[..., perm, :, :], bdk, mult=3, name="dk", magnitude=mags["dk"])
    assert_attention_close(dv, rdv[..., perm, :, :], bdv, mult=3, name="dv", magnitude=mags["dv"])


@given(case=attention_cases(dtypes=("float32",), **NO_MASKS), data=st.data())
def test_permuting_queries_permutes_rows(case, data):
    sq = case.q.shape[-3]
    perm = np.asarray(data.draw(st.permutations(range(sq)), label="perm"))
    out, lse = forward(case.q, case.k, case.v, **case.options)
    out_p, lse_p = forward(case.q[..., perm, :, :], case.k, case.v, **case.options)
    # rows are computed independently of each other: at most a rounding apart (a BLAS kernel
    # may round a row differently at another position in the tile)
    mags = reference.term_magnitudes(case.q, case.k, case.v, **case.options)
    u = rounding(case.q.dtype)
    np.testing.assert_allclose(out_p, out[..., perm, :, :], rtol=0, atol=2 * u * mags["out"])
    np.testing.assert_allclose(lse_p, lse[..., perm], rtol=0, atol=2 * u * mags["lse"])


# ----------------------------------------------------------------------------- score shift
def _quantize(x, step=2.0 ** -6, bound=4.0):
    """Values on a 2^-6 grid in [-bound, bound]: k + c below is then exact even in float16."""
    return (np.clip(np.round(x.astype(np.float64) / step), -bound / step, bound / step) * step).astype(x.dtype)


@given(case=attention_cases(dtypes=("float16", "float32", "float64"), max_seqlen=128), data=st.data())
def test_adding_a_constant_to_every_key_shifts_scores_rowwise(case, data):
    """k_j + c for all j adds scale·q_i·c to every score of row i: out is unchanged and lse moves
    by exactly that amount (masks of any kind do not matter: the shift is per row)."""
    q, k, v = case.q, _quantize(case.k), case.v
    hkv, d = k.shape[-2:]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    c = _quantize(rng.uniform(-2, 2, size=(hkv, d)).astype(k.dtype), bound=2.0)
    k_shift = k + c  # broadcast over batch and key rows
    assert np.array_equal(k_shift.astype(np.float64) - c.astype(np.float64), k.astype(np.float64)), "not exact"
    opts = case.options
    p = make_problem(q, k, v, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, compute_dtype=REF(q), **opts)
    group = q.shape[-2] // hkv
    shift = p.scale * np.einsum("...shd,hd->...hs", q.astype(np.float64), np.repeat(c.astype(np.float64), group, 0))
    mags = reference.term_magnitudes(q, k_shift, v, **opts)
    out, lse = forward(q, k_shift, v, **opts)
    base, base_lse = naive(q, k_shift, v, **opts)
    assert_attention_close(out, ref, base, name="out", magnitude=mags["out"])
    assert_attention_close(lse, ref_lse + shift, base_lse, name="lse", magnitude=mags["lse"])


# ----------------------------------------------------------------------------- convexity
def _visible(case):
    p = make_problem(case.q, case.k, case.v, **case.options)
    vis = p.visible_mask()  # (B, Hq|1, Sq, Sk)
    return np.broadcast_to(vis, (p.batch, p.heads_q) + vis.shape[2:]), p


@given(attention_cases(dtypes=("float16", "float32", "float64"), max_seqlen=64, max_head_dim=16))
def test_output_rows_are_convex_combinations_of_visible_values(case):
    vis, p = _visible(case)
    out, _ = forward(case.q, case.k, case.v, **case.options)
    out = out.reshape(p.batch, p.seqlen_q, p.heads_q, p.head_dim).transpose(0, 2, 1, 3).astype(np.float64)
    v = case.v.reshape(p.batch, p.seqlen_k, p.heads_kv, p.head_dim).astype(np.float64)
    v = np.repeat(v, p.group, axis=2).transpose(0, 2, 1, 3)[:, :, None]  # (B, Hq, 1, Sk, D)
    hi = np.where(vis[..., None], v, -np.inf).max(axis=-2)  # (B, Hq, Sq, D)
    lo = np.where(vis[..., None], v, np.inf).min(axis=-2)
    count = vis.sum(axis=-1)
    # no visible key: exactly zero
    assert np.all(out[count == 0] == 0)
    # one visible key: exactly that value row (its weight is exp(0) = 1, the others 0)
    one = count == 1
    if one.any():
        j = vis.argmax(axis=-1)
        np.testing.assert_array_equal(out[one], np.take_along_axis(v[:, :, 0], j[..., None], axis=2)[one])
    # otherwise inside the box of visible values, up to two roundings at the term magnitude
    tol = 2 * rounding(case.q.dtype) * reference.term_magnitudes(case.q, case.k, case.v, **case.options)["out"]
    some = count > 0
    assert np.all(out[some] <= hi[some] + tol) and np.all(out[some] >= lo[some] - tol)


@pytest.mark.parametrize("sq, sk", [(40, 40), (25, 60), (60, 25)])
def test_single_visible_key_copies_its_value(sq, sk):
    """window=(0, 0): every row that sees anything sees exactly its diagonal key."""
    rng = np.random.default_rng(sq + sk)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, sq, 4, 8), (2, sk, 2, 8), (2, sk, 2, 8)))
    out, lse = forward(q, k, v, window=(0, 0), seqlens_k=np.array([sk, sk // 2]))
    lens_k = (sk, sk // 2)
    for b in range(2):
        for i in range(sq):
            j = i + lens_k[b] - sq
            if 0 <= j < lens_k[b]:
                np.testing.assert_array_equal(out[b, i], np.repeat(v[b, j], 2, axis=0))
                assert np.isfinite(lse[b, :, i]).all()
            else:
                assert np.all(out[b, i] == 0) and np.all(lse[b, :, i] == -np.inf)


# ----------------------------------------------------------------------------- grouped heads
@pytest.mark.parametrize("kind", ["gqa", "mqa"])
@settings(max_examples=max(2, N_EXAMPLES // 2))
@given(attention_cases(dtypes=("float32", "float64"), max_seqlen=100))
def test_grouped_heads_equal_repeated_heads(kind, case):
    q, k, v, do = case.q, case.k, case.v, case.dout
    if kind == "mqa":
        k, v = k[..., :1, :], v[..., :1, :]
    opts = case.options
    group = q.shape[-2] // k.shape[-2]
    kr, vr = np.repeat(k, group, axis=-2), np.repeat(v, group, axis=-2)
    mags = reference.term_magnitudes(q, k, v, do, **opts)
    # the reference itself: head h reads kv head h // group
    ref, ref_lse = reference.attention(q, kr, vr, return_lse=True, compute_dtype=REF(q), **opts)
    ref_g, ref_g_lse = reference.attention(q, k, v, return_lse=True, compute_dtype=REF(q), **opts)
    eps = np.finfo(np.float64).eps
    assert np.abs(ref_g - ref).max(initial=0) <= 2 * eps * mags["out"]
    # the backend on grouped heads against the reference on repeated heads
    out, lse = forward(q, k, v, **opts)
    base, base_lse = naive(q, k, v, **opts)
    assert_attention_close(out, ref, base, name="out", magnitude=mags["out"])
    assert_attention_close(lse, ref_lse, base_lse, name="lse", magnitude=mags["lse"])
    # dk, dv of a kv head are the sums over its query heads of the repeated problem's
    rdq, rdk, rdv = reference.attention_backward(do, q, kr, vr, compute_dtype=REF(q), **opts)
    fold = lambda g: g.reshape(g.shape[:-2] + (k.shape[-2], group, g.shape[-1])).sum(axis=-2)  # noqa: E731
    grads = backward(do, q, k, v, out, lse, **opts)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, (rdq, fold(rdk), fold(rdv)), naive(q, k, v, do, **opts)):
        assert_attention_close(g, r, b, mult=3, name=name, magnitude=mags[name])


# ----------------------------------------------------------------------------- batch dims
def _one(options, index, flat_index):
    """The options of batch element ``index`` (``flat_index`` in the flattened batch)."""
    opts = dict(options)
    for key in ("seqlens_q", "seqlens_k"):
        if key in opts:
            opts[key] = np.asarray(opts[key][index])
    bm = opts.get("block_mask")
    if bm is not None:
        dense = bm.to_dense()  # element-exact: the grid alone would lose the rule of partial blocks
        opts["block_mask"] = BlockMask.from_dense(dense[flat_index if dense.shape[0] > 1 else 0][None], block=bm.block)
    return opts


@settings(max_examples=max(2, N_EXAMPLES // 2))
@given(attention_cases(dtypes=("float16", "float32", "float64"), max_batch_dims=2, max_seqlen=100))
def test_batch_dims_equal_separate_calls(case):
    q, k, v, do = case.q, case.k, case.v, case.dout
    batch_shape = q.shape[:-3]
    out, lse = forward(q, k, v, **case.options)
    grads = backward(do, q, k, v, out, lse, **case.options)
    for flat, index in enumerate(np.ndindex(batch_shape)):
        opts = _one(case.options, index, flat)
        o1, l1 = forward(q[index], k[index], v[index], **opts)
        g1 = backward(do[index], q[index], k[index], v[index], o1, l1, **opts)
        mags = reference.term_magnitudes(q[index], k[index], v[index], do[index], **opts)
        for name, batched, single in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + grads, (o1, l1) + g1):
            a, b = batched[index].astype(np.float64), single.astype(np.float64)
            assert np.array_equal(np.isinf(a), np.isinf(b)) and np.array_equal(a[np.isinf(a)], b[np.isinf(b)])
            fin = np.isfinite(b)
            # at most a rounding apart (float16 results are float32 values rounded once)
            assert np.abs(a[fin] - b[fin]).max(initial=0) <= 2 * rounding(q.dtype) * mags[name], \
                f"{name} of batch element {index} differs from its separate call"


def test_batch_dims_directed():
    """(2, 3, ...) with per-sequence lengths and a per-(batch, head) BlockMask equals 6 calls."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 50, 4, 16), (2, 3, 70, 2, 16),
                                                                  (2, 3, 70, 2, 16)))
    grid = rng.random((6, 4, 4, 5)) < 0.6
    opts = dict(causal=True, seqlens_q=rng.integers(0, 51, (2, 3)), seqlens_k=rng.integers(0, 71, (2, 3)),
                block_mask=BlockMask(grid, block=(16, 16), seqlen_q=50, seqlen_k=70))
    out, lse = forward(q, k, v, **opts)
    for flat, index in enumerate(np.ndindex(2, 3)):
        one = _one(opts, index, flat)
        o1, l1 = forward(q[index], k[index], v[index], **one)
        mags = reference.term_magnitudes(q[index], k[index], v[index], **one)
        for name, batched, single in (("out", out[index], o1), ("lse", lse[index], l1)):
            # -inf (rows that see no key) where the separate call has it; the finite values at most a rounding
            # apart, at the magnitude of their terms (as test_batch_dims_equal_separate_calls)
            np.testing.assert_array_equal(np.isinf(batched), np.isinf(single), err_msg=f"{name} {index}")
            np.testing.assert_array_equal(batched[np.isinf(single)], single[np.isinf(single)], err_msg=name)
            fin = np.isfinite(single)
            assert fin.any() and np.isfinite(batched[fin]).all(), f"{name} of batch element {index}"
            err = np.abs(batched[fin].astype(np.float64) - single[fin]).max()
            assert err <= 2 * rounding(q.dtype) * mags[name], f"{name} of batch element {index}: {err:.3e}"
