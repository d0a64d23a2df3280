"""cuflash.merge_attention_states: exact log-sum-exp merge of partial attention results.

The main property: attention over keys split into chunks (1 to 5, empty ones included, and chunks that some causal
rows cannot see at all), merged, equals attention over all the keys, held to the usual rule against the float64
reference (at most 2x the naive same-dtype error plus the floor). Then the merge alone against a float64 formula
over arbitrary shapes, the -inf / NaN rules, overflow safety and the argument errors.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference
from cuflash.testing import assert_attention_close, reference_dtype

try:
    import ml_dtypes  # noqa: F401

    HAVE_BF16 = True
except ImportError:
    HAVE_BF16 = False

DTYPES = ["float64", "float32", "float16",
          pytest.param("bfloat16", marks=pytest.mark.skipif(not HAVE_BF16, reason="ml_dtypes not installed"))]


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def chunked_attention(q, k, v, bounds, *, causal, scale=None):
    """Attention over each key chunk ``[c0, c1)`` through the public API, then merged.

    Causal over the whole sequence (query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``) is, on the chunk, the window
    ``(None, Lk - c1)`` around the chunk's own bottom-right diagonal: ``c0 + j <= i + Lk - Lq`` rewritten with the
    chunk's offset ``(c1 - c0) - Lq``.
    """
    lk = k.shape[-3]
    parts = []
    for c0, c1 in bounds:
        window = (None, lk - c1) if causal else None
        parts.append(cuflash.attention(q, k[..., c0:c1, :, :], v[..., c0:c1, :, :], window=window, scale=scale,
                                       return_lse=True))
    return cuflash.merge_attention_states([p[0] for p in parts], [p[1] for p in parts])


def random_bounds(rng, lk, n_chunks):
    """``n_chunks`` consecutive ``[c0, c1)`` covering ``[0, lk)``; cuts may repeat (empty chunks)."""
    cuts = np.sort(rng.integers(0, lk + 1, size=n_chunks - 1))
    edges = [0, *cuts.tolist(), lk]
    return list(zip(edges[:-1], edges[1:]))


def check_against_whole(q, k, v, bounds, *, causal, scale=None):
    out, lse = chunked_attention(q, k, v, bounds, causal=causal, scale=scale)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                       compute_dtype=reference_dtype(q.dtype))
    base, base_lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True, compute_dtype=q.dtype)
    mags = reference.term_magnitudes(q, k, v, causal=causal, scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    assert_attention_close(out, ref, base, mult=2, name="out", magnitude=mags["out"])
    assert_attention_close(lse, ref_lse, base_lse, mult=2, name="lse", magnitude=mags["lse"])
    return out, lse


# ------------------------------------------------------------------------------- merge == whole attention
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n_chunks", [1, 2, 3, 5])
def test_chunked_equals_whole(dtype, causal, n_chunks):
    rng = np.random.default_rng(n_chunks * 7 + causal)
    sq, sk = 37, 53  # Sq != Sk: the causal diagonal is offset by 16
    q, k, v = (rng.standard_normal(s).astype(_dtype(dtype)) for s in ((2, sq, 4, 16), (2, sk, 2, 16), (2, sk, 2, 16)))
    bounds = random_bounds(rng, sk, n_chunks)
    check_against_whole(q, k, v, bounds, causal=causal)


def test_empty_chunks_and_chunks_some_rows_cannot_see():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 40, 2, 8), (1, 40, 2, 8), (1, 40, 2, 8)))
    bounds = [(0, 0), (0, 10), (10, 10), (10, 30), (30, 40)]
    # the last chunk is invisible to causal rows 0..29 (their partial lse is -inf), and the empty ones to every row
    _, lse_last = cuflash.attention(q, k[:, 30:], v[:, 30:], window=(None, 0), return_lse=True)
    assert np.isneginf(lse_last[..., :30]).all() and np.isfinite(lse_last[..., 30:]).all()
    check_against_whole(q, k, v, bounds, causal=True)


def test_rows_that_see_no_key_anywhere():
    # Lq > Lk with causal: rows 0..Lq-Lk-1 see no key in any chunk; the merge keeps out 0 and lse -inf for them.
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 30, 2, 8), (1, 12, 1, 8), (1, 12, 1, 8)))
    out, lse = check_against_whole(q, k, v, [(0, 5), (5, 12)], causal=True)
    assert np.isneginf(lse[:, :, :18]).all() and (out[:, :18] == 0).all()


@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(sq=st.integers(1, 70), sk=st.integers(1, 70), n_chunks=st.integers(1, 5), causal=st.booleans(),
       hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]), d=st.integers(1, 40),
       batch=st.lists(st.integers(1, 2), max_size=2), dtype=st.sampled_from(["float32", "float16", "float64"]),
       scale=st.one_of(st.none(), st.floats(0.1, 2.0)), seed=st.integers(0, 2**31))
def test_chunked_equals_whole_hypothesis(sq, sk, n_chunks, causal, hkv, group, d, batch, dtype, scale, seed):
    rng = np.random.default_rng(seed)
    b = tuple(batch)
    q = rng.standard_normal(b + (sq, hkv * group, d)).astype(dtype)
    k, v = (rng.standard_normal(b + (sk, hkv, d)).astype(dtype) for _ in range(2))
    check_against_whole(q, k, v, random_bounds(rng, sk, n_chunks), causal=causal, scale=scale)


# ------------------------------------------------------------------------------- the merge alone
def merge64(outs, lses):
    """The definition, in float64 with np.logaddexp (no max trick of our own)."""
    lse = np.logaddexp.reduce(np.stack([x.astype(np.float64) for x in lses]), axis=0)
    w = [np.exp(x.astype(np.float64) - np.where(np.isneginf(lse), 0, lse)) for x in lses]
    out = sum(np.swapaxes(wi, -1, -2)[..., None] * o.astype(np.float64) for wi, o in zip(w, outs))
    return out, lse


@settings(max_examples=max(20, settings.default.max_examples // 2))
@given(shape=st.tuples(st.lists(st.integers(1, 3), max_size=2), st.integers(0, 9), st.integers(1, 4),
                       st.integers(1, 6)),
       n=st.integers(1, 6), neg_inf=st.floats(0, 0.6), spread=st.floats(0, 200), dtype=st.sampled_from(
           ["float32", "float64", "float16"]), seed=st.integers(0, 2**31))
def test_merge_matches_float64_definition(shape, n, neg_inf, spread, dtype, seed):
    batch, sq, h, d = shape
    rng = np.random.default_rng(seed)
    lse_dtype = np.float64 if dtype == "float64" else np.float32
    outs = [rng.standard_normal((*batch, sq, h, d)).astype(dtype) for _ in range(n)]
    lses = [(rng.standard_normal((*batch, h, sq)) * spread).astype(lse_dtype) for _ in range(n)]
    for x in lses:
        x[rng.random(x.shape) < neg_inf] = -np.inf
    out, lse = cuflash.merge_attention_states(outs, lses)
    assert out.dtype == np.dtype(dtype) and out.shape == outs[0].shape
    assert lse.dtype == lse_dtype and lse.shape == lses[0].shape
    ref, ref_lse = merge64(outs, lses)
    dead = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), dead)
    assert (out[np.swapaxes(dead, -1, -2)] == 0).all()
    fin = ~dead
    # out is a convex combination of the parts: its error is a few roundings at max|out_i|, times the condition
    # number of each weight exp(lse_i - lse), which is |lse_i - lse| (the working precision is lse's dtype).
    eps = np.finfo(lse_dtype).eps
    gaps = [np.abs(x[fin & np.isfinite(x)] - ref_lse[fin & np.isfinite(x)]) for x in lses]
    cond = n + max(g.max(initial=0) for g in gaps)
    out_max = max(np.abs(o.astype(np.float64)).max(initial=0) for o in outs)
    assert np.abs(out - ref).max(initial=0) <= 2 * cond * eps * out_max + np.finfo(dtype).eps * out_max
    assert np.all(np.abs(lse[fin] - ref_lse[fin]) <= 2 * eps * (n + np.abs(ref_lse[fin])))


def test_single_part_is_returned_unchanged():
    rng = np.random.default_rng(0)
    out = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    lse = rng.standard_normal((2, 3, 5)).astype(np.float32)
    m_out, m_lse = cuflash.merge_attention_states([out], [lse])
    np.testing.assert_array_equal(m_lse, lse)
    np.testing.assert_array_equal(m_out, out)


def test_order_and_grouping_do_not_matter():
    rng = np.random.default_rng(1)
    outs = [rng.standard_normal((4, 2, 8)) for _ in range(4)]
    lses = [rng.standard_normal((2, 4)) * 5 for _ in range(4)]
    flat = cuflash.merge_attention_states(outs, lses)
    left = cuflash.merge_attention_states(outs[:2], lses[:2])
    right = cuflash.merge_attention_states(outs[2:], lses[2:])
    nested = cuflash.merge_attention_states([left[0], right[0]], [left[1], right[1]])
    backwards = cuflash.merge_attention_states(outs[::-1], lses[::-1])
    for other in (nested, backwards):
        np.testing.assert_allclose(other[0], flat[0], rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(other[1], flat[1], rtol=1e-14)


@pytest.mark.parametrize("dtype, big", [(np.float64, 1000.0), (np.float32, 100.0)])
def test_huge_lse_does_not_overflow(dtype, big):
    # exp(1000) overflows float64 and exp(100) float32: the max subtraction must keep the merge exact anyway
    out1, out2 = np.full((1, 1, 2), 1.0, dtype), np.full((1, 1, 2), 3.0, dtype)
    for sign in (1, -1):  # and exp(-1000) underflows: tiny weights must not vanish either
        lse1, lse2 = np.array([[sign * big]], dtype), np.array([[sign * big + np.log(3.0)]], dtype)
        gap = np.float64(lse2[0, 0]) - np.float64(lse1[0, 0])  # log 3 up to the rounding of lse2
        w2 = 1 / (1 + np.exp(-gap))
        out, lse = cuflash.merge_attention_states([out1, out2], [lse1, lse2])
        np.testing.assert_allclose(out, (1 - w2) * 1.0 + w2 * 3.0, rtol=4 * np.finfo(dtype).eps)
        np.testing.assert_allclose(lse, np.float64(lse1[0, 0]) + np.log1p(np.exp(gap)), rtol=4 * np.finfo(dtype).eps)


# ------------------------------------------------------------------------------- -inf and NaN
def test_all_parts_neg_inf_give_zero_and_neg_inf():
    outs = [np.zeros((3, 2, 4), np.float16) for _ in range(3)]
    lses = [np.full((2, 3), -np.inf, np.float32) for _ in range(3)]
    with np.errstate(all="raise"):  # no (-inf) - (-inf) anywhere
        out, lse = cuflash.merge_attention_states(outs, lses)
    assert (out == 0).all() and out.dtype == np.float16
    assert np.isneginf(lse).all() and lse.dtype == np.float32


def test_neg_inf_part_contributes_nothing():
    rng = np.random.default_rng(2)
    out1 = rng.standard_normal((3, 2, 4))
    lse1 = rng.standard_normal((2, 3))
    out, lse = cuflash.merge_attention_states([out1, np.zeros_like(out1)], [lse1, np.full_like(lse1, -np.inf)])
    np.testing.assert_array_equal(out, out1)
    np.testing.assert_array_equal(lse, lse1)


def test_a_part_with_lse_plus_inf_gives_what_the_whole_gives():
    """A row that saw an infinite score has lse +inf over the union (logsumexp): the merge gave NaN there
    (exp(inf - inf)), a single such part too, where it must come back unchanged."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 1, 4)).astype(np.float32) for _ in range(3))
    k, v = np.concatenate([k, k], axis=1), np.concatenate([v, v], axis=1)
    k[0, 0, 0, 0] = np.inf
    with np.errstate(all="ignore"):
        whole, lse_whole = cuflash.attention(q, k, v, return_lse=True)
        parts = [cuflash.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 2), slice(2, 4))]
        out, lse = cuflash.merge_attention_states(*zip(*parts))
    assert np.isposinf(lse_whole).any()
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(lse_whole))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(whole))
    one = cuflash.merge_attention_states([np.zeros((1, 1, 4), np.float32)], [np.full((1, 1), np.inf, np.float32)])
    assert np.isposinf(one[1]).all()


def test_nan_propagates_to_its_row_only():
    out1, out2 = np.ones((3, 2, 4), np.float32), np.ones((3, 2, 4), np.float32)
    lse1, lse2 = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)
    lse1[1, 2] = np.nan          # head 1, row 2
    out2[0, 0, 1] = np.nan       # row 0, head 0 (one element)
    out, lse = cuflash.merge_attention_states([out1, out2], [lse1, lse2])
    assert np.isnan(lse[1, 2]) and np.isnan(out[2, 1]).all()
    assert np.isnan(out[0, 0, 1]) and np.isfinite(np.delete(out[0, 0], 1)).all()
    mask = np.ones((2, 3), bool)
    mask[1, 2] = False
    assert np.isfinite(lse[mask]).all()
    # a NaN out in a part whose lse is -inf is still NaN (0 * NaN): corruption is not hidden
    out3 = np.full((3, 2, 4), np.nan, np.float32)
    out, _ = cuflash.merge_attention_states([out1, out3], [lse2, np.full((2, 3), -np.inf, np.float32)])
    assert np.isnan(out).all()


# ------------------------------------------------------------------------------- errors
def _parts(n=2, dtype=np.float32, lse_dtype=np.float32):
    return [np.zeros((5, 2, 4), dtype) for _ in range(n)], [np.zeros((2, 5), lse_dtype) for _ in range(n)]


@pytest.mark.parametrize("make, exc, match", [
    (lambda o, l: ([], []), ValueError, "at least one"),
    (lambda o, l: (o, l[:1]), ValueError, "one entry per part"),
    (lambda o, l: (o[0], l), TypeError, "outs must be a list"),
    (lambda o, l: (o, "lse"), TypeError, "lses must be a list"),
    (lambda o, l: (dict(enumerate(o)), l), TypeError, "outs must be a list or tuple of arrays .* got dict"),
    (lambda o, l: ([o[0], o[1][:4]], l), ValueError, r"outs\[1\] has shape"),
    (lambda o, l: (o, [l[0], l[1][:, :4]]), ValueError, r"lses\[1\] has shape"),
    (lambda o, l: ([o[0], o[1].astype(np.float16)], l), TypeError, r"outs\[1\] has dtype"),
    (lambda o, l: (o, [l[0], l[1].astype(np.float64)]), TypeError, r"lses\[1\] has dtype"),
    (lambda o, l: (o, [x.astype(np.float16) for x in l]), TypeError, r"lses\[0\] must be float32, float64"),
    (lambda o, l: ([x.astype(np.int32) for x in o], l), TypeError, r"outs\[0\] must be float16"),
    (lambda o, l: (o, [x.T for x in l]), ValueError, r"lses\[0\] must have shape \(\.\.\., heads, seqlen_q\)"),
    (lambda o, l: ([x[0] for x in o], [x[0] for x in l]), ValueError, r"outs\[0\] must have shape"),
    (lambda o, l: ([o[0], o[1].tolist()], l), TypeError, r"outs\[1\] must be a numpy.ndarray or cupy.ndarray"),
    (lambda o, l: (o, [l[0], np.ma.masked_array(l[1])]), TypeError, r"lses\[1\] is a numpy.ma.MaskedArray"),
])
def test_errors_name_the_argument(make, exc, match):
    outs, lses = make(*_parts())
    with pytest.raises(exc, match=match):
        cuflash.merge_attention_states(outs, lses)


def test_exported():
    assert "merge_attention_states" in cuflash.__all__
    assert cuflash.merge_attention_states.__doc__.count("Parameters") == 1


@pytest.mark.parametrize("num_splits", [2, 4])
def test_a_split_whose_weight_underflows_reaches_nothing(num_splits):
    """Split-KV merges its splits' (out, lse): a split whose keys' probabilities underflow to 0 (scores 2121 below the
    row's largest) holding an infinite value gave NaN (its out inf, its weight exactly 0, 0 * inf), where the unsplit
    call, as the reference, gives the finite result: a key of probability 0 contributes nothing. The public merge
    keeps 0 * inf = NaN (test_nan_propagates_to_its_row_only)."""
    q = np.zeros((1, 1, 1, 8), np.float32)
    q[..., 0] = 1.0
    k = np.zeros((1, 256, 1, 8), np.float32)
    k[0, :128, 0, 0], k[0, 128:, 0, 0] = 3000.0, -3000.0
    v = np.ones((1, 256, 1, 8), np.float32)
    v[0, 200] = np.inf
    lens = np.array([256], np.int32)
    want = reference.attention(q, k, v)
    np.testing.assert_array_equal(want, np.ones_like(want))
    whole = cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=1, backend="numpy")
    split = cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=num_splits, backend="numpy")
    np.testing.assert_array_equal(whole, want)
    np.testing.assert_array_equal(split, want)


@pytest.mark.parametrize("heads", [4, 3], ids=["heads-equal-seqlen_q", "heads-other"])
def test_bhsd_parts_merge_into_the_bhsd_whole(heads):
    """layout="bhsd" as attention takes it: the parts of bhsd calls were read as bshd, a silently wrong merge where
    heads == seqlen_q (1.3 off) and an error about the lse's shape otherwise. Now the merge holds to the rule against
    the float64 reference, C-contiguous and in the caller's layout; without the layout, the error names it."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, heads, n, 8)).astype(np.float32) for n in (4, 10, 10))
    parts = [cuflash.attention(q, k[:, :, s], v[:, :, s], layout="bhsd", return_lse=True)
             for s in (slice(0, 6), slice(6, 10))]
    out, lse = cuflash.merge_attention_states([p[0] for p in parts], [p[1] for p in parts], layout="bhsd")
    assert out.shape == q.shape and out.flags.c_contiguous and out.dtype == q.dtype
    ref, ref_lse = reference.attention(q, k, v, layout="bhsd", return_lse=True, compute_dtype=np.float64)
    base, base_lse = reference.attention(q, k, v, layout="bhsd", return_lse=True, compute_dtype=np.float32)
    mags = reference.term_magnitudes(q, k, v, layout="bhsd")
    assert_attention_close(out, ref, base, mult=2, name="out", magnitude=mags["out"])
    assert_attention_close(lse, ref_lse, base_lse, mult=2, name="lse", magnitude=mags["lse"])
    with pytest.raises(ValueError, match=r"layout must be 'bshd' .* or 'bhsd'"):
        cuflash.merge_attention_states([p[0] for p in parts], [p[1] for p in parts], layout="sbhd")
    if heads != 4:
        with pytest.raises(ValueError, match=r"lses\[0\] must have shape .* \(layout='bshd'\)"):
            cuflash.merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
