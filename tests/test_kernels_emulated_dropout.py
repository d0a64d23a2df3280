"""Dropout in the CUDA forward kernel (kernels/dropout.cuh), run unchanged on the CPU by cuflash.emulate.

- every feature with dropout, fp16 and bf16, against the float64 reference given the explicit keep-mask
  (cuflash.testing.check_forward): out scaled by 1/(1-p), lse of the undropped scores;
- the *same bits* as cuflash.dropout_mask and the NumPy backend: with q = k = 0 (uniform P) and V one-hot in the
  key index modulo head_dim under a window no wider than head_dim, out[i, j mod d] is nonzero exactly when key j
  is kept, so the kernel's keep-mask is read back element by element, over several key and query tiles, both
  fragment layouts (32 and 16 rows per warp) and a seed with both 32-bit halves nonzero;
- same seed -> bitwise identical output, different seed -> different output (a p so small that its threshold would
  be 0 is refused before any kernel: tests/test_hostile.py);
- the backward kernel refuses dropout with a clear error until it supports it.
"""
import numpy as np
import pytest
from hypothesis import given, settings

from cuflash.cuda import launch as launches
from cuflash.cuda.specs import KernelSpec
from cuflash.backends import emulate as emulate_backend
from cuflash.problem import make_problem
from cuflash.testing import attention_cases

from cases import SEED, bf16, check_forward, check_keep_mask, dropout_case, dropout_feature_cases, make_case

from emulated_support import DTYPES, emulated, pytestmark  # noqa: F401  (pytestmark marks the module)



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,case", dropout_feature_cases(), ids=[n for n, _ in dropout_feature_cases()])
def test_feature_with_dropout(name, case, dtype):
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    case.q, case.k, case.v = (a.astype(dt) for a in (case.q, case.k, case.v))
    out, lse = check_forward(emulated, case)
    assert out.dtype == dt and out.shape == case.q.shape and lse.dtype == np.float32


def test_small_smem_specialization_with_dropout():
    """A 64 x 32 x 4 tile at head_dim 256: 4 n-tiles per key tile, 16 rows per warp."""
    spec = KernelSpec("fwd", "float16", 256, 64, 32, 4)
    case = dropout_case(1, 70, 75, 2, 1, 250, causal=True, p=0.5, seed=SEED)
    check_forward(lambda q, k, v, **o: emulate_backend.forward(make_problem(q, k, v, **o), spec=spec), case)


@settings(max_examples=max(4, settings.default.max_examples // 4))  # ci: 5 examples, dev: 10
@given(attention_cases(dtypes=("float16", "bfloat16") if isinstance(DTYPES[1], str) else ("float16",),
                       max_seqlen=160, max_head_dim=136, block_sizes=(16, 32, 64, 128), dropout=True))
def test_hypothesis_with_dropout(case):
    if not case.options.get("dropout_p"):
        case.options.update(dropout_p=0.5, seed=SEED)
    check_forward(emulated, case)


# ------------------------------------------------------------------------------------------------
# The same bits as cuflash.dropout_mask and the NumPy backend
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d,window,p", [(64, (31, 32), 0.5),    # 32 rows per warp (2 m-tiles), block_n 64
                                        (128, (100, 27), 0.2),  # 16 rows per warp
                                        (64, (63, 0), 0.9)],    # causal-like band, most keys dropped
                         ids=["d64_two_mtiles", "d128_one_mtile", "d64_p0.9"])
def test_kernel_keep_mask_is_bit_equal_to_dropout_mask(d, window, p):
    check_keep_mask(emulated, batch=2, sq=300, sk=290, hq=2, hkv=1, d=d, window=window, p=p)


# ------------------------------------------------------------------------------------------------
# Seeds and the backward's refusal
# ------------------------------------------------------------------------------------------------
def test_same_seed_same_bits_different_seed_different_output():
    case = make_case(1, 130, 150, 2, 1, 64, causal=True)
    runs = [emulated(case.q, case.k, case.v, causal=True, dropout_p=0.3, seed=s)[0] for s in (SEED, SEED, SEED + 1)]
    assert np.array_equal(runs[0].view(np.uint16), runs[1].view(np.uint16))
    assert (runs[0] != runs[2]).mean() > 0.5
    # a seed differing only in its high 32 bits gives a different mask too
    hi = emulated(case.q, case.k, case.v, causal=True, dropout_p=0.3, seed=SEED ^ (1 << 40))[0]
    assert (runs[0] != hi).mean() > 0.5


def test_forward_launch_dropout_arguments():
    case = make_case(1, 8, 8, 1, 1, 32)
    params = launches.forward_launch(make_problem(case.q, case.k, case.v, dropout_p=0.25, seed=SEED)).launch.args[0]
    drop = params["dropout"][0]
    assert (int(drop["seed_lo"]), int(drop["seed_hi"]), int(drop["threshold"])) == (SEED & 0xFFFFFFFF, SEED >> 32,
                                                                                     2 ** 30)
    assert drop["rescale"] == np.float32(1 / 0.75)
    none = launches.forward_launch(make_problem(case.q, case.k, case.v)).launch.args[0]["dropout"][0]
    assert [int(none[f]) for f in ("seed_lo", "seed_hi", "threshold")] == [0, 0, 0] and none["rescale"] == 1
