"""Hostile input (issue: hardening): huge, negative, NaN, wrongly typed, byte-swapped, subclassed, aliased and
later-modified arguments give a clear error before any computation, or the float64 reference's result."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import cuflash
import cuflash.emulate


# ------------------------------------------------------------------------------------------------ hostile values
def _qkv(seed=0, dtype=np.float32, shape=(2, 40, 2, 16)):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


@pytest.mark.parametrize("window,same_as", [((None, sys.maxsize), {}), ((2**63, 0), {"causal": True}),
                                             ((10**30, 10**30), {}), ((np.int64(2**62), None), {})])
def test_huge_windows_mean_unbounded(window, same_as):
    """A bound beyond both lengths keeps every key: no wrap-around to "sees nothing", no OverflowError."""
    q, k, v = _qkv()
    got = cuflash.attention(q, k, v, window=window, return_lse=True)
    want = cuflash.attention(q, k, v, return_lse=True, **same_as)
    for a, b in zip(got, want):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("backend", ["numpy", "emulate"])
def test_non_native_byte_order_is_converted_not_reinterpreted(backend):
    if backend == "emulate":
        emulate_ok, why = cuflash.emulate.available()
        if not emulate_ok:
            pytest.skip(why)
    dtype = np.float16 if backend == "emulate" else np.float32
    q, k, v = _qkv(dtype=dtype)
    want = cuflash.attention(q, k, v, causal=True, backend=backend, return_lse=True)
    swapped = [a.astype(a.dtype.newbyteorder(">" if np.little_endian else "<")) for a in (q, k, v)]
    assert not swapped[0].dtype.isnative
    got = cuflash.attention(*swapped, causal=True, backend=backend, return_lse=True)
    for a, b in zip(got, want):
        assert a.dtype.isnative and np.array_equal(a, b)
    dq, dk, dv = cuflash.attention_backward(swapped[0], *swapped, *got, causal=True, backend=backend)
    assert np.array_equal(dq, cuflash.attention_backward(q, q, k, v, *want, causal=True, backend=backend)[0])


def test_masked_arrays_are_refused_and_subclasses_read_as_arrays():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q is a numpy.ma.MaskedArray: its mask would be ignored"):
        cuflash.attention(np.ma.masked_array(q, mask=q > 1), k, v)

    class Tagged(np.ndarray):
        pass

    got = cuflash.attention(q.view(Tagged), k.view(Tagged), v)
    assert type(got) is np.ndarray and np.array_equal(got, cuflash.attention(q, k, v))


@pytest.mark.parametrize("changed", ["q", "k", "v", "out"])
def test_vjp_detects_in_place_changes(changed):
    q, k, v = _qkv()
    out, vjp = cuflash.attention_vjp(q, k, v, causal=True)
    arrays = dict(q=q, k=k, v=v, out=out)
    dout = np.ones_like(out)
    grads = vjp(dout)  # unchanged: fine, and repeatable
    assert all(np.array_equal(a, b) for a, b in zip(grads, vjp(dout)))
    arrays[changed][1, 3] = arrays[changed][1, 4]  # a row copied over another: sums of values might not notice
    with pytest.raises(ValueError, match=f"{changed} was modified in place after attention_vjp"):
        vjp(dout)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(shape=(1, 2, 8, 8), seed=1, p=1.5), ValueError, r"p must lie in \[0, 1\)"),
    (dict(shape=(1, 2, 8, 8), seed=1, p=float("nan")), ValueError, r"p must lie in \[0, 1\)"),
    (dict(shape=(1, 2, 8, 8), seed=1, p="0.5"), TypeError, "p must be a float"),
    (dict(shape=(1, 2, 8, 8), seed=-1, p=0.5), ValueError, r"seed must be an int in \[0, 2\*\*64\)"),
    (dict(shape=(1, 2, 8, 8), seed=2**70, p=0.5), ValueError, r"seed must be an int in \[0, 2\*\*64\)"),
    (dict(shape=(1, 2, 8, 8), seed=None, p=0.5), ValueError, "seed is required"),
    (dict(shape=(1, -2, 8, 8), seed=1, p=0.5), TypeError, "shape must be a tuple of ints >= 0"),
    (dict(shape=(8, 8), seed=1, p=0.5), ValueError, "shape must be"),
    (dict(shape="1,2,8,8", seed=1, p=0.5), TypeError, "shape must be a tuple"),
])
def test_dropout_mask_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cuflash.dropout_mask(**kwargs)
