"""The CUDA backward kernels (kernels/flash_bwd.cu), run unchanged on the CPU by cuflash.emulate.

Held to the float64 analytic gradients with the 3x same-dtype rule (cuflash.testing.check_backward), on small
shapes: every mask feature in fp16 and bf16, each warp layout of the main kernel (split 1, 2, 4), every backward
tile-table row, the golden vectors, a small hypothesis sweep, and the deterministic mode (bitwise equal across
runs and thread schedules, and equal in value to the default mode up to the atomics' summation order).
The forward that produces out and lse is the emulated forward kernel, as on the GPU.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from cuflash.blockmask import BlockMask
from cuflash.cuda import specs
from cuflash.cuda.specs import KernelSpec
from cuflash.testing import Case, attention_cases

import cases
from golden import golden_cases
from cases import bf16, feature_cases, make_case

from emulated_support import emulated_backward, forward, kernel_grads, pytestmark  # noqa: F401  (pytestmark marks the module)

try:
    import ml_dtypes  # noqa: F401

    HAVE_BF16 = True
except ImportError:  # bf16 NumPy arrays need ml_dtypes (extra "bf16")
    HAVE_BF16 = False
needs_bf16 = pytest.mark.skipif(not HAVE_BF16, reason="ml_dtypes not installed")




def check_backward(fn, case: Case):
    """The 3x same-dtype rule (cases.check_backward) with out and lse from the emulated forward kernel."""
    out, lse = forward(case)
    return cases.check_backward(fn, case, out, lse)


def as_dtype(case, dtype):
    case.q, case.k, case.v, case.dout = (a.astype(dtype) for a in (case.q, case.k, case.v, case.dout))
    return case


# ------------------------------------------------------------------------------------------------
# Every feature (the forward's feature cases), fp16; a representative subset in bf16
# ------------------------------------------------------------------------------------------------
FEATURES = feature_cases()
BF16_FEATURES = ("ragged_sq_ne_sk", "causal_long_q", "window", "gqa_mqa", "seqlens", "odd_head_dim_59",
                 "blockmask_finer_than_tile", "blockmask_straddling")


@pytest.mark.parametrize("name,case", FEATURES, ids=[n for n, _ in FEATURES])
def test_feature_fp16(name, case):
    dq, dk, dv = check_backward(emulated_backward(), case)
    assert dq.dtype == dk.dtype == dv.dtype == np.float16
    assert dq.shape == case.q.shape and dk.shape == case.k.shape and dv.shape == case.v.shape


@needs_bf16
@pytest.mark.parametrize("name,case", [(n, c) for n, c in FEATURES if n in BF16_FEATURES],
                         ids=[n for n, _ in FEATURES if n in BF16_FEATURES])
def test_feature_bf16(name, case):
    dq, dk, dv = check_backward(emulated_backward(), as_dtype(case, bf16()))
    assert dq.dtype == bf16()


# ------------------------------------------------------------------------------------------------
# Warp layouts of the main kernel and the dq kernel, on small tiles (many tiles per problem)
# ------------------------------------------------------------------------------------------------
SMALL_SPECS = {
    "split1": (KernelSpec("bwd", "float16", 64, 32, 32, 2), KernelSpec("dq", "float16", 64, 32, 32, 2)),
    "split2": (KernelSpec("bwd", "float16", 64, 32, 32, 4), KernelSpec("dq", "float16", 64, 64, 16, 2)),
    "split4": (KernelSpec("bwd", "float16", 64, 64, 16, 4), KernelSpec("dq", "float16", 64, 32, 16, 1)),
}


def _layout_case():
    rng = np.random.default_rng(5)
    grid = rng.random((2, 1, 5, 3)) < 0.6
    return make_case(2, 150, 120, 4, 2, 59, np.float16, causal=True, window=(90, None),
                     seqlens_q=np.array([150, 70], np.int32), seqlens_k=np.array([101, 120], np.int32),
                     block_mask=BlockMask(grid, block=(32, 48), seqlen_q=150, seqlen_k=120))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("layout", sorted(SMALL_SPECS))
def test_warp_layouts(layout, deterministic):
    spec, dq_spec = SMALL_SPECS[layout]
    check_backward(emulated_backward(deterministic, spec=spec, dq_spec=dq_spec), _layout_case())


# ------------------------------------------------------------------------------------------------
# Every backward tile-table row (main + dq), fp16 (the bf16 rows are the same code with another T)
# ------------------------------------------------------------------------------------------------
TABLE = [s for s in specs.all_specs(("bwd",)) if s.dtype == "float16"]


@pytest.mark.parametrize("spec", TABLE, ids=lambda s: s.name_expression.split("<")[1][:-1])
def test_every_table_row(spec):
    dq_spec = specs.select("dq", "float16", spec.head_dim)
    d = spec.head_dim - 5 if spec.head_dim > 32 else spec.head_dim
    sq, sk = spec.block_m + 3, 2 * spec.block_n + 1
    case = make_case(2, sq, sk, 2, 1, d, np.float16, causal=True,
                     seqlens_q=np.array([sq, spec.block_m - 1], np.int32),
                     seqlens_k=np.array([spec.block_n + 7, sk], np.int32))
    check_backward(emulated_backward(True, spec=spec, dq_spec=dq_spec), case)


# ------------------------------------------------------------------------------------------------
# Golden vectors (float64 gradients from an independent oracle), inputs rounded to fp16
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,case,gold_out,gold_lse", golden_cases())
def test_golden(name, case, gold_out, gold_lse):
    out, lse = forward(case)
    cases.check_golden_grads(emulated_backward()(case.dout, case.q, case.k, case.v, out, lse, **case.options),
                                 case, name)


# ------------------------------------------------------------------------------------------------
# Hypothesis over the shared strategies (small budget: every example compiles nothing new after the first
# few head dims, and runs forward + backward through the fibers)
# ------------------------------------------------------------------------------------------------
@settings(max_examples=max(4, settings.default.max_examples // 4), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(attention_cases(dtypes=("float16", "bfloat16") if HAVE_BF16 else ("float16",), max_seqlen=100,
                       head_dims=(8, 40, 59, 64), block_sizes=(16, 32, 64)))
def test_hypothesis(case):
    check_backward(emulated_backward(deterministic=bool(case.q.shape[-1] % 2)), case)


# ------------------------------------------------------------------------------------------------
# Deterministic mode, fully masked rows, layouts in memory
# ------------------------------------------------------------------------------------------------
def test_deterministic_is_bitwise_reproducible_across_runs_and_schedules():
    # GQA (4 query heads per kv head) with many key tiles per query tile and many query tiles per key tile.
    case = make_case(2, 140, 150, 4, 1, 64, np.float16, causal=True, window=(100, None))
    spec, dq_spec = SMALL_SPECS["split1"]
    runs = [kernel_grads(case, True, schedule=s, seed=3, spec=spec, dq_spec=dq_spec)
            for s in ("forward", "forward", "reverse", "random")]
    cases.assert_bitwise_equal_runs(runs)


@pytest.mark.parametrize("shape", [(75,), (4, 75, 1), (1, 1, 75, 75)], ids=["per_key", "heads_rows", "batch_heads"])
def test_deterministic_dbias_of_a_broadcast_bias_is_bitwise_reproducible(shape):
    """A bias that broadcasts gathers several dS into each element of dbias: by fp32 atomics in no fixed order, so the
    deterministic mode's dbias varied in its last bits with the order of the threads (here the emulator's random
    schedule, as a GPU's warps and blocks). Now that mode accumulates in the problem's whole (B, H, Sq, Sk) shape
    (each element added to once) and sums the broadcast axes in a fixed order: the same bits for every schedule (the
    default mode's differ between them). Its values are held to the reference in tests/test_modifiers.py."""
    from cuflash.backends import emulate as emulate_backend
    from cuflash.problem import check_backward as flatten_backward, make_problem

    bias = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    case = make_case(2, 75, 75, 4, 2, 40, np.float16, bias=bias, causal=True)
    problem = make_problem(case.q, case.k, case.v, **case.options)
    out, lse = forward(case)
    d, o, lse = flatten_backward(problem, case.dout, out, lse)

    def dbias(deterministic, seed):
        return emulate_backend.backward(problem, d, o, lse, deterministic=deterministic, dbias=True, schedule="random",
                                        seed=seed)[3]

    runs = [dbias(True, seed) for seed in (1, 2, 3)]
    assert all(np.array_equal(runs[0], r) for r in runs[1:])
    atomic = [dbias(False, seed) for seed in (1, 2)]
    assert not np.array_equal(*atomic)  # the schedules do reorder the atomics: the check above can fail


@pytest.mark.parametrize("lengths, shape", [((0, 75), (75,)), ((75, 0), (75, 1)), ((75, 75), (75, 75))])
def test_deterministic_dbias_of_an_empty_problem_is_zeros(lengths, shape):
    """No query, no key, or no batch: nothing is launched, and the deterministic mode's whole-shape dbias failed to
    be summed (a reshape of 0 elements) where the default mode gave zeros."""
    sq, sk = lengths
    batch = 0 if lengths == (75, 75) else 2
    bias = np.ones(shape, np.float32)
    case = make_case(batch, sq, sk, 4, 2, 40, np.float16, bias=bias)
    for deterministic in (False, True):
        dbias = emulated_backward(deterministic)(case.dout, case.q, case.k, case.v, *forward(case), return_dbias=True,
                                                 **case.options)[3]
        assert dbias.shape == shape and not dbias.any(), deterministic


def test_default_mode_agrees_with_deterministic():
    # Same math, only the order of the fp32 atomic additions into dQ differs: dK and dV are bitwise equal,
    # dQ equal to within the last bits of fp32 accumulation, rounded once to fp16.
    case = make_case(1, 130, 100, 2, 2, 64, np.float16, window=(30, 30))
    spec, dq_spec = SMALL_SPECS["split1"]
    a = kernel_grads(case, False, schedule="random", seed=1, spec=spec, dq_spec=dq_spec)
    b = kernel_grads(case, True, spec=spec, dq_spec=dq_spec)
    assert np.array_equal(a[1].view(np.uint16), b[1].view(np.uint16))
    assert np.array_equal(a[2].view(np.uint16), b[2].view(np.uint16))
    diff = np.abs(a[0].astype(np.float64) - b[0].astype(np.float64))
    assert diff.max() <= 2.0 ** -10 * np.abs(b[0].astype(np.float64)).max()


def test_rows_that_see_nothing_get_zero_gradients():
    # Rows past seqlens_q, a sequence without keys, keys past seqlens_k, and keys no query sees (window):
    # exactly zero gradients, never NaN (lse = -inf rows give P = 0).
    case = make_case(2, 130, 130, 1, 1, 64, np.float16, window=(2, 0),
                     seqlens_q=np.array([90, 130], np.int32), seqlens_k=np.array([110, 0], np.int32))
    dq, dk, dv = check_backward(emulated_backward(), case)
    assert np.all(dq[0, 90:] == 0) and np.all(dq[1] == 0)
    assert np.all(dk[0, 110:] == 0) and np.all(dv[0, 110:] == 0) and np.all(dk[1] == 0) and np.all(dv[1] == 0)
    # query i sees keys i + 18 .. i + 20 (window (2, 0), Lk - Lq = 20): keys below 18 are seen by no query
    assert np.all(dk[0, :18] == 0) and np.all(dv[0, :18] == 0) and np.any(dk[0, 18:110] != 0)


def test_strided_inputs():
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((2, 70, 3, 4, 64)).astype(np.float16)  # a fused (B, S, 3, H, D) projection
    dout = rng.standard_normal((2, 70, 4, 128)).astype(np.float16)[..., ::2]  # non-contiguous head dim: copied
    case = Case(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dout, {"causal": True})
    check_backward(emulated_backward(), case)
    check_backward(emulated_backward(), make_case(1, 1, 1, 1, 1, 1))  # one query, one key, head_dim 1


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_huge_scores_give_capped_one_hot_gradients(dtype):
    """Scores so large that the lse's roundings exceed 1 (|lse| >= 2^22 in base 2 for float32 statistics): exactly
    P <= 1, but exp2(S - lse) may come out above 1 and overflow (it did from scale 1e7 at head_dim 64, every gradient
    NaN), so the backward caps P at 1. With q = k unit rows each row's softmax is one-hot on its diagonal, so
    dV_j = P_jj dO_j: never larger than dO (P <= 1), finite, and within the rule (whose floor there is as coarse as
    a float32 lse: P_jj itself may round to 1/2 or 1/4)."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, 70, 2, 64))
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    q, v, do = (a.astype(dtype) for a in (x, rng.standard_normal(x.shape), rng.standard_normal(x.shape)))
    # dQ, dK are scale x the rounding of dP - D (0 in exact arithmetic): past 1e7 they leave float16's range
    for scale in (1e7,) if dtype == np.float16 else (1e7, 1e10, 1e20):
        case = Case(q, q, v, do, dict(scale=scale, causal=True))
        grads = check_backward(emulated_backward(), case)
        assert all(np.isfinite(g).all() for g in grads), scale
        assert np.all(np.abs(grads[2].astype(np.float64)) <= np.abs(do.astype(np.float64))), scale
