"""The float64 oracle against an independent brute force, and finite differences of the backwards.

The brute force below writes the visibility rule from ../shared/README.md directly (no cuflash
code) and computes each row with ``math.fsum``. The finite-difference checks differentiate
``L = sum(dout * out)`` numerically, for the reference's backward and for the NumPy backend's.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings

import cuflash
from cuflash import BlockMask, reference
from cuflash.testing import attention_cases

EPS = np.finfo(np.float64).eps
N_EXAMPLES = settings.default.max_examples


# ----------------------------------------------------------------------------- brute force
def sees(i, j, len_q, len_k, causal, window):
    """README semantics: bottom-right aligned diagonal; window=(left, right) around it."""
    if not (i < len_q and j < len_k):
        return False
    diag = i + (len_k - len_q)
    if causal and j > diag:
        return False
    if window is not None:
        left, right = window
        if left is not None and j < diag - left:
            return False
        if right is not None and j > diag + right:
            return False
    return True


def brute_force(q, k, v, *, causal=False, scale=None, window=None, block_mask=None,
                seqlens_q=None, seqlens_k=None):
    """Per-row Python loop: ``(out, lse)`` with the layouts of :func:`cuflash.attention`."""
    batch_shape = q.shape[:-3]
    sq, hq, d = q.shape[-3:]
    sk, hkv, _ = k.shape[-3:]
    qf, kf, vf = (x.reshape((-1,) + x.shape[-3:]).astype(np.float64) for x in (q, k, v))
    nb = qf.shape[0]
    lq = np.full(nb, sq) if seqlens_q is None else np.asarray(seqlens_q).reshape(-1)
    lk = np.full(nb, sk) if seqlens_k is None else np.asarray(seqlens_k).reshape(-1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((nb, sq, hq, d))
    lse = np.full((nb, hq, sq), -np.inf)
    for b in range(nb):
        for h in range(hq):
            hk = h // (hq // hkv)
            for i in range(sq):
                scores = {}
                for j in range(sk):
                    if not sees(i, j, lq[b], lk[b], causal, window):
                        continue
                    if block_mask is not None and not block_mask.keep(b, h, i, j):  # element-exact
                        continue
                    scores[j] = scale * math.fsum(qf[b, i, h, c] * kf[b, j, hk, c] for c in range(d))
                if not scores:
                    continue
                m = max(scores.values())
                w = {j: math.exp(s - m) for j, s in scores.items()}
                total = math.fsum(w.values())
                for c in range(d):
                    out[b, i, h, c] = math.fsum(w[j] * vf[b, j, hk, c] for j in w) / total
                lse[b, h, i] = m + math.log(total)
    return out.reshape(batch_shape + (sq, hq, d)), lse.reshape(batch_shape + (hq, sq))


def assert_close64(actual, expected, magnitude, name):
    """Float64: -inf where expected is, elsewhere within two roundings at the term magnitude."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, name
    inf = np.isinf(expected)
    assert np.array_equal(np.isinf(actual), inf) and np.array_equal(actual[inf], expected[inf]), \
        f"{name}: infinite entries differ"
    if (~inf).any():
        err = np.abs(actual[~inf] - expected[~inf]).max()
        assert err <= 2 * EPS * magnitude, f"{name}: error {err:.3e} > {2 * EPS * magnitude:.3e}"


TINY = dict(dtypes=("float64",), max_seqlen=12, max_head_dim=5, max_batch_dims=2, block_sizes=(1, 2, 3))


@given(attention_cases(**TINY))
def test_reference_matches_brute_force(case):
    out, lse = reference.attention(case.q, case.k, case.v, return_lse=True, **case.options)
    b_out, b_lse = brute_force(case.q, case.k, case.v, **case.options)
    mags = reference.term_magnitudes(case.q, case.k, case.v, **case.options)
    assert_close64(out, b_out, mags["out"], "out")
    assert_close64(lse, b_lse, mags["lse"], "lse")


@pytest.mark.parametrize("sq, sk", [(5, 9), (9, 5), (7, 7)])
@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(2, 1)), dict(window=(None, 3)),
                                     dict(window=(0, None), causal=True), dict(window=(0, 0))],
                         ids=["causal", "win2-1", "winNone-3", "win0-None-causal", "win0-0"])
def test_brute_force_visibility_directed(sq, sk, options):
    """Fixed cases for the diagonal alignment, both Sq < Sk and Sq > Sk, with seqlens."""
    rng = np.random.default_rng(sq * 10 + sk)
    q, k, v = (rng.standard_normal(s) for s in ((2, sq, 2, 3), (2, sk, 1, 3), (2, sk, 1, 3)))
    for extra in ({}, dict(seqlens_q=np.array([sq, sq - 2]), seqlens_k=np.array([sk - 3, sk]))):
        out, lse = reference.attention(q, k, v, return_lse=True, **options, **extra)
        b_out, b_lse = brute_force(q, k, v, **options, **extra)
        mags = reference.term_magnitudes(q, k, v, **options, **extra)
        assert_close64(out, b_out, mags["out"], "out")
        assert_close64(lse, b_lse, mags["lse"], "lse")


# ----------------------------------------------------------------------------- finite differences
H = 1e-5


def finite_difference(forward, dout, arrays, options):
    """Central differences of ``L = sum(dout * forward(q, k, v))`` for every input element."""
    grads = []
    for which in range(3):
        g = np.zeros_like(arrays[which])
        for idx in np.ndindex(arrays[which].shape):
            vals = []
            for sign in (1, -1):
                xs = [a.copy() for a in arrays]
                xs[which][idx] += sign * H
                vals.append(np.sum(dout * forward(*xs, **options)))
            g[idx] = (vals[0] - vals[1]) / (2 * H)
        grads.append(g)
    return grads


def assert_fd_close(analytic, numeric, mags):
    # Central differences err by O(H^2 L''') + O(eps |L| / H), ~1e-11 of the magnitude here; a wrong
    # gradient (scale, mask, head mapping, group sum) errs by O(1) of the magnitude.
    for name, a, n in zip(("dq", "dk", "dv"), analytic, numeric):
        err = np.abs(a - n).max(initial=0)
        assert err <= 1e-8 * mags[name], f"{name}: analytic vs finite difference {err:.3e} (magnitude {mags[name]:.3e})"


def _numpy_forward(q, k, v, **options):
    return cuflash.attention(q, k, v, backend="numpy", **options)


def _check_fd(case):
    arrays = [case.q, case.k, case.v]
    mags = reference.term_magnitudes(*arrays, case.dout, **case.options)
    mags = {n: max(m, 1.0) for n, m in mags.items()}
    ref_grads = reference.attention_backward(case.dout, *arrays, **case.options)
    assert_fd_close(ref_grads, finite_difference(reference.attention, case.dout, arrays, case.options), mags)
    out, lse = cuflash.attention(*arrays, return_lse=True, backend="numpy", **case.options)
    np_grads = cuflash.attention_backward(case.dout, *arrays, out, lse, backend="numpy", **case.options)
    assert_fd_close(np_grads, finite_difference(_numpy_forward, case.dout, arrays, case.options), mags)


FD_TINY = dict(dtypes=("float64",), max_seqlen=6, max_head_dim=3, max_batch_dims=1, block_sizes=(2, 3))


@settings(max_examples=max(2, N_EXAMPLES // 2))
@given(attention_cases(**FD_TINY))
def test_finite_differences(case):
    _check_fd(case)


FD_DIRECTED = {
    "causal": dict(causal=True),
    "window": dict(window=(1, 2)),
    "causal_window_seqlens": dict(causal=True, window=(2, None), seqlens_q=np.array([5, 3]),
                                  seqlens_k=np.array([4, 6])),
    "block_mask": dict(block_mask=BlockMask(np.array([[True, False], [True, True], [False, True]]),
                                            block=(2, 3), seqlen_q=5, seqlen_k=6), scale=0.7),
}


@pytest.mark.parametrize("name", FD_DIRECTED)
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=["gqa", "mqa"])
def test_finite_differences_directed(name, heads):
    from cuflash.testing import Case

    rng = np.random.default_rng(len(name))
    hq, hkv = heads
    q, k, v, do = (rng.standard_normal(s) for s in ((2, 5, hq, 3), (2, 6, hkv, 3), (2, 6, hkv, 3), (2, 5, hq, 3)))
    _check_fd(Case(q, k, v, do, dict(FD_DIRECTED[name])))


# ----------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("shape_q, shape_k", [((2, 0, 3, 4), (2, 5, 3, 4)), ((2, 4, 3, 4), (2, 0, 3, 4)),
                                              ((0, 3, 5, 2, 4), (0, 3, 6, 2, 4))], ids=["sq0", "sk0", "batch0"])
def test_reference_zero_lengths(shape_q, shape_k):
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(s) for s in (shape_q, shape_k, shape_k, shape_q))
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == shape_q[:-3] + (shape_q[-2], shape_q[-3])
    assert np.all(out == 0) and np.all(lse == -np.inf)
    grads = reference.attention_backward(do, q, k, v, causal=True)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(np.all(g == 0) for g in grads)


def test_reference_propagates_nan():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 12, 1, 4)) for _ in range(3))
    k[0, 5, 0, 1] = np.nan
    with np.errstate(invalid="ignore"):
        out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert np.isnan(out[0, 5:]).all() and np.isnan(lse[0, 0, 5:]).all()
    assert np.isfinite(out[0, :5]).all() and np.isfinite(lse[0, 0, :5]).all()


@pytest.mark.parametrize("backend", [None, "numpy"])
def test_an_infinite_score_takes_every_weight_of_its_row(backend):
    """A row with a +inf score has lse = +inf and NaN outputs; its P is exp(S - lse): NaN at the infinite score and 0
    at the finite ones, also those whose exp overflows (a score of 1300 here), so that the backward's NaN pattern does
    not hang on the dtype's range. The NumPy backend recomputes P from the saved lse the same way."""
    q = np.array([[[[1.0, 0.0]]]])
    k = np.array([[[[np.inf, 0.0]], [[1300.0 * np.sqrt(2.0), 0.0]], [[-2.0, 0.0]]]])
    v = np.arange(6.0).reshape(1, 3, 1, 2)
    dout = np.ones((1, 1, 1, 2))
    with np.errstate(invalid="ignore", over="ignore"):
        out, lse = reference.attention(q, k, v, return_lse=True)
        if backend is None:
            dq, dk, dv = reference.attention_backward(dout, q, k, v)
        else:
            dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, backend=backend)
    assert np.isnan(out).all() and lse[0, 0, 0] == np.inf
    assert np.isnan(dq).all() and np.isnan(dk[0, 0]).all() and np.isnan(dv[0, 0]).all()
    assert np.array_equal(dk[0, 1:], np.zeros((2, 1, 2))) and np.array_equal(dv[0, 1:], np.zeros((2, 1, 2)))


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_compute_dtype_is_the_computation_dtype(dtype):
    """``compute_dtype`` is the naive computation in that dtype: results come back in it (the
    tolerance rule reads the floor off their dtype), rounded to it at every step (ml_dtypes'
    bfloat16 matmul alone would return float32)."""
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(dtype)
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((1, 9, 2, 8)).astype(dt) for _ in range(4))
    out, lse = reference.attention(q, k, v, return_lse=True, compute_dtype=dt)
    assert out.dtype == dt and lse.dtype == dt
    assert all(g.dtype == dt for g in reference.attention_backward(do, q, k, v, compute_dtype=dt))
    # and it is not the float64 computation rounded once at the end: its error is of the dtype's size
    ref = reference.attention(q, k, v)
    err = np.abs(out.astype(np.float64) - ref).max()
    assert err > 0 and err > np.abs(ref.astype(dt).astype(np.float64) - ref).max()


def test_reference_refuses_what_it_would_misread():
    """The oracle's own arguments: a non-bool keep-mask (2.0 doubled the output), a masked one, dropout_p outside
    [0, 1) (1.0 gave NaN), a complex, integer or None compute_dtype."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 5, 2, 4)) for _ in range(3))
    keep = np.ones((1, 2, 5, 5), bool)
    with pytest.raises(TypeError, match="dropout_mask must be a plain boolean array"):
        reference.attention(q, k, v, dropout_mask=np.array(2.0), dropout_p=0.5)
    with pytest.raises(TypeError, match="dropout_mask must be a plain boolean array"):
        reference.attention(q, k, v, dropout_mask=np.ma.masked_array(keep, mask=~keep), dropout_p=0.5)
    for p in (1.0, -3, True):
        with pytest.raises(ValueError, match="dropout_p must be a float in"):
            reference.attention(q, k, v, dropout_mask=keep, dropout_p=p)
    for dt in (np.complex128, np.int64, None):  # None: np.dtype(None) is float64, silently
        with pytest.raises(TypeError, match="compute_dtype must be a real floating-point dtype"):
            reference.attention(q, k, v, compute_dtype=dt)


@pytest.mark.parametrize("saved", [False, True], ids=["without-out-lse", "with-out-lse"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_reference_backward_checks_dout_as_the_api_does(saved, layout):
    """dout was checked only with both out and lse given: a masked dout (every element masked) gave nonzero
    gradients, its mask dropped; an int dout or a list was computed with. Refused as cuflash.attention_backward
    refuses them, in either layout, with out and lse or without."""
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((1, 5, 2, 4)) for _ in range(4))
    out, lse = reference.attention(q, k, v, return_lse=True)
    swap = (lambda a: a) if layout == "bshd" else (lambda a: a.swapaxes(1, 2))
    q, k, v, do, out = map(swap, (q, k, v, do, out))
    bad = [(np.ma.masked_array(do, mask=np.ones(do.shape, bool)), TypeError, r"dout is a numpy\.ma\.MaskedArray"),
           (np.ones(do.shape, np.int64), TypeError, "dout must have q's dtype float64, got int64"),
           (np.ones(do.shape, bool), TypeError, "dout must have q's dtype float64, got bool"),
           (do.astype(np.float32), TypeError, "dout must have q's dtype float64, got float32"),
           (do.tolist(), TypeError, r"dout must be a numpy\.ndarray or cupy\.ndarray"),
           (None, TypeError, r"dout must be a numpy\.ndarray or cupy\.ndarray"),
           (do[..., :3], ValueError, "dout must have (q's )?shape"),
           (do[:, :, :1], ValueError, "dout must have (q's )?shape")]
    extra = dict(out=out, lse=lse) if saved else {}
    for dout, error, match in bad:
        with pytest.raises(error, match=match):
            reference.attention_backward(dout, q, k, v, layout=layout, **extra)
        with pytest.raises(error, match=match):
            cuflash.attention_backward(dout, q, k, v, out, lse, layout=layout)
    # a valid dout's gradients are those of the API, given out and lse or not
    grads = reference.attention_backward(do, q, k, v, layout=layout, **extra)
    for got, want in zip(grads, cuflash.attention_backward(do, q, k, v, out, lse, layout=layout)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    # v of a head dim of its own, wider than q's or narrower (dout zero-padded to q's: named dout, not "dout/out")
    for dv in (6, 3):
        vw, dow = (swap(rng.standard_normal((1, 5, 2, dv))) for _ in range(2))
        with pytest.raises(TypeError, match=r"^dout is a numpy\.ma\.MaskedArray"):
            reference.attention_backward(np.ma.masked_array(dow, mask=True), q, k, vw, layout=layout)


@pytest.mark.parametrize("shape", [(1, 2, 5, 4), (3, 5, 5), (1, 1, 2, 5, 5), (5, 4)])
def test_reference_names_a_dropout_mask_of_the_wrong_shape(shape):
    """A dropout_mask that does not broadcast to (..., heads, Sq, Sk) raised NumPy's own broadcast error, which named
    neither dropout_mask nor the shape it must take, and only after the scores were computed."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 5, 2, 4)) for _ in range(4))
    form = re.escape(f"dropout_mask must be broadcastable to (..., heads, seqlen_q, seqlen_k) = (1, 2, 5, 5), got "
                     f"shape {shape}")
    with pytest.raises(ValueError, match=form):
        reference.attention(q, k, v, dropout_mask=np.ones(shape, bool), dropout_p=0.5)
    with pytest.raises(ValueError, match=form):
        reference.attention_backward(do, q, k, v, dropout_mask=np.ones(shape, bool), dropout_p=0.5)
    for fine in [(1, 2, 5, 5), (2, 1, 5), (5,), ()]:  # shapes that broadcast are taken, as before
        keep = np.ones(fine, bool)
        np.testing.assert_array_equal(reference.attention(q, k, v, dropout_mask=keep, dropout_p=0.5),
                                      2 * reference.attention(q, k, v))


def test_testing_helpers_refuse_what_they_would_misread():
    """attention_cases(dtypes="float16") drew the string's letters; a complex result passed the rule on its real
    part."""
    from cuflash.testing import assert_attention_close

    with pytest.raises(TypeError, match="dtypes must be a non-empty tuple of dtype names"):
        attention_cases(dtypes="float16")
    ref = np.ones(3)
    with pytest.raises(TypeError, match=r"actual must be a real \(float or integer\) array"):
        assert_attention_close(ref + 1000j, ref, ref.astype(np.float32))


def test_term_magnitudes_of_a_bias_masking_with_minus_inf():
    """A -inf bias is the usual way to mask with a bias: its masked score times P = 0 gave a NaN magnitude, so
    cuflash.testing failed every correct result of such a problem."""
    from cuflash.testing import Case, check_backward, check_forward

    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 3, 1, 4)).astype(np.float32) for _ in range(4))
    bias = np.zeros((1, 1, 3, 3), np.float32)
    bias[0, 0, 0, 2] = -np.inf
    mags = reference.term_magnitudes(q, k, v, dout, bias=bias)
    assert all(np.isfinite(m) and m > 0 for m in mags.values()), mags
    case = Case(q, k, v, dout, dict(bias=bias))
    out, lse = check_forward(lambda *a, **o: cuflash.attention(*a, **o, return_lse=True), case)
    check_backward(cuflash.attention_backward, case, out, lse)


def test_the_rule_is_not_disarmed_by_a_naive_overflow_nor_by_python_O():
    """A naive float16 computation that overflows somewhere (a long row sum, one large score) gave an infinite
    naive error, and the check passed anything; under python -O the bare asserts checked nothing; a backward fn
    returning fewer gradients had the missing ones go unchecked."""
    import subprocess
    import sys

    from cuflash.testing import Case, assert_attention_close, check_backward

    ref = np.array([1.0, 2.0, 3.0])
    baseline = np.array([np.inf, 2.001, np.nan], np.float16)
    with pytest.raises(AssertionError, match="max error 5.000e-01 exceeds"):
        assert_attention_close(np.array([1.0, 2.5, 3.0]), ref, baseline)
    assert_attention_close(np.array([1.0, 2.0005, 3.0]), ref, baseline)  # within 2x the finite naive errors
    code = ("import numpy as np; from cuflash.testing import assert_attention_close as c\n"
            "try: c(np.array([np.nan]), np.ones(1), np.ones(1))\n"
            "except AssertionError as e: print('raised:', e)")
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert "raised: out: NaN in the result" in done.stdout
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 5, 1, 4)) for _ in range(4))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(AssertionError, match=r"fn must return \(dq, dk, dv\), got 1 values"):
        check_backward(lambda *a, **o: cuflash.attention_backward(*a, **o)[:1], Case(q, k, v, dout), out, lse)


def test_term_magnitudes_ignore_what_no_row_sees():
    """NaN and infinities past seqlens_k (padding, never read) made the magnitudes NaN (0 * inf in P @ |V|), and
    check_forward/check_backward failed correct results with a NaN floor."""
    from cuflash.testing import Case, check_backward, check_forward

    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((1, 6, 2, 4)) for _ in range(4))
    v[0, 5, 0, 1], k[0, 4, 1, 2] = np.nan, np.inf  # keys 4 and 5: past seqlens_k = 4
    options = dict(seqlens_k=np.array([4], np.int32))
    mags = reference.term_magnitudes(q, k, v, dout, **options)
    assert all(np.isfinite(m) for m in mags.values()), mags
    case = Case(q, k, v, dout, options)
    out, lse = check_forward(lambda *a, **o: cuflash.attention(*a, **o, return_lse=True), case)
    check_backward(cuflash.attention_backward, case, out, lse)


def test_the_reference_takes_layout_as_cuflash_does():
    """Every option of cuflash.attention, layout="bhsd" too (it died inside make_problem): the results are those
    of the bshd arrays, in the caller's layout."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((2, 7, 3, 8)) for _ in range(4))
    swap = lambda a: np.swapaxes(a, 1, 2)  # noqa: E731
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    out_h, lse_h = reference.attention(*map(swap, (q, k, v)), causal=True, return_lse=True, layout="bhsd")
    np.testing.assert_array_equal(swap(out_h), out)
    np.testing.assert_array_equal(lse_h, lse)
    grads = reference.attention_backward(dout, q, k, v, causal=True)
    grads_h = reference.attention_backward(*map(swap, (dout, q, k, v)), causal=True, layout="bhsd")
    for g, g_h in zip(grads, grads_h):
        np.testing.assert_array_equal(swap(g_h), g)
    assert reference.term_magnitudes(*map(swap, (q, k, v, dout)), layout="bhsd") == \
        reference.term_magnitudes(q, k, v, dout)
    with pytest.raises(ValueError, match="layout"):
        reference.attention(q, k, v, layout="sbhd")


@pytest.mark.parametrize("dv", [3, 9])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_a_value_head_dim_of_its_own_is_the_zero_padded_problem(dv, layout):
    """reference.attention takes v with its own head dim, as cuflash.attention does (it refused it, so the testing
    helpers could not check that case): exactly the problem zero-padded to the larger head dim (zero columns add
    exact zeros), cut back; forward, backward and the term magnitudes, with the default scale of q's head dim."""
    rng = np.random.default_rng(6)
    d = 5
    q, k = rng.standard_normal((2, 7, 4, d)), rng.standard_normal((2, 6, 2, d))
    v, dout = rng.standard_normal((2, 6, 2, dv)), rng.standard_normal((2, 7, 4, dv))
    width = max(d, dv)
    pad = lambda x: np.concatenate([x, np.zeros(x.shape[:-1] + (width - x.shape[-1],))], axis=-1)  # noqa: E731
    swap = (lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))) if layout == "bhsd" else (lambda x: x)  # noqa
    options = dict(causal=True, scale=1 / math.sqrt(d), layout=layout)
    out, lse = reference.attention(*map(swap, (q, k, v)), return_lse=True, **dict(options, scale=None))
    want, want_lse = reference.attention(*map(swap, map(pad, (q, k, v))), return_lse=True, **options)
    np.testing.assert_array_equal(out, want[..., :dv])
    np.testing.assert_array_equal(lse, want_lse)
    grads = reference.attention_backward(*map(swap, (dout, q, k, v)), **options)
    padded = reference.attention_backward(*map(swap, map(pad, (dout, q, k, v))), **options)
    for g, w, n in zip(grads, padded, (d, d, dv)):
        np.testing.assert_array_equal(g, w[..., :n])
    mags = reference.term_magnitudes(*map(swap, (q, k, v, dout)), **options)
    assert mags == reference.term_magnitudes(*map(swap, map(pad, (q, k, v, dout))), **options)


@pytest.mark.parametrize("dv", [3, 5, 9])
def test_dout_and_out_of_another_width_are_refused_as_the_api_refuses_them(dv):
    """dout (and out) must have q's shape with v's head dim, as cuflash.attention_backward requires: a wider one was
    cut silently where v is padded, and a bare reshape error elsewhere."""
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((1, 4, 2, 5)), rng.standard_normal((1, 6, 2, 5)), rng.standard_normal((1, 6, 2, dv))
    wrong = rng.standard_normal((1, 4, 2, dv + 2))
    with pytest.raises(ValueError, match=rf"dout must have shape \(1, 4, 2, {dv}\) \(q's shape with v's head_dim\)"):
        reference.attention_backward(wrong, q, k, v)
    with pytest.raises(ValueError, match=r"dout must have shape"):
        reference.term_magnitudes(q, k, v, wrong)
    out, lse = reference.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=rf"out must have shape \(1, 4, 2, {dv}\)"):
        reference.attention_backward(out, q, k, v, wrong, lse)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be a float in \[0, 1\)"),
    (dict(dropout_p=-1), ValueError, r"dropout_p must be a float in \[0, 1\)"),
    (dict(dropout_p="x"), ValueError, r"dropout_p must be a float in \[0, 1\)"),
    (dict(dropout_p=0.5, dropout_mask=np.ones((3, 3), bool)), ValueError, "dropout_mask must be broadcastable"),
])
def test_term_magnitudes_checks_dropout_as_attention_does(kw, exc, match):
    """term_magnitudes took dropout_p = 1 (infinite magnitudes: a bound that passes anything), -1 (smaller ones) and
    'x' (a bare TypeError), and ignored a dropout_mask of the wrong shape."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 5, 2, 8)) for _ in range(3))
    with pytest.raises(exc, match=match):
        reference.term_magnitudes(q, k, v, **kw)
