"""cuflash.testing, the helpers users hold their own attention code to (README: "Testing your own attention code"):
the checks must not be fooled by a fn that writes into its inputs, and misuse of the helpers must be refused with a
message that says what was expected rather than with an error from deep inside."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings

import cuflash
from cuflash.testing import (Case, assert_attention_close, attention_cases, check_backward, check_forward,
                             reference_dtype)

ml_dtypes = pytest.importorskip("ml_dtypes")


def forward(q, k, v, **options):
    return cuflash.attention(q, k, v, return_lse=True, **options)


def make_case(dtype=np.float32, seed=0, shape=(1, 6, 2, 4), **options):
    rng = np.random.default_rng(seed)
    return Case(*(rng.standard_normal(shape).astype(dtype) for _ in range(4)), options=options)


# ------------------------------------------------------------------ fn modifying its inputs in place
def test_dropout_cases_in_the_bhsd_layout_are_checked():
    """The reference's keep-mask takes the case's layout: a bhsd case with dropout (heads, Sq, Sk all different) was
    a broadcast error in check_forward; now it passes for cuflash, and fails for a fn that drops other elements."""
    rng = np.random.default_rng(2)
    q, do = (rng.standard_normal((2, 3, 20, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 3, 17, 8)).astype(np.float32) for _ in range(2))
    case = Case(q, k, v, do, dict(layout="bhsd", dropout_p=0.2, seed=3))
    out, lse = check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, **o), case)
    check_backward(cuflash.attention_backward, case, out, lse)
    with pytest.raises(AssertionError, match="out: max error"):
        check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, **dict(o, seed=4)), case)


def test_a_forward_fn_that_scales_q_in_place_fails():
    """fn did ``q *= s`` and computed with the case's scale: the reference, computed afterwards from the same q,
    moved with it and the check passed with a true error of order 1."""
    case = make_case(scale=0.5)

    def fn(q, k, v, **options):
        q *= 4.0
        return forward(q, k, v, **options)

    with pytest.raises(AssertionError, match=r"fn modified q in place"):
        check_forward(fn, case)


def test_a_forward_fn_that_zeroes_v_in_place_fails():
    case = make_case()

    def fn(q, k, v, **options):
        v[...] = 0
        return forward(q, k, v, **options)  # out is all zeros

    with pytest.raises(AssertionError, match=r"fn modified v in place"):
        check_forward(fn, case)


def test_a_backward_fn_that_zeroes_dout_in_place_fails():
    case = make_case()
    out, lse = check_forward(forward, case)

    def fn(dout, q, k, v, out, lse, **options):
        dout[...] = 0
        return tuple(np.zeros_like(x) for x in (q, k, v))

    with pytest.raises(AssertionError, match=r"fn modified dout in place"):
        check_backward(fn, case, out, lse)


def test_options_and_forward_results_written_in_place_are_named():
    rng = np.random.default_rng(3)
    case = make_case(bias=rng.standard_normal((6, 6)).astype(np.float32),
                     score_mod="score * 0.7 + w[kv_idx]", mod_arrays=dict(w=rng.standard_normal(6).astype(np.float32)))

    def zero_bias(q, k, v, **options):
        options["bias"][...] = 0
        return forward(q, k, v, **options)

    with pytest.raises(AssertionError, match=r"fn modified options\['bias'\] in place"):
        check_forward(zero_bias, case)
    case = make_case(score_mod="score * 0.7 + w[kv_idx]", mod_arrays=dict(w=rng.standard_normal(6).astype(np.float32)))

    def scale_w(q, k, v, **options):
        options["mod_arrays"]["w"] *= 2
        return forward(q, k, v, **options)

    with pytest.raises(AssertionError, match=r"fn modified options\['mod_arrays'\]\['w'\] in place"):
        check_forward(scale_w, case)
    case = make_case()
    out, lse = check_forward(forward, case)

    def clobber_out(dout, q, k, v, out, lse, **options):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
        out[...] = 0
        return grads

    with pytest.raises(AssertionError, match=r"fn modified out in place"):
        check_backward(clobber_out, case, out, lse)


def test_a_sign_flipped_zero_in_bfloat16_is_a_modification_and_nan_padding_is_not():
    """Compared bit for bit: -0.0 == 0.0 by value, NaN != NaN, and bfloat16 is no NumPy float kind."""
    case = make_case(ml_dtypes.bfloat16, seqlens_k=np.array([4], np.int32))
    case.q[0, 0, 0, 0] = 0.0
    case.v[0, 5, 1, 2] = np.nan  # key 5 is past seqlens_k: never read, and unchanged by a correct fn
    out, lse = check_forward(forward, case)
    check_backward(cuflash.attention_backward, case, out, lse)

    def flip(q, k, v, **options):
        q[0, 0, 0, 0] = -0.0
        return forward(q, k, v, **options)

    with pytest.raises(AssertionError, match=r"fn modified q in place"):
        check_forward(flip, case)


# ------------------------------------------------------------------ results of the wrong arity
@pytest.mark.parametrize("result,got", [(lambda o: o[:1], "1 values"), (lambda o: o + (o[1],), "3 values"),
                                        (lambda o: o[0], "ndarray, not a tuple")])
def test_check_forward_says_what_fn_must_return(result, got):
    case = make_case()
    with pytest.raises(AssertionError, match=rf"fn must return \(out, lse\), got {got}"):
        check_forward(lambda *a, **o: result(forward(*a, **o)), case)


# ------------------------------------------------------------------ assert_attention_close's arguments
def test_the_rule_refuses_a_baseline_of_another_shape_or_kind():
    ref = np.linspace(1, 2, 6)
    with pytest.raises(ValueError, match=r"out: baseline shape \(5,\) != reference \(6,\)"):
        assert_attention_close(ref, ref, ref[:5].astype(np.float32))
    with pytest.raises(TypeError, match=r"baseline must be a floating-point array .*got dtype int64"):
        assert_attention_close(ref, ref, ref.astype(np.int64))
    assert_attention_close(ref, ref, ref.astype(ml_dtypes.bfloat16))  # bfloat16 is floating point


@pytest.mark.parametrize("bad", [None, "abc", np.array([object()] * 6), {"a": 1}])
@pytest.mark.parametrize("role", ["actual", "ref64", "baseline"])
def test_the_rule_says_what_it_expected_of_a_non_array(bad, role):
    ref = np.linspace(1, 2, 6)
    args = {"actual": ref, "ref64": ref, "baseline": ref.astype(np.float32), role: bad}
    with pytest.raises(TypeError, match=rf"{role} must be a (real|floating-point) .*array") as info:
        assert_attention_close(args["actual"], args["ref64"], args["baseline"])
    assert "complex part" not in str(info.value)


def test_cupy_is_told_by_module_not_by_a_get_attribute():
    """``hasattr(actual, "get")`` took a dict for a CuPy array."""
    ref = np.linspace(1, 2, 6)

    class FakeCupyArray:  # what cuflash.problem._is_cupy sees of a CuPy array: its type's module
        __module__ = "cupy._core.core"

        def get(self):
            return ref.copy()

    assert_attention_close(FakeCupyArray(), ref, ref.astype(np.float32))
    with pytest.raises(TypeError, match=r"actual must be a real .*got dict"):
        assert_attention_close({"get": 1}, ref, ref.astype(np.float32))


@pytest.mark.parametrize("kwargs,error", [
    (dict(mult=np.inf), ValueError), (dict(mult=np.nan), ValueError), (dict(mult=0), ValueError),
    (dict(mult=-2.0), ValueError), (dict(mult="2"), TypeError), (dict(mult=True), TypeError),
    (dict(magnitude=np.inf), ValueError), (dict(magnitude=np.nan), ValueError), (dict(magnitude=-1.0), ValueError),
    (dict(magnitude="1"), TypeError), (dict(magnitude=np.ones(2)), TypeError)])
def test_mult_and_magnitude_are_validated(kwargs, error):
    """mult=inf or magnitude=inf passed anything, NaN failed everything, a negative magnitude made a negative floor."""
    ref = np.linspace(1, 2, 6)
    with pytest.raises(error, match=rf"{next(iter(kwargs))} must be"):
        assert_attention_close(ref + 1.0, ref, ref.astype(np.float32), **kwargs)


def test_valid_mult_and_magnitude_still_work():
    ref = np.linspace(1, 2, 6)
    base = ref.astype(np.float32)
    assert_attention_close(ref, ref, base, mult=np.float64(3), magnitude=np.float64(0.0))
    assert_attention_close(ref, ref, base, mult=1, magnitude=None)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_attention_close(ref + 1.0, ref, base, mult=2.0, magnitude=np.longdouble(1.0))


def test_a_nan_reference_is_reported_as_such():
    ref = np.array([1.0, np.nan, 3.0])
    with pytest.raises(AssertionError, match=r"lse: the reference holds NaN"):
        assert_attention_close(np.array([1.0, 2.0, 3.0]), ref, ref.astype(np.float32), name="lse")


# ------------------------------------------------------------------ reference_dtype and the strategy's arguments
@pytest.mark.parametrize("dtype,want", [("float16", np.float64), (np.float16, np.float64), ("float32", np.float64),
                                        ("bfloat16", np.float64), (ml_dtypes.bfloat16, np.float64),
                                        (np.dtype(ml_dtypes.bfloat16), np.float64), ("float64", np.longdouble),
                                        (np.float64, np.longdouble), (float, np.longdouble)])
def test_reference_dtype_of_the_input_dtypes(dtype, want):
    assert reference_dtype(dtype) is want


def test_reference_dtype_of_bfloat16_by_name_in_a_fresh_process():
    """np.dtype("bfloat16") is known to NumPy only once ml_dtypes is imported: by name it raised "data type
    'bfloat16' not understood" though the strategy takes that name."""
    code = ("import sys; from cuflash.testing import reference_dtype; had = 'ml_dtypes' in sys.modules; "
            "print(had, reference_dtype('bfloat16').__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split()[-1] == "float64", done.stdout + done.stderr


@pytest.mark.parametrize("dtype", [None, "int32", "bool", np.bool_, "complex64", np.longdouble, "uint16", "bf16",
                                   object, True])
def test_reference_dtype_refuses_what_is_no_input_dtype(dtype):
    """None was float64's dtype (so longdouble), "bfloat16" unknown to NumPy, ints and bools float64."""
    with pytest.raises(TypeError, match=r"dtype must be one of float16, bfloat16, float32, float64"):
        reference_dtype(dtype)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dtypes=("bool",)), TypeError, r"dtypes\[0\] must be one of float16"),
    (dict(dtypes=("float32", "int32")), TypeError, r"dtypes\[1\] must be one of"),
    (dict(dtypes=("complex64",)), TypeError, r"dtypes\[0\] must be one of"),
    (dict(dtypes=(None,)), TypeError, r"dtypes\[0\] must be one of"),
    (dict(dtypes=()), TypeError, r"dtypes must be a non-empty tuple"),
    (dict(dtypes=iter(())), TypeError, r"dtypes must be a non-empty tuple .*, got \(\)$"),
    (dict(dtypes="float16"), TypeError, r"dtypes must be a non-empty tuple"),
    (dict(head_dims=(0,)), ValueError, r"head_dims\[0\] must be at least 1"),
    (dict(head_dims=(16, -1)), ValueError, r"head_dims\[1\] must be at least 1"),
    (dict(head_dims=()), ValueError, r"head_dims must be a non-empty tuple"),
    (dict(head_dims="64"), TypeError, r"head_dims must be a non-empty tuple"),
    (dict(head_dims=(16.0,)), TypeError, r"head_dims\[0\] must be an int"),
    (dict(block_sizes=(0,)), ValueError, r"block_sizes\[0\] must be at least 1"),
    (dict(block_sizes=16), TypeError, r"block_sizes must be a non-empty tuple"),
    (dict(max_seqlen=0), ValueError, r"max_seqlen must be at least 1"),
    (dict(max_head_dim=0), ValueError, r"max_head_dim must be at least 1"),
    (dict(max_batch_dims=-1), ValueError, r"max_batch_dims must be at least 0"),
    (dict(max_seqlen=1.5), TypeError, r"max_seqlen must be an int"),
    (dict(causal="yes"), TypeError, r"causal must be a bool")])
def test_attention_cases_checks_its_arguments_when_called(kwargs, error, match):
    """They were met only when drawn, if at all: block size 0 was a ZeroDivisionError inside a draw, head dim 0 and
    bool/int/complex dtypes built cases by casting normal samples."""
    with pytest.raises(error, match=match):
        attention_cases(**kwargs)


@settings(max_examples=20)
@given(attention_cases(dtypes=(dt for dt in ("float16", "float32")), max_seqlen=8, head_dims=(d for d in (4, 8)),
                       block_sizes=iter((1, 3)), max_batch_dims=1, block_mask=True))
def test_attention_cases_takes_its_tuples_as_any_iterable(case):
    """An iterable is read once: a generator of dtypes was consumed by the check that it is non-empty, and the
    strategy, left with no dtype to draw, raised InvalidArgument at its first draw."""
    assert case.q.dtype.name in ("float16", "float32") and case.q.shape[-1] in (4, 8)
    bm = case.options.get("block_mask")
    assert bm is None or set(bm.block) <= {1, 3}


@settings(max_examples=5)
@given(attention_cases(dtypes=(ml_dtypes.bfloat16, np.float16, "float32"), max_seqlen=8, head_dims=(np.int64(4),),
                       block_sizes=(1, 3), max_batch_dims=1))
def test_attention_cases_draws_the_accepted_dtypes(case):
    assert case.q.dtype.name in ("bfloat16", "float16", "float32") and case.q.shape[-1] == 4


def test_dbias_of_a_wider_bias_keeps_the_inputs_floor():
    """The naive float16 dbias was rounded to a float32 bias's dtype, and the floor taken in float32's unit, 8000x
    too small: where the naive error happened to be 0 (one key: dS = P (dP - D) is 0 exactly, and the float16
    computation leaves 3e-5 of rounding), cuflash's own correct dbias failed."""
    import functools

    q, k, v, do = (np.float16([[[x]]]) for x in (-0.1083, 1.342, 0.1952, -0.716))
    case = Case(q, k, v, do, options=dict(bias=np.float32([[-0.136]]), dropout_p=0.1, seed=1))
    out, lse = check_forward(functools.partial(cuflash.attention, return_lse=True), case)
    check_backward(cuflash.attention_backward, case, out, lse)


def test_a_result_past_the_dtypes_range_may_be_its_infinity():
    """out = 80000 (two keys of V = 40000 under dropout 0.5) is inf in float16, the correctly rounded answer, which
    failed as 'infinite entries differ from the reference'; a finite value there, or -inf, still fails."""
    import functools

    q = k = np.ones((1, 1, 1), np.float16)
    v = np.full((1, 1, 1), 40000, np.float16)
    case = Case(q, k, v, q, options=dict(dropout_p=0.5, seed=1))
    fn = functools.partial(cuflash.attention, return_lse=True)
    out, _ = fn(q, k, v, dropout_p=0.5, seed=1)
    assert np.isinf(out).all()
    check_forward(fn, case)
    for wrong in (np.float16(60000), np.float16(-np.inf)):
        with pytest.raises(AssertionError, match="out: "):
            check_forward(lambda *a, **o: (np.full_like(out, wrong), fn(*a, **o)[1]), case)


@pytest.mark.emulate
def test_bfloat16_bits_are_checked_as_bfloat16():
    """uint16 bits with dtype="bfloat16" (the form CuPy without bfloat16 takes) were refused: the checks took the
    bits' dtype for the inputs' (reference_dtype(uint16)) and compared bits with values."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from cuflash import emulate

    emulate.skip_unless_available()
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, 16, 2, 16)).astype(ml_dtypes.bfloat16).view(np.uint16) for _ in range(4))
    case = Case(q, k, v, do, options=dict(dtype="bfloat16", causal=True))

    def fwd(*a, **o):
        return cuflash.attention(*a, return_lse=True, backend="emulate", **o)

    def bwd(*a, **o):
        return cuflash.attention_backward(*a, backend="emulate", **o)
    out, lse = check_forward(fwd, case)
    check_backward(bwd, case, fwd(q, k, v, dtype="bfloat16", causal=True)[0], lse)
    with pytest.raises(AssertionError, match="out: max error"):  # bits of another result fail
        check_forward(lambda *a, **o: (np.roll(fwd(*a, **o)[0], 1, axis=1), fwd(*a, **o)[1]), case)


def _reference_backward(off, which):
    """A backward fn: the float64 reference's gradients rounded to the input dtype, the one named ``which`` times
    ``1 + off``."""
    def fn(dout, q, k, v, out, lse, **options):
        grads = cuflash.reference.attention_backward(dout, q, k, v, **options)
        return tuple((g * (1 + off if name == which else 1)).astype(q.dtype)
                     for name, g in zip(("dq", "dk", "dv"), grads))
    return fn


@pytest.mark.parametrize("dtype,off", [(np.float16, 0.02), (np.float32, 1e-3)])
def test_the_rule_fails_a_gradient_a_little_off_on_every_feature_case(dtype, off):
    """The rule's floor is two roundings of the largest term a result is summed from: the sum of all terms'
    magnitudes (a row spread over many keys, dS = P (dP - D) bounded through every term of dP and D) set it at up to
    11% of the largest float16 gradient, and dk 10% off passed. Each gradient that is not all zero, 2% off in float16
    (20 roundings) or 0.1% in float32 (where the floor carries exp's condition, 1 + max|S| + max|lse| roundings),
    now fails every feature case; the correctly rounded gradients pass."""
    from cases import feature_cases
    for name, case in feature_cases(dtype):
        out, lse = cuflash.reference.attention(case.q, case.k, case.v, return_lse=True, **case.options)
        check_backward(_reference_backward(0.0, None), case, out, lse)
        refs = cuflash.reference.attention_backward(case.dout, case.q, case.k, case.v, **case.options)
        for which, ref in zip(("dq", "dk", "dv"), refs):
            if not np.any(ref):
                continue  # zero_scale's dq and dk, an empty block mask's every gradient: nothing to scale
            with pytest.raises(AssertionError, match=f"{which}: max error"):
                check_backward(_reference_backward(off, which), case, out, lse)


def test_attention_cases_draw_under_numpys_raise_setting():
    """The strategy rounded its normal draws to float16, now and then into a subnormal: FloatingPointError (underflow)
    in the draw itself under np.seterr(all="raise") (hypothesis draws inside the decorated call: the setting is made
    around it)."""
    @settings(max_examples=150, database=None)
    @given(attention_cases(dtypes=("float16",), max_seqlen=8, head_dims=(4,), block_mask=False))
    def draw(case):
        assert case.q.dtype == np.float16

    before = np.seterr(all="raise")
    try:
        draw()
    finally:
        np.seterr(**before)


# ------------------------------------------------------------------------------------------------ a second hunt
def _long_case(dtype, sk=1024, sd=1.0, **options):
    rng = np.random.default_rng(0)
    q, k, dout = ((sd * rng.standard_normal(s)).astype(dtype) for s in ((1, 64, 2, 64), (1, sk, 2, 64), (1, 64, 2, 64)))
    v = (1 + 0.1 * rng.standard_normal((1, sk, 2, 64))).astype(dtype)
    return Case(q, k, v, dout, options)


def _lse_forward(q, k, v, **options):
    return cuflash.attention(q, k, v, return_lse=True, **options)


def test_a_bfloat16_output_of_zeros_fails_on_long_rows():
    """NumPy sums ml_dtypes' bfloat16 in bfloat16 (1000 ones: 256): the naive baseline's row sums were so wrong at
    1024 keys that an all-zero output passed, and all-zero gradients at 2048. The baseline sums in float32 now,
    rounded once, as its products are summed; cuflash's own results still pass."""
    case = _long_case(ml_dtypes.bfloat16)
    out, lse = check_forward(_lse_forward, case)
    with pytest.raises(AssertionError, match="out: max error"):
        check_forward(lambda *a, **o: (np.zeros_like(out), lse), case)
    grads = cuflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse)
    check_backward(lambda *a, **o: grads, case, out, lse)
    with pytest.raises(AssertionError, match="max error"):
        check_backward(lambda *a, **o: tuple(np.zeros_like(g) for g in grads), case, out, lse)


@pytest.mark.parametrize("dtype,off", [(np.float16, 0.05), (ml_dtypes.bfloat16, 0.5)])
def test_a_16_bit_inputs_lse_is_held_to_the_statistics_precision(dtype, off):
    """The lse is computed and returned in float32: its floor was two float16 roundings of 1 + max|S| + max|lse|,
    so an lse 0.1 off passed (1.0 off for bfloat16, a factor e in every probability)."""
    case = _long_case(dtype, sk=64, sd=2.0)
    out, lse = check_forward(_lse_forward, case)
    with pytest.raises(AssertionError, match="lse: max error"):
        check_forward(lambda *a, **o: (out, lse + np.float32(off)), case)


def test_precision_tf32_is_held_to_the_naive_tf32_computation():
    """A Case with precision="tf32" had a float32 baseline: the naive TF32 computation itself failed (error 5.6e-4
    against a bound of 1.3e-5)."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 64, 2, 64)).astype(np.float32) for _ in range(4))
    case = Case(q, k, v, dout, {"precision": "tf32"})

    def naive_tf32(q, k, v, precision, **options):
        out, lse = cuflash.reference.attention(q, k, v, return_lse=True, compute_dtype=cuflash.reference.TF32,
                                               **options)
        return out.astype(np.float32), lse.astype(np.float32)

    check_forward(naive_tf32, case)
    exact = cuflash.reference.attention(q, k, v)

    def four_times_its_error(*args, **options):
        out, lse = naive_tf32(*args, **options)
        return (4 * out - 3 * exact).astype(np.float32), lse

    with pytest.raises(AssertionError, match="out: max error"):
        check_forward(four_times_its_error, case)


def test_results_must_come_in_the_inputs_dtype():
    """A float64 out (or lse of float16, or gradients of float64) for float16 inputs passed: only shapes and values
    were compared."""
    case = _long_case(np.float16, sk=32)
    out, lse = check_forward(_lse_forward, case)
    with pytest.raises(AssertionError, match="out: dtype float64, expected the inputs' float16"):
        check_forward(lambda *a, **o: (out.astype(np.float64), lse), case)
    with pytest.raises(AssertionError, match="lse: dtype float16, expected float32 or float64"):
        check_forward(lambda *a, **o: (out, lse.astype(np.float16)), case)
    grads = cuflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse)
    with pytest.raises(AssertionError, match="dk: dtype float64, expected the inputs' float16"):
        check_backward(lambda *a, **o: (grads[0], grads[1].astype(np.float64), grads[2]), case, out, lse)


@pytest.mark.parametrize("options,match", [
    ({"backend": "numpy"}, "backend is not among them: bind it"),
    ({"return_lse": True, "out": None}, "out, return_lse are not among them: bind them"),
    ({"casual": True}, "casual is not among them"),  # a misspelt option was taken to the reference's TypeError
    ({"dropout_p": 0.1}, r"needs options\['seed'\]"),
])
def test_options_a_check_cannot_take_are_refused_before_fn_runs(options, match):
    """The reference raised "unexpected keyword argument 'backend'" (and "multiple values for return_lse"); dropout
    without a seed said "fn must return (out, lse), got 3 values"."""
    q = np.zeros((1, 8, 2, 8), np.float32)
    with pytest.raises(ValueError, match=match):
        check_forward(lambda *a, **o: pytest.fail("fn ran"), Case(q, q, q, q, options))
    with pytest.raises(ValueError, match=match):
        check_backward(lambda *a, **o: pytest.fail("fn ran"), Case(q, q, q, q, options), q, q[..., 0])
