"""What users of FlashAttention-2 expect (issue: conveniences): ``out=`` buffers for the forward and the backward,
a value head dim different from the query/key head dim, packed QKV / KV inputs, ``layout="bhsd"``; and complete
docstrings. Values are held to the float64 reference by the 2x/3x rule, or compared bitwise with the plain call
they must equal."""
from __future__ import annotations

import inspect
import math
import re

import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash.backends import numpy as nb
from cuflash.testing import assert_attention_close

import fake_cupy


def _arrays(shape_q=(2, 19, 4, 16), shape_k=(2, 27, 2, 16), dv=None, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    shape_v = shape_k if dv is None else shape_k[:-1] + (dv,)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_v).astype(dtype)
    dout = rng.standard_normal(shape_q[:-1] + (shape_v[-1],)).astype(dtype)
    return q, k, v, dout


# ================================================================================================ out= buffers
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_forward_writes_into_out_and_returns_it(layout):
    q, k, v, _ = _arrays(dv=24)
    if layout == "bhsd":
        q, k, v = (np.ascontiguousarray(np.swapaxes(a, 1, 2)) for a in (q, k, v))
    buf = np.full(q.shape[:-1] + (24,), np.nan, np.float32)
    got = cuflash.attention(q, k, v, causal=True, layout=layout, out=buf)
    assert got is buf
    assert np.array_equal(buf, cuflash.attention(q, k, v, causal=True, layout=layout))
    out, lse = cuflash.attention(q, k, v, layout=layout, out=buf, return_lse=True)
    assert out is buf and lse.shape == (2, 4, 19)


def test_backward_writes_into_dq_dk_dv_and_returns_them():
    q, k, v, dout = _arrays()
    out, residual = cuflash.attention(q, k, v, causal=True, return_residual=True)
    bufs = [np.full(a.shape, np.nan, a.dtype) for a in (q, k, v)]
    got = cuflash.attention_backward(dout, residual, dq=bufs[0], dk=bufs[1], dv=bufs[2])
    assert all(g is b for g, b in zip(got, bufs))
    for g, w in zip(got, cuflash.attention_backward(dout, residual)):
        assert np.array_equal(g, w)
    only = cuflash.attention_backward(dout, q, k, v, out, residual.lse, causal=True, dk=bufs[1])
    assert only[1] is bufs[1] and only[0] is not bufs[0]


def _bad_buffers():
    q, k, v, dout = _arrays()
    read_only = np.empty_like(q)
    read_only.flags.writeable = False
    big = np.empty((2, 19, 4, 32), np.float32)
    return q, k, v, dout, [
        ("shape", np.empty((2, 19, 4, 8), np.float32), ValueError, r"out must have shape \(2, 19, 4, 16\)"),
        ("dtype", np.empty(q.shape, np.float64), TypeError, "out must have dtype float32"),
        ("read-only", read_only, ValueError, "out is read-only"),
        ("is-q", q, ValueError, "out shares memory with q"),
        ("view-of-v", None, ValueError, "out shares memory with"),
        ("list", q.tolist(), TypeError, r"\bout must be a numpy.ndarray"),
        ("masked", np.ma.masked_array(np.empty_like(q)), TypeError, "out is a numpy.ma.MaskedArray"),
        ("strided-ok", big[..., ::2], None, None),  # no contiguity is required: the result is copied in
        # one place for several elements: batch 1's result would land on batch 0's
        ("broadcast", np.lib.stride_tricks.as_strided(np.empty((1,) + q.shape[1:], np.float32), q.shape,
                                                      (0,) + q.strides[1:], writeable=True),
         ValueError, "out has elements that share memory"),
        ("window", np.lib.stride_tricks.as_strided(np.empty(q.size, np.float32), q.shape,
                                                   (4 * 16, 4 * 16, 4 * 4, 4), writeable=True),
         ValueError, "out has elements that share memory"),
    ]


@pytest.mark.parametrize("index", range(10))
def test_out_buffer_validation(index, monkeypatch):
    q, k, v, dout, cases = _bad_buffers()
    name, buf, exc, match = cases[index]
    if name == "view-of-v":  # a buffer overlapping an input through another view of the same memory
        qv = np.empty((2, 19, 4, 32), np.float32)
        q, buf = qv[..., :16], qv[..., 8:24]
        q[...] = _arrays()[0]
    if exc is None:
        assert cuflash.attention(q, k, v, out=buf) is buf
        assert np.array_equal(buf, cuflash.attention(q, k, v))
        return
    monkeypatch.setattr(nb, "forward", lambda *a, **kw: pytest.fail("a backend ran before the buffer was checked"))
    with pytest.raises(exc, match=match):
        cuflash.attention(q, k, v, out=buf)


def test_gradient_buffers_must_not_overlap_each_other_or_inputs():
    q, k, v, dout = _arrays()
    _, residual = cuflash.attention(q, k, v, return_residual=True)
    shared = np.empty_like(k)
    with pytest.raises(ValueError, match="dv shares memory with dk"):
        cuflash.attention_backward(dout, residual, dk=shared, dv=shared)
    with pytest.raises(ValueError, match="dq shares memory with dout"):
        cuflash.attention_backward(dout, residual, dq=dout)
    with pytest.raises(ValueError, match=r"dk must have shape \(2, 27, 2, 16\)"):
        cuflash.attention_backward(dout, residual, dk=np.empty_like(q))
    one = np.empty((1,) + q.shape[1:], q.dtype)
    with pytest.raises(ValueError, match="dq has elements that share memory"):
        cuflash.attention_backward(dout, residual, dq=np.lib.stride_tricks.as_strided(
            one, q.shape, (0,) + q.strides[1:], writeable=True))


def test_overlap_with_a_packed_input_names_the_packed_array():
    """A buffer overlapping a packed input is reported under the name the caller passed (``qkv``, ``kv``), not as
    the ``q`` or ``k`` view cuflash cut from it."""
    q, k, v, dout = _arrays(shape_k=(2, 19, 4, 16))
    qkv = np.stack([q, k, v], axis=-3)
    with pytest.raises(ValueError, match=r"out shares memory with qkv \(its v part\)"):
        cuflash.attention_qkvpacked(qkv, out=qkv[..., 2, :, :])
    kv = np.stack([k, v], axis=-3)
    with pytest.raises(ValueError, match=r"out shares memory with kv \(its k part\)"):
        cuflash.attention_kvpacked(q, kv, out=kv[..., 0, :, :])
    _, residual = cuflash.attention_qkvpacked(qkv, return_residual=True)
    with pytest.raises(ValueError, match=r"dqkv shares memory with qkv \(its q part\)"):
        cuflash.attention_backward(dout, residual, dqkv=qkv)
    _, residual = cuflash.attention_kvpacked(q, kv, return_residual=True)
    with pytest.raises(ValueError, match=r"dkv shares memory with kv \(its k part\)"):
        cuflash.attention_backward(dout, residual, dkv=kv)


def test_buffers_on_cupy_are_checked_by_device_ranges(monkeypatch):
    """CuPy buffers: the same rules, the overlap judged by device address ranges; a NumPy buffer for CuPy inputs
    is refused. All before any kernel launch."""
    cp = fake_cupy.install(monkeypatch, fake_cupy.make())
    q, k, v = (cp.asarray(a.astype(np.float16)) for a in _arrays()[:3])
    with pytest.raises(ValueError, match="out shares memory with q"):
        cuflash.attention(q, k, v, out=q[:, :, :, :])
    with pytest.raises(TypeError, match="out must be a cupy array like q, k, v"):
        cuflash.attention(q, k, v, out=np.empty(q.shape, np.float16))
    with pytest.raises(ValueError, match="out must have shape"):
        cuflash.attention(q, k, v, out=cp.empty((1, 1, 1, 1), np.float16))
    assert cp._launches == []


# ======================================================================================== head_dim_v != head_dim
def _reference_by_value_columns(q, k, v, dout, compute_dtype=np.float64, **options):
    """The float64 reference, which needs v's head dim to be q's, applied to v's columns in chunks of q's head
    dim (attention is linear in v: out = P v, and dS = P∘(dO Vᵀ - rowsum(dO∘O)) is a sum over the columns),
    the last chunk completed with zero columns. Returns (out, lse, dq, dk, dv, magnitudes)."""
    d, dv = k.shape[-1], v.shape[-1]
    outs, dvs, dq, dk, lse = [], [], 0, 0, None
    mags = {"out": 0.0, "lse": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    for start in range(0, dv, d):
        width = min(d, dv - start)
        vc, dc = v[..., start:start + width], dout[..., start:start + width]
        if width < d:
            pad = [(0, 0)] * (v.ndim - 1) + [(0, d - width)]
            vc, dc = np.pad(vc, pad), np.pad(dc, pad)
        o, lse = reference.attention(q, k, vc, return_lse=True, compute_dtype=compute_dtype, **options)
        g = reference.attention_backward(dc, q, k, vc, compute_dtype=compute_dtype, **options)
        outs.append(o[..., :width])
        dvs.append(g[2][..., :width])
        dq, dk = dq + g[0].astype(np.float64), dk + g[1].astype(np.float64)
        m = reference.term_magnitudes(q, k, vc, dc, **options)
        mags = {"out": max(mags["out"], m["out"]), "lse": m["lse"], "dq": mags["dq"] + m["dq"],
                "dk": mags["dk"] + m["dk"], "dv": max(mags["dv"], m["dv"])}
    return np.concatenate(outs, -1), lse, dq, dk, np.concatenate(dvs, -1), mags


@pytest.mark.parametrize("d,dv", [(16, 8), (8, 24), (12, 40), (16, 1)])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (5, 1), "scale": 0.7},
                                     {"seqlens_q": np.array([19, 3]), "seqlens_k": np.array([2, 27])}],
                         ids=["plain", "causal", "window-scale", "seqlens"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_value_head_dim_differs(d, dv, options, dtype):
    q, k, v, dout = _arrays((2, 19, 4, d), (2, 27, 2, d), dv=dv, seed=d * dv, dtype=dtype)
    out, residual = cuflash.attention(q, k, v, return_residual=True, **options)
    assert out.shape == (2, 19, 4, dv) and out.dtype == dtype
    grads = cuflash.attention_backward(dout, residual)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    ref = _reference_by_value_columns(q, k, v, dout, **options)
    base = _reference_by_value_columns(q, k, v, dout, compute_dtype=dtype, **options)
    mags = ref[5]
    for name, got, r, b, mult in (("out", out, ref[0], base[0], 2), ("lse", residual.lse, ref[1], base[1], 2),
                                  ("dq", grads[0], ref[2], base[2], 3), ("dk", grads[1], ref[3], base[3], 3),
                                  ("dv", grads[2], ref[4], base[4], 3)):
        assert_attention_close(got, r, np.asarray(b).astype(dtype), mult=mult, name=name, magnitude=mags[name])


def test_value_head_dim_keeps_the_default_scale_of_q_and_k():
    """Padding q and k to v's head dim must not change the default scale 1/sqrt(head_dim of q, k)."""
    q, k, v, _ = _arrays((1, 9, 2, 8), (1, 9, 2, 8), dv=32)
    got = cuflash.attention(q, k, v)
    assert np.array_equal(got, cuflash.attention(q, k, v, scale=1 / math.sqrt(8)))
    assert not np.allclose(got, cuflash.attention(q, k, v, scale=1 / math.sqrt(32)))


def test_value_head_dim_shapes_of_dout_and_out_are_checked():
    q, k, v, dout = _arrays(dv=8)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"dout must have shape \(2, 19, 4, 8\) \(q's shape with v's head_dim\)"):
        cuflash.attention_backward(np.zeros(q.shape, q.dtype), q, k, v, out, lse)  # q's head dim: the wrong one
    with pytest.raises(ValueError, match="k and v"):
        cuflash.attention(q, k, v[:, :-1])


# ================================================================================================ packed inputs
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_qkvpacked_is_attention_of_the_views(layout):
    q, k, v, dout = _arrays((2, 19, 4, 16), (2, 19, 4, 16))
    axis = 2 if layout == "bshd" else 1  # (B, S, 3, H, D) or (B, 3, H, S, D)
    if layout == "bhsd":
        q, k, v, dout = (np.swapaxes(a, 1, 2) for a in (q, k, v, dout))
    qkv = np.stack([q, k, v], axis=axis)
    out, residual = cuflash.attention_qkvpacked(qkv, causal=True, layout=layout, return_residual=True)
    assert residual.packed == "qkv"
    want_out, want_res = cuflash.attention(q, k, v, causal=True, layout=layout, return_residual=True)
    assert np.array_equal(out, want_out)
    dqkv = cuflash.attention_backward(dout, residual)
    assert dqkv.shape == qkv.shape
    assert np.array_equal(dqkv, np.stack(cuflash.attention_backward(dout, want_res), axis=axis))
    buf = np.empty_like(qkv)
    assert cuflash.attention_backward(dout, residual, dqkv=buf) is buf and np.array_equal(buf, dqkv)
    with pytest.raises(TypeError, match=r"dq= is not a buffer of a residual of attention_qkvpacked"):
        cuflash.attention_backward(dout, residual, dq=np.empty_like(q))


def test_kvpacked_is_attention_of_the_views():
    q, k, v, dout = _arrays()
    kv = np.stack([k, v], axis=2)  # (B, Sk, 2, Hkv, D)
    out, residual = cuflash.attention_kvpacked(q, kv, window=(6, 0), return_residual=True)
    want, want_res = cuflash.attention(q, k, v, window=(6, 0), return_residual=True)
    assert np.array_equal(out, want)
    dq, dkv = cuflash.attention_backward(dout, residual)
    gq, gk, gv = cuflash.attention_backward(dout, want_res)
    assert np.array_equal(dq, gq) and np.array_equal(dkv, np.stack([gk, gv], axis=2))
    bufs = np.empty_like(q), np.empty_like(kv)
    got = cuflash.attention_backward(dout, residual, dq=bufs[0], dkv=bufs[1])
    assert got[0] is bufs[0] and got[1] is bufs[1] and np.array_equal(bufs[1], dkv)


def test_packed_shapes_are_checked():
    q, k, v, _ = _arrays((2, 19, 4, 16), (2, 19, 4, 16))
    with pytest.raises(ValueError, match=r"qkv must have shape \(..., seqlen, 3, heads, head_dim\)"):
        cuflash.attention_qkvpacked(np.stack([q, k], axis=2))
    with pytest.raises(ValueError, match=r"kv must have shape \(..., 2, heads, seqlen, head_dim\) for layout='bhsd'"):
        cuflash.attention_kvpacked(q, np.stack([k, v], axis=2), layout="bhsd")
    with pytest.raises(TypeError, match="qkv must be a numpy.ndarray"):
        cuflash.attention_qkvpacked([q, k, v])


# ================================================================================================ layout
def test_bhsd_layout_reads_views_and_equals_bshd(monkeypatch):
    q, k, v, dout = _arrays()
    qt, kt, vt, dt = (np.ascontiguousarray(np.swapaxes(a, 1, 2)) for a in (q, k, v, dout))  # (B, H, S, D)
    seen = []
    forward = nb.forward

    def spy(problem):
        seen.append(np.shares_memory(problem.q, qt) and np.shares_memory(problem.k, kt))
        return forward(problem)

    monkeypatch.setattr(nb, "forward", spy)
    out, residual = cuflash.attention(qt, kt, vt, causal=True, layout="bhsd", return_residual=True)
    assert seen == [True]  # the backend read the caller's memory: transposed views, no copies
    want, want_res = cuflash.attention(q, k, v, causal=True, return_residual=True)
    assert out.shape == qt.shape and np.array_equal(out, np.swapaxes(want, 1, 2))
    assert np.array_equal(residual.lse, want_res.lse)  # (B, H, Sq) in both layouts
    for g, w in zip(cuflash.attention_backward(dt, residual), cuflash.attention_backward(dout, want_res)):
        assert g.shape == np.swapaxes(w, 1, 2).shape and np.array_equal(g, np.swapaxes(w, 1, 2))
    keyword = cuflash.attention_backward(dt, qt, kt, vt, out, residual.lse, causal=True, layout="bhsd")
    assert np.array_equal(keyword[0], np.swapaxes(cuflash.attention_backward(dout, want_res)[0], 1, 2))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_results_are_contiguous_in_the_callers_layout(monkeypatch, layout, dtype):
    """out and the gradients come back C-contiguous in the layout asked for (a "bshd" result was a transposed view
    of the NumPy backend's (B, H, S, D) memory; the docs said the opposite), and the NumPy backend lays them out so
    itself: no copy at the edge. A value head dim of its own (results cut from padded ones) is contiguous too."""
    from cuflash import _layout

    copies = []

    class Spy:  # NumPy, as the array module of _layout (whose from_bshd copies with it), counting the copies
        def __getattr__(self, name):
            return getattr(np, name)

        def ascontiguousarray(self, a):
            copies.append(a.shape)
            return np.ascontiguousarray(a)

    monkeypatch.setattr(_layout, "array_module", lambda *a, **kw: Spy())
    for dv in (None, 8):
        q, k, v, dout = (_layout.swap(a).astype(dtype) if layout == "bhsd" else a.astype(dtype)
                         for a in _arrays(dv=dv))
        out, residual = cuflash.attention(q, k, v, causal=True, layout=layout, return_residual=True)
        grads = cuflash.attention_backward(dout, residual)
        for name, x in zip(("out", "dq", "dk", "dv"), (out,) + tuple(grads)):
            assert x.flags.c_contiguous, (name, dv, x.strides)
        assert len(copies) == (0 if dv is None else 2), copies  # out and dv, cut from padded ones, copied


def test_layout_is_validated():
    q, k, v, _ = _arrays()
    with pytest.raises(ValueError, match=r"layout must be 'bshd' \(..., seqlen, heads, head_dim\) or 'bhsd'"):
        cuflash.attention(q, k, v, layout="BSHD")


# ================================================================================================ docstrings
PUBLIC = [cuflash.attention, cuflash.attention_backward, cuflash.attention_qkvpacked, cuflash.attention_kvpacked,
          cuflash.merge_attention_states]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_docstrings_are_complete_numpydoc(fn):
    """Every parameter of the signature is documented in the Parameters section, the placeholders are filled in,
    and there are Parameters and Returns sections."""
    doc = fn.__doc__
    assert "{options}" not in doc and "{arrays}" not in doc
    assert re.search(r"\n\s*Parameters\n\s*-{10}", doc) and re.search(r"\n\s*Returns\n\s*-{7}", doc)
    params = doc.split("Parameters")[1].split("Returns")[0]
    documented = set()
    for line in params.splitlines():
        head = re.match(r"^ {4}([A-Za-z_][\w, ]*) :", line)
        if head:
            documented.update(n.strip() for n in head.group(1).split(","))
    missing = [p for p in inspect.signature(fn).parameters if p not in documented]
    assert not missing, f"{fn.__name__}: undocumented parameters {missing}"
