"""Dropout in the CUDA backward kernels on a real GPU (CuPy): skipped cleanly without CuPy or a usable GPU.

The emulated tests (test_kernels_emulated_bwd_dropout.py) at GPU sizes: the dropout feature cases and a hypothesis
sweep against the float64 reference gradients given the explicit keep-mask (3x same-dtype rule), both dQ modes;
the main kernel's keep-mask read back through dV bit for bit against cuflash.dropout_mask for every native head
dim (every warp layout of the tile table); the deterministic mode bitwise reproducible with dropout; the
attention_vjp round trip with a drawn seed.
"""
import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash.cuda import specs
from cuflash.testing import attention_cases

from cases import (SEED, assert_bitwise_equal_runs, bf16, check_backward, check_dv_keep_mask, dropout_case,
                   dropout_feature_cases, host, make_case)

import gpu_support  # noqa: E402

cp, pytestmark, DTYPES = gpu_support.setup()
MODES = pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])


def dev(*arrays):
    return tuple(cp.asarray(a) for a in arrays)


def gpu_forward(case):
    out, lse = cuflash.attention(*dev(case.q, case.k, case.v), return_lse=True, **case.options)
    return host(out), host(lse)


def gpu_backward(deterministic=False):
    def fn(dout, q, k, v, out, lse, **options):
        grads = cuflash.attention_backward(*dev(dout, q, k, v, out, lse), deterministic=deterministic, **options)
        return tuple(host(g) for g in grads)

    return fn


def check(case, deterministic=False):
    out, lse = gpu_forward(case)
    return check_backward(gpu_backward(deterministic), case, out, lse)


def gpu_grads(q, k, v, dout, **options):
    """Forward, then backward, on the GPU: ``(dq, dk, dv)`` on the host."""
    q, k, v, dout = dev(q, k, v, dout)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    return tuple(host(g) for g in cuflash.attention_backward(dout, q, k, v, out, lse, **options))


@MODES
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,case", dropout_feature_cases(), ids=[n for n, _ in dropout_feature_cases()])
def test_feature_with_dropout(name, case, dtype, deterministic):
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    case = dataclasses.replace(case, **{n: getattr(case, n).astype(dt) for n in ("q", "k", "v", "dout")},
                               options=dict(case.options))
    check(case, deterministic)


@gpu_support.sharded(attention_cases(dtypes=DTYPES, max_seqlen=600, max_head_dim=256, block_sizes=(16, 64, 128),
                                     dropout=True), max_examples=100, shards=4)
def test_hypothesis_with_dropout(case):
    if not case.options.get("dropout_p"):
        case.options.update(dropout_p=0.5, seed=SEED)
    check(case, deterministic=bool(case.q.shape[-1] % 2))


@pytest.mark.parametrize("d", specs.NATIVE_HEAD_DIMS)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_main_kernel_keep_mask_is_bit_equal_to_dropout_mask(d, p):
    g = 2  # query heads per kv head; a key is seen by at most d / g queries
    w = d // g
    check_dv_keep_mask(gpu_grads, batch=3, sq=700, sk=650, hq=4, hkv=2, d=d, window=(w // 2, w - w // 2 - 1), p=p,
                       seed=SEED + d)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_table_row_with_dropout(d):
    case = dropout_case(2, 300, 333, 4, 2, d, causal=True, p=0.3, seed=SEED, seqlens_q=np.array([300, 131], np.int32),
                        seqlens_k=np.array([290, 333], np.int32))
    check(case)
    check(case, deterministic=True)


def test_deterministic_with_dropout_is_bitwise_reproducible():
    case = dropout_case(2, 1000, 1100, 8, 2, 128, causal=True, window=(300, None), p=0.2, seed=SEED)
    out, lse = gpu_forward(case)
    fn = gpu_backward(deterministic=True)
    runs = [fn(case.dout, case.q, case.k, case.v, out, lse, **case.options) for _ in range(3)]
    assert_bitwise_equal_runs(runs)


def test_attention_vjp_round_trip_with_drawn_seed():
    case = make_case(2, 257, 300, 4, 2, 96, causal=True, window=(128, None), dropout_p=0.25)  # no seed: drawn
    q, k, v, dout = dev(case.q, case.k, case.v, case.dout)
    out, vjp = cuflash.attention_vjp(q, k, v, **case.options)
    grads = vjp(dout)
    case.options["seed"] = vjp.seed
    o_ref, lse_ref = gpu_forward(case)
    assert np.array_equal(host(out).view(np.uint16), o_ref.view(np.uint16))
    check_backward(lambda *a, **o: tuple(host(g) for g in grads), case, o_ref, lse_ref)
