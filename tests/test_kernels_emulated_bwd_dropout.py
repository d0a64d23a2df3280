"""Dropout in the CUDA backward kernels (kernels/flash_bwd.cu, kernels/bwd_dropout.cuh), run on the CPU by
cuflash.emulate.

- every dropout feature case, fp16 and bf16, both dQ modes (atomics; the deterministic dq kernel), against the float64
  reference gradients given the explicit keep-mask (cuflash.testing.check_backward via tests/cases.py); out and lse
  from the emulated forward kernel with the same dropout, as on the GPU;
- each warp layout of the main kernel (split 1, 2, 4) and of the dq kernel (16 and 32 rows per warp), both modes;
  with the table rows of the feature cases, warps hold 2, 4 and 8 n-tiles of S^T (8, 16, 32 keep bits per lane);
- the main kernel's keep bits read back through dV, bit for bit against cuflash.dropout_mask: the transposed
  fragments (rows keys, columns queries), several key and query tiles, the QUERY head under GQA;
- deterministic mode bitwise reproducible with dropout across runs and thread schedules, and the default mode equal
  to it (dK, dV bitwise) (a p whose threshold would be 0 is refused before any kernel: tests/test_hostile.py);
- a small hypothesis sweep over the shared strategies with dropout;
- the public API on backend="emulate": attention_backward, and attention_vjp with a drawn seed.
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cuflash
from cuflash import testing
from cuflash.backends import emulate as emulate_backend
from cuflash.blockmask import BlockMask
from cuflash.cuda.specs import KernelSpec
from cuflash.problem import make_problem
from cuflash.testing import attention_cases

import cases
from cases import SEED, bf16, check_dv_keep_mask, dropout_case, dropout_feature_cases, make_case

from emulated_support import DTYPES, forward, emulated_backward, kernel_grads, pytestmark  # noqa: F401  (pytestmark marks the module)
MODES = pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])

#: small tiles: many key and query tiles per problem; every warp layout of both kernels
SMALL_SPECS = {  # S^T 4 n-tiles, dq 16 rows; 2 n-tiles, dq 32 rows; 2 n-tiles, dq 32 rows
    "split1": (KernelSpec("bwd", "float16", 64, 32, 32, 2), KernelSpec("dq", "float16", 64, 32, 32, 2)),
    "split2": (KernelSpec("bwd", "float16", 64, 32, 32, 4), KernelSpec("dq", "float16", 64, 64, 16, 2)),
    "split4": (KernelSpec("bwd", "float16", 64, 64, 16, 4), KernelSpec("dq", "float16", 64, 32, 16, 1)),
}




def check_backward(fn, case):
    out, lse = forward(case)
    return cases.check_backward(fn, case, out, lse)


def as_dtype(case, dtype):
    """A copy of ``case`` in ``dtype`` (parametrized cases are shared by the test items)."""
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    return dataclasses.replace(case, **{n: getattr(case, n).astype(dt) for n in ("q", "k", "v", "dout")},
                               options=dict(case.options))


# ------------------------------------------------------------------------------------------------
# Against the float64 reference with the explicit keep-mask
# ------------------------------------------------------------------------------------------------
@MODES
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,case", dropout_feature_cases(), ids=[n for n, _ in dropout_feature_cases()])
def test_feature_with_dropout(name, case, dtype, deterministic):
    case = as_dtype(case, dtype)
    dq, dk, dv = check_backward(emulated_backward(deterministic), case)
    assert dq.dtype == dk.dtype == dv.dtype == case.q.dtype
    assert dq.shape == case.q.shape and dk.shape == case.k.shape and dv.shape == case.v.shape


def _layout_case(p=0.4):
    rng = np.random.default_rng(5)
    grid = rng.random((2, 1, 5, 3)) < 0.6
    return dropout_case(2, 150, 120, 4, 2, 59, causal=True, window=(90, None), p=p, seed=SEED,
                        seqlens_q=np.array([150, 70], np.int32), seqlens_k=np.array([101, 120], np.int32),
                        block_mask=BlockMask(grid, block=(32, 48), seqlen_q=150, seqlen_k=120))


@MODES
@pytest.mark.parametrize("layout", sorted(SMALL_SPECS))
def test_warp_layouts_with_dropout(layout, deterministic):
    spec, dq_spec = SMALL_SPECS[layout]
    check_backward(emulated_backward(deterministic, spec=spec, dq_spec=dq_spec), _layout_case())


def test_small_smem_row_with_dropout():
    """The 99 KB-GPU row of head_dim 192 (64 x 32 x 8: split 4) and the dq kernel's 16-key tiles of head_dim 256."""
    spec, dq_spec = KernelSpec("bwd", "float16", 192, 64, 32, 8), KernelSpec("dq", "float16", 256, 64, 16, 4)
    case = dropout_case(1, 70, 75, 2, 1, 181, causal=True, p=0.5, seed=SEED)
    check_backward(emulated_backward(False, spec=spec), case)
    case = dropout_case(1, 70, 75, 2, 1, 250, window=(30, 2), p=0.3, seed=7)
    check_backward(emulated_backward(True, dq_spec=dq_spec), case)


@settings(max_examples=max(4, settings.default.max_examples // 4), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(attention_cases(dtypes=("float16", "bfloat16") if isinstance(DTYPES[1], str) else ("float16",),
                       max_seqlen=100, head_dims=(8, 40, 59, 64), block_sizes=(16, 32, 64), dropout=True))
def test_hypothesis_with_dropout(case):
    if not case.options.get("dropout_p"):
        case.options.update(dropout_p=0.5, seed=SEED)
    check_backward(emulated_backward(deterministic=bool(case.q.shape[-1] % 2)), case)


# ------------------------------------------------------------------------------------------------
# The main kernel's keep bits, read back through dV
# ------------------------------------------------------------------------------------------------
def emulated_grads(spec=None):
    """``run(q, k, v, dout, **options) -> (dq, dk, dv)``: emulated forward, then the emulated backward."""

    def run(q, k, v, dout, **options):
        problem = make_problem(q, k, v, **options)
        out, lse = emulate_backend.forward(problem)
        return emulate_backend.backward(problem, dout, out, lse, spec=spec)

    return run


@pytest.mark.parametrize("layout", ["split1", "split2", "split4", "table"])
def test_main_kernel_keep_mask_is_bit_equal_to_dropout_mask(layout):
    spec = SMALL_SPECS[layout][0] if layout != "table" else None  # table: 64 x 128 x 8 (S^T 8 n-tiles per warp)
    check_dv_keep_mask(emulated_grads(spec), batch=2, sq=150, sk=140, hq=4, hkv=2, d=64, window=(20, 11), p=0.5)


def test_main_kernel_keep_mask_mqa_high_p():
    check_dv_keep_mask(emulated_grads(SMALL_SPECS["split1"][0]), batch=1, sq=100, sk=200, hq=4, hkv=1, d=64,
                       window=(3, 12), p=0.9, seed=2 ** 64 - 1)


# ------------------------------------------------------------------------------------------------
# Reproducibility, the threshold-0 path, the public API
# ------------------------------------------------------------------------------------------------
def test_deterministic_with_dropout_is_bitwise_reproducible():
    case = dropout_case(2, 140, 150, 4, 1, 64, causal=True, window=(100, None), p=0.3, seed=SEED)
    spec, dq_spec = SMALL_SPECS["split1"]
    runs = [kernel_grads(case, True, schedule=s, seed=3, spec=spec, dq_spec=dq_spec)
            for s in ("forward", "forward", "reverse", "random")]
    cases.assert_bitwise_equal_runs(runs)
    # and the default mode computes the same dK, dV bit for bit (dQ up to the order of the fp32 atomics)
    a = kernel_grads(case, False, schedule="random", seed=1, spec=spec, dq_spec=dq_spec)
    assert np.array_equal(a[1].view(np.uint16), runs[0][1].view(np.uint16))
    assert np.array_equal(a[2].view(np.uint16), runs[0][2].view(np.uint16))
    diff = np.abs(a[0].astype(np.float64) - runs[0][0].astype(np.float64))
    assert diff.max() <= 2.0 ** -10 * np.abs(runs[0][0].astype(np.float64)).max()


def test_different_seeds_give_different_gradients():
    case = dropout_case(1, 64, 64, 2, 2, 64, p=0.5, seed=SEED)
    a = kernel_grads(case, True)
    case.options["seed"] = SEED + 1
    b = kernel_grads(case, True)
    assert all((x != y).mean() > 0.5 for x, y in zip(a, b))


def test_public_api_backward_and_vjp_with_drawn_seed():
    case = make_case(1, 90, 70, 4, 2, 40, causal=True)
    out, vjp = cuflash.attention_vjp(case.q, case.k, case.v, causal=True, dropout_p=0.25, deterministic=True,
                                     backend="emulate")
    assert vjp.seed is not None
    grads = vjp(case.dout)
    case.options.update(dropout_p=0.25, seed=vjp.seed)
    _, lse = forward(case)
    # the vjp's gradients are the reference's with the drawn seed's mask
    testing.check_backward(lambda *a, **o: grads, case, out, lse)
    # and attention_backward with that seed computes them again, bit for bit
    again = cuflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse, deterministic=True,
                                       backend="emulate", **case.options)
    cases.assert_bitwise_equal_runs([grads, again])
