"""Dropout in the CUDA forward kernel on a real GPU (CuPy): skipped cleanly without CuPy or a usable GPU.

The emulated tests (test_kernels_emulated_dropout.py) at GPU sizes: the dropout feature cases and a hypothesis
sweep against the float64 reference with the explicit keep-mask, the keep-mask read back bit for bit against
cuflash.dropout_mask for every native head dim (both fragment layouts, many query and key tiles), and bitwise
determinism of repeated runs with one seed.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cuflash
from cuflash.testing import attention_cases

from cases import SEED, bf16, check_forward, check_keep_mask, dropout_feature_cases, make_case

import gpu_support  # noqa: E402

cp, pytestmark, DTYPES = gpu_support.setup()


def on_gpu(q, k, v, **options):
    out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True, **options)
    return cp.asnumpy(out), cp.asnumpy(lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,case", dropout_feature_cases(), ids=[n for n, _ in dropout_feature_cases()])
def test_feature_with_dropout(name, case, dtype):
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    case.q, case.k, case.v = (a.astype(dt) for a in (case.q, case.k, case.v))
    check_forward(on_gpu, case)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(attention_cases(dtypes=DTYPES, max_seqlen=600, max_head_dim=256, block_sizes=(16, 64, 128), dropout=True))
def test_hypothesis_with_dropout(case):
    if not case.options.get("dropout_p"):
        case.options.update(dropout_p=0.5, seed=SEED)
    check_forward(on_gpu, case)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kernel_keep_mask_is_bit_equal_to_dropout_mask(d, p):
    window = (d // 2, d - d // 2 - 1)  # d keys per row at most: j % d is one-to-one on them
    check_keep_mask(on_gpu, batch=3, sq=1000, sk=1100, hq=4, hkv=2, d=d, window=window, p=p,
                    seed=SEED + d, numpy_too=(p == 0.5))


def test_same_seed_bitwise_identical_runs():
    case = make_case(2, 1500, 1500, 8, 2, 128, causal=True)
    q, k, v = (cp.asarray(a) for a in (case.q, case.k, case.v))
    runs = [cp.asnumpy(cuflash.attention(q, k, v, causal=True, dropout_p=0.2, seed=s)) for s in (SEED, SEED, 1)]
    assert np.array_equal(runs[0].view(np.uint16), runs[1].view(np.uint16))
    assert (runs[0] != runs[2]).mean() > 0.5
