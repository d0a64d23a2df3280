"""The float32/float64 CUDA kernels (kernels/flash_fwd_wide.cu, kernels/flash_bwd_wide.cu), run unchanged on the CPU
by cuflash.emulate, forward and backward, in every arithmetic:

    f32-ieee    float32 FFMA              (precision="ieee", the default)
    f32-3xtf32  float32 on TF32 x3        (precision="3xtf32")
    f32-tf32    float32 on TF32           (precision="tf32")
    f64-dmma    float64 on mma.m8n8k4.f64 (A100 / H100: CUFLASH_EMULATE_ARCH 80 or 90)
    f64-dfma    float64 DFMA              (GPUs without float64 tensor cores: CUFLASH_EMULATE_ARCH 86 or 89)

each held to its rule against the float64 (for float64: long double) reference (tests/wide_support.py: the max
rule with its floor on every case, the RMS rule on mid-size problems): every specialization of the wide tile tables,
every feature (causal, windows, seqlens, GQA, BlockMask, dropout, softcap, bias with dbias, ALiBi, score_mod,
mask_mod, fully masked rows, odd head dims), a hypothesis sweep per arithmetic, both backward modes, thread
schedules, the float64 modifier code, and the dispatch (precision, compute capability, dtypes through the API).
"""
import numpy as np
import pytest
from hypothesis import given, settings

import cuflash
from cuflash import emulate, mods, reference
from cuflash.backends import emulate as emulate_backend
from cuflash.blockmask import BlockMask
from cuflash.cuda import launch as launches
from cuflash.cuda import modcode, specs
from cuflash.cuda.launch import LaunchSpec
from cuflash.problem import check_backward as flatten_backward
from cuflash.problem import make_problem
from cuflash.testing import Case, attention_cases

import wide_support as ws
from cases import make_case

from emulated_support import check_infinite_scores, infinite_key_case  # noqa: I001
from emulated_support import pytestmark  # noqa: F401  (pytestmark marks the module)

# mode id -> (dtype, precision, emulated compute capability)
MODES = {"f32-ieee": ("float32", "ieee", 80), "f32-3xtf32": ("float32", "3xtf32", 80),
         "f32-tf32": ("float32", "tf32", 80), "f64-dmma": ("float64", "ieee", 80), "f64-dfma": ("float64", "ieee", 86)}
MATH_OF_MODE = {"f32-ieee": "ffma", "f32-3xtf32": "3xtf32", "f32-tf32": "tf32", "f64-dmma": "dmma", "f64-dfma": "dfma"}


@pytest.fixture(params=sorted(MODES))
def mode(request, monkeypatch):
    """(dtype, precision) of one arithmetic, with the emulated GPU set to one that runs it."""
    dtype, precision, cc = MODES[request.param]
    monkeypatch.setenv("CUFLASH_EMULATE_ARCH", str(cc))
    return dtype, precision


def fwd(q, k, v, **options):
    return cuflash.attention(q, k, v, return_lse=True, backend="emulate", **options)


def bwd(deterministic=False, **kw):
    def fn(dout, q, k, v, out, lse, **options):
        if not kw:
            return cuflash.attention_backward(dout, q, k, v, out, lse, backend="emulate",
                                              deterministic=deterministic, **options)
        problem = make_problem(q, k, v, **options)
        d, o, l = flatten_backward(problem, dout, out, lse)
        grads = emulate_backend.backward(problem, d, o, l, deterministic=deterministic, **kw)
        return tuple(problem.unflatten(g, a.shape[1:]) for g, a in zip(grads, (problem.q, problem.k, problem.v)))

    return fn


def as_mode(case: Case, dtype, precision) -> Case:
    case.q, case.k, case.v, case.dout = (a.astype(dtype) for a in (case.q, case.k, case.v, case.dout))
    case.options = dict(case.options, precision=precision)
    return case


def check(case: Case, precision: str, deterministic=False):
    """Forward then backward through the emulated kernels, each held to the mode's max rule."""
    out, lse = ws.check_forward(fwd, case, precision)
    assert out.dtype == case.q.dtype and lse.dtype == (np.float64 if case.q.dtype == np.float64 else np.float32)
    grads = ws.check_backward(bwd(deterministic), case, out, lse, precision)
    assert all(g.dtype == case.q.dtype for g in grads)
    return out, lse, grads


# ------------------------------------------------------------------------------------------------
# Every specialization of the wide tables: forward, backward (atomic dQ), deterministic dQ pass
# ------------------------------------------------------------------------------------------------
def _table():
    out = []
    for fs in specs.all_specs(("wfwd",)):
        bs = next(s for s in specs.all_specs(("wbwd",)) if s.math == fs.math and s.head_dim == fs.head_dim)
        qs = next(s for s in specs.all_specs(("wdq",)) if s.math == fs.math and s.head_dim == fs.head_dim)
        out.append(pytest.param(fs, bs, qs, id=f"{fs.math}-{fs.head_dim}"))
    return out


@pytest.mark.parametrize("spec,bwd_spec,dq_spec", _table())
def test_every_table_specialization(spec, bwd_spec, dq_spec):
    """Each row of each arithmetic's table on a ragged causal GQA problem with seqlens (several tiles of each of the
    three kernels), held to its mode's rule."""
    precision = {"ffma": "ieee", "3xtf32": "3xtf32", "tf32": "tf32"}.get(spec.math, "ieee")
    d = spec.head_dim - 5 if spec.head_dim > 32 else spec.head_dim  # odd dims ride on the native one
    bm, bn = max(spec.block_m, dq_spec.block_m, bwd_spec.block_m), max(spec.block_n, bwd_spec.block_n)
    sq, sk = bm + 3, bn + 7
    case = as_mode(make_case(2, sq, sk, 2, 1, d, causal=True, seqlens_q=np.array([sq, sq - 5], np.int32),
                             seqlens_k=np.array([sk - 3, sk], np.int32)), spec.dtype, precision)
    out, lse = ws.check_forward(lambda q, k, v, **o: emulate_backend.forward(make_problem(q, k, v, **o), spec=spec),
                                case, precision)
    for det in (False, True):
        ws.check_backward(bwd(det, spec=bwd_spec, dq_spec=dq_spec), case, out.reshape(case.q.shape),
                          lse.reshape(case.q.shape[:-3] + (2, sq)), precision)


def test_tables_cover_every_head_dim_on_the_gpus_that_run_them():
    """select() finds a row for each arithmetic, head_dim and GPU that runs the arithmetic (no silent hole: a row
    too large for a GPU would drop out of specs_by_arch and of the compile check)."""
    for cc, limit in specs.SMEM_LIMIT.items():
        for dtype, precision in (("float32", "ieee"), ("float32", "3xtf32"), ("float32", "tf32"), ("float64", "ieee")):
            math = specs.wide_math(dtype, precision, cc)
            for family in specs.WIDE_FAMILIES:
                for d in range(1, 257):
                    spec = specs.select(family, dtype, d, limit, math=math)
                    assert spec.smem_bytes <= limit and spec.head_dim >= d and spec.math == math
    assert specs.wide_math("float64", cc=80) == specs.wide_math("float64", cc=90) == "dmma"
    assert specs.wide_math("float64", cc=86) == specs.wide_math("float64", cc=89) == "dfma"
    plan = specs.specs_by_arch()
    assert {s.math for s in plan[90] if s.wide} == {"ffma", "tf32", "3xtf32", "dmma"}  # no DFMA cubin for sm_90
    assert {s.math for s in plan[80] if s.wide} == {"ffma", "tf32", "3xtf32", "dmma", "dfma"}


# ------------------------------------------------------------------------------------------------
# Every feature, every arithmetic (forward and backward)
# ------------------------------------------------------------------------------------------------
def feature_cases():
    rng = np.random.default_rng(1)
    c = []
    c.append(("causal_sq_ne_sk", make_case(1, 113, 75, 2, 2, 64, causal=True)))
    c.append(("window_gqa", make_case(1, 90, 90, 4, 1, 32, window=(20, 5))))
    c.append(("seqlens_and_empty", make_case(3, 70, 80, 2, 1, 64, causal=True,
                                             seqlens_q=np.array([70, 37, 0], np.int32),
                                             seqlens_k=np.array([80, 40, 5], np.int32))))
    c.append(("fully_masked_rows", make_case(2, 66, 66, 1, 1, 40, window=(2, 0), seqlens_q=np.array([50, 66], np.int32),
                                             seqlens_k=np.array([66, 0], np.int32))))
    c.append(("odd_head_dim_111_scale", make_case(1, 40, 50, 1, 1, 111, scale=-0.4)))
    grid = rng.random((2, 1, 9, 7)) < 0.5
    c.append(("blockmask_finer", make_case(2, 130, 100, 2, 1, 59, causal=True, block_mask=BlockMask(
        grid, block=(16, 16), seqlen_q=130, seqlen_k=100))))
    c.append(("dropout", make_case(1, 70, 90, 2, 1, 64, causal=True, dropout_p=0.3)))
    c[-1][1].options["seed"] = 1234  # (make_case's own seed is the arrays')
    bias = rng.standard_normal((2, 60, 70))
    c.append(("softcap_bias_alibi", make_case(1, 60, 70, 2, 2, 32, softcap=4.0, bias=bias, alibi_slopes=np.array(
        [0.25, 0.5]))))
    doc = np.repeat(np.arange(4), 20)[:75]
    c.append(("score_mod_mask_mod", make_case(1, 75, 75, 2, 1, 48, score_mod="score * slope + 0.1 * (q_idx - kv_idx)",
                                              mask_mod="doc[q_idx] == doc[kv_idx]",
                                              mod_arrays={"slope": 1.25, "doc": doc})))
    return c


def _with_float_operands(case: Case):
    """Float modifier operands in the case's dtype (the API takes any floating dtype; the kernels convert)."""
    for key in ("bias", "alibi_slopes"):
        if key in case.options:
            case.options[key] = case.options[key].astype(case.q.dtype)
    return case


@pytest.mark.parametrize("name,case", feature_cases(), ids=[n for n, _ in feature_cases()])
def test_feature(name, case, mode):
    dtype, precision = mode
    check(_with_float_operands(as_mode(case, dtype, precision)), precision)


def test_dbias_in_the_elements_type(mode):
    """bias's gradient (return_dbias) against the reference's: accumulated by float32 / float64 atomics."""
    dtype, precision = mode
    rng = np.random.default_rng(3)
    case = as_mode(make_case(1, 50, 60, 2, 1, 32, causal=True), dtype, precision)
    bias = rng.standard_normal((1, 50, 60)).astype(dtype)  # broadcast over heads: two contributions per element
    out, lse = fwd(case.q, case.k, case.v, bias=bias, **case.options)
    *_, dbias = cuflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse, bias=bias, return_dbias=True,
                                           backend="emulate", **case.options)
    opts = {k: v for k, v in case.options.items() if k != "precision"}
    rule = ws.RULES[(dtype, precision)]
    want = reference.attention_backward(case.dout, case.q, case.k, case.v, bias=bias, return_dbias=True,
                                        compute_dtype=rule.ref, **opts)[3]
    base = reference.attention_backward(case.dout, case.q, case.k, case.v, bias=bias, return_dbias=True,
                                        compute_dtype=rule.baseline, **opts)[3]
    mags = reference.term_magnitudes(case.q, case.k, case.v, case.dout, bias=bias, **opts)
    assert dbias.dtype == dtype and dbias.shape == bias.shape
    ws.close(dbias, want, base, mult=3, eps=rule.eps, magnitude=mags["dbias"], name="dbias", mode=(dtype, precision))


# ------------------------------------------------------------------------------------------------
# Hypothesis: small random problems, every arithmetic (dropout included)
# ------------------------------------------------------------------------------------------------
N_EXAMPLES = max(4, settings.default.max_examples // 5)


@pytest.mark.parametrize("mode_id", sorted(MODES))
def test_hypothesis(mode_id, monkeypatch):
    dtype, precision, cc = MODES[mode_id]
    monkeypatch.setenv("CUFLASH_EMULATE_ARCH", str(cc))

    @settings(max_examples=N_EXAMPLES)
    @given(attention_cases(dtypes=(dtype,), max_seqlen=90, max_head_dim=72, block_sizes=(16, 32), dropout=True))
    def run(case):
        case.options["precision"] = precision
        check(case, precision, deterministic=bool(case.q.shape[-2] % 2))

    run()


# ------------------------------------------------------------------------------------------------
# The RMS rule (accuracy class) on mid-size problems; float32 also with the GPU's approximate exp2f (hw_math)
# ------------------------------------------------------------------------------------------------
# hw_math changes float32 arithmetic only: the float64 modes run without it
@pytest.mark.parametrize("mode_id, hw_math", [(m, h) for m in sorted(MODES) for h in (False, True)
                                              if not (h and MODES[m][0] == "float64")])
def test_rms_accuracy_class(mode_id, hw_math, monkeypatch):
    dtype, precision, cc = MODES[mode_id]
    mode = (dtype, precision)
    monkeypatch.setenv("CUFLASH_EMULATE_ARCH", str(cc))
    if hw_math:
        monkeypatch.setenv("CUFLASH_EMULATE_HW_MATH", "1")
    for seed, (sq, sk, d, opts) in enumerate([(128, 160, 64, dict(causal=True)),
                                              (96, 200, 32, dict(window=(60, 20), scale=0.4))]):
        case = as_mode(make_case(1, sq, sk, 2, 1, d, seed=seed, **opts), dtype, precision)
        ratios = ws.check_rms(fwd, bwd(), case, precision)
        assert all(np.isfinite(r) for r in ratios.values())
        print(mode, "hw_math" if hw_math else "", {k: round(v, 2) for k, v in ratios.items()})


def test_3xtf32_long_sums_keep_the_accuracy_class(monkeypatch):
    """The tensor core rounds its sums toward zero (hw_math models it): accumulated inside the mma, that bias grows
    with the number of k-steps; 3xTF32 sums each step apart and adds it round-to-nearest (wide_mma.cuh), so a long
    row of keys stays in the RMS class (before: out 3.3x naive float32 here; 20x at 2048 keys on an H100)."""
    monkeypatch.setenv("CUFLASH_EMULATE_ARCH", "80")
    monkeypatch.setenv("CUFLASH_EMULATE_HW_MATH", "1")
    case = as_mode(make_case(1, 128, 1024, 1, 1, 64, seed=0), "float32", "3xtf32")
    ratios = ws.check_rms(fwd, bwd(), case, "3xtf32")
    print({k: round(v, 2) for k, v in ratios.items()})


@pytest.mark.parametrize("sq, sk", [(128, 4096), (2048, 128)], ids=["long_rows", "long_columns"])
def test_ieee_long_sums_keep_the_accuracy_class(sq, sk):
    """float32 FFMA: O sums over every key (long rows), dK and dV over every query (long columns). Summed in one
    chain of FMAs, their error grew with the length (here: out 2.58x the naive float32 RMS error over 4096 keys, dK
    2.61x over 2048 queries of two query heads; the GPU suite's 2048 x 2048 case: out 1.84x, dK 2.63x, dV 2.73x).
    Each tile's product is now summed apart and added (wide_mma.cuh, warp_gemm_add), as BLAS adds blocks of a few
    hundred terms: out 0.76x, dK 0.92x here."""
    case = as_mode(make_case(1, sq, sk, 2, 1, 64, seed=1), "float32", "ieee")
    ratios = ws.check_rms(fwd, bwd(), case, "ieee")
    print({k: round(v, 2) for k, v in ratios.items()})


# ------------------------------------------------------------------------------------------------
# Backward modes, schedules
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode_id", ["f32-3xtf32", "f64-dmma"])
def test_deterministic_mode_is_bitwise_reproducible_and_agrees(mode_id):
    dtype, precision, _ = MODES[mode_id]
    case = as_mode(make_case(1, 100, 90, 4, 2, 64, causal=True, seed=4), dtype, precision)
    problem = make_problem(case.q, case.k, case.v, **case.options)
    out, lse = emulate_backend.forward(problem)
    d, o, l = flatten_backward(problem, case.dout, out, lse)
    runs = [emulate_backend.backward(problem, d, o, l, deterministic=True, schedule=s, seed=3)
            for s in ("forward", "reverse", "random")]
    for r in runs[1:]:
        for a, b in zip(r, runs[0]):
            assert np.array_equal(a, b)
    atomic = emulate_backend.backward(problem, d, o, l, deterministic=False)
    for a, b in zip(atomic[1:], runs[0][1:]):  # dK, dV: the same kernel, the same bits
        assert np.array_equal(a, b)
    np.testing.assert_allclose(atomic[0], runs[0][0], rtol=0, atol=10 * np.finfo(dtype).eps)


@pytest.mark.parametrize("mode_id", sorted(MODES))
def test_schedules_give_bitwise_identical_results(mode_id, monkeypatch):
    """Threads run forward, reversed and shuffled between barriers: a missing __syncthreads/__syncwarp or cp.async
    wait would show (fresh shared memory and pending copies read NaN)."""
    dtype, precision, cc = MODES[mode_id]
    monkeypatch.setenv("CUFLASH_EMULATE_ARCH", str(cc))
    case = as_mode(make_case(1, 70, 90, 2, 1, 64, causal=True, dropout_p=0.2), dtype, precision)
    case.options["seed"] = 9
    problem = make_problem(case.q, case.k, case.v, **case.options)
    runs = [emulate_backend.forward(problem, schedule=s, seed=5) for s in ("forward", "reverse", "random")]
    for out, lse in runs[1:]:
        assert np.array_equal(out, runs[0][0]) and np.array_equal(lse, runs[0][1])
    d, o, l = flatten_backward(problem, case.dout, *runs[0])
    grads = [emulate_backend.backward(problem, d, o, l, deterministic=True, schedule=s, seed=5)
             for s in ("forward", "random")]
    assert all(np.array_equal(a, b) for a, b in zip(*grads))


def test_dropout_keep_mask_is_cuflash_dropout_mask():
    """With q = 0 every kept P is 1/Sk before dropout: out = (mask * 1/(1-p)) @ v / Sk exactly where v is one-hot
    columns, so the kernel's zero pattern is the mask of cuflash.dropout_mask (forward orientation); the backward's
    (transposed) bits are the same ones (dV = P^T dO with dO one-hot rows)."""
    sq, sk, p, seed = 24, 40, 0.4, 77
    q = np.zeros((1, sq, 1, 32))
    k = np.random.default_rng(0).standard_normal((1, sk, 1, 32))
    v = np.zeros((1, sk, 1, 32))
    v[0, :32, 0, :] = np.eye(32)
    out, lse = fwd(q, k, v, dropout_p=p, seed=seed)
    mask = cuflash.dropout_mask((1, 1, sq, sk), seed=seed, p=p)[0, 0]
    want = mask[:, :32] / (1 - p) / sk
    np.testing.assert_allclose(out[0, :, 0, :], want, rtol=1e-12, atol=1e-15)
    dout = np.zeros((1, sq, 1, 32))
    dout[0, :, 0, 0] = 1.0
    _, _, dv = cuflash.attention_backward(dout, q, k, v, out, lse, dropout_p=p, seed=seed, backend="emulate")
    np.testing.assert_allclose(dv[0, :, 0, 0], mask.sum(axis=0) / (1 - p) / sk, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# The float64 modifier code; dispatch through the API
# ------------------------------------------------------------------------------------------------
_CPP_KERNEL = r"""
#include "wide_math.cuh"
namespace cuflash {
__device__ double eval(double s, int b, int h, int q_idx, int kv_idx, int q_len, int kv_len, const double* slope,
                       const int* doc) { return EXPR; }
}
extern "C" __global__ void eval_kernel(const double* score, double* out, const double* slope, const int* doc, int n) {
  for (int i = 0; i < n; ++i) {
    const int kv_idx = i % 5, q_idx = (i / 5) % 5, h = (i / 25) % 3, b = i / 75;
    out[i] = cuflash::eval(score[i], b, h, q_idx, kv_idx, 5, 5, slope, doc);
  }
}
"""


@pytest.mark.parametrize("text", ["score + slope[h] * (kv_idx - q_idx)", "2.5 * tanh(score / 2.5) + 1e-17 * score",
                                  "max(score, -1.0) + exp(score / 4) - abs(score) + sqrt(1.0 + score * score)",
                                  "where(doc[q_idx] == doc[kv_idx], score, -inf) + log(2.0)"])
def test_float64_modifier_code_computes_in_float64(text, tmp_path):
    """Expr.cpp(real="double") agrees with NumPy float64 to a few ulp (a float version would be off by ~1e-8)."""
    from cuflash.cuda.source import KERNELS_DIR, inline_includes

    arrays = {"slope": np.array([0.5, 1.0 / 3.0, 2.0]), "doc": np.array([0, 0, 1, 1, 2], np.int32)}
    e = mods.parse(text, kind="score", arrays=arrays)
    cpp = e.cpp(lambda name, index: f"{name}[{index[0]}]", real="double").replace("score", "s")
    rng = np.random.default_rng(1)
    score = rng.standard_normal((2, 3, 5, 5))
    out = np.zeros(150)
    both = tmp_path / "helpers.cuh"  # wide_math.cuh and the modifier helpers (nan_max, floor_div), inlined once
    both.write_text(f'#include "{KERNELS_DIR / "wide_math.cuh"}"\n#include "{KERNELS_DIR / "mods.cuh"}"\n')
    source = inline_includes(both) + _CPP_KERNEL.replace('#include "wide_math.cuh"', "").replace("EXPR", cpp)
    emulate.launch(LaunchSpec(source, "eval_kernel", (1, 1, 1), (1, 1, 1), 0,
                              (score, out, arrays["slope"], arrays["doc"], np.int32(150))))
    env = dict(b=np.arange(2).reshape(2, 1, 1, 1), h=np.arange(3).reshape(1, 3, 1, 1),
               q_idx=np.arange(5).reshape(1, 1, 5, 1), kv_idx=np.arange(5).reshape(1, 1, 1, 5), q_len=5, kv_len=5,
               score=score)
    want = np.broadcast_to(e.evaluate(env, arrays, np.float64), (2, 3, 5, 5)).ravel()
    np.testing.assert_allclose(out, want, rtol=4e-16, atol=4e-16)


def test_float64_modifier_operands_travel_in_float64():
    q = np.zeros((1, 8, 2, 32))
    p = make_problem(q, q, q, softcap=1 / 3, bias=np.full((2, 8, 8), 0.1), mask_mod="keep[kv_idx]",
                     mod_arrays={"keep": np.ones(8, bool)})
    name, code = modcode.render(p.mods, real="double")
    assert "double score(double score" in code and "tanhf" not in code and "mod_read<double>" in code
    value, keep = modcode.operands(p.mods, None, np, real="double")
    kinds = sorted(str(a.dtype) for a in keep)
    assert kinds == ["float64", "float64", "uint8"]  # the bias, the softcap (one element), keep
    # a zero margin past every q_idx / kv_idx axis: the kernels evaluate the modifier on whole boundary tiles
    bias = next(a for a in keep if a.ndim == 4)
    m = modcode.MOD_MARGIN
    assert bias.shape == (1, 2, 8 + m, 8 + m) and not bias[:, :, 8:].any() and not bias[..., 8:].any()
    assert next(a for a in keep if a.dtype == np.uint8).shape == (8 + m,)
    assert max(max(s.block_m, s.block_n) for s in specs.all_specs()) <= m
    assert next(a for a in keep if a.size == 1)[0] == 1 / 3  # not rounded to float32
    assert modcode.render(p.mods)[0] != name  # the float32 struct is another specialization


def test_dispatch_precision_and_dtypes():
    q = np.zeros((1, 20, 1, 32), np.float32)
    for precision, math in (("ieee", "ffma"), ("3xtf32", "3xtf32"), ("tf32", "tf32")):
        fl = launches.forward_launch(make_problem(q, q, q, precision=precision))
        assert fl.launch.name_expression.startswith("cuflash::flash_fwd_wide_kernel<" + specs.MATHS[math][1])
    q64 = q.astype(np.float64)
    assert "F64Dmma" in launches.forward_launch(make_problem(q64, q64, q64), cc=90).launch.name_expression
    assert "F64Fma" in launches.forward_launch(make_problem(q64, q64, q64), cc=89).launch.name_expression
    fl = launches.forward_launch(make_problem(q64, q64, q64))
    assert fl.lse.dtype == np.float64 and fl.out.dtype == np.float64
    with pytest.raises(ValueError, match="precision must be one of"):
        cuflash.attention(q, q, q, precision="fast")
    with pytest.raises(ValueError, match="float64 inputs take only precision='ieee'"):
        cuflash.attention(q64, q64, q64, precision="tf32")
    with pytest.raises(ValueError, match="float16 inputs take only"):
        cuflash.attention(q.astype(np.float16), q.astype(np.float16), q.astype(np.float16), precision="3xtf32")
    # the NumPy backend takes the option and computes float32 in float32
    a = cuflash.attention(q + 1, q, q, precision="tf32")
    assert a.dtype == np.float32


@pytest.mark.parametrize("mode_id", ["f32-ieee", "f64-dmma"])
def test_an_infinite_score_gives_lse_inf_as_the_reference(mode_id, monkeypatch):
    dtype, precision, cc = MODES[mode_id]
    monkeypatch.setenv("CUFLASH_EMULATE_ARCH", str(cc))
    q, k, v = infinite_key_case(np.dtype(dtype))
    check_infinite_scores(*fwd(q, k, v, causal=True, precision=precision), q, k, v)
