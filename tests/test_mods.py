"""The modifier language (cuflash.mods): the grammar's refusals, NumPy evaluation against Python's own arithmetic,
the symbolic derivative against finite differences, the C++ emitted for the kernels against NumPy (compiled and run
by the CPU emulator), and the float64 reference's modifiers against their definitions."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
import cuflash.emulate
from cuflash import mods, reference
from cuflash.testing import assert_attention_close, reference_dtype

ARRAYS = {"slope": np.linspace(0.5, 2.0, 3).astype(np.float32), "doc": np.array([0, 0, 1, 1, 2], np.int32),
          "keep": np.array([True, False, True, True, False]), "c": 2.5, "n": 3}


# ------------------------------------------------------------------------------------------------ the grammar
@pytest.mark.parametrize("text,kind,match", [
    ("score.real", "score", "Attribute is not part of the modifier grammar"),
    ("__import__('os')", "score", "only the functions"),
    ("open('x')", "score", "only the functions"),
    ("score + x", "score", "unknown name 'x'"),
    ("doc[q_idx + 1] == 0", "mask", "array indices must be the variables"),
    ("doc[q_idx, kv_idx] == 0", "mask", "has 1 dimensions but is indexed by 2"),
    ("doc[q_idx]", "mask", "must evaluate to a bool"),
    ("q_idx < kv_idx", "score", "must evaluate to a number"),
    ("score > 0", "mask", "'score' is only available to a score modifier"),
    ("lambda: 1", "score", "Lambda is not part of"),
    ("[score]", "score", "List is not part of"),
    ("score ** 2", "score", "operator Pow is not allowed"),
    ("q_idx / 0 > 1 or", "mask", "not one Python expression"),
    ("q_idx // 2.0 > 1", "mask", "'//' takes integers"),
    ("tanh(score, 1)", "score", "tanh takes 1 argument"),
    ("where(q_idx, 1.0, 2.0)", "score", "expected a bool here"),
    ("2**40 + score", "score", "operator Pow"),
    ("4000000000 + score", "score", "must fit in 32 bits"),
    ("slope", "score", "array 'slope' must be indexed"),
])
def test_grammar_refuses_with_the_offending_token(text, kind, match):
    with pytest.raises(ValueError, match=match):
        mods.parse(text, kind=kind, arrays=ARRAYS)


def test_names_of_mod_arrays_are_checked():
    with pytest.raises(ValueError, match="must be an identifier other than"):
        mods.parse("score", kind="score", arrays={"q_idx": np.zeros(3)})
    with pytest.raises(ValueError, match="names starting with 'cuflash_'"):
        mods.parse("score", kind="score", arrays={"cuflash_bias": np.zeros(3)})
    with pytest.raises(TypeError, match="bool, integer or floating point"):
        mods.parse("s[h] > 0", kind="mask", arrays={"s": np.array(["a"])})
    with pytest.raises(TypeError, match="must be a string"):
        mods.parse(3, kind="score")


# ------------------------------------------------------------------------------------------------ evaluation
_ENV = dict(b=np.arange(2)[:, None, None, None], h=np.arange(3)[None, :, None, None],
            q_idx=np.arange(5)[None, None, :, None], kv_idx=np.arange(5)[None, None, None, :],
            q_len=np.array([5, 3])[:, None, None, None], kv_len=np.array([4, 5])[:, None, None, None])


def _python(text, b, h, i, j, ql, kl, score):
    """The same expression evaluated by Python itself on scalars (the definition the vectorized one must meet)."""
    names = dict(b=b, h=h, q_idx=i, kv_idx=j, q_len=ql, kv_len=kl, score=score, inf=math.inf,
                 slope=ARRAYS["slope"].astype(float), doc=ARRAYS["doc"].astype(int), keep=ARRAYS["keep"],
                 c=ARRAYS["c"], n=ARRAYS["n"], abs=abs, min=min, max=max, exp=math.exp, tanh=math.tanh,
                 sqrt=math.sqrt, log=math.log, where=lambda c, a, b: a if c else b)
    return eval(text, {"__builtins__": {}}, names)  # test oracle only: the library never evals


@pytest.mark.parametrize("text,kind", [
    ("score + slope[h] * (kv_idx - q_idx)", "score"),
    ("c * tanh(score / c)", "score"),
    ("where(kv_idx <= q_idx + kv_len - q_len, score, score - 3)", "score"),
    ("score * n - abs(q_idx - kv_idx) // 2 + (q_idx % 3)", "score"),
    ("max(score, -1.0) + min(q_idx, kv_idx) + exp(score / 4)", "score"),
    ("score / (1 + kv_idx)", "score"),
    ("doc[q_idx] == doc[kv_idx] and (keep[kv_idx] or kv_idx == 0)", "mask"),
    ("not (q_idx < kv_idx) or b == 1 and h != 2", "mask"),
    ("0 <= kv_idx - q_idx < 3", "mask"),
])
def test_numpy_evaluation_is_pythons_arithmetic(text, kind):
    e = mods.parse(text, kind=kind, arrays=ARRAYS)
    rng = np.random.default_rng(0)
    score = rng.standard_normal((2, 3, 5, 5))
    env = dict(_ENV, score=score) if kind == "score" else _ENV
    got = np.broadcast_to(e.evaluate(env, ARRAYS, np.float64), (2, 3, 5, 5))
    for b, h, i, j in np.ndindex(2, 3, 5, 5):
        want = _python(text, b, h, i, j, int(_ENV["q_len"][b, 0, 0, 0]), int(_ENV["kv_len"][b, 0, 0, 0]),
                       float(score[b, h, i, j]))
        assert got[b, h, i, j] == pytest.approx(want, rel=1e-12, abs=1e-12), (b, h, i, j)


# ------------------------------------------------------------------------------------------------ d/dscore
_UNARY = st.sampled_from(["tanh({})", "exp({} / 8)", "({}) * 1.5", "-({})", "abs({})", "({}) + slope[h]",
                          "sqrt(({}) * ({}) + 1)", "log(1 + exp({}))", "max({}, 0.25)", "min({}, -0.5)",
                          "({}) / (2 + kv_idx)", "where(q_idx > kv_idx, {}, 2 * {})", "c * tanh(({}) / c)"])


@settings(max_examples=60, deadline=None)
@given(st.lists(_UNARY, min_size=1, max_size=4), st.floats(-3, 3))
def test_derivative_matches_finite_differences(layers, x0):
    text = "score"
    for layer in layers:
        text = layer.replace("{}", f"({text})")
    e = mods.parse(text, kind="score", arrays=ARRAYS)
    d = e.derivative()
    score = np.full((2, 3, 5, 5), x0) + np.linspace(-0.3, 0.3, 25).reshape(5, 5)
    h = 1e-6
    f = lambda s: np.broadcast_to(e.evaluate(dict(_ENV, score=s), ARRAYS), score.shape)  # noqa: E731
    numeric = (f(score + h) - f(score - h)) / (2 * h)
    g = lambda s: np.broadcast_to(d.evaluate(dict(_ENV, score=s), ARRAYS), score.shape)  # noqa: E731
    analytic = g(score)
    # away from the kinks of abs/min/max/where, where a finite difference straddles two branches: there the
    # derivative itself jumps within a small neighbourhood
    smooth = np.abs(g(score + 1e-4) - g(score - 1e-4)) < 1e-2
    assert np.allclose(analytic[smooth], numeric[smooth], rtol=1e-5, atol=1e-6), text


@pytest.mark.parametrize("text, want", [("cap * tanh(score / cap)", 1.0), ("score / cap", 1e-30),
                                        ("(score * 3e20) / (3e20 + kv_idx)", 3e20 / (3e20 + np.arange(5)))])
def test_derivative_of_a_quotient_does_not_square_the_divisor(text, want):
    """d(a/b) as (da - (a/b) db) / b: the quotient rule's b^2 overflows float32 at |b| > 1.8e19 where a/b does not,
    and softcap = 1e30 had a derivative of 0 (an infinite dS times 0: NaN gradients where the reference has
    infinities)."""
    cap = {"cap": np.array(1e30, np.float32)}  # an operand (as cuflash's own softcap): no constant folding
    e = mods.parse(text, kind="score", arrays=cap)
    score = np.broadcast_to(np.linspace(-2, 2, 25, dtype=np.float32).reshape(5, 5), (2, 3, 5, 5))
    got = np.broadcast_to(e.derivative().evaluate(dict(_ENV, score=score), cap, np.float32), score.shape)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np.broadcast_to(want, score.shape), rtol=4 * np.finfo(np.float32).eps)


def test_derivative_with_respect_to_an_operand_and_composition():
    bias = {"cuflash_b": np.zeros((5, 5))}
    inner = mods.parse("score + cuflash_b[q_idx, kv_idx]", kind="score", arrays=bias, internal=True)
    outer = mods.parse("3.0 * tanh(score / 3.0)", kind="score")
    both = outer.compose(inner)
    score = np.linspace(-2, 2, 25).reshape(5, 5)
    env = dict(_ENV, score=score)
    want = 1 - np.tanh(score / 3) ** 2  # d/dbias of 3 tanh((s + bias)/3) at bias = 0
    for got in (both.derivative("cuflash_b").evaluate(env, bias), both.derivative().evaluate(env, bias)):
        # float64 both: a few roundings apart (np.allclose's rtol of 1e-5 passed tanh(score / 3.00003))
        np.testing.assert_allclose(np.broadcast_to(got, (1, 1, 5, 5))[0, 0], want, rtol=8 * np.finfo(np.float64).eps,
                                   atol=0)
    assert {o.name for o in both.operands} == {"cuflash_b"}


# ------------------------------------------------------------------------------------------------ C++
_CPP_KERNEL = r"""
#include "mods.cuh"
using namespace cuflash;  // the kernels' own helpers (floor_div, nan_max, pos_inf, ...), not copies
__global__ void eval_kernel(const float* score, float* out, const float* slope, const int* doc, int n) {
  for (int t = 0; t < n; ++t) {
    const int b = t / 75, h = t / 25 % 3, q_idx = t / 5 % 5, kv_idx = t % 5;
    const int q_len = b == 0 ? 5 : 3, kv_len = b == 0 ? 4 : 5;
    const float s = score[t];
    out[t] = EXPR;
  }
}
"""


@pytest.mark.emulate
@pytest.mark.parametrize("text,kind", [
    ("score + slope[h] * (kv_idx - q_idx)", "score"),
    ("2.5 * tanh(score / 2.5)", "score"),
    ("where(kv_idx <= q_idx + kv_len - q_len, score, score - 3) + (q_idx - 7) // 2 + (kv_idx - 9) % 4", "score"),
    ("max(score, -1.0) + min(q_idx, kv_idx) + exp(score / 4) - abs(score)", "score"),
    ("doc[q_idx] == doc[kv_idx] or -kv_idx // 2 == -1", "mask"),
])
def test_emitted_cpp_computes_what_numpy_computes(text, kind):
    ok, why = cuflash.emulate.available()
    if not ok:
        pytest.skip(why)
    from cuflash.cuda.launch import LaunchSpec

    e = mods.parse(text, kind=kind, arrays=ARRAYS)
    cpp = e.cpp(lambda name, index: f"{name}[{index[0]}]").replace("score", "s")
    rng = np.random.default_rng(1)
    score = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    out = np.zeros(150, np.float32)
    source = _CPP_KERNEL.replace("EXPR", f"float({cpp})")
    cuflash.emulate.launch(LaunchSpec(source, "eval_kernel", (1, 1, 1), (1, 1, 1), 0,
                                      (score, out, ARRAYS["slope"], ARRAYS["doc"], np.int32(150))))
    env = dict(_ENV, score=score) if kind == "score" else _ENV
    want = np.broadcast_to(e.evaluate(env, ARRAYS, np.float32), (2, 3, 5, 5)).astype(np.float32).ravel()
    if any(f in text for f in ("tanh", "exp")):  # the CUDA math library's and NumPy's, each within a few ulp, of
        np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)  # terms up to ~10 (17 float32 roundings)
    else:  # correctly rounded step by step (+, -, * as __f*_rn), as NumPy: the same bits
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("real", ["float", "double"])
def test_emitted_float_arithmetic_is_rounded_step_by_step(real):
    """NVRTC contracts a plain `a * b - c * d` into a fused multiply-add (--fmad=true, its default), which rounds once
    where NumPy rounds twice: the rule `q_idx * 0.1 - kv_idx * 0.1 >= 0` (to_dense: causal) dropped half of the
    diagonal in a kernel built that way. Float +, - and * are emitted as CUDA's correctly rounded intrinsics, never
    contracted; integer arithmetic stays plain C++."""
    names = {"float": ("__fadd_rn", "__fsub_rn", "__fmul_rn"), "double": ("__dadd_rn", "__dsub_rn", "__dmul_rn")}
    read = lambda name, index: f"{name}[{index[0]}]"  # noqa: E731
    rule = mods.parse("q_idx * 0.1 - kv_idx * 0.1 + slope[h] * q_idx >= 0.0", kind="mask",
                      arrays=ARRAYS).cpp(read, real)
    assert all(name in rule for name in names[real]) and not any(f" {op} " in rule for op in "+-*"), rule
    ints = mods.parse("q_idx * 2 + kv_idx - 1 >= 0", kind="mask", arrays=ARRAYS).cpp(read, real)
    assert " * " in ints and not any(name in ints for name in names[real]), ints


# ------------------------------------------------------------------------------------------------ the reference
def _qkv(seed=0, sq=7, sk=9, h=4, hkv=2, d=8):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, sq, h, d)), rng.standard_normal((2, sk, hkv, d)),
            rng.standard_normal((2, sk, hkv, d)), rng.standard_normal((2, sq, h, d)))


def _same64(a, b, q, k, v, **options):
    """float64 results of two forms of one definition: at most two roundings apart at the term magnitude of out
    (as tests/test_reference.py's assert_close64); they agree to ~1e-15, where np.allclose's default rtol of 1e-5 let
    a slope or an offset off by 1e-6 pass."""
    assert np.array_equal(np.isinf(a), np.isinf(b))
    bound = 2 * np.finfo(np.float64).eps * reference.term_magnitudes(q, k, v, **options)["out"]
    err = np.abs(a - b).max()
    assert err <= bound, f"{options}: {err:.3e} > {bound:.3e}"


def test_reference_builtins_are_their_definitions():
    q, k, v, do = _qkv()
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    i, j = np.arange(7)[:, None], np.arange(9)[None, :]
    alibi = -slopes[:, None, None] * np.abs(i + 9 - 7 - j)
    want = reference.attention(q, k, v, alibi_slopes=slopes)
    _same64(want, reference.attention(q, k, v, bias=alibi), q, k, v, alibi_slopes=slopes)
    as_mod = reference.attention(q, k, v, score_mod="score - s[h] * abs(q_idx + kv_len - q_len - kv_idx)",
                                 mod_arrays={"s": slopes})
    _same64(as_mod, want, q, k, v, alibi_slopes=slopes)
    capped = reference.attention(q, k, v, softcap=0.7, causal=True)
    _same64(capped, reference.attention(q, k, v, score_mod="0.7 * tanh(score / 0.7)", causal=True), q, k, v,
            softcap=0.7, causal=True)
    doc = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2])
    docq = doc[2:]  # bottom-right aligned rows
    mask = docq[:, None] == doc[None, :]
    by_mod = dict(mask_mod="dq[q_idx] == dk[kv_idx]", mod_arrays={"dq": docq, "dk": doc})
    _same64(reference.attention(q, k, v, **by_mod), reference.attention(q, k, v, bias=np.where(mask, 0.0, -np.inf)),
            q, k, v, **by_mod)


def test_reference_gradients_match_finite_differences():
    q, k, v, do = _qkv(1)
    bias = np.random.default_rng(2).standard_normal((1, 4, 7, 9))
    opts = dict(bias=bias, softcap=1.5, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]), score_mod="score * 1.3 + 0.1",
                causal=True)
    grads = reference.attention_backward(do, q, k, v, return_dbias=True, **opts)
    loss = lambda **changed: float((reference.attention(**{**dict(q=q, k=k, v=v), **changed}, **{  # noqa: E731
        n: x for n, x in opts.items() if n not in changed}) * do).sum())
    eps = 1e-6
    for name, arr, g in (("q", q, grads[0]), ("k", k, grads[1]), ("bias", bias, grads[3])):
        for idx in [(0, 1, 1, 3), (arr.shape[0] - 1, 3, 1, 5)]:
            e = np.zeros_like(arr)
            e[idx] = eps
            fd = (loss(**{name: arr + e}) - loss(**{name: arr - e})) / (2 * eps)
            assert g[idx] == pytest.approx(fd, rel=1e-5, abs=1e-8), (name, idx)
    assert grads[3].shape == bias.shape  # summed over the batch it broadcasts


@pytest.mark.parametrize("backend,dtype", [("numpy", np.float64), ("numpy", np.float32), ("emulate", np.float16)])
@pytest.mark.parametrize("stored,declared", [((1, 1, 1, 9), (2, 4, 7, 9)), ((4, 1, 9), (4, 7, 9)),
                                             ((1, 4, 7, 1), (1, 4, 7, 9))])
def test_dbias_takes_the_declared_shape_of_a_broadcast_view(backend, dtype, stored, declared):
    """A bias made with np.broadcast_to has zero strides along axes its shape declares full: dbias comes in the
    declared shape, bitwise the dbias of the same values stored in full, and as the reference's."""
    q, k, v, do = (x.astype(dtype) for x in _qkv(3))
    bias_dtype = np.float64 if dtype == np.float64 else np.float32  # dbias comes in the bias's dtype
    view = np.broadcast_to(np.random.default_rng(4).standard_normal(stored).astype(bias_dtype), declared)
    grads = {}
    for name, bias in (("view", view), ("copy", np.ascontiguousarray(view))):
        out, lse = cuflash.attention(q, k, v, bias=bias, causal=True, return_lse=True, backend=backend)
        grads[name] = cuflash.attention_backward(do, q, k, v, out, lse, bias=bias, causal=True, return_dbias=True,
                                                 backend=backend)
    assert grads["view"][3].shape == declared
    for got, want in zip(grads["view"], grads["copy"]):
        np.testing.assert_array_equal(got, want)
    opts = dict(bias=view, causal=True)
    ref = reference.attention_backward(do, q, k, v, return_dbias=True, compute_dtype=reference_dtype(dtype), **opts)
    naive = reference.attention_backward(do, q, k, v, return_dbias=True, compute_dtype=dtype, **opts)
    mags = reference.term_magnitudes(q, k, v, do, **opts)
    assert_attention_close(grads["view"][3], ref[3], naive[3].astype(bias_dtype), mult=3, name="dbias",
                           magnitude=mags["dbias"])


@pytest.mark.parametrize("kw,exc,match", [
    (dict(bias=np.zeros((3, 7, 9))), ValueError, "bias must be broadcastable"),
    (dict(bias=np.zeros((1, 2, 4, 7, 9))), ValueError, "bias must be broadcastable"),
    (dict(bias=np.zeros((4, 7, 9), np.int32)), TypeError, "bias must be a floating-point array"),
    (dict(alibi_slopes=np.zeros(3)), ValueError, "alibi_slopes must be of shape"),
    (dict(softcap=0.0), ValueError, "softcap must be a real > 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a real > 0 or None and finite"),
    (dict(score_mod="score + w[q_idx]", mod_arrays={"w": np.zeros(8)}), ValueError, r"needs shape \(7,\)"),
    (dict(mask_mod="q_idx > 0", mod_arrays={"w": np.zeros(7)}), ValueError, "are read by neither"),
    (dict(mod_arrays={"w": np.zeros(7)}), ValueError, "without score_mod or mask_mod"),
    (dict(score_mod="score", mod_arrays=[1]), TypeError, "mod_arrays must be a dict"),
    (dict(score_mod="score + w", mod_arrays={"w": "x"}), TypeError, "must be an array or a number"),
    # the text's fullwidth name is read as "w": the key named a name the expression cannot write
    (dict(score_mod="score + \uff57[kv_idx]", mod_arrays={"\uff57": np.zeros(9)}), ValueError, "NFKC"),
])
def test_modifier_arguments_are_validated(kw, exc, match):
    q, k, v, _ = _qkv()
    with pytest.raises(exc, match=match):
        cuflash.problem.make_problem(q, k, v, **kw)


@pytest.mark.parametrize("score_mod", ["where(kv_idx <= q_idx, 0.0, -inf)", "q_idx * 0.1", "1.0"])
def test_reference_takes_score_mods_that_do_not_read_the_score(score_mod):
    """An expression without score, b or h has fewer axes than S: the reference broadcast failed on it (reshape
    error) where the backends take it; the NumPy backend is held to the reference by the rule."""
    from cuflash.testing import Case, check_forward

    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 70, 2, 32)).astype(np.float32) for _ in range(4))
    case = Case(q, k, v, dout, {"score_mod": score_mod})
    check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, backend="numpy", **o), case)


def test_mod_arrays_may_be_any_mapping():
    """mod_arrays is typed as a Mapping: a read-only MappingProxyType is taken as its dict (it was refused, "must be
    a dict"), forward and backward, and the residual keeps a copy of it."""
    from types import MappingProxyType

    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((1, 40, 2, 16)).astype(np.float32) for _ in range(4))
    slope = np.array([0.5, -0.25], np.float32)
    opts = dict(score_mod="score + slope[h] * (kv_idx - q_idx)")
    want, want_res = cuflash.attention(q, k, v, mod_arrays={"slope": slope}, return_residual=True, **opts)
    got, res = cuflash.attention(q, k, v, mod_arrays=MappingProxyType({"slope": slope}), return_residual=True, **opts)
    assert np.array_equal(got, want)
    for g, w in zip(cuflash.attention_backward(dout, res), cuflash.attention_backward(dout, want_res)):
        assert np.array_equal(g, w)


@pytest.mark.parametrize("mod_arrays,exc,match", [
    ({"a": 2 + 1j}, TypeError, r"mod_arrays\['a'\] must be an array or a number, got complex"),
    ({"a": [1, 2]}, TypeError, r"mod_arrays\['a'\] must be an array or a number, got list"),
    ([("a", 1)], TypeError, r"mod_arrays must be a dict \(a mapping\) of name -> array or number, got list"),
    ({"a": 1, "unread": 2}, ValueError, r"mod_arrays \['unread'\] are not read by mask_mod"),
])
def test_blockmask_refuses_the_mod_arrays_that_attention_refuses(mod_arrays, exc, match):
    """from_mask_mod checks mod_arrays as attention(mask_mod=...) does (problem validation's check): it raised an
    AttributeError for a list of pairs and took Python lists and entries its rule never reads."""
    with pytest.raises(exc, match=match):
        cuflash.BlockMask.from_mask_mod("kv_idx <= q_idx + a", seqlen_q=64, mod_arrays=mod_arrays)


def test_the_derivative_takes_the_literals_in_the_working_precision():
    """score * ((1.0 + 1e-8) - 1.0) * 1e8 is score * 0 in float32, where the forward evaluates it: the output does
    not depend on q or k, so dQ and dK are 0. The derivative's simplifier folded the literals in float64 (a factor
    0.99999999), and the backward returned gradients of another function."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 8, 1, 16)).astype(np.float32) for _ in range(4))
    mod = "score * ((1.0 + 1e-8) - 1.0) * 1e8"
    out, lse = cuflash.attention(q, k, v, score_mod=mod, return_lse=True, backend="numpy")
    np.testing.assert_array_equal(out, cuflash.attention(q + 1, 3 * k, v, score_mod=mod, backend="numpy"))
    dq, dk, _ = cuflash.attention_backward(do, q, k, v, out, lse, score_mod=mod, backend="numpy")
    np.testing.assert_array_equal(dq, 0)
    np.testing.assert_array_equal(dk, 0)


@pytest.mark.parametrize("text,kind", [
    ("exp(q_idx * 0.1) * exp(kv_idx * 0.1) >= exp((q_idx + kv_idx) * 0.1)", "mask"),
    ("log(kv_idx + 1.0) < 2.0", "mask"),
    ("where(tanh(score) > 0.5, score, 0.0)", "score"),
])
def test_a_comparison_of_exp_log_or_tanh_is_refused(text, kind):
    """The mask above kept 194 of 256 elements in NumPy and to_dense, 208 in the emulated kernel (glibc's expf): no
    two backends round these functions alike, and a comparison turns an ulp into a whole element."""
    with pytest.raises(ValueError, match=r"a comparison of what exp/log/tanh give decides elements differently"):
        mods.parse(text, kind=kind, arrays=ARRAYS)
    mods.parse("2.0 * tanh(score / 2.0) + log(kv_idx + 1.0)", kind="score")  # in a value: an ulp or so, accepted
    mods.parse("sqrt(q_idx * 1.0) <= kv_idx", kind="mask")  # sqrt is correctly rounded everywhere


@pytest.mark.parametrize("text", ["q_idx >= kv_idx" + " and True" * 500, "kv_idx" + " <= q_idx" * 2200,
                                  "score * where(" + " and ".join(["q_idx >= kv_idx"] * 500) + ", 1.0, 0.5)"])
def test_a_long_flat_chain_counts_its_folded_depth(text):
    """A chain of 500 `and` operands is one node of Python's syntax tree but 500 nested ones once folded: a
    RecursionError in the evaluators, under the 20000-character limit."""
    with pytest.raises(ValueError, match=r"is nested \d+ levels deep; at most 200"):
        mods.parse(text, kind="score" if text.startswith("score") else "mask")
    assert mods.parse("q_idx >= kv_idx" + " and True" * 150, kind="mask") is not None
