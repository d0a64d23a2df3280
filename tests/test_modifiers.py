"""Score and mask modifiers and element-exact BlockMasks on every backend (NumPy, the emulated CUDA kernels, the fake
CuPy's cuda backend), forward and backward (dbias included), against the float64 reference at the usual rule."""
from __future__ import annotations

import fractions
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cuflash
from cuflash import BlockMask, reference
from cuflash.testing import Case, assert_attention_close, attention_cases, check_backward, check_forward

from emulated_support import emulated, emulated_backward
from cases import hostile_modifier_cases, make_case, modifier_cases

_emulate_ok, _why = cuflash.emulate.available()
needs_emulator = pytest.mark.skipif(not _emulate_ok, reason=f"CPU emulation unavailable: {_why}")


def numpy_fwd(q, k, v, **options):
    return cuflash.attention(q, k, v, return_lse=True, **options)


def numpy_bwd(dout, q, k, v, out, lse, **options):
    return cuflash.attention_backward(dout, q, k, v, out, lse, **options)


CASES = modifier_cases()
HOSTILE = hostile_modifier_cases()


def _case(name, dtype=np.float16):
    return make_case(2, 75, 75, 4, 2, 40, dtype, **CASES[name])


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_numpy_backend(name, dtype):
    case = _case(name, dtype)
    out, lse = check_forward(numpy_fwd, case)
    check_backward(numpy_bwd, case, out, lse)


@pytest.mark.parametrize("shape", [(1, 2, 300, 300), (300,), (2, 300, 1)], ids=["full", "per_key", "per_row"])
def test_numpy_backward_strips_carry_dbias(shape):
    """The NumPy backward runs a partial tile as row strips cut to the keys they see (``STRIP_ROWS`` rows): each
    strip's share of dbias lands at its own rows and keys. 300 rows: the one 300 x 300 tile is cut, and with a left
    window as well as causal, strips after the first start past the tile's first key."""
    from cuflash.backends import numpy as nb

    assert 300 > nb.STRIP_ROWS and 300 <= min(nb.BLOCK_Q, nb.BLOCK_K)  # guard: one partial tile, several strips
    bias = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
    case = make_case(1, 300, 300, 2, 1, 32, np.float32, causal=True, window=(100, None), bias=bias)
    out, lse = check_forward(numpy_fwd, case)
    check_backward(numpy_bwd, case, out, lse)


@needs_emulator
@pytest.mark.emulate
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_emulated_kernels(name, deterministic):
    case = _case(name)
    out, lse = check_forward(emulated, case)
    check_backward(emulated_backward(deterministic), case, out, lse)


@settings(max_examples=max(10, settings.default.max_examples // 2), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(attention_cases(dtypes=("float32", "float64"), max_seqlen=90, max_head_dim=24, modifiers=True))
def test_numpy_backend_hypothesis(case):
    out, lse = check_forward(numpy_fwd, case)
    check_backward(numpy_bwd, case, out, lse)


@needs_emulator
@pytest.mark.emulate
@settings(max_examples=max(6, settings.default.max_examples // 8), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(attention_cases(dtypes=("float16",), max_seqlen=80, head_dims=(16, 40), modifiers=True))
def test_emulated_kernels_hypothesis(case):
    out, lse = check_forward(emulated, case)
    check_backward(emulated_backward(deterministic=False), case, out, lse)


def test_sliding_window_blockmask_equals_window_on_the_kernels():
    """Not bitwise there (different tiles), but both exact: the same keep set, at the rule (out and lse)."""
    if not _emulate_ok:
        pytest.skip(_why)
    case = make_case(1, 130, 130, 2, 1, 64, np.float16)
    window = Case(case.q, case.k, case.v, case.dout, dict(window=(40, 0)))
    check_forward(emulated, window)
    # the BlockMask form, held to the reference of the window form (the same keep set)
    mask = BlockMask.sliding_window(130, window=(40, 0), block=(16, 16))
    check_forward(lambda q, k, v, **o: emulated(q, k, v, block_mask=mask), window)
    check_forward(emulated, Case(case.q, case.k, case.v, case.dout, dict(block_mask=mask)))


def test_a_mask_modifier_removes_whole_rows_like_seqlens():
    """The same bits as seqlens_q = 3 on the same backend (rows 3.. are 0 / -inf, the others the same sums)."""
    q, k, v, _ = (x for x in _qkv())
    out, lse = cuflash.attention(q, k, v, mask_mod="q_idx < 3", return_lse=True)
    assert (out[:, 3:] == 0).all() and np.isneginf(lse[..., 3:]).all() and np.isfinite(lse[..., :3]).all()
    want, want_lse = cuflash.attention(q, k, v, seqlens_q=np.array([3], np.int32), return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


def _qkv():
    rng = np.random.default_rng(3)
    return [rng.standard_normal(s) for s in ((1, 9, 2, 8), (1, 9, 2, 8), (1, 9, 2, 8), (1, 9, 2, 8))]


def test_modifier_gradients_vanish_where_masked_even_if_undefined_there():
    """log(score) is NaN for negative scores: masked entries must not bring that NaN into dq, dk (dS = 0 there)."""
    q, k, v, do = _qkv()
    opts = dict(score_mod="log(abs(score) + 1e-3)", mask_mod="q_idx >= kv_idx")
    case = Case(q, k, v, do, opts)
    out, lse = check_forward(numpy_fwd, case)
    for g in check_backward(numpy_bwd, case, out, lse):  # float64: against the long double reference, by the rule
        assert np.isfinite(g).all()


def test_the_deterministic_dbias_sum_is_the_sum_over_the_broadcast_axes_in_a_copy():
    """cuflash.cuda.modcode.dbias_sum (the deterministic backward's fixed-order sum of a whole (B, H, Sq, Sk) dbias
    to the bias's compact shape) against NumPy's sum, for every pattern of broadcast axes, odd and even extents, and
    empty ones (the kernels write nothing there: zeros); the result holds no view of the accumulator (a view kept
    naive attention's memory alive in the caller's dbias)."""
    import itertools

    from cuflash.cuda.modcode import dbias_sum

    rng = np.random.default_rng(0)
    for extents in [(2, 3, 4, 5), (1, 3, 1, 5), (3, 1, 7, 1), (5, 2, 3, 2), (2, 0, 3, 4), (2, 3, 4, 0)]:
        for broadcast in itertools.product([False, True], repeat=4):
            compact = tuple(1 if b else n for b, n in zip(broadcast, extents))
            acc = rng.standard_normal(extents)
            want = acc.sum(axis=tuple(i for i, b in enumerate(broadcast) if b), keepdims=True)
            got = dbias_sum(np, acc.copy(), compact)
            assert got.shape == compact and np.allclose(got, want, rtol=1e-12, atol=1e-12), (extents, compact)
            assert got.base is None or got.base.nbytes == got.nbytes, (extents, compact)


def test_term_magnitudes_with_bias_only():
    q, k, v, do = _qkv()
    mags = reference.term_magnitudes(q, k, v, do, bias=np.zeros((2, 9, 9)))
    assert set(mags) == {"out", "lse", "dq", "dk", "dv", "dbias"} and all(np.isfinite(x) for x in mags.values())


# ------------------------------------------------------------------------------------------------ hostile modifiers
def _tiny(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8, 2, 32)).astype(dtype) for _ in range(3)]


def _same_on_every_backend(**options):
    """The NumPy backend and the emulated kernels against the float64 reference: NaN exactly where it has NaN, the
    rest held to the rule."""
    q, k, v = _tiny()
    case = Case(q, k, v, q, options)
    with np.errstate(all="ignore"):
        ref = reference.attention(q, k, v, **options)
        for backend in ("numpy", "emulate") if _emulate_ok else ("numpy",):
            def fn(*a, **o):
                return cuflash.attention(*a, **o, return_lse=True, backend=backend)

            if np.isnan(ref).any():
                np.testing.assert_array_equal(np.isnan(fn(q, k, v, **options)[0]), np.isnan(ref), err_msg=backend)
            else:
                check_forward(fn, case)


@needs_emulator
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_modifiers_mean_the_same_everywhere(name):
    _same_on_every_backend(**HOSTILE[name])


@pytest.mark.parametrize("options, fits_float64", [
    (dict(score_mod="score + 1e39"), True), (dict(mask_mod="kv_idx * -1e39 < 0"), True),
    (dict(score_mod="score - x", mod_arrays={"x": fractions.Fraction(10 ** 39)}), True),
    (dict(score_mod="score - x", mod_arrays={"x": fractions.Fraction(10 ** 400)}), False),
], ids=["score-literal", "mask-literal", "fraction", "fraction-past-float64"])
def test_finite_constants_beyond_the_working_precision_are_refused(options, fits_float64):
    """1e39 in the text became inf in float32 (all-NaN outputs, or every key masked) where the same number in
    mod_arrays was refused; a Fraction in mod_arrays slipped past that check too. float64 inputs take what fits."""
    q, k, v = _tiny()
    with pytest.raises(ValueError, match="beyond the largest float32"):
        cuflash.attention(q, k, v, **options)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    if fits_float64:
        out, _ = check_forward(numpy_fwd, Case(q64, k64, v64, q64, options))  # the lse's floor: roundings of 1e39
        # out: the scores' exp condition of 1e39 makes the rule's floor for it vacuous. But score -/+ 1e39 rounds to
        # the same float64 for every key (weights all equal, as the reference computes them), and kv_idx * -1e39 < 0
        # is kv_idx > 0: held to the rule of that problem, whose scores are O(1)
        same = dict(mask_mod="kv_idx > 0") if "mask_mod" in options else dict(score_mod="score * 0")
        want = reference.attention(q64, k64, v64, compute_dtype=np.longdouble, **same)
        assert np.array_equal(reference.attention(q64, k64, v64, **options), reference.attention(q64, k64, v64, **same))
        assert_attention_close(out, want, reference.attention(q64, k64, v64, **same), name="out",
                               magnitude=reference.term_magnitudes(q64, k64, v64, **same)["out"])
    else:
        with pytest.raises(ValueError, match="beyond the largest float64"):
            cuflash.attention(q64, k64, v64, **options)


def test_modifiers_the_kernels_cannot_hold_or_the_parser_cannot_nest_are_refused():
    q, k, v = _tiny()
    for text in ("-" * 2000 + "q_idx > 0", "+".join(["q_idx"] * 3000) + " > 0", "not " * 3000 + "q_idx > 0",
                 "q_idx > 0 and " * 2000 + "True"):
        with pytest.raises(ValueError, match="mask_mod (is nested|must be at most)"):
            cuflash.attention(q, k, v, mask_mod=text)
    def balanced(n):  # a sum of n scores nested log2(n) deep
        return "score" if n == 1 else f"({balanced(n // 2)} + {balanced(n - n // 2)})"
    nested = balanced(40)
    for _ in range(180):  # d tanh(u) = (1 - tanh(u)^2) du repeats u: 62k operations of C++ and NumPy passes
        nested = f"tanh({nested})"
    with pytest.raises(ValueError, match="score_mod: its derivative would take 61819 operations, at most 50000"):
        cuflash.attention(q, k, v, score_mod=nested)
    deep = "+".join(["score * 0.01"] * 90)  # 90 terms: within the limit, and every recursion copes with it
    out, lse = cuflash.attention(q, k, v, score_mod=deep, return_lse=True)
    grads = cuflash.attention_backward(q, q, k, v, out, lse, score_mod=deep)
    # it is score * 0.9: held to the rule against that modifier's reference (not one that parses the same text)
    case = Case(q, k, v, q, dict(score_mod="score * 0.9"))
    check_forward(lambda *a, **o: (out, lse), case)
    check_backward(lambda *a, **o: grads, case, out, lse)


@pytest.mark.parametrize("backend", ["numpy", "emulate"] if _emulate_ok else ["numpy"])
@pytest.mark.parametrize("text, arrays, shown", [
    ("q_idx < c", {"c": 2 ** 40}, "c may reach 1099511627776"),
    ("u[kv_idx] > 0", {"u": np.array([0] * 7 + [2 ** 31], np.int64)}, "u[kv_idx] may reach 2147483648"),
    ("q_idx * c + kv_idx > 0", {"c": (2 ** 31 - 1) // 7}, "((q_idx * c) + kv_idx) may reach 2147483653"),
    ("-(u[kv_idx] - 1) > 0", {"u": np.full(8, -2 ** 31, np.int64)}, "(u[kv_idx] - 1) may reach -2147483649"),
    ("abs(u[kv_idx]) > 0", {"u": np.full(8, -2 ** 31, np.int32)}, "::abs(u[kv_idx]) may reach 2147483648"),
    ("u[kv_idx] // -1 > 0", {"u": np.full(8, -2 ** 31, np.int32)},
     "floor_div(u[kv_idx], (-1)) may reach 2147483648"),
], ids=["scalar", "array", "product-sum", "neg", "abs", "floordiv"])
def test_integers_past_int32_are_refused_on_every_backend(backend, text, arrays, shown):
    """The kernels' integers are int32 and NumPy's 64-bit: an integer a modifier could compute past int32 would
    differ between the backends (int32 wraps silently), so every backend refuses it before running, naming it."""
    q, k, v = _tiny()
    with pytest.raises(ValueError, match="mask_mod: the integer " + re.escape(shown) + " here, outside int32"):
        cuflash.attention(q, k, v, mask_mod=text, mod_arrays=arrays, backend=backend)
    with pytest.raises(ValueError, match=re.escape(shown) + " here, outside int32"):
        cuflash.BlockMask.from_mask_mod(text, seqlen_q=q.shape[1], seqlen_k=k.shape[1], mod_arrays=arrays)


@pytest.mark.parametrize("text, arrays", [
    ("(q_idx if q_idx > 3 else c) > 0", {"c": -2 ** 31 + 1}),
    ("min(q_idx - c, 0) < 0 and kv_idx % c >= 0", {"c": 2 ** 31 - 1}),
    ("u[kv_idx] - q_idx < 0", {"u": np.full(8, -2 ** 31 + 7, np.int64)}),  # reaches -2**31 exactly
], ids=["if", "min-mod", "array-edge"])
def test_integers_inside_int32_are_taken(text, arrays):
    """The bounds are the operands' values and the problem's extents, so what stays inside int32 is taken."""
    _same_on_every_backend(mask_mod=text, mod_arrays=arrays)


def test_a_bfloat16_bias_is_taken_with_bfloat16_inputs():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in _tiny())
    bias = np.zeros((1, 1, 8, 8), ml_dtypes.bfloat16)
    np.testing.assert_array_equal(cuflash.attention(q, k, v, bias=bias), cuflash.attention(q, k, v))


def test_numpy_scalars_are_numbers_in_mod_arrays():
    """np.True_ or np.float32(0.5) mean what True and 0.5 mean (np.True_ was refused as "got bool")."""
    q, k, v = _tiny()
    for scalar, same in ((np.True_, True), (np.float32(0.5), 0.5), (np.int64(3), 3)):
        mask = "c or kv_idx <= q_idx" if isinstance(same, bool) else "kv_idx < 3 * c + 1"
        np.testing.assert_array_equal(cuflash.attention(q, k, v, mask_mod=mask, mod_arrays={"c": scalar}),
                                      cuflash.attention(q, k, v, mask_mod=mask, mod_arrays={"c": same}))


# ---------------------------------------------------------------------------------------------- working precision
#: float arithmetic a precision changes: in float32 q_idx + 1e-7 == q_idx for q_idx >= 1, in float64 it is larger
_NEAR = "1.0 * q_idx + 0.0000001 > kv_idx"
#: ... and with it a mask whose rows >= 1 see nothing in float32 (each sees its own key in float64)
_NEAR_DIAG = _NEAR + " and kv_idx >= q_idx"


def _near_keep(dtype, n, diag):
    """The mask of _NEAR / _NEAR_DIAG over n x n in ``dtype``'s arithmetic."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    keep = i.astype(dtype) + dtype(1e-7) > j.astype(dtype)
    return keep & (j >= i) if diag else keep


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("diag", [False, True], ids=["near", "near_diag"])
@pytest.mark.parametrize("how", ["mask_mod", "from_mask_mod"])
@pytest.mark.parametrize("fn", [numpy_fwd, pytest.param(emulated, marks=[needs_emulator, pytest.mark.emulate])],
                         ids=["numpy", "emulate"])
def test_mask_floats_are_in_the_working_precision(fn, how, diag, dtype):
    """A mask expression's floats are the working precision of the inputs (float32, float64 for float64 inputs) on
    every backend and in the reference, whatever its compute dtype, and in a BlockMask.from_mask_mod's partial blocks:
    the same elements seen everywhere (NumPy and the reference computed mask_mod in float64, the kernels in float32)."""
    n = 64
    mm = _NEAR_DIAG if diag else _NEAR
    case = make_case(1, n, n, 2, 2, 32, dtype, seed=3)
    if how == "mask_mod":
        case = Case(case.q, case.k, case.v, case.dout, dict(mask_mod=mm))
    else:
        case = Case(case.q, case.k, case.v, case.dout,
                    dict(block_mask=BlockMask.from_mask_mod(mm, seqlen_q=n, block=(16, 16))))
    out, lse = check_forward(fn, case)
    unseen = ~_near_keep(dtype, n, diag).any(axis=-1)  # rows that see nothing: lse -inf
    assert (unseen.any() if diag and dtype == np.float32 else not unseen.any())
    np.testing.assert_array_equal(np.isneginf(lse), np.broadcast_to(unseen, lse.shape))
    _, ref_lse = reference.attention(case.q, case.k, case.v, return_lse=True, **case.options)
    np.testing.assert_array_equal(np.isneginf(ref_lse), np.broadcast_to(unseen, ref_lse.shape))


@pytest.mark.parametrize("fn", [numpy_fwd, pytest.param(emulated, marks=[needs_emulator, pytest.mark.emulate])],
                         ids=["numpy", "emulate"])
def test_from_mask_mod_lengths_and_batch_on_every_backend(fn):
    """A BlockMask rule's q_len / kv_len are the mask's own lengths on every backend (the kernels read each sequence's
    seqlens_q / seqlens_k, NumPy and the reference the mask's), and a rule that reads b built for the problem's batch
    gives each sequence its own b."""
    lengths = dict(seqlens_q=np.array([64, 40], np.int32), seqlens_k=np.array([48, 30], np.int32))
    bm = BlockMask.from_mask_mod("kv_idx <= q_idx + kv_len - q_len", seqlen_q=64, seqlen_k=48, block=(16, 16))
    check_forward(fn, make_case(2, 64, 48, 2, 2, 32, np.float32, seed=4, block_mask=bm, **lengths))
    bm = BlockMask.from_mask_mod("b == 0 and kv_idx <= q_idx", seqlen_q=64, batch=2, block=(16, 16))
    out, lse = check_forward(fn, make_case(2, 64, 64, 2, 2, 32, np.float32, seed=5, block_mask=bm))
    assert np.isneginf(lse[1]).all() and not np.isneginf(lse[0]).any()


@pytest.mark.parametrize("bias_shape", [(8,), (8, 8)])
@pytest.mark.parametrize("mod", ["score * sqrt(1.0 * (q_idx - kv_idx))", "score * where(kv_idx > q_idx, nan, 1.0)"])
def test_dbias_where_the_modifiers_derivative_is_nan_at_hidden_scores(bias_shape, mod):
    """A score modifier whose derivative is NaN only where the causal mask hides the score: the NumPy backend's dbias
    took dS times that factor unguarded (0 * NaN = NaN in 7 of 8 elements of a (Sk,) bias), where its dQ, the
    reference and the kernels keep a zero dS from contributing."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 8, 1, 16)).astype(np.float32) for _ in range(4))
    case = Case(q, k, v, do, options=dict(causal=True, bias=rng.standard_normal(bias_shape).astype(np.float32),
                                          score_mod=mod))
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy", **case.options)
    check_backward(lambda *a, **o: cuflash.attention_backward(*a, backend="numpy", **o), case, out, lse)
