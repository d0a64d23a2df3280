"""Arrays of other libraries (issue: fits the array ecosystem): PyTorch tensors and array-api-strict arrays through
DLPack, CUDA arrays of an unknown library and CUDA Array Interface objects through the fake CuPy, and the errors
for masked, object, mixed-library and mixed-device arrays.

Every value is held to the float64 reference by the 2x/3x same-dtype rule (:mod:`cuflash.testing`); every result
must be of the caller's array type. PyTorch and array-api-strict are test dependencies (``.[test]``): their tests
are skipped only where the package is not installed at all.
"""
from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

import cuflash
from cuflash import interop
from cuflash.backends import cuda
from cuflash.testing import assert_attention_close

import fake_cupy
from interop_support import cases, check_through

CASES = cases()


def _torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed (it comes with the test extra)")


def _xps():
    return pytest.importorskip("array_api_strict", reason="array-api-strict is not installed (test extra)")


# ================================================================================================ PyTorch (CPU)
@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_tensors_in_torch_tensors_out(name):
    torch = _torch()
    check_through(CASES[name], torch.from_dlpack, lambda t: t.numpy(), lambda t: isinstance(t, torch.Tensor))


def test_torch_zero_copy_in_place_change_is_detected_and_out_buffer_is_written():
    """The tensors are read through views: an in-place change of q after the forward reaches cuflash's
    fingerprint (a copy would hide it), and an ``out=`` tensor is written in place and returned as itself."""
    torch = _torch()
    case = CASES["causal-gqa"]
    q, k, v = (torch.from_dlpack(a.copy()) for a in (case.q, case.k, case.v))
    buf = torch.empty(q.shape, dtype=q.dtype)
    out, residual = cuflash.attention(q, k, v, causal=True, out=buf, return_residual=True)
    assert out is buf and residual.out is buf
    assert np.array_equal(buf.numpy(), cuflash.attention(case.q, case.k, case.v, causal=True))
    q[0, 1, 0, 0] += 1.0
    with pytest.raises(ValueError, match="q was modified in place"):
        cuflash.attention_backward(torch.ones_like(out), residual)


def test_torch_tensors_written_in_place_tell_autograd():
    """cuflash writes a tensor through a view of its memory (out=, dq=, a KV cache appended to), which PyTorch does
    not see: a tensor that autograd had saved for another operation's backward was read with the new values, and
    that backward's gradient came out silently wrong (8.0 where 0.0 was right). Now the version counter of every
    tensor written advances, and autograd refuses as it does after its own in-place writes."""
    torch = _torch()
    case = CASES["causal-gqa"]
    q, k, v = (torch.from_dlpack(a.copy()) for a in (case.q, case.k, case.v))

    def saved_for_backward(t):  # a loss whose backward reads t as it was when the loss was made
        w = torch.ones((), dtype=t.dtype, requires_grad=True)
        return (w * t).sum()

    buf = torch.zeros(q.shape, dtype=q.dtype)
    loss = saved_for_backward(buf)
    cuflash.attention(q, k, v, causal=True, out=buf)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dq = torch.zeros(q.shape, dtype=q.dtype)
    before = dq._version
    cuflash.attention_backward(torch.ones_like(out), q, k, v, out, lse, causal=True, dq=dq)
    assert dq._version > before
    k_cache, v_cache = (torch.zeros((1, 16, 2, 8), dtype=torch.float32) for _ in range(2))
    new = torch.ones((1, 1, 2, 8), dtype=torch.float32)
    loss = saved_for_backward(k_cache)
    cuflash.attention_with_kvcache(torch.ones((1, 1, 4, 8)), k_cache, v_cache,
                                   cache_seqlens=torch.zeros(1, dtype=torch.int32), k_new=new, v_new=new)
    assert k_cache[0, 0].eq(1).all()  # written in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_refused_call_leaves_the_version_counters_as_they_were():
    """A call refused by its checks writes nothing, and the tensors it would have written keep their version, as
    after PyTorch's own refused in-place operations: a KV-cache append refused for a full cache (or an out= of the
    wrong shape) advanced them, and a backward that had saved the cache raised "modified by an inplace operation"."""
    torch = _torch()
    q, k, v = (torch.randn(2, 9, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    k_cache, v_cache = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)
    new = torch.randn(2, 1, 2, 8)
    w = torch.zeros(k_cache.shape, requires_grad=True)
    loss = (w * k_cache).sum()  # autograd saves k_cache
    with pytest.raises(ValueError, match="cache_seqlens"):  # the second sequence is full
        cuflash.attention_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=torch.tensor([3, 16],
                                       dtype=torch.int32), k_new=new, v_new=new)
    out, wrong = torch.empty(2, 9, 2, 8), torch.empty(2, 9, 2, 7)
    with pytest.raises(ValueError, match="out"):
        cuflash.attention(q, k, v, out=wrong)
    dq = torch.empty(2, 9, 2, 8)
    o, lse = cuflash.attention(q, k, v, return_lse=True, out=out)
    with pytest.raises(ValueError, match="dout"):
        cuflash.attention_backward(torch.ones(2, 9, 2, 7), q, k, v, o, lse, dq=dq)
    assert (k_cache._version, v_cache._version, wrong._version, dq._version) == (0, 0, 0, 0)
    assert out._version > 0  # the call that ran wrote it
    loss.backward()  # the saved cache is as it was
    np.testing.assert_array_equal(w.grad.numpy(), 0)


def test_torch_permuted_tensors_with_bhsd_layout():
    """PyTorch SDPA's layout: (batch, heads, seqlen, head_dim) tensors, here non-contiguous views, with
    layout="bhsd"; compared with the bshd call on the same values and with torch's own SDPA."""
    torch = _torch()
    case = CASES["causal-gqa"]
    q, k, v = (torch.from_dlpack(a).transpose(1, 2) for a in (case.q, case.k, case.v))  # views, not contiguous
    assert not q.is_contiguous()
    out = cuflash.attention(q, k, v, causal=True, layout="bhsd")
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(q.shape)
    want = cuflash.attention(case.q, case.k, case.v, causal=True)
    assert np.array_equal(out.transpose(1, 2).numpy(), want)
    # torch's SDPA aligns causal top-left: equal to cuflash's bottom-right only for Sq == Sk; compare without it
    got = cuflash.attention(q, k, v, layout="bhsd")
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    # against the float64 reference: at most 2x the error of torch's own SDPA in the same dtype (+ the rule's floor)
    ref = cuflash.reference.attention(case.q, case.k, case.v)
    assert_attention_close(got.transpose(1, 2).numpy(), ref, sdpa.transpose(1, 2).numpy())


def test_torch_every_public_function_returns_tensors():
    torch = _torch()
    case = CASES["plain"]
    T = torch.from_dlpack
    q, k, v, dout = (T(a) for a in (case.q, case.k, case.v, case.dout))
    out, vjp = cuflash.attention_vjp(q, k, v)
    assert all(isinstance(g, torch.Tensor) for g in (out, *vjp(dout)))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    merged, lse2 = cuflash.merge_attention_states([out, out], [lse, lse])
    assert isinstance(merged, torch.Tensor) and isinstance(lse2, torch.Tensor)
    # two equal halves: weights 1/2 each, exact in float32; lse + log 2 rounded once
    assert np.array_equal(merged.numpy(), out.numpy())
    assert np.array_equal(lse2.numpy(), lse.numpy() + np.log(np.float32(2)))
    qkv = torch.stack([q, k, v], dim=2)  # (B, S, 3, H, D)
    out_p, res = cuflash.attention_qkvpacked(qkv, return_residual=True)
    assert isinstance(out_p, torch.Tensor) and np.array_equal(out_p.numpy(), out.numpy())
    dqkv = cuflash.attention_backward(dout, res)
    assert isinstance(dqkv, torch.Tensor) and dqkv.shape == qkv.shape
    out_kv = cuflash.attention_kvpacked(q, torch.stack([k, v], dim=2))
    assert isinstance(out_kv, torch.Tensor) and np.array_equal(out_kv.numpy(), out.numpy())


def test_torch_errors_are_clear():
    torch = _torch()
    case = CASES["plain"]
    q, k, v = (torch.from_dlpack(a) for a in (case.q, case.k, case.v))
    with pytest.raises(TypeError, match=r"q is a torch array but k is a numpy array: pass arrays of one library"):
        cuflash.attention(q, case.k, v)
    with pytest.raises(TypeError, match=r"q: torch could not hand this array over through DLPack.*detach"):
        cuflash.attention(q.clone().requires_grad_(), k, v)
    with pytest.raises(TypeError, match=r"q: torch could not hand this array over through DLPack"):
        cuflash.attention(q.bfloat16(), k.bfloat16(), v.bfloat16())  # NumPy's DLPack import has no bfloat16
    with pytest.raises(TypeError, match=r"dout is a numpy array"):
        out, residual = cuflash.attention(q, k, v, return_residual=True)
        cuflash.attention_backward(case.dout, residual)
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        cuflash.attention(q, k.double(), v)


# ================================================================================================ array-api-strict
@pytest.mark.parametrize("name", sorted(CASES))
def test_array_api_strict_arrays(name):
    xps = _xps()
    check_through(CASES[name], xps.asarray, lambda a: np.asarray(a), lambda a: isinstance(a, xps._array_object.Array))


def test_array_api_strict_results_stay_on_the_callers_device():
    xps = _xps()
    case = CASES["plain"]
    device = xps.Device("device1")
    q, k, v = (xps.asarray(a, device=device) for a in (case.q, case.k, case.v))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert out.device == device and lse.device == device
    assert np.array_equal(np.asarray(xps.asarray(out, device=xps.Device("CPU_DEVICE"))),
                          cuflash.attention(case.q, case.k, case.v))
    out + q  # the caller's arithmetic works: same device (array-api-strict refuses mixtures)


# ================================================================================================ JAX arrays (DLPack)
@pytest.mark.usefixtures("jax_cpu")
@pytest.mark.parametrize("name", sorted(CASES))
def test_jax_arrays_through_cuflash_attention(name):
    """Plain cuflash.attention on JAX arrays (no jit: cuflash.jax is the adapter for transformations)."""
    jax = pytest.importorskip("jax", reason="JAX is not installed (it comes with the test extra)")
    check_through(CASES[name], jax.numpy.asarray, np.asarray, lambda a: isinstance(a, jax.Array))


@pytest.mark.usefixtures("jax_cpu")
def test_jax_arrays_are_immutable_buffers():
    jax = pytest.importorskip("jax", reason="JAX is not installed (it comes with the test extra)")
    q, k, v = (jax.numpy.asarray(a) for a in (CASES["plain"].q, CASES["plain"].k, CASES["plain"].v))
    with pytest.raises(ValueError, match=r"out is a JAX array, which JAX never lets change"):
        cuflash.attention(q, k, v, out=jax.numpy.zeros_like(q))


@pytest.mark.usefixtures("jax_cpu")
def test_jax_results_sliced_to_vs_own_head_dim_come_back():
    """v's own head dim: the forward's result and the backward's gradients are slices of padded buffers, which
    JAX's DLPack import refused (compact strides only) after the whole computation had run."""
    jax = pytest.importorskip("jax", reason="JAX is not installed (it comes with the test extra)")
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 6, 2, 8)).astype(np.float32) for _ in range(2))
    for dv in (4, 16):
        v, dout = (rng.standard_normal((1, 6, 2, dv)).astype(np.float32) for _ in range(2))
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        j = [jax.numpy.asarray(a) for a in (q, k, v, dout, out, lse)]
        got = cuflash.attention(*j[:3])
        assert isinstance(got, jax.Array) and np.array_equal(np.asarray(got), out)
        grads = cuflash.attention_backward(j[3], *j[:3], j[4], j[5])
        for g, want in zip(grads, cuflash.attention_backward(dout, q, k, v, out, lse)):
            assert isinstance(g, jax.Array) and np.array_equal(np.asarray(g), want)


def test_one_library_on_two_of_its_devices_is_refused():
    """array-api-strict's virtual devices (as JAX's several CPU devices) share host memory: the result landed on
    q's device, although the library itself refuses to combine the arrays."""
    xps = _xps()
    case = CASES["plain"]
    one, two = xps.Device("device1"), xps.Device("device2")
    q, k, v = (xps.asarray(a, device=one) for a in (case.q, case.k, case.v))
    with pytest.raises(ValueError, match=r"q is on array_api_strict's device .*device1.* but k is on .*device2"):
        cuflash.attention(q, xps.asarray(case.k, device=two), v)
    with pytest.raises(ValueError, match=r"but out is on .*device2"):
        cuflash.attention(q, k, v, out=xps.empty(q.shape, dtype=q.dtype, device=two))


def test_torch_lazily_negated_or_meta_tensors_are_refused_naming_them():
    """A tensor with PyTorch's negative bit (``z.conj().imag``) exports its memory without the sign: it was read
    as -q, and an out= buffer so flagged gave the caller -out. The meta device has no memory to export."""
    torch = _torch()
    case = CASES["plain"]
    q, k, v = (torch.from_dlpack(a) for a in (case.q, case.k, case.v))
    negated = torch.complex(torch.zeros_like(q), -q).conj().imag  # the values of q, negated lazily
    assert negated.is_neg() and torch.equal(negated, q)
    with pytest.raises(TypeError, match=r"q: this torch tensor is negated lazily .* pass q.resolve_neg\(\)"):
        cuflash.attention(negated, k, v)
    with pytest.raises(TypeError, match=r"out: this torch tensor is negated lazily"):
        cuflash.attention(q, k, v, out=torch.complex(torch.zeros_like(q), q).conj().imag)
    np.testing.assert_array_equal(cuflash.attention(negated.resolve_neg(), k, v).numpy(),
                                  cuflash.attention(case.q, case.k, case.v))
    with pytest.raises(TypeError, match=r"k: .*meta"):
        cuflash.attention(q, k.to("meta"), v)


def test_torch_tensors_without_memory_of_their_values_are_refused_naming_them():
    """A zero tensor (autograd's stand-in for zeros) and a fake tensor (FakeTensorMode: torch.compile and torch.export
    tracing) export through DLPack an address that holds none of their values: they were read as whatever lay there
    (max |out| 3e30, or NaN; a fake call returned a real tensor of garbage), with no error."""
    torch = _torch()
    case = CASES["plain"]
    q, k, v = (torch.from_dlpack(a) for a in (case.q, case.k, case.v))
    zero = torch._efficientzerotensor(v.shape, dtype=v.dtype)
    assert zero._is_zerotensor()
    with pytest.raises(TypeError, match=r"v: this torch tensor is a zero tensor .* torch.zeros_like\(v\)"):
        cuflash.attention(q, k, zero)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(q)
        with pytest.raises(TypeError, match=r"q: this torch tensor is a fake tensor"):
            cuflash.attention(fake, k, v)


def test_inference_tensors_are_written_in_place_only_in_inference_mode():
    """PyTorch refuses an in-place write to an inference tensor outside torch.inference_mode(); cuflash wrote one
    (out=, a KV cache appended to) through its DLPack view all the same. Now refused alike, naming it; inside
    inference mode it is written."""
    torch = _torch()
    case = CASES["plain"]
    q, k, v = (torch.from_dlpack(a) for a in (case.q, case.k, case.v))
    with torch.inference_mode():
        out = torch.empty_like(q)
        kc, vc = torch.zeros(2, 8, 1, 4), torch.zeros(2, 8, 1, 4)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        out.add_(1)  # PyTorch's own rule
    with pytest.raises(TypeError, match=r"out: this torch tensor is an inference tensor"):
        cuflash.attention(q, k, v, out=out)
    new = torch.ones(2, 1, 1, 4)
    with pytest.raises(TypeError, match=r"k_cache: this torch tensor is an inference tensor"):
        cuflash.attention_with_kvcache(torch.ones(2, 1, 1, 4), kc, vc, cache_seqlens=torch.tensor([0, 3]),
                                       k_new=new, v_new=new)
    assert not kc.any() and not vc.any()  # nothing written
    with torch.inference_mode():
        got = cuflash.attention(q, k, v, out=out)
    assert got is out
    np.testing.assert_array_equal(out.numpy(), cuflash.attention(case.q, case.k, case.v))


# ================================================================================================ NumPy edge cases
def test_masked_object_and_non_array_inputs_are_refused_everywhere():
    case = CASES["plain"]
    q, k, v = case.q, case.k, case.v
    masked = np.ma.masked_array(k, mask=k > 1)
    with pytest.raises(TypeError, match="k is a numpy.ma.MaskedArray"):
        cuflash.attention(q, masked, v)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="dout is a numpy.ma.MaskedArray"):
        cuflash.attention_backward(np.ma.masked_array(q), q, k, v, out, lse)
    with pytest.raises(TypeError, match=r"outs\[1\] is a numpy.ma.MaskedArray"):
        cuflash.merge_attention_states([out, np.ma.masked_array(out)], [lse, lse])
    with pytest.raises(TypeError, match="out is a numpy.ma.MaskedArray"):
        cuflash.attention(q, k, v, out=np.ma.masked_array(np.empty_like(q)))
    objects = np.empty(q.shape, dtype=object)
    objects[...] = 1.0
    with pytest.raises(TypeError, match=r"v is an array of Python objects \(dtype object\)"):
        cuflash.attention(q, k, objects)
    with pytest.raises(TypeError, match=r"q must be a numpy.ndarray or cupy.ndarray \(or an array of another "
                                        r"library that implements __dlpack__"):
        cuflash.attention(q.tolist(), k, v)


def test_unsupported_dlpack_device_is_named():
    class OnAnotherAccelerator:
        def __dlpack__(self, **kw):
            raise AssertionError("must not be read")

        def __dlpack_device__(self):
            return 14, 0  # kDLOneAPI

    with pytest.raises(TypeError, match="q: DLPack device type 14 is not supported"):
        cuflash.attention(OnAnotherAccelerator(), CASES["plain"].k, CASES["plain"].v)
    with pytest.raises(TypeError, match="bias: DLPack device type 14 is not supported"):
        cuflash.attention(CASES["plain"].q, CASES["plain"].k, CASES["plain"].v, bias=OnAnotherAccelerator())


def test_an_array_that_cannot_be_exported_is_named():
    """DLPack's ``__dlpack_device__`` raises BufferError where the array cannot be exported (a JAX array sharded over
    several devices): that came out as a bare BufferError naming nothing."""
    class Sharded:
        def __dlpack__(self, **kw):
            raise AssertionError("must not be read")

        def __dlpack_device__(self):
            raise BufferError("__dlpack__ only supported for unsharded arrays.")

    with pytest.raises(TypeError, match="k: __dlpack__ only supported for unsharded arrays"):
        cuflash.attention(CASES["plain"].q, Sharded(), CASES["plain"].v)


def test_a_dbias_the_callers_library_cannot_take_is_refused_before_the_backward(monkeypatch):
    """dbias comes back in the caller's array type, in bias's dtype: a NumPy bias of the other byte order beside
    torch tensors gave a BufferError after the whole backward, and a float64 one beside JAX arrays (x64 off) a
    float32 dbias. Both are TypeErrors now, before the backend runs; a dtype the library takes comes back as it is."""
    from cuflash import backends

    torch = pytest.importorskip("torch")
    c = CASES["plain"]
    q, k, v = (torch.from_numpy(a) for a in (c.q, c.k, c.v))
    good = np.zeros(c.q.shape[1:2] * 2, np.float64)
    out, lse = cuflash.attention(q, k, v, bias=good, return_lse=True)
    dbias = cuflash.attention_backward(torch.ones_like(out), q, k, v, out, lse, bias=good, return_dbias=True)[3]
    assert isinstance(dbias, torch.Tensor) and dbias.dtype == torch.float64
    monkeypatch.setattr(backends, "select", lambda *a, **kw: pytest.fail("the backward ran"))
    with pytest.raises(TypeError, match="return_dbias=True: dbias .* >f4"):
        cuflash.attention_backward(torch.ones_like(out), q, k, v, out, lse, bias=good.astype(">f4"),
                                   return_dbias=True)
    jnp = pytest.importorskip("jax.numpy")
    import jax

    if not jax.config.jax_enable_x64:
        cpu = jax.devices("cpu")[0]  # CPU JAX (what the message is about), on a machine with a GPU too
        q, k, v, out, lse = (jax.device_put(np.asarray(a), cpu) for a in (q, k, v, out, lse))
        with pytest.raises(TypeError, match="float64 would come back as a .* float32"):
            cuflash.attention_backward(jnp.ones_like(out), q, k, v, out, lse, bias=good, return_dbias=True)


def test_numpy_calls_do_not_import_array_api_compat():
    """The conversion layer costs NumPy and CuPy callers nothing: array-api-compat is loaded only for arrays of
    other libraries."""
    code = ("import sys, numpy as np, cuflash; x = np.ones((1, 4, 1, 8), np.float32); cuflash.attention(x, x, x); "
            "cuflash.attention_vjp(x, x, x)[1](x); print('array_api_compat' in sys.modules)")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "False"


# ================================================================================================ CUDA (fake CuPy)
class ForeignCuda:
    """A CUDA array of a library cuflash does not know (a torch CUDA tensor, say): DLPack only, over the fake
    CuPy's device memory. ``__dlpack__`` records the consumer stream it is asked to order against."""

    def __init__(self, arr):
        self._arr = arr
        self.streams = []

    def __dlpack_device__(self):
        return 2, self._arr.device.id  # kDLCUDA

    def __dlpack__(self, *, stream=None, **kwargs):
        self.streams.append(stream)
        return self._arr  # stands in for the capsule: the fake from_dlpack below unwraps it

    def __array_namespace__(self, api_version=None):
        return FOREIGN

    shape = property(lambda self: self._arr.shape)
    dtype = property(lambda self: self._arr.dtype)
    device = property(lambda self: ("foreign-gpu", self._arr.device.id))


FOREIGN = types.SimpleNamespace(from_dlpack=lambda x: ForeignCuda(x), __name__="foreign")


class CaiOnly:
    """A Numba-like device array: only ``__cuda_array_interface__`` (over a fake CuPy array)."""

    def __init__(self, arr):
        self._arr = arr

    @property
    def __cuda_array_interface__(self):
        return self._arr.__cuda_array_interface__


@pytest.fixture
def cp(monkeypatch):
    """A fake CuPy with two GPUs and the DLPack import real CuPy has: ``from_dlpack`` of a CUDA array on the
    current device (the consumer stream it hands over belongs to that device), and ``asarray`` of CUDA Array
    Interface objects."""
    fake = fake_cupy.install(monkeypatch, fake_cupy.make([fake_cupy.H100, fake_cupy.A100]))
    cuda._memoized.cache_clear()

    def from_dlpack(x, *, device=None, copy=None):
        kind, index = x.__dlpack_device__()
        current = fake.cuda.Device().id
        if kind != 2 or index != current:
            raise ValueError(f"from_dlpack of a device-{index} array with device {current} current")
        return x.__dlpack__(stream=fake.cuda.get_current_stream().ptr)

    asarray = fake.asarray

    def asarray_cai(a, dtype=None, order=None, *, blocking=False):
        return a._arr if isinstance(a, CaiOnly) else asarray(a, dtype, order, blocking=blocking)

    fake.from_dlpack, fake.asarray = from_dlpack, asarray_cai
    yield fake
    cuda._memoized.cache_clear()


def _emulator():
    from cuflash import emulate

    ok, why = emulate.available()
    if not ok:
        pytest.skip(f"CPU emulation unavailable: {why}")


def _fp16_case():
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((1, 20, 2, 16)).astype(np.float16) for _ in range(4))
    return q, k, v, dout


@pytest.mark.emulate
def test_foreign_cuda_arrays_run_on_their_device_and_come_back_in_their_type(cp):
    """A DLPack CUDA array on GPU 1 (GPU 0 current): imported under GPU 1 (the fake's from_dlpack refuses
    another current device), computed there (the kernels launch on device 1), and returned as the caller's type;
    values as the emulated NumPy call's, bitwise (the same kernels)."""
    _emulator()
    q, k, v, dout = _fp16_case()
    with cp.cuda.Device(1):
        arrays = [ForeignCuda(cp.asarray(a)) for a in (q, k, v, dout)]
    out, residual = cuflash.attention(*arrays[:3], causal=True, return_residual=True)
    grads = cuflash.attention_backward(arrays[3], residual)
    assert cp.cuda.Device().id == 0
    assert isinstance(out, ForeignCuda) and out.device == ("foreign-gpu", 1)
    assert all(isinstance(g, ForeignCuda) and g.device == ("foreign-gpu", 1) for g in grads)
    assert cp._launches and {launch.device for launch in cp._launches} == {1}
    assert all(a.streams for a in arrays)  # each was read through DLPack (with the consumer's stream)
    want = cuflash.attention(q, k, v, causal=True, backend="emulate")
    assert np.array_equal(out._arr.get(), want)
    want_grads = cuflash.attention_backward(dout, q, k, v, *cuflash.attention(q, k, v, causal=True, return_lse=True,
                                                                              backend="emulate"),
                                            causal=True, backend="emulate")
    for g, w in zip(grads, want_grads):
        assert np.array_equal(g._arr.get(), w)


@pytest.mark.emulate
def test_cuda_array_interface_objects_give_cupy_results(cp):
    _emulator()
    q, k, v, _ = _fp16_case()
    got = cuflash.attention(*(CaiOnly(cp.asarray(a)) for a in (q, k, v)))
    assert isinstance(got, cp.ndarray)
    assert np.array_equal(got.get(), cuflash.attention(q, k, v, backend="emulate"))


def test_mixed_devices_are_refused_before_any_launch(cp):
    q, k, v, _ = _fp16_case()
    torch_like_cpu = CASES["plain"]  # a foreign CPU array next to a foreign CUDA one
    gpu0 = [ForeignCuda(cp.asarray(a)) for a in (q, k, v)]
    with cp.cuda.Device(1):
        gpu1 = ForeignCuda(cp.asarray(k))
        native1 = cp.asarray(k)
    with pytest.raises(ValueError, match="q is on GPU 0 but k is on GPU 1: move them to one device"):
        cuflash.attention(gpu0[0], gpu1, gpu0[2])
    with pytest.raises(ValueError, match=r"the arrays must all live on one GPU \(q on GPU 0, k on GPU 1"):
        cuflash.attention(cp.asarray(q), native1, cp.asarray(v))
    xps = pytest.importorskip("array_api_strict", reason="array-api-strict is not installed (test extra)")
    with pytest.raises(TypeError, match="q is a array_api_strict array but k is a "):
        cuflash.attention(xps.asarray(torch_like_cpu.q), gpu0[1], gpu0[2])
    with pytest.raises(TypeError, match="q is numpy, k is cupy"):
        cuflash.attention(q, cp.asarray(k), cp.asarray(v))
    assert cp._launches == []


def test_device_kind():
    assert interop.device_kind(np.zeros(3)) == ("cpu", 0)

    class Managed:
        def __dlpack_device__(self):
            return 13, 2  # kDLCUDAManaged on GPU 2

    assert interop.device_kind(Managed()) == ("cuda", 2)


class JaxCuda(ForeignCuda):
    """A JAX array on a GPU, as cuflash sees one: DLPack only, its type's module jaxlib."""


JaxCuda.__module__ = "jaxlib._jax"


def test_a_jax_array_on_a_gpu_is_refused_as_a_buffer_or_a_cache_to_append_to(cp):
    """JAX arrays never change, and the refusal of one as out= was NumPy's read-only flag: on a GPU, CuPy's view of it
    is writable, and out= was filled in place (the caller's immutable array changed, and every array sharing its
    memory). Refused by type now, as a buffer and as a KV cache that k_new would be appended to, before anything
    runs."""
    q, k, v, _ = _fp16_case()
    arrays = [JaxCuda(cp.asarray(a)) for a in (q, k, v)]
    out = JaxCuda(cp.zeros(q.shape, dtype=q.dtype))
    with pytest.raises(ValueError, match="out is a JAX array, which JAX never lets change"):
        cuflash.attention(*arrays, out=out)
    assert not out._arr.get().any() and not cp._launches
    with pytest.raises(ValueError, match="k_cache is a JAX array, which JAX never lets change"):
        cuflash.attention_with_kvcache(arrays[0], arrays[1], arrays[2], cache_seqlens=np.array([3], np.int32),
                                       k_new=JaxCuda(cp.asarray(q[:, :1])), v_new=JaxCuda(cp.asarray(q[:, :1])))


def test_a_residuals_failed_backward_leaves_no_tensor_to_mark_written():
    """A residual keeps its call's conversions for the backward. A backward that took dq= (a torch tensor) and failed
    at dk= (a NumPy array beside torch tensors) left dq listed as written: the next backward on that residual, which
    took no buffer, advanced dq's version counter, and autograd refused a graph that had saved dq ("modified by an
    inplace operation") though cuflash never wrote it. Each backward now starts with nothing written."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 4, 2, 8, generator=g) for _ in range(4))
    _, residual = cuflash.attention(q, k, v, return_residual=True)
    dq = torch.zeros(1, 4, 2, 8)
    with pytest.raises(TypeError, match="dk is a numpy array"):
        cuflash.attention_backward(dout, residual, dq=dq, dk=np.zeros((1, 4, 2, 8), np.float32))
    cuflash.attention_backward(dout, residual)
    assert dq._version == 0 and not dq.any()


@pytest.mark.parametrize("library", ["torch", "jax", "array_api_strict"])
def test_a_residual_of_foreign_arrays_pickles_and_deep_copies(library, request):
    """A residual keeps its call's edge, which held the library's Array API namespace, a module: pickle.dumps and
    copy.deepcopy raised "cannot pickle 'module' object" (and a JAX device does not pickle either). Both give a
    residual whose backward has the original's results, in the library's type."""
    import copy
    import pickle

    mod = pytest.importorskip(library)
    if library == "jax":
        request.getfixturevalue("jax_cpu")
    x = np.random.default_rng(0).standard_normal((2, 5, 3, 8))
    if library == "torch":
        a, ones = mod.from_numpy(x), mod.ones_like
    elif library == "jax":
        a, ones = mod.numpy.asarray(x.astype(np.float32)), mod.numpy.ones_like
    else:
        a, ones = mod.asarray(x), mod.ones_like
    out, residual = cuflash.attention(a, a, a, causal=True, return_residual=True)
    want = cuflash.attention_backward(ones(out), residual)
    for again in (pickle.loads(pickle.dumps(residual)), copy.deepcopy(residual)):
        got = cuflash.attention_backward(ones(out), again)
        assert all(type(g) is type(w) and np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))


def test_a_pickled_edge_imports_only_its_own_librarys_namespace():
    """Loading a pickle imports the namespace it names: only one of the edge's library (or array-api-compat's)."""
    from cuflash.interop import _ModuleName

    with pytest.raises(ValueError, match="names the Array API namespace 'os', which is not torch's"):
        _ModuleName("os").load("torch")
    assert _ModuleName("array_api_compat.numpy").load("numpy").__name__ == "array_api_compat.numpy"
