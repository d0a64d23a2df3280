"""Conformance vectors from an independent oracle (../shared/golden, PyTorch float64 autograd).

In float64 both the golden values and ours carry a few roundings, each scaled by the magnitude of
the terms a result is summed from (:func:`cuflash.reference.term_magnitudes`): four roundings
(two on each side) at that magnitude is the tolerance. In float32 and float16 the NumPy backend is
held to the usual rule with the golden values as the float64 truth.
"""
from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash.testing import assert_attention_close

EPS = np.finfo(np.float64).eps
NAMES = ("out", "lse", "dq", "dk", "dv")


def _compare64(vec, results, who):
    mags = reference.term_magnitudes(vec.q, vec.k, vec.v, vec.dout, **vec.kwargs)
    for name, got in results.items():
        want = getattr(vec, name)
        assert got.shape == want.shape, f"{who} {name}: shape {got.shape} != {want.shape}"
        inf = np.isinf(want)
        assert np.array_equal(np.isinf(got), inf) and np.array_equal(got[inf], want[inf]), \
            f"{who} {name}: infinite entries (rows that see no key) differ from the golden vector"
        err = np.abs(got[~inf] - want[~inf]).max(initial=0)
        tol = 4 * EPS * mags[name]
        assert err <= tol, f"{who} {name}: error {err:.3e} > {tol:.3e}"


def test_numpy_backend_float64(golden, golden_name):
    vec = golden(golden_name)
    out, lse = cuflash.attention(vec.q, vec.k, vec.v, return_lse=True, backend="numpy", **vec.kwargs)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    grads = cuflash.attention_backward(vec.dout, vec.q, vec.k, vec.v, out, lse, backend="numpy", **vec.kwargs)
    _compare64(vec, dict(zip(NAMES, (out, lse) + tuple(grads))), "numpy")


def test_reference_float64(golden, golden_name):
    vec = golden(golden_name)
    out, lse = reference.attention(vec.q, vec.k, vec.v, return_lse=True, **vec.kwargs)
    grads = reference.attention_backward(vec.dout, vec.q, vec.k, vec.v, **vec.kwargs)
    _compare64(vec, dict(zip(NAMES, (out, lse) + tuple(grads))), "reference")


def test_vjp_float64(golden, golden_name):
    vec = golden(golden_name)
    out, vjp = cuflash.attention_vjp(vec.q, vec.k, vec.v, **vec.kwargs)
    _compare64(vec, dict(zip(("out", "dq", "dk", "dv"), (out,) + tuple(vjp(vec.dout)))), "vjp")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_numpy_backend_low_precision(golden, golden_name, dtype):
    """Inputs rounded to ``dtype``; the naive computation on the same rounded inputs is the baseline."""
    vec = golden(golden_name)
    q, k, v, dout = (x.astype(dtype) for x in (vec.q, vec.k, vec.v, vec.dout))
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy", **vec.kwargs)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="numpy", **vec.kwargs)
    base = reference.attention(q, k, v, return_lse=True, compute_dtype=q.dtype, **vec.kwargs)
    base += reference.attention_backward(dout, q, k, v, compute_dtype=q.dtype, **vec.kwargs)
    mags = reference.term_magnitudes(vec.q, vec.k, vec.v, vec.dout, **vec.kwargs)
    for name, got, b in zip(NAMES, (out, lse) + tuple(grads), base):
        assert_attention_close(got, getattr(vec, name), b, mult=2 if name in ("out", "lse") else 3,
                               name=name, magnitude=mags[name])


def test_golden_set_covers_the_semantics(golden):
    """The vectors pin what they should: -inf rows, causal both ways, windows, GQA, seqlens, masks."""
    vecs = [golden(n) for n in golden.names]
    assert any(np.isneginf(vec.lse).any() for vec in vecs), "no vector has a row that sees no key"
    assert any(vec.q.shape[-3] > vec.k.shape[-3] and vec.kwargs.get("causal") for vec in vecs)
    assert any(vec.q.shape[-3] < vec.k.shape[-3] and vec.kwargs.get("causal") for vec in vecs)
    assert any("window" in vec.kwargs for vec in vecs)
    assert any(vec.q.shape[-2] != vec.k.shape[-2] for vec in vecs)
    assert any("seqlens_q" in vec.kwargs for vec in vecs)
    assert any("block_mask" in vec.kwargs for vec in vecs)
