"""The ``cuda`` backend's Python code path without a GPU: CuPy replaced by tests/fake_cupy.py, kernels run by the
CPU emulator.

Everything in cuflash/backends/cuda.py that does not need hardware runs here: device and capability queries,
``available()`` (no CuPy, no device, no driver, sm_75, a broken compiler, several devices), the per-device compile
cache (``cupy.memoize``) and its shared-memory opt-in, the params struct (null and device pointers), the current
stream, ``warmup()``, the forward and the backward in both ``deterministic`` modes, with dropout, GQA,
BlockMask, seqlens, padded odd head dims, strided and misaligned inputs, and bfloat16 both as ``ml_dtypes`` arrays
and as ``uint16`` bits with ``dtype="bfloat16"``, all through the public API and held to the float64 reference by
the 2x/3x same-dtype rule. The fake enforces what CuPy and CUDA would (see its docstring), so a launch the backend
gets wrong fails here as it would on a GPU.
"""
import io
import re
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cuflash
from cuflash import backends, emulate
from cuflash.backends import cuda
from cuflash.cuda import specs
from cuflash.cuda.compile import KERNEL_OPTIONS
from cuflash.cuda.source import kernel_source
from cuflash.cuda.specs import KernelSpec
from cuflash.testing import Case, assert_attention_close, attention_cases, check_forward

import cases
import fake_cupy
from cases import bf16, feature_cases, make_case

_ok, _why = emulate.available()
pytestmark = [pytest.mark.emulate, pytest.mark.skipif(not _ok, reason=f"CPU emulation unavailable: {_why}")]

try:
    import ml_dtypes  # noqa: F401

    HAVE_BF16 = True
except ImportError:
    HAVE_BF16 = False
needs_bf16 = pytest.mark.skipif(not HAVE_BF16, reason="ml_dtypes not installed")

FEATURES = dict(feature_cases())


# ------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def make_fake(monkeypatch):
    """``make_fake(gpus, **kw)``: a fresh fake CuPy in sys.modules["cupy"] (removed after the test), with the
    cuda backend's device and kernel caches emptied (and restored after) so that nothing leaks between fakes."""

    def build(*args, **kw):
        fake = fake_cupy.install(monkeypatch, fake_cupy.make(*args, **kw))
        cuda._memoized.cache_clear()  # the memoized functions belong to the previous fake
        return fake

    yield build
    cuda._memoized.cache_clear()


@pytest.fixture
def cp(make_fake):
    """One fake H100 (sm_90, 227 KiB of opt-in shared memory per block)."""
    return make_fake()


def on_device(cp, options):
    """The case's options with seqlens moved to the device (as a CuPy user would pass them)."""
    return {k: (cp.asarray(v) if k.startswith("seqlens") else v) for k, v in options.items()}


def gpu_forward(cp):
    """``fn(q, k, v, **options) -> (out, lse)`` through cuflash.attention on fake device arrays; host results."""

    def fn(q, k, v, **options):
        out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True,
                                     **on_device(cp, options))
        assert isinstance(out, cp.ndarray) and isinstance(lse, cp.ndarray)
        assert out.dtype == q.dtype and lse.dtype == np.float32 and out.shape == q.shape
        return out.get(), lse.get()

    return fn


def gpu_backward(cp, deterministic):
    """``fn(dout, q, k, v, out, lse, **options) -> (dq, dk, dv)`` through cuflash.attention_backward."""

    def fn(dout, q, k, v, out, lse, **options):
        grads = cuflash.attention_backward(*(cp.asarray(a) for a in (dout, q, k, v, out, lse)),
                                           deterministic=deterministic, **on_device(cp, options))
        assert all(isinstance(g, cp.ndarray) for g in grads)
        return tuple(g.get() for g in grads)

    return fn


def names(launches):
    """The launched kernels' names without the modifier struct (a BlockMask compiles one in: its own name)."""
    return [re.sub(r", cuflash::(NoMods|Mods_[0-9a-f]+)>$", ">", launch.name) for launch in launches]


def bwd_names(dtype, d, deterministic, max_smem=227 * 1024, cc=90):
    main, dq = specs.select("bwd", dtype, d, max_smem, cc=cc), specs.select("dq", dtype, d, max_smem, cc=cc)
    preprocess, convert = specs.helper_names(dtype)
    return names(type("L", (), {"name": n}) for n in (preprocess, main.name_expression,
                                                         dq.name_expression if deterministic else convert))


def modules(cp):
    """The RawModules built for kernels (not the one available() compiles to probe the compiler)."""
    return [m for m in cp._modules if m.code != cuda.PROBE]


def function(spec, module=None):
    """The memoized compiled kernel of ``spec`` on the current device (compiling it on a miss)."""
    return cuda._memoized()[1](kernel_source(spec.source), module or (spec.name_expression,), spec.name_expression,
                               spec.smem_bytes)


def pointer(launch, field):
    """The device address a launch's params struct holds in ``field`` ("q", "mask.tile_lists", ...)."""
    plain = ("lse", "seqlens_q", "cu_seqlens_q", "cu_seqlens_k")  # pointer fields, not TensorArgs
    value = fake_cupy._field(launch.args[0], field if field in plain or "." in field else field + ".ptr")
    return int(value)


def inside(address, array):
    base = array._a.ctypes.data
    return base <= address < base + array._a.nbytes


# ------------------------------------------------------------------------------------------------
# available(): CuPy, devices, drivers, compute capability
# ------------------------------------------------------------------------------------------------
def test_available_on_a_supported_gpu(cp):
    ok, why = cuda.available()
    assert ok and why == f"CuPy {fake_cupy.__version__}, NVRTC 12.9, sm_90"
    assert backends.status()["cuda"] == (True, why)


def test_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    ok, why = cuda.available()
    assert not ok and why.startswith("CuPy is not installed") and "cuflash[cuda12]" in why
    x = np.zeros((1, 8, 1, 32), np.float16)
    with pytest.raises(RuntimeError, match="backend 'cuda' is not available: CuPy is not installed"):
        cuflash.attention(x, x, x, backend="cuda")


def test_broken_compiler_makes_the_backend_unavailable(make_fake):
    """CuPy installed and a GPU present, but NVRTC cannot compile (no CUDA headers, an NVRTC newer than the
    driver): available() says so and how to fix it, instead of a failure at the first attention call."""
    cp = make_fake(compile_error='kern.cu(2): catastrophic error: cannot open source file "cuda_fp16.h"')
    ok, why = cuda.available()
    assert not ok and "CuPy cannot compile and load a kernel (CompileException: kern.cu(2)" in why
    assert "cuflash[cuda12]" in why and "nvidia-smi" in why
    x = cp.zeros((1, 8, 1, 32), cp.float16)
    with pytest.raises(RuntimeError, match="backend 'cuda' is not available: CuPy cannot compile"):
        cuflash.attention(x, x, x)


def test_without_device(make_fake):
    make_fake(())
    assert cuda.available() == (False, "no CUDA device")


def test_without_driver(make_fake):
    make_fake(device_count_error="cudaErrorInsufficientDriver: CUDA driver version is insufficient")
    ok, why = cuda.available()
    assert not ok and why.startswith("no usable CUDA device (cudaErrorInsufficientDriver")


def test_compute_capability_below_8_is_refused(make_fake):
    cp = make_fake([fake_cupy.H100, fake_cupy.T4])
    assert cuda.available()[0]
    with cp.cuda.Device(1):
        ok, why = cuda.available()
        assert not ok
        assert why.startswith("compute capability 7.5 is not supported: the kernels need 8.0 or newer")
        x = cp.zeros((1, 8, 1, 32), cp.float16)
        with pytest.raises(RuntimeError, match="backend 'cuda' is not available: compute capability 7.5 is not"):
            cuflash.attention(x, x, x)
        with pytest.raises(RuntimeError, match="cannot warm up the CUDA kernels: compute capability 7.5"):
            cuda.warmup(progress=False)
        assert backends.status()["cuda"] == (False, why)
    assert cuda.available()[0]  # device 0 is still fine: capabilities are cached per device
    assert modules(cp) == [] and cp._launches == []


def test_device_query_is_cached_per_device(make_fake):
    cp = make_fake([fake_cupy.H100, fake_cupy.RTX_4090, fake_cupy.Gpu("86", None), fake_cupy.Gpu("87", None)])
    assert cuda._device() == (0, 90, 227 * 1024)
    cuda._device()
    assert cp._attribute_reads == 1
    with cp.cuda.Device(1):
        assert cuda._device() == (1, 89, 99 * 1024)
    with cp.cuda.Device(2):  # no opt-in attribute reported: the table's value for the architecture
        assert cuda._device() == (2, 86, specs.SMEM_LIMIT[86])
    with cp.cuda.Device(3):  # an architecture the table does not know: the 48 KiB every GPU allows
        assert cuda._device() == (3, 87, 48 * 1024)
    assert cuda._device() == (0, 90, 227 * 1024) and cp._attribute_reads == 4
    # the SM count of the split-KV heuristic comes with them: each KV-cache call asked the driver again
    assert [cuda._sm_count() for _ in range(3)] == [132] * 3 and cp._attribute_reads == 4


def test_params_struct_holds_null_and_device_pointers(cp):
    """No seqlens, no BlockMask, no dQ workspace (forward): null pointers in the struct; every other pointer is
    the device address of the array the kernel reads or writes."""
    case = FEATURES["gqa_mqa"]
    q, k, v = (cp.asarray(a) for a in (case.q, case.k, case.v))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    launch = cp._launches[-1]
    assert all(pointer(launch, f) == 0 for f in ("seqlens_q", "mask.tile_counts", "mask.tile_lists", "dq_accum", "dout"))
    assert inside(pointer(launch, "q"), q) and inside(pointer(launch, "k"), k) and inside(pointer(launch, "o"), out)
    assert inside(pointer(launch, "lse"), lse)


# ------------------------------------------------------------------------------------------------
# The fake holds launches to CUDA's rules (so that the tests below mean something)
# ------------------------------------------------------------------------------------------------
def test_fake_enforces_cuda_rules(cp):
    spec = specs.select("fwd", "float16", 128)  # 70 KB of shared memory
    module = cp.RawModule(code=kernel_source(spec.source), options=KERNEL_OPTIONS,
                          name_expressions=(spec.name_expression,))
    fn = module.get_function(spec.name_expression)
    x = cp.zeros((1, 8, 1, 64), cp.float16)
    p = cuflash.cuda.params.pack(q=x)
    with pytest.raises(fake_cupy.CUDAError, match="named symbol not found"):
        module.get_function(specs.select("fwd", "float16", 64).name_expression)
    with pytest.raises(TypeError, match="tuple"):
        cp.RawModule(code=kernel_source(spec.source), options=list(KERNEL_OPTIONS),
                     name_expressions=(spec.name_expression,))
    with pytest.raises(fake_cupy.CUDAError, match="max_dynamic_shared_size_bytes"):
        fn((1, 1, 1), (256, 1, 1), (p,), shared_mem=spec.smem_bytes)
    with pytest.raises(fake_cupy.CUDAError, match="opt-in limit"):
        fn.max_dynamic_shared_size_bytes = 228 * 1024
    with pytest.raises(TypeError, match="expected tuple"):
        fn([1, 1, 1], (256, 1, 1), (p,))
    with pytest.raises(fake_cupy.CUDAError, match="limits"):
        fn((1, 65536, 1), (256, 1, 1), (p,))
    with pytest.raises(fake_cupy.CUDAError, match="empty dimension"):
        fn((0, 1, 1), (256, 1, 1), (p,))
    with pytest.raises(fake_cupy.CUDAError, match="1024 threads"):
        fn((1, 1, 1), (1024, 2, 1), (p,))
    with pytest.raises(TypeError, match="np.uint64"):
        fn((1, 1, 1), (256, 1, 1), (x, None))
    with pytest.raises(TypeError, match="host array"):
        fn((1, 1, 1), (256, 1, 1), (np.zeros(2, np.int32),))
    host = np.zeros((1, 8, 1, 64), np.float16)
    with pytest.raises(fake_cupy.CUDAError, match="field q.ptr = .* is not device memory"):
        fn((1, 1, 1), (256, 1, 1), (cuflash.cuda.params.pack(q=host),))
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    assert cp._launches == []


# ------------------------------------------------------------------------------------------------
# Forward: every feature case, fp16 (GQA, causal, windows, seqlens, BlockMask, odd head dims, scales)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_forward_feature(cp, name):
    case = FEATURES[name]
    check_forward(gpu_forward(cp), case)
    spec = specs.select("fwd", "float16", case.q.shape[-1], 227 * 1024, cc=90)
    assert names(cp._launches) == names([type("L", (), {"name": spec.name_expression})])
    launch = cp._launches[0]
    assert launch.stream is cp.cuda.Stream.null and launch.device == 0
    assert launch.block == (spec.threads, 1, 1) and launch.shared_mem == spec.smem_bytes


def test_seqlens_as_host_arrays(cp):
    """seqlens may be NumPy arrays next to CuPy q, k, v: they are moved to the device (a host pointer would
    be refused by the fake, as CuPy refuses or mis-passes it)."""
    case = FEATURES["seqlens"]
    check_forward(lambda q, k, v, **o: _host_seqlens(cp, q, k, v, **o), case)


def _host_seqlens(cp, q, k, v, **options):
    out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True, **options)
    return out.get(), lse.get()


def test_unsupported_dtype_is_a_clear_error(cp):
    # every floating dtype has kernels now (float32/float64: tests/test_cuda_backend_fake_wide.py); an integer array
    # is refused before any compilation
    x = cp.zeros((1, 8, 1, 32), cp.int32)
    with pytest.raises(TypeError, match="must be floating point"):
        cuflash.attention(x, x, x)
    assert modules(cp) == []


def test_strided_inputs_in_place_and_misaligned_inputs_copied(cp):
    rng = np.random.default_rng(0)
    qkv = cp.asarray(rng.standard_normal((1, 100, 3, 2, 64)).astype(np.float16))  # a fused projection
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    check_forward(lambda *a, **o: (out, lse), Case(q.get(), k.get(), v.get(), None, {"causal": True}))
    assert all(inside(pointer(cp._launches[-1], f), qkv) for f in "qkv")  # 16-byte aligned strides: read in place

    big = cp.asarray(rng.standard_normal((1, 90, 2, 65)).astype(np.float16))
    q = big[..., 1:]  # head_dim 64, but 2 bytes off alignment and 130-byte rows
    out, lse = cuflash.attention(q, q, q, return_lse=True)
    host = q.get()
    check_forward(lambda *a, **o: (out, lse), Case(host, host, host, None, {}))
    assert not any(inside(pointer(cp._launches[-1], f), big) for f in "qkv")  # copied to aligned buffers


def test_empty_problems_launch_nothing(cp):
    q = cp.zeros((2, 0, 2, 40), cp.float16)
    k = cp.zeros((2, 5, 2, 40), cp.float16)
    out, lse = cuflash.attention(q, k, k, return_lse=True)
    assert out.shape == (2, 0, 2, 40) and lse.shape == (2, 2, 0) and cp._launches == []

    q = cp.asarray(np.ones((1, 4, 2, 40), np.float16))
    k = cp.zeros((1, 0, 1, 40), cp.float16)
    out, lse = cuflash.attention(q, k, k, return_lse=True)  # no keys: out 0, lse -inf
    assert (out.get() == 0).all() and np.isneginf(lse.get()).all()
    n = len(cp._launches)
    dq, dk, dv = cuflash.attention_backward(q, q, k, k, out, lse)
    assert len(cp._launches) == n  # nothing to compute
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and (dq.get() == 0).all()


# ------------------------------------------------------------------------------------------------
# Backward: both dQ modes, features, dropout
# ------------------------------------------------------------------------------------------------
BWD_FEATURES = ("gqa_mqa", "seqlens", "odd_head_dim_59", "window", "blockmask_finer_than_tile",
                "blockmask_straddling")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("name", BWD_FEATURES)
def test_backward_feature(cp, name, deterministic):
    case = FEATURES[name]
    out, lse = gpu_forward(cp)(case.q, case.k, case.v, **case.options)
    n = len(cp._launches)
    dq, dk, dv = cases.check_backward(gpu_backward(cp, deterministic), case, out, lse)
    assert dq.dtype == dk.dtype == dv.dtype == np.float16
    assert names(cp._launches[n:]) == bwd_names("float16", case.q.shape[-1], deterministic)
    main = specs.select("bwd", "float16", case.q.shape[-1], 227 * 1024, cc=90)
    assert cp._launches[n + 1].shared_mem == main.smem_bytes and cp._launches[n + 1].block == (main.threads, 1, 1)


def test_deterministic_mode_is_bitwise_reproducible(cp):
    case = make_case(1, 100, 90, 4, 2, 64, np.float16, causal=True)
    out, lse = gpu_forward(cp)(case.q, case.k, case.v, causal=True)
    runs = [gpu_backward(cp, True)(case.dout, case.q, case.k, case.v, out, lse, causal=True) for _ in range(2)]
    for a, b in zip(*runs):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_dropout_forward_and_backward(cp, deterministic):
    from cuflash import testing

    case = make_case(2, 70, 90, 4, 2, 40, np.float16, causal=True, dropout_p=0.3,
                     seqlens_q=np.array([70, 33], np.int32), seqlens_k=np.array([90, 51], np.int32))
    case.options["seed"] = 2**40 + 12345  # both halves of the 64-bit seed matter
    out, lse = check_forward(gpu_forward(cp), case)
    testing.check_backward(gpu_backward(cp, deterministic), case, out, lse)


def test_vjp_with_a_drawn_dropout_seed(cp):
    from cuflash import testing

    case = make_case(1, 64, 64, 2, 1, 32, np.float16)
    out, vjp = cuflash.attention_vjp(*(cp.asarray(a) for a in (case.q, case.k, case.v)), dropout_p=0.25,
                                     deterministic=True)
    grads = vjp(cp.asarray(case.dout))
    assert isinstance(vjp.seed, int)
    case.options = {"dropout_p": 0.25, "seed": vjp.seed}  # the drawn seed reproduces the forward
    out_again, lse = check_forward(gpu_forward(cp), case)
    assert np.array_equal(out.get(), out_again)
    testing.check_backward(lambda *a, **o: tuple(g.get() for g in grads), case, out_again, lse)


def test_the_device_fingerprint_sees_every_change_and_reads_back_once(cp, monkeypatch):
    """A CuPy array's fingerprint (what proves a residual's arrays unchanged): an odd byte count (a bool mask of
    3 elements could not be viewed as 16-bit words), every chunk weighted, and one read-back however many chunks."""
    from cuflash import residual

    monkeypatch.setattr(residual, "_CHUNK", 4)
    reads = []
    real_get = cp.ndarray.get
    monkeypatch.setattr(cp.ndarray, "get", lambda self, *a, **k: reads.append(1) or real_get(self, *a, **k))
    for host in (np.array([True, False, True]), np.arange(11, dtype=np.float32), np.arange(7, dtype=np.int8)):
        a = cp.asarray(host)
        reads.clear()
        before = residual.fingerprint(a)
        assert reads == [1]
        for i in range(host.size):  # an edit anywhere, in every chunk, changes it
            changed = host.copy()
            changed[i] = not changed[i] if host.dtype == bool else changed[i] + 1
            assert residual.fingerprint(cp.asarray(changed)) != before, (host.dtype, i)
        assert residual.fingerprint(cp.asarray(host)) == before
        assert residual.fingerprint(cp.asarray(np.roll(host, 1))) != before  # the same values, moved


def test_the_device_fingerprint_sees_a_one_bit_change_in_a_large_array(cp):
    """The lowest bit of one float16 among 2 Mi (two chunks): a float64 weighted sum of the 16-bit words lost it
    below half an ulp of its total; the sum modulo 2**64 with odd weights cannot."""
    from cuflash import residual

    host = np.random.default_rng(3).standard_normal(1 << 21).astype(np.float16)
    before = residual.fingerprint(cp.asarray(host))
    for i in (0, 12345, (1 << 20) + 7, (1 << 21) - 1):
        changed = host.copy()
        changed.view(np.uint16)[i] ^= 1
        assert residual.fingerprint(cp.asarray(changed)) != before, i
    halves = np.concatenate([host[1 << 20:], host[:1 << 20]])  # the two chunks swapped
    assert residual.fingerprint(cp.asarray(halves)) != before


def test_several_batch_dimensions(cp):
    """(2, 3) batch dimensions: flattened for the kernels by CuPy reshapes, unflattened in the results;
    seqlens of the batch shape."""
    rng = np.random.default_rng(7)
    q, k, v, dout = (rng.standard_normal((2, 3) + s).astype(np.float16)
                     for s in ((45, 4, 40), (60, 2, 40), (60, 2, 40), (45, 4, 40)))
    case = Case(q, k, v, dout, {"causal": True, "seqlens_q": rng.integers(0, 46, (2, 3)).astype(np.int32),
                                "seqlens_k": rng.integers(0, 61, (2, 3)).astype(np.int32)})
    out, lse = check_forward(gpu_forward(cp), case)
    assert lse.shape == (2, 3, 4, 45)
    dq, dk, dv = cases.check_backward(gpu_backward(cp, False), case, out, lse)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert cp._launches[0].grid == (1, 4, 6)  # one query tile, 4 heads, 6 flattened sequences


@settings(max_examples=max(6, settings.default.max_examples // 3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(attention_cases(dtypes=("float16", "bfloat16") if HAVE_BF16 else ("float16",), max_seqlen=90,
                       head_dims=(8, 40, 59, 64), block_sizes=(16, 32, 64), dropout=True))
def test_hypothesis(cp, case):
    """The shared strategies (GQA, causal, windows, seqlens, BlockMask, batch dims, dropout) through the fake."""
    from cuflash import testing

    out, lse = check_forward(gpu_forward(cp), case)
    check = testing.check_backward if case.options.get("dropout_p") else cases.check_backward
    check(gpu_backward(cp, deterministic=bool(case.q.shape[-1] % 2)), case, out, lse)


# ------------------------------------------------------------------------------------------------
# bfloat16: ml_dtypes arrays, and uint16 bits with dtype="bfloat16" (a CuPy without bfloat16)
# ------------------------------------------------------------------------------------------------
@needs_bf16
@pytest.mark.parametrize("name", ["causal_long_q", "odd_head_dim_59", "blockmask_straddling"])
def test_bf16_ml_dtypes(cp, name):
    case = FEATURES[name]
    case = Case(*(a.astype(bf16()) for a in (case.q, case.k, case.v, case.dout)), options=case.options)
    out, lse = check_forward(gpu_forward(cp), case)
    assert out.dtype == bf16()
    dq, dk, dv = cases.check_backward(gpu_backward(cp, name == "odd_head_dim_59"), case, out, lse)
    assert dq.dtype == bf16()


@needs_bf16
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_bf16_as_uint16_bits(make_fake, deterministic):
    """dtype="bfloat16" over uint16 arrays through the public API, on a CuPy that refuses ml_dtypes.bfloat16:
    uint16 bits out, held to the bf16 rule, and bit-identical to the ml_dtypes path."""
    case = make_case(2, 90, 70, 4, 1, 59, bf16(), causal=True, window=(40, None),
                     seqlens_q=np.array([90, 41], np.int32), seqlens_k=np.array([70, 65], np.int32))
    cp = make_fake()  # with bfloat16 support: the ml_dtypes path, for comparison
    want = gpu_forward(cp)(case.q, case.k, case.v, **case.options)
    want_grads = gpu_backward(cp, deterministic)(case.dout, case.q, case.k, case.v, *want, **case.options)

    cp = make_fake(bf16=False)
    with pytest.raises(ValueError, match="Unsupported dtype bfloat16"):
        cp.asarray(case.q)
    bits = lambda a: cp.asarray(a.view(np.uint16))  # noqa: E731
    q, k, v, dout = (bits(a) for a in (case.q, case.k, case.v, case.dout))
    opts = on_device(cp, case.options)
    out, lse = cuflash.attention(q, k, v, return_lse=True, dtype="bfloat16", **opts)
    assert out.dtype == np.uint16 and lse.dtype == np.float32
    host_out = out.get().view(bf16())
    check_forward(lambda *a, **o: (host_out, lse.get()), case)
    assert np.array_equal(out.get(), want[0].view(np.uint16)) and np.array_equal(lse.get(), want[1])

    grads = cuflash.attention_backward(dout, q, k, v, out, lse, dtype="bfloat16", deterministic=deterministic, **opts)
    assert all(g.dtype == np.uint16 for g in grads)
    host_grads = tuple(g.get().view(bf16()) for g in grads)
    cases.check_backward(lambda *a, **o: host_grads, case, host_out, lse.get())
    if deterministic:  # the atomic dQ may differ in its last bits from run to run; dK, dV never do
        assert np.array_equal(host_grads[0].view(np.uint16), want_grads[0].view(np.uint16))
    for g, w in zip(host_grads[1:], want_grads[1:]):
        assert np.array_equal(g.view(np.uint16), w.view(np.uint16))
    with pytest.raises(TypeError, match="uint16 bfloat16 bits with dtype='bfloat16'"):  # uint16 alone is no float
        cuflash.attention(q, k, v)


# ------------------------------------------------------------------------------------------------
# Streams, compile caches, shared-memory opt-in, several devices, warmup
# ------------------------------------------------------------------------------------------------
def test_launches_go_to_the_current_stream(cp):
    case = make_case(1, 70, 70, 2, 2, 64, np.float16)
    q, k, v, dout = (cp.asarray(a) for a in (case.q, case.k, case.v, case.dout))
    with cp.cuda.Stream(non_blocking=True) as stream:
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        cuflash.attention_backward(dout, q, k, v, out, lse)
        stream.synchronize()
    assert len(cp._launches) == 4 and all(launch.stream is stream for launch in cp._launches)
    assert cp._syncs == 1  # the backend itself never synchronizes
    cuflash.attention(q, k, v)
    assert cp._launches[-1].stream is cp.cuda.Stream.null


def test_compile_cache_and_shared_memory_opt_in(cp):
    case = make_case(1, 40, 50, 2, 1, 128, np.float16, causal=True)
    q, k, v, dout = (cp.asarray(a) for a in (case.q, case.k, case.v, case.dout))
    for _ in range(2):
        out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True)
        for deterministic in (False, True):
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
    assert len(cp._launches) == 2 * (1 + 3 + 3)
    fwd = specs.select("fwd", "float16", 128, 227 * 1024, cc=90)
    main, dq_spec = (specs.select("bwd", "float16", 128, 227 * 1024, cc=90),
                     specs.select("dq", "float16", 128, 227 * 1024, cc=90))
    module = (*specs.helper_names("float16"), main.name_expression, dq_spec.name_expression)
    # one forward module, one backward module holding all four kernels (both dQ modes share it)
    fwd_module, bwd_module = modules(cp)
    assert fwd_module.name_expressions == specs.forward_module(fwd, "float16")
    assert fwd_module.code == kernel_source(fwd.source)
    assert bwd_module.name_expressions == module and bwd_module.code == kernel_source(main.source)
    assert fwd_module.options == bwd_module.options == KERNEL_OPTIONS
    # every kernel above 48 KiB opted in to exactly what it launches with; the small helpers did not
    assert fwd.smem_bytes > 48 * 1024
    assert function(fwd, specs.forward_module(fwd, "float16")).max_dynamic_shared_size_bytes == fwd.smem_bytes
    for s in (main, dq_spec):
        assert s.smem_bytes > 48 * 1024 and function(s, module).max_dynamic_shared_size_bytes == s.smem_bytes
    preprocess = cuda._memoized()[1](kernel_source(main.source), module, module[0], 0)
    assert preprocess.max_dynamic_shared_size_bytes == 48 * 1024
    assert len(modules(cp)) == 2  # the lookups above were cache hits


def test_arrays_on_another_gpu_are_refused_before_anything_is_done_with_them(make_fake):
    """The current-device check ran in the backend, after work on the arrays: a v with a head dim of its own was
    padded on the current GPU first (a cross-device copy, or CuPy's peer-access error naming nothing), a float64
    bias was cast and tested there, and a current GPU the kernels cannot use said "backend 'cuda' is not available"
    for arrays on one they can. Now the first array's GPU is checked as the call begins."""
    cp = make_fake([fake_cupy.H100, fake_cupy.T4])
    rng = np.random.default_rng(0)
    q, v = rng.standard_normal((1, 20, 2, 40)).astype(np.float16), rng.standard_normal((1, 20, 2, 72)).astype(np.float16)
    with cp.cuda.Device(1):
        on1 = cp.asarray(q), cp.asarray(v), cp.asarray(rng.standard_normal((2, 20, 20)))  # q, v, a float64 bias
    with cp.cuda.Device(0):
        on0 = cp.asarray(q), cp.asarray(v)
    n, allocated = len(cp._launches), len(cp._allocations)
    with pytest.raises(ValueError, match=r"q is on GPU 1 but the current device is GPU 0: .*Device\(1\)"):
        cuflash.attention(on1[0], on1[0], on1[1])
    with pytest.raises(ValueError, match=r"q is on GPU 1 but the current device is GPU 0"):
        cuflash.attention(on1[0], on1[0], on1[0], bias=on1[2])
    with cp.cuda.Device(1), pytest.raises(ValueError, match=r"q is on GPU 0 but the current device is GPU 1"):
        cuflash.attention(on0[0], on0[0], on0[1])  # GPU 1 is a T4: not "backend 'cuda' is not available"
    assert len(cp._launches) == n and len(cp._allocations) == allocated  # nothing padded, cast or launched


def test_small_kernels_do_not_opt_in(cp):
    spec = specs.select("fwd", "float16", 64, 227 * 1024, cc=90)
    assert spec.smem_bytes <= 48 * 1024
    assert function(spec).max_dynamic_shared_size_bytes == 48 * 1024


def test_each_device_compiles_and_opts_in_for_itself(make_fake):
    cp = make_fake([fake_cupy.H100, fake_cupy.A100])
    case = make_case(1, 50, 50, 2, 2, 128, np.float16)
    results = []
    for dev in (0, 1):
        with cp.cuda.Device(dev):
            out, lse = gpu_forward(cp)(case.q, case.k, case.v)
            results.append(out)
    assert [m.device for m in modules(cp)] == [0, 1] and [launch.device for launch in cp._launches] == [0, 1]
    assert np.array_equal(results[0].view(np.uint16), results[1].view(np.uint16))
    q, k, v, dout = (cp.asarray(a) for a in (case.q, case.k, case.v, case.dout))  # on device 0
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    n = len(cp._launches)
    with cp.cuda.Device(1):  # another GPU's memory would be an illegal address to the kernels
        with pytest.raises(ValueError, match=r"q is on GPU 0 but the current device is GPU 1: .*Device\(0\)"):
            cuflash.attention(q, k, v)
        q1, k1, v1 = (cp.asarray(a) for a in (case.q, case.k, case.v))
        with pytest.raises(ValueError, match="dout is on GPU 0 but the current device is GPU 1"):
            cuflash.attention_backward(dout, q1, k1, v1, out, lse)
    assert len(cp._launches) == n
    spec = specs.select("fwd", "float16", 128)
    with cp.cuda.Device(1), pytest.raises(fake_cupy.CUDAError, match="points into device 0's memory"):
        function(spec)((1, 1, 1), (256, 1, 1), (cuflash.cuda.params.pack(q=q),))  # the fake's own guard


def test_smaller_shared_memory_gpu(make_fake):
    """An sm_89 GPU (99 KiB per block): the small-memory tiles, and clear errors where none fits."""
    cp = make_fake([fake_cupy.RTX_4090])
    spec = specs.select("fwd", "float16", 192, 99 * 1024)
    assert spec.smem_bytes <= 99 * 1024 < specs.select("fwd", "float16", 192).smem_bytes
    case = make_case(1, 40, 40, 1, 1, 192, np.float16)
    check_forward(gpu_forward(cp), case)
    assert cp._launches[-1].name == spec.name_expression and cp._launches[-1].shared_mem == spec.smem_bytes
    n = len(modules(cp))
    big = specs.select("fwd", "float16", 192)  # the A100/H100 tile: 100 KB
    with pytest.raises(ValueError, match="needs 102400 bytes of shared memory; this GPU allows 101376"):
        cuflash.backends.cuda.forward(cuflash.problem.make_problem(*(cp.asarray(a) for a in (case.q, case.k,
                                                                                           case.v))), spec=big)
    assert len(modules(cp)) == n  # refused before compiling anything
    x = cp.zeros((1, 8, 1, 256), cp.float16)
    lse = cp.zeros((1, 1, 8), cp.float32)
    with pytest.raises(ValueError, match="head_dim 256 needs an A100/H100-class GPU"):
        cuflash.attention_backward(x, x, x, x, x, lse)


def test_warmup_compiles_once(cp):
    err = io.StringIO()
    done = cuda.warmup(dtypes=(np.float16, "bfloat16"), head_dims=(59, 64, 128), file=err)
    want = [specs.select("fwd", dt, d, 227 * 1024, cc=90) for dt in ("float16", "bfloat16") for d in (64, 128)]
    assert done == want
    # the module every forward call of the spec builds, a split KV-cache call's too (it compiled once more)
    assert [m.name_expressions for m in modules(cp)] == [specs.forward_module(s, s.dtype) for s in want]
    assert "4/4 done" in err.getvalue() and "cuflash warmup [" in err.getvalue()
    for s in want:
        assert function(s, specs.forward_module(s, s.dtype)).max_dynamic_shared_size_bytes == max(s.smem_bytes,
                                                                                                   48 * 1024)
    quiet = io.StringIO()
    assert cuda.warmup(dtypes=(np.float16, "bfloat16"), head_dims=(59, 64, 128), progress=False, file=quiet) == want
    assert len(modules(cp)) == 4 and quiet.getvalue() == ""  # the second call compiles nothing
    # the first real call finds its kernel compiled
    case = make_case(1, 30, 30, 1, 1, 128, np.float16)
    check_forward(gpu_forward(cp), case)
    assert len(modules(cp)) == 4 and len(cp._launches) == 1
    # and a split KV-cache call at that head dim (the combine is in the module): no compile either
    caches = [cp.asarray(np.zeros((1, 300, 1, 128), np.float16)) for _ in range(2)]
    cuflash.attention_with_kvcache(cp.asarray(case.q[:, :1]), *caches, cache_seqlens=cp.asarray(np.array([300],
                                   np.int32)), num_splits=2)
    assert len(modules(cp)) == 4 and len(cp._launches) == 3  # the forward's split and the combine
    # the default: every native head dim in both dtypes
    all_specs = cuda.warmup(progress=False)
    assert len(all_specs) == 2 * len(specs.NATIVE_HEAD_DIMS) and len(modules(cp)) == len(all_specs)
    assert cp._launches[0].name == want[1].name_expression


def test_warmup_on_threads_compiles_the_same_modules_once(cp):
    done = cuda.warmup(dtypes=("float16", "bfloat16"), head_dims=(64, 96, 128), backward=True, progress=False,
                       workers=4)
    compiled = [m.name_expressions for m in modules(cp)]
    assert len(compiled) == len(done) == 12 and len(set(compiled)) == 12  # each module compiled once
    assert cuda.warmup(dtypes=("float16", "bfloat16"), head_dims=(64, 96, 128), backward=True, progress=False,
                       workers=4) == done
    assert len(modules(cp)) == 12
    for bad, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="workers must be a positive int"):
            cuda.warmup(workers=bad)


def test_warmup_backward_compiles_each_backward_family_once(cp):
    done = cuda.warmup(dtypes=("float16",), head_dims=(59, 64, 128), backward=True, progress=False)
    fwd = [specs.select("fwd", "float16", d, 227 * 1024, cc=90) for d in (64, 128)]
    bwd = [(specs.select("bwd", "float16", d, 227 * 1024, cc=90),
            specs.select("dq", "float16", d, 227 * 1024, cc=90))
           for d in (64, 128)]
    assert done == [fwd[0], bwd[0], fwd[1], bwd[1]]
    assert len(modules(cp)) == 4  # two forward specs, two backward families (each one RawModule of 4 kernels)
    assert cuda.warmup(dtypes=("float16",), head_dims=(59, 64, 128), backward=True, progress=False) == done
    assert len(modules(cp)) == 4  # the second call compiles nothing


# ------------------------------------------------------------------------------------------------
# Ragged batches (varlen): the kernels read cu_seqlens on the device
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen_forward_and_backward(cp, deterministic):
    """attention_varlen on device arrays: one launch per kernel with grid z = sequences and x = tiles of the longest
    sequence, the offsets read from the caller's device arrays; bitwise what backend="emulate" computes (the same
    launches), which tests/test_kernels_emulated_varlen.py holds to the float64 reference."""
    from test_varlen import ragged

    rng = np.random.default_rng(21)
    q, k, v, dout, cq, ck = ragged(rng, [5, 0, 70, 1], [7, 3, 40, 0], 4, 2, 40, np.float16)
    options = dict(causal=True, dropout_p=0.2, seed=5)
    dev = [cp.asarray(a) for a in (q, k, v, dout, cq, ck)]
    out, lse = cuflash.attention_varlen(*dev[:3], dev[4], dev[5], return_lse=True, **options)
    launch = cp._launches[-1]
    fwd = specs.select("fwd", "float16", 40, 227 * 1024, cc=90)
    assert launch.grid == (-(-70 // fwd.block_m), 4, 4)
    assert inside(pointer(launch, "cu_seqlens_q"), dev[4]) and inside(pointer(launch, "cu_seqlens_k"), dev[5])
    assert int(fake_cupy._field(launch.args[0], "q.batch_stride")) == 0
    want_out, want_lse = cuflash.attention_varlen(q, k, v, cq, ck, return_lse=True, backend="emulate", **options)
    assert np.array_equal(out.get(), want_out) and np.array_equal(lse.get(), want_lse)
    n = len(cp._launches)
    grads = cuflash.attention_varlen_backward(dev[3], *dev[:3], out, lse, dev[4], dev[5], deterministic=deterministic,
                                              **options)
    assert names(cp._launches[n:]) == bwd_names("float16", 40, deterministic)
    main = specs.select("bwd", "float16", 40, 227 * 1024, cc=90)
    assert cp._launches[n + 1].grid == (-(-40 // main.block_n), 2, 4)
    # the same launches as backend="emulate" in the same mode (the emulator's atomics run in one order): bitwise
    want = cuflash.attention_varlen_backward(dout, q, k, v, want_out, want_lse, cq, ck, backend="emulate",
                                             deterministic=deterministic, **options)
    for g, w in zip(grads, want):
        assert isinstance(g, cp.ndarray) and np.array_equal(g.get(), w)


def test_varlen_wide_and_empty(cp):
    """float32 through the wide kernels; only empty sequences launch nothing."""
    from test_varlen import ragged

    rng = np.random.default_rng(22)
    q, k, v, dout, cq, ck = ragged(rng, [3, 9], [9, 2], 2, 1, 16, np.float32)
    out = cuflash.attention_varlen(*(cp.asarray(a) for a in (q, k, v, cq, ck)), window=(2, 2))
    assert np.array_equal(out.get(), cuflash.attention_varlen(q, k, v, cq, ck, window=(2, 2), backend="emulate"))
    n = len(cp._launches)
    empty = cp.zeros((0, 2, 16), cp.float16)
    cu = cp.zeros(3, cp.int32)
    out, lse = cuflash.attention_varlen(empty, empty, empty, cu, cu, return_lse=True)
    grads = cuflash.attention_varlen_backward(out, empty, empty, empty, out, lse, cu, cu)
    assert len(cp._launches) == n and out.shape == (0, 2, 16) and all(g.shape == (0, 2, 16) for g in grads)


# ------------------------------------------------------------------------------------------------
# KV cache: contiguous and paged caches, split-KV and its combine
# ------------------------------------------------------------------------------------------------
def test_kvcache_refused_by_the_grid_leaves_the_device_cache_as_it_was(cp):
    """The kernels' grid limit (batch x num_splits) is checked before the append, as on the emulator."""
    rng = np.random.default_rng(24)
    b = 65536
    q = rng.standard_normal((b, 1, 1, 8)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((b, 2, 1, 8)).astype(np.float16) for _ in range(2))
    k_new, v_new = (rng.standard_normal((b, 1, 1, 8)).astype(np.float16) for _ in range(2))
    k_dev, v_dev = cp.asarray(k_cache), cp.asarray(v_cache)
    n = len(cp._launches)
    with pytest.raises(ValueError, match=r"batch \(65536\) x num_splits \(1\) must be at most 65535"):
        cuflash.attention_with_kvcache(cp.asarray(q), k_dev, v_dev, cache_seqlens=cp.asarray(np.ones(b, np.int32)),
                                       k_new=cp.asarray(k_new), v_new=cp.asarray(v_new), num_splits=1)
    assert len(cp._launches) == n
    assert np.array_equal(k_dev.get(), k_cache) and np.array_equal(v_dev.get(), v_cache)


@pytest.mark.parametrize("option", ["cache_seqlens", "alibi_slopes", "block_table"])
def test_kvcache_numpy_scalar_options_are_named_as_on_the_host(cp, option):
    """A NumPy scalar beside CuPy caches: the overlap check took its memory for a device array (AttributeError:
    'memoryview' object has no attribute 'ptr'); now the argument's own TypeError, as with NumPy caches."""
    x = cp.asarray(np.zeros((2, 1, 2, 32), np.float16))
    kc, vc = (cp.asarray(np.zeros((2, 16, 2, 32), np.float16)) for _ in range(2))
    args = dict(cache_seqlens=cp.asarray(np.array([3, 4], np.int32)))
    args[option] = np.int32(0) if option == "block_table" else np.float32(0.5) if option == "alibi_slopes" \
        else np.int32(3)
    with pytest.raises(TypeError, match=option):
        cuflash.attention_with_kvcache(x, kc, vc, k_new=x, v_new=x, **args)


def test_kvcache_splits_are_capped_at_the_key_tiles(cp):
    """num_splits past the key tiles left shares empty: 40000 was refused by the grid limit where the NumPy backend
    takes it, and 3000 launched 6000 blocks and workspaces for mostly nothing. Capped at the key tiles: the same
    launches and bits as num_splits = the key tiles."""
    rng = np.random.default_rng(25)
    q = rng.standard_normal((2, 1, 4, 40)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((2, 200, 2, 40)).astype(np.float16) for _ in range(2))
    lens = cp.asarray(np.array([150, 7], np.int32))
    tiles = -(-150 // specs.select("fwd", "float16", 40, 227 * 1024, cc=90).block_n)
    runs = []
    for splits in (tiles, 40000):
        n = len(cp._launches)
        runs.append(cuflash.attention_with_kvcache(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache),
                                                   cache_seqlens=lens, num_splits=splits, return_lse=True))
        assert cp._launches[n].grid == (1, 4, 2 * tiles)
    for a, b in zip(*runs):
        assert np.array_equal(a.get(), b.get())


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_forward_and_split_combine(cp, paged):
    """attention_with_kvcache on device arrays: the append lands in the device cache; one forward launch (grid z =
    batch x splits) and, split, the combine after it; bitwise what backend="emulate" computes (the same launches)."""
    from test_kvcache import Cache

    rng = np.random.default_rng(23)
    cache = Cache(rng, 2, 200, 2, 40, np.float16, page_size=24 if paged else None)
    q = rng.standard_normal((2, 1, 4, 40)).astype(np.float16)
    k_new, v_new = (rng.standard_normal((2, 1, 2, 40)).astype(np.float16) for _ in range(2))
    lens = np.array([150, 7], np.int32)
    table = None if cache.block_table is None else cp.asarray(cache.block_table)
    for splits in (1, 3):
        k_dev, v_dev = cp.asarray(cache.k), cp.asarray(cache.v)
        n = len(cp._launches)
        out, lse = cuflash.attention_with_kvcache(cp.asarray(q), k_dev, v_dev, cache_seqlens=cp.asarray(lens),
                                                  k_new=cp.asarray(k_new), v_new=cp.asarray(v_new),
                                                  block_table=table, num_splits=splits, return_lse=True)
        fwd = specs.select("fwd", "float16", 40, 227 * 1024, cc=90)
        assert [launch.grid for launch in cp._launches[n:]] == [(1, 4, 2 * splits)] + ([(1, 4, 2)] if splits > 1
                                                                                       else [])
        if paged:
            assert inside(pointer(cp._launches[n], "paged.block_table"), table)
        k_host, v_host = cache.k.copy(), cache.v.copy()
        want = cuflash.attention_with_kvcache(q, k_host, v_host, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                              block_table=cache.block_table, num_splits=splits, return_lse=True,
                                              backend="emulate")
        assert np.array_equal(k_dev.get(), k_host) and np.array_equal(v_dev.get(), v_host)
        assert np.array_equal(out.get(), want[0]) and np.array_equal(lse.get(), want[1])
        assert cp._launches[n].shared_mem == fwd.smem_bytes


# ------------------------------------------------------------------------------------------------
# Arguments on another GPU than q, k, v
# ------------------------------------------------------------------------------------------------
def test_modifier_operands_and_buffers_on_another_gpu_are_refused_before_any_launch(make_fake):
    """The kernels read bias, ALiBi slopes and mod_arrays through raw pointers, and write out=/dq= buffers: on
    another GPU than q, k, v they were read from (or copied across) the wrong device."""
    cp = make_fake((fake_cupy.H100, fake_cupy.H100))
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((1, 16, 2, 32)).astype(np.float16) for _ in range(3)]
    elsewhere = {"alibi_slopes": cp.asarray(np.ones(2, np.float32)),
                 "bias": cp.asarray(np.zeros((1, 2, 16, 16), np.float32)), "buffer": cp.empty((1, 16, 2, 32), np.float16)}
    with cp.cuda.Device(1):
        q, k, v = (cp.asarray(x) for x in host)
        n = len(cp._launches)
        for name in ("alibi_slopes", "bias"):
            with pytest.raises(ValueError, match=f"must all live on one GPU \\(q on GPU 1, {name} on GPU 0\\)"):
                cuflash.attention(q, k, v, **{name: elsewhere[name]})
        with pytest.raises(ValueError, match=r"must all live on one GPU \(q on GPU 1, mod_arrays\['w'\] on GPU 0\)"):
            cuflash.attention(q, k, v, score_mod="score * w[h]", mod_arrays={"w": elsewhere["alibi_slopes"]})
        with pytest.raises(ValueError, match=r"must all live on one GPU \(out on GPU 0, q on GPU 1"):
            cuflash.attention(q, k, v, out=elsewhere["buffer"])
        assert len(cp._launches) == n
        # a 0-d device scalar is a scalar, as a NumPy one
        # an integer one too (the modifier's int32 bounds read it through .item(), as CuPy converts it)
        three = cuflash.attention(q, k, v, mask_mod="kv_idx <= q_idx + t", mod_arrays={"t": cp.asarray(np.int32(3))})
        assert np.array_equal(three.get(), cuflash.attention(q, k, v, mask_mod="kv_idx <= q_idx + t",
                                                            mod_arrays={"t": 3}).get())
        half = cuflash.attention(q, k, v, score_mod="score * t", mod_arrays={"t": cp.asarray(np.float32(0.5))})
        same = cuflash.attention(q, k, v, score_mod="score * t", mod_arrays={"t": 0.5})
        assert half.device.id == 1 and np.array_equal(half.get(), same.get())


def test_varlen_offsets_and_kvcache_lengths_on_another_gpu_are_refused_before_any_launch(make_fake):
    """cu_seqlens, cache_seqlens and block_table are read by the kernels through raw pointers: on another GPU than
    q the backward launched anyway, and the forward's error sent the caller to the offsets' device, where q is not."""
    cp = make_fake((fake_cupy.H100, fake_cupy.H100))
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape).astype(np.float16) for shape in ((8, 2, 16), (9, 1, 16), (9, 1, 16), (8, 2, 16))]
    cq, ck = np.array([0, 3, 8], np.int32), np.array([0, 4, 9], np.int32)
    cq0, ck0, lengths0 = cp.asarray(cq), cp.asarray(ck), cp.asarray(np.array([2], np.int32))
    with cp.cuda.Device(1):
        q, k, v, dout = (cp.asarray(a) for a in host)
        out, lse = cuflash.attention_varlen(q, k, v, cp.asarray(cq), cp.asarray(ck), return_lse=True)
        n = len(cp._launches)
        refused = r"must all live on one GPU \(q on GPU 1, {} on GPU 0\)"
        with pytest.raises(ValueError, match=refused.format("cu_seqlens_q")):
            cuflash.attention_varlen(q, k, v, cq0, ck0)
        with pytest.raises(ValueError, match=refused.format("cu_seqlens_q")):
            cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq0, ck0)
        cache = cp.asarray(np.zeros((1, 4, 1, 16), np.float16))
        with pytest.raises(ValueError, match=refused.format("cache_seqlens")):
            cuflash.attention_with_kvcache(q[None, :1], cache, cache, cache_seqlens=lengths0)
        assert len(cp._launches) == n


# ------------------------------------------------------------------------------------------------
# A BlockMask's tile lists and operands: derived once per mask and device
# ------------------------------------------------------------------------------------------------
def test_a_block_mask_is_derived_once_per_device_and_a_callers_array_every_call(make_fake, monkeypatch):
    """The H100 run's block-sparse forward took 2.0 ms at density 1/16 against 3.5 dense: the tile lists (NumPy
    prefix sums and sorts) and the mask's operands were derived on the host at every call. They are kept on the
    mask now, per device (each GPU gets its own copies), while a caller's mod_arrays value is converted at every
    call (it may change in between, and a change must show)."""
    from cuflash import BlockMask, reference, tiling

    cp = make_fake((fake_cupy.H100, fake_cupy.H100))
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((1, 64, 2, 32)).astype(np.float16) for _ in range(3)]
    mask = BlockMask.from_mask_mod("kv_idx <= q_idx + t[q_idx]", seqlen_q=64, seqlen_k=64, block=(16, 16),
                                   mod_arrays={"t": rng.integers(0, 20, 64).astype(np.int32)})
    derivations = []
    real_mask_tiles = tiling.mask_tiles
    monkeypatch.setattr(tiling, "mask_tiles", lambda *a: derivations.append(a[1:]) or real_mask_tiles(*a))
    w = np.array([0.5, 2.0], np.float32)
    options = dict(block_mask=mask, score_mod="score * w[h]")
    expected = [[reference.attention(*host, block_mask=mask, score_mod="score * w[h]", mod_arrays={"w": x},
                                     compute_dtype=dt) for dt in (np.float64, np.float16)] for x in (w, 2 * w)]
    for device in (0, 1):
        with cp.cuda.Device(device):
            q, k, v = (cp.asarray(x) for x in host)
            w_dev = cp.asarray(w)
            for call in range(3):
                if call == 2:
                    w_dev *= 2  # the caller's array, changed in place: the next call must read it again
                out = cuflash.attention(q, k, v, mod_arrays={"w": w_dev}, **options)
                assert out.device.id == device
                assert_attention_close(out, *expected[call == 2], name=f"device {device}, call {call}")
        assert len(derivations) == device + 1  # one derivation per device, none for the later calls


def test_a_block_mask_is_kept_per_stream_without_synchronizing(cp, monkeypatch):
    """What a mask keeps is made and read in one stream's order: a copy from pageable host memory may still be in
    flight when CuPy returns, and memory freed with the mask goes back to the pool of the stream that made it. So
    one set per stream, and no synchronization (a mask built anew for every batch must not stall the host)."""
    from cuflash import BlockMask, tiling

    rng = np.random.default_rng(1)
    q, k, v = (cp.asarray(rng.standard_normal((1, 48, 2, 32)).astype(np.float16)) for _ in range(3))
    mask = BlockMask(np.tril(np.ones((3, 3), bool)), block=(16, 16))
    derivations = []
    real_mask_tiles = tiling.mask_tiles
    monkeypatch.setattr(tiling, "mask_tiles", lambda *a: derivations.append(a[1:]) or real_mask_tiles(*a))
    syncs = cp._syncs
    outs = []
    for stream in (cp.cuda.Stream(), cp.cuda.Stream(), cp.cuda.Stream.null):
        with stream:
            for _ in range(2):
                outs.append(cuflash.attention(q, k, v, block_mask=mask))
    assert cp._syncs == syncs and len(derivations) == 3  # once per stream, never waiting on the device
    assert all(np.array_equal(o.get(), outs[0].get()) for o in outs)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(20, 5)),
                                     dict(score_mod="score * 0.5 + kv_idx % 3"), dict(mask_mod="kv_idx <= q_idx + 16"),
                                     dict(causal=True, p=0.2)], ids=str)
def test_the_h100_rows_run_the_features_at_head_dim_128(cp, options):
    """specs.ARCH_TILES: the Hopper rows at head_dim 128, forward (64 x 128 x 4 warps) and backward (128 x 64 x 8,
    without modifier code; with a score or mask modifier the table's row), under masks, modifiers and dropout,
    against the float64 reference (the feature cases reach them only unmasked)."""
    shape = (1, 150, 170, 2, 1, 128, np.float16)
    case = cases.dropout_case(*shape, seed=3, **options) if "p" in options else make_case(*shape, **options)
    check_forward(gpu_forward(cp), case)

    def launched(family, row):
        return any(f"flash_{family}_kernel<__half, 128, {row.block_m}, {row.block_n}, {row.warps},"
                   in launch.name for launch in cp._launches)

    assert launched("fwd", specs.ARCH_TILES["fwd", 128, 90])
    out, lse = gpu_forward(cp)(case.q, case.k, case.v, **case.options)
    cp._launches.clear()
    cases.check_backward(gpu_backward(cp, False), case, out, lse)
    modified = "score_mod" in options or "mask_mod" in options
    assert launched("bwd", specs.ARCH_TILES["bwd", 128, 90]) is not modified
    assert launched("bwd", specs.TILES["bwd"][128][0]) is modified


def test_overlap_of_device_arrays_is_exact(cp):
    """Device arrays were compared by their byte ranges: the two halves of an interleaved KV cache (k and v of one
    (B, C, 2, H, D) buffer, FlashAttention's packed layout), which share no element, were refused as sharing
    memory ("writing the new keys would overwrite values"). Now NumPy's exact solver decides from their addresses,
    as for host arrays, negative strides included."""
    from cuflash.problem.core import _overlap

    rng = np.random.default_rng(0)
    host = rng.standard_normal((2, 8, 2, 1, 16)).astype(np.float32)
    kv = cp.asarray(host)
    assert not _overlap(kv[:, :, 0], kv[:, :, 1])
    assert _overlap(kv[:, :, 0], kv[:, :, 0]) and _overlap(kv[:, 1:, 0], kv[:, :-1, 0])
    assert _overlap(kv[:, ::-1, 0], kv[:, :, 0]) and not _overlap(kv[:, ::-1, 0], kv[:, :, 1])
    assert not _overlap(kv[0], kv[1]) and not _overlap(kv[:, :, 0].view(np.uint8), kv[:, :, 1].view(np.uint8))
    for sl in [(slice(None), slice(None), 0), (slice(None), slice(None, None, -1), 0), (0,), (1,)]:
        for other in [(slice(None), slice(None), 1), (slice(None), slice(1, None), 0), (1,)]:
            assert _overlap(kv[sl], kv[other]) == np.shares_memory(host[sl], host[other]), (sl, other)
    q = cp.asarray(rng.standard_normal((2, 1, 2, 16)).astype(np.float32))
    new = cp.asarray(rng.standard_normal((2, 1, 1, 16)).astype(np.float32))
    out = cuflash.attention_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], cache_seqlens=cp.asarray(np.array([3, 5],
                                         np.int32)), k_new=new, v_new=new)
    got, k_all, v_all = out.get(), host[:, :, 0].copy(), host[:, :, 1].copy()
    for b, length in enumerate((3, 5)):  # each sequence by the rule, over its cache with the new key appended
        k_all[b, length], v_all[b, length] = new.get()[b, 0], new.get()[b, 0]
        qkv = q.get()[b:b + 1], k_all[b:b + 1, :length + 1], v_all[b:b + 1, :length + 1]
        assert_attention_close(got[b:b + 1], cuflash.reference.attention(*qkv),
                               cuflash.reference.attention(*qkv, compute_dtype=np.float32),
                               magnitude=cuflash.reference.term_magnitudes(*qkv)["out"])
    np.testing.assert_array_equal(kv.get()[:, :, 0], k_all)  # the appends landed in k's half and v's half
    np.testing.assert_array_equal(kv.get()[:, :, 1], v_all)
