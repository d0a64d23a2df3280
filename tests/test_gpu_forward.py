"""The CUDA forward kernel on a real GPU (CuPy): skipped cleanly without CuPy or a usable GPU.

Against the float64 reference with the 2x same-dtype rule: hypothesis over the shared strategies
(fp16/bf16, head dims up to 256 incl. odd ones, awkward lengths, Sq != Sk, causal, window, BlockMask,
seqlens, GQA), long awkward lengths (113/203/1023/1024/2000), non-contiguous inputs, the golden
vectors, every tile-table row, and bitwise determinism of repeated runs.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash.cuda import specs
from cuflash.testing import Case, assert_attention_close, attention_cases

from golden import golden_cases
from cases import bf16, check_forward, feature_cases, make_case

import gpu_support  # noqa: E402

cp, pytestmark, DTYPES = gpu_support.setup()


def on_gpu(q, k, v, **options):
    out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True, **options)
    assert isinstance(out, cp.ndarray) and out.dtype == q.dtype and lse.dtype == np.float32
    return cp.asnumpy(out), cp.asnumpy(lse)


@gpu_support.sharded(attention_cases(dtypes=DTYPES, max_seqlen=300, max_head_dim=256,
                                     block_sizes=(16, 32, 64, 128, 256)), max_examples=300, shards=6)
def test_hypothesis_small(case):
    check_forward(on_gpu, case)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(attention_cases(dtypes=DTYPES, max_seqlen=2000, head_dims=(40, 59, 64, 111, 128, 256), max_batch_dims=1,
                       block_sizes=(64, 128)))
def test_hypothesis_long(case):
    check_forward(on_gpu, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [113, 203, 1023, 1024, 2000])
@pytest.mark.parametrize("causal", [False, True])
def test_awkward_lengths(n, causal, dtype):
    dt = bf16() if dtype == "bfloat16" else np.float16
    check_forward(on_gpu, make_case(1, n, n + 37, 4, 2, 128, dt, causal=causal))
    check_forward(on_gpu, make_case(1, n, max(1, n // 3), 2, 1, 64, dt, causal=causal))


@pytest.mark.parametrize("name,case", feature_cases(), ids=[n for n, _ in feature_cases()])
def test_feature(name, case):
    check_forward(on_gpu, case)


@pytest.mark.parametrize("name,case,gold_out,gold_lse", golden_cases())
def test_golden(name, case, gold_out, gold_lse):
    from cuflash import reference

    out, lse = on_gpu(case.q, case.k, case.v, **case.options)
    base, base_lse = reference.attention(case.q, case.k, case.v, return_lse=True, compute_dtype=case.q.dtype,
                                         **case.options)
    assert_attention_close(out, gold_out, base, name="out")
    assert_attention_close(lse, gold_lse, base_lse, name="lse")


@pytest.mark.parametrize("d", specs.NATIVE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_native_head_dim(d, dtype):
    dt = bf16() if dtype == "bfloat16" else np.float16
    check_forward(on_gpu, make_case(2, 300, 333, 4, 2, d, dt, causal=True,
                                    seqlens_q=np.array([300, 131], np.int32), seqlens_k=np.array([290, 333], np.int32)))


def test_non_contiguous_inputs():
    rng = np.random.default_rng(0)
    qkv = cp.asarray(rng.standard_normal((2, 257, 3, 4, 64)).astype(np.float16))  # fused projection
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    check_forward(lambda *a, **o: (out, lse), Case(cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v), None,
                                                   {"causal": True}))
    bhsd = cp.asarray(rng.standard_normal((2, 4, 190, 96)).astype(np.float16))  # (B, H, S, D) storage
    x = bhsd.transpose(0, 2, 1, 3)
    out, lse = cuflash.attention(x, x, x, return_lse=True)
    host = cp.asnumpy(x)
    check_forward(lambda *a, **o: (out, lse), Case(host, host, host, None, {}))


def test_bitwise_deterministic():
    case = make_case(2, 1000, 1100, 8, 2, 128, np.float16, causal=True, window=(300, None))
    q, k, v = (cp.asarray(a) for a in (case.q, case.k, case.v))
    o1, l1 = cuflash.attention(q, k, v, return_lse=True, **case.options)
    o2, l2 = cuflash.attention(q, k, v, return_lse=True, **case.options)
    assert cp.array_equal(o1.view(cp.uint16), o2.view(cp.uint16)) and cp.array_equal(l1, l2)


def test_unsupported_dtype_is_a_clear_error():
    x = cp.zeros((1, 8, 1, 32), cp.int32)  # float32 and float64 have kernels of their own (flash_*_wide.cu)
    with pytest.raises(TypeError, match="int32"):
        cuflash.attention(x, x, x)


def test_warmup_compiles_with_progress(capsys):
    from cuflash.backends import cuda

    specs = cuda.warmup(dtypes=("float16",), head_dims=(64, 128))
    assert len(specs) == 2 and "done" in capsys.readouterr().err


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_current_stream(seed):
    case = make_case(1, 129, 129, 2, 2, 64, np.float16, seed=seed % 1000)
    with cp.cuda.Stream(non_blocking=True) as stream:
        out, lse = cuflash.attention(cp.asarray(case.q), cp.asarray(case.k), cp.asarray(case.v), return_lse=True)
        stream.synchronize()
    check_forward(lambda *a, **o: (out, lse), case)


def test_params_layout_on_the_device():
    """NVRTC cannot check offsets at compile time (no offsetof constant expression there): a kernel reads
    the address of every field of the params struct and the offsets must be the NumPy dtype's."""
    from cuflash.backends.cuda import KERNEL_OPTIONS
    from cuflash.cuda import params
    from cuflash.cuda.source import KERNELS_DIR, inline_includes

    fields = [(path, offset) for path, offset, _ in params._members(params.PARAMS)]
    body = "\n".join(f"  out[{i}] = (const char*)&p.{path} - (const char*)&p;" for i, (path, _) in enumerate(fields))
    source = (inline_includes(KERNELS_DIR / "params.cuh") +
              f'\nextern "C" __global__ void layout(const __grid_constant__ cuflash::Params p, long long* out) {{\n'
              f"{body}\n  out[{len(fields)}] = sizeof(cuflash::Params);\n}}\n")
    out = cp.zeros(len(fields) + 1, dtype=np.int64)
    module = cp.RawModule(code=source, options=KERNEL_OPTIONS, name_expressions=("layout",))
    module.get_function("layout")((1,), (1,), (params.pack(), out))
    got = cp.asnumpy(out)
    assert list(got[:-1]) == [offset for _, offset in fields] and got[-1] == params.PARAMS.itemsize


def test_kvcache_call_that_raises_after_the_append_leaves_the_caches_as_they_were(monkeypatch):
    """The CUDA backend appends k_new/v_new into the CuPy caches before its kernels run (they read the new keys from
    there): a launch that raises (here: the first one) writes the slots' old contents back, on the device."""
    from cuflash.backends import cuda

    def interrupted(*_):
        raise KeyboardInterrupt

    rng = np.random.default_rng(0)
    q, k_new, v_new = (cp.asarray(rng.standard_normal((2, 1, 4, 64)).astype(np.float16)) for _ in range(3))
    k_cache, v_cache = (cp.asarray(rng.standard_normal((2, 40, 4, 64)).astype(np.float16)) for _ in range(2))
    before = k_cache.copy(), v_cache.copy()
    monkeypatch.setattr(cuda, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cp.asarray([3, 39], cp.int32),
                                       k_new=k_new, v_new=v_new)
    assert cp.array_equal(k_cache, before[0]) and cp.array_equal(v_cache, before[1])
    monkeypatch.undo()  # and the same call, let run, appends
    cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cp.asarray([3, 39], cp.int32), k_new=k_new,
                                   v_new=v_new)
    assert cp.array_equal(k_cache[0, 3], k_new[0, 0]) and cp.array_equal(v_cache[1, 39], v_new[1, 0])
