"""cuflash.jax and plain cuflash calls on JAX arrays that live on a GPU (JAX with CUDA, CuPy): skipped cleanly without
CuPy, a usable GPU, or a JAX that sees that GPU.

tests/test_jax.py and tests/test_interop.py hold JAX to the CPU (what CI has); the GPU branch of the callback ran
there with the fake CuPy only. Here XLA hands ``buffer_callback`` device buffers and its stream: the adapter's
results must be the bits of the same call on CuPy arrays (the kernels' forward and their deterministic backward are
bitwise reproducible), a traced bias's dbias must hold to the rule, and a JAX array must be refused as a buffer or as
a KV cache to append to (CuPy's view of its device memory is writable).
"""
import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash.testing import assert_attention_close

from cases import make_case

import gpu_support  # noqa: E402

cp, pytestmark, DTYPES = gpu_support.setup()
jax = pytest.importorskip("jax", reason="JAX is not installed (it comes with the test extra)")
jnp = pytest.importorskip("jax.numpy")
import cuflash.jax as cj  # noqa: E402

try:
    GPU = jax.devices("gpu")[0]
except RuntimeError as exc:  # a CPU-only jaxlib: no "gpu" platform
    pytestmark.append(pytest.mark.skip(reason=f"JAX sees no GPU: {exc}"))
    GPU = None


def on_gpu(*arrays):
    return tuple(jax.device_put(a, GPU) for a in arrays)


def bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(20, 3)), {}], ids=["causal", "window", "plain"])
def test_jit_forward_is_the_cupy_calls_bits(options):
    case = make_case(2, 77, 90, 4, 2, 64, np.float16, seed=5, **options)
    got = jax.jit(lambda q, k, v: cj.attention(q, k, v, **options))(*on_gpu(case.q, case.k, case.v))
    assert isinstance(got, jax.Array) and got.devices() == {GPU} and got.dtype == case.q.dtype
    want = cuflash.attention(*(cp.asarray(a) for a in (case.q, case.k, case.v)), **options)
    assert np.array_equal(bits(got), bits(cp.asnumpy(want)))


def test_jit_grad_with_deterministic_is_the_cupy_backwards_bits():
    case = make_case(2, 65, 65, 4, 2, 64, np.float16, seed=6, causal=True)
    dout = jnp.asarray(case.dout.astype(np.float32), device=GPU)

    def loss(q, k, v):
        return jnp.sum(cj.attention(q, k, v, causal=True, deterministic=True).astype(jnp.float32) * dout)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*on_gpu(case.q, case.k, case.v))
    q, k, v, d = (cp.asarray(a) for a in (case.q, case.k, case.v, case.dout))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    want = cuflash.attention_backward(d, q, k, v, out, lse, causal=True, deterministic=True)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert g.devices() == {GPU}, name
        assert np.array_equal(bits(g), bits(cp.asnumpy(w))), name


def test_a_traced_bias_is_differentiated_on_the_gpu():
    """The cuda backend computes modifiers: dbias of a per-head bias under jit(grad), held to the rule (mult 3)."""
    case = make_case(2, 40, 40, 2, 2, 64, np.float16, seed=10)
    bias = np.random.default_rng(12).standard_normal((2, 40, 40)).astype(np.float32)
    dout = jnp.asarray(case.dout.astype(np.float32), device=GPU)
    k, v = on_gpu(case.k, case.v)

    def loss(bias, q):
        return jnp.sum(cj.attention(q, k, v, bias=bias).astype(jnp.float32) * dout)

    dbias = jax.jit(jax.grad(loss))(*on_gpu(bias, case.q))
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype and dbias.devices() == {GPU}
    args = (case.dout, case.q, case.k, case.v)
    want = reference.attention_backward(*args, bias=bias, return_dbias=True)[3]
    base = reference.attention_backward(*args, bias=bias, return_dbias=True, compute_dtype=np.float16)[3]
    assert_attention_close(np.asarray(dbias), want, base, mult=3, name="dbias")


def test_plain_calls_on_jax_gpu_arrays_come_back_as_jax_arrays_with_the_cupy_calls_bits():
    pytest.importorskip("array_api_compat", reason="arrays of other libraries need array-api-compat")
    case = make_case(1, 50, 50, 2, 2, 64, np.float16, seed=7)
    got = cuflash.attention(*on_gpu(case.q, case.k, case.v), causal=True)
    assert isinstance(got, jax.Array) and got.devices() == {GPU}
    want = cuflash.attention(*(cp.asarray(a) for a in (case.q, case.k, case.v)), causal=True)
    assert np.array_equal(bits(got), bits(cp.asnumpy(want)))


def test_a_jax_gpu_array_is_refused_as_a_buffer_or_a_cache_to_append_to():
    pytest.importorskip("array_api_compat", reason="arrays of other libraries need array-api-compat")
    case = make_case(1, 8, 8, 2, 2, 64, np.float16, seed=8)
    q, k, v = on_gpu(case.q, case.k, case.v)
    out = jnp.zeros(q.shape, q.dtype, device=GPU)
    with pytest.raises(ValueError, match="out is a JAX array, which JAX never lets change"):
        cuflash.attention(q, k, v, out=out)
    assert not np.asarray(out).any()
    k_cache, v_cache = (jnp.zeros((1, 16, 2, 64), q.dtype, device=GPU) for _ in range(2))
    with pytest.raises(ValueError, match="k_cache is a JAX array, which JAX never lets change"):
        cuflash.attention_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=jnp.asarray([3], jnp.int32),
                                       k_new=k[:, :1], v_new=v[:, :1])
    assert not np.asarray(k_cache).any() and not np.asarray(v_cache).any()
