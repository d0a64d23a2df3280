"""The CUDA backward kernels on a real GPU (CuPy): skipped cleanly without CuPy or a usable GPU.

Against the float64 analytic gradients with the 3x same-dtype rule for dq, dk, dv: hypothesis over the shared
strategies (fp16/bf16, head dims up to 256 incl. odd ones, awkward lengths, Sq != Sk, causal, window, BlockMask,
seqlens, GQA), long awkward lengths, every native head dim, non-contiguous inputs, the golden vectors, the
deterministic mode (bitwise equal across runs) and the attention_vjp round trip.
"""
import numpy as np
import pytest

import cuflash
from cuflash.cuda import specs
from cuflash.problem import check_backward as flatten_backward
from cuflash.problem import make_problem
from cuflash.testing import Case, attention_cases

from cases import assert_bitwise_equal_runs, bf16, check_backward, check_golden_grads, feature_cases, host, make_case
from golden import golden_cases

import gpu_support  # noqa: E402

cp, pytestmark, DTYPES = gpu_support.setup()


def dev(*arrays):
    return tuple(None if a is None else cp.asarray(a) for a in arrays)


def gpu_forward(case):
    q, k, v = dev(case.q, case.k, case.v)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **case.options)
    return host(out), host(lse)


def gpu_backward(deterministic=False):
    """``fn(dout, q, k, v, out, lse, **options)`` on the GPU. The default mode goes through the public
    cuflash.attention_backward; the deterministic one through the backend (until api.py exposes the flag)."""

    def fn(dout, q, k, v, out, lse, **options):
        args = dev(dout, q, k, v, out, lse)
        if not deterministic:
            return tuple(host(g) for g in cuflash.attention_backward(*args, **options))
        from cuflash.backends import cuda

        problem = make_problem(*args[1:4], **options)
        grads = cuda.backward(problem, *flatten_backward(problem, args[0], args[4], args[5]), deterministic=True)
        return tuple(host(problem.unflatten(g, a.shape[1:])) for g, a in zip(grads, (problem.q, problem.k, problem.v)))

    return fn


def check(case, deterministic=False):
    out, lse = gpu_forward(case)
    return check_backward(gpu_backward(deterministic), case, out, lse)


@gpu_support.sharded(attention_cases(dtypes=DTYPES, max_seqlen=300, max_head_dim=256,
                                     block_sizes=(16, 32, 64, 128, 256)), max_examples=200, shards=8)
def test_hypothesis_small(case):
    check(case, deterministic=bool(case.q.shape[-1] % 2))


@gpu_support.sharded(attention_cases(dtypes=DTYPES, max_seqlen=2000, head_dims=(40, 59, 64, 111, 128, 256),
                                     max_batch_dims=1, block_sizes=(64, 128)), max_examples=30, shards=2)
def test_hypothesis_long(case):
    check(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [113, 203, 1023, 1024])
@pytest.mark.parametrize("causal", [False, True])
def test_awkward_lengths(n, causal, dtype):
    dt = bf16() if dtype == "bfloat16" else np.float16
    check(make_case(1, n, n + 37, 4, 2, 128, dt, causal=causal))
    check(make_case(1, n, max(1, n // 3), 2, 1, 64, dt, causal=causal), deterministic=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("name,case", feature_cases(), ids=[n for n, _ in feature_cases()])
def test_feature(name, case, deterministic):
    check(case, deterministic)


@pytest.mark.parametrize("d", specs.NATIVE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_native_head_dim(d, dtype):
    dt = bf16() if dtype == "bfloat16" else np.float16
    case = make_case(2, 300, 333, 4, 2, d, dt, causal=True, seqlens_q=np.array([300, 131], np.int32),
                     seqlens_k=np.array([290, 333], np.int32))
    check(case)
    check(case, deterministic=True)


@pytest.mark.parametrize("name,case,gold_out,gold_lse", golden_cases())
def test_golden(name, case, gold_out, gold_lse):
    out, lse = gpu_forward(case)
    check_golden_grads(gpu_backward()(case.dout, case.q, case.k, case.v, out, lse, **case.options), case, name)


def test_deterministic_is_bitwise_reproducible():
    case = make_case(2, 1000, 1100, 8, 2, 128, np.float16, causal=True, window=(300, None))
    out, lse = gpu_forward(case)
    fn = gpu_backward(deterministic=True)
    runs = [fn(case.dout, case.q, case.k, case.v, out, lse, **case.options) for _ in range(3)]
    assert_bitwise_equal_runs(runs)


def test_default_mode_dk_dv_are_reproducible():
    # Only dQ goes through atomics in the default mode; dK, dV are summed by one block in a fixed order.
    case = make_case(1, 777, 900, 4, 1, 64, np.float16, causal=True)
    out, lse = gpu_forward(case)
    runs = [gpu_backward()(case.dout, case.q, case.k, case.v, out, lse, **case.options) for _ in range(2)]
    for i in (1, 2):
        assert np.array_equal(runs[0][i].view(np.uint16), runs[1][i].view(np.uint16))


def test_attention_vjp_round_trip():
    case = make_case(2, 257, 300, 4, 2, 96, np.float16, causal=True, window=(128, None))
    q, k, v, dout = dev(case.q, case.k, case.v, case.dout)
    out, vjp = cuflash.attention_vjp(q, k, v, **case.options)
    dq, dk, dv = vjp(dout)
    assert all(isinstance(g, cp.ndarray) for g in (out, dq, dk, dv))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dq.dtype == q.dtype
    o_ref, lse_ref = gpu_forward(case)
    assert np.array_equal(host(out).view(np.uint16), o_ref.view(np.uint16))
    check_backward(lambda *a, **o: (dq, dk, dv), case, o_ref, lse_ref)


def test_non_contiguous_inputs():
    rng = np.random.default_rng(0)
    qkv = cp.asarray(rng.standard_normal((2, 257, 3, 4, 64)).astype(np.float16))  # fused projection
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = cp.asarray(rng.standard_normal((2, 257, 4, 64)).astype(np.float16))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    case = Case(host(q), host(k), host(v), host(dout), {"causal": True})
    check_backward(lambda *a, **o: grads, case, host(out), host(lse))


def test_memory_is_linear_in_seqlen():
    # No N x N buffer: the pool's high-water mark during the backward stays O(N * d).
    mempool = cp.get_default_memory_pool()
    case = make_case(1, 8192, 8192, 2, 2, 64, np.float16, causal=True)
    q, k, v, dout = dev(case.q, case.k, case.v, case.dout)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    cp.cuda.Device().synchronize()
    mempool.free_all_blocks()
    before = mempool.total_bytes()
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    cp.cuda.Device().synchronize()
    extra = mempool.total_bytes() - before  # freed blocks stay cached: this is the peak of the call
    n_d_bytes = 8192 * 2 * 64 * 2
    assert extra <= 8 * n_d_bytes, extra  # dq, dk, dv (3 N·d·2 bytes) + fp32 dQ workspace (N·d·4) + L, D
    del grads
