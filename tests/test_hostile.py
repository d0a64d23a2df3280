"""Hostile input (issue: hardening): huge, negative, NaN, wrongly typed, byte-swapped, subclassed, aliased and
later-modified arguments give a clear error before any computation, or the float64 reference's result."""
from __future__ import annotations

import re
import sys

import numpy as np
import pytest

import cuflash
import cuflash.emulate
from cuflash.testing import Case, assert_attention_close, check_forward


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


@pytest.mark.parametrize("form,part,name", [("qkv", 2, "qkv (its v part)"), ("kv", 0, "kv (its k part)")])
def test_an_in_place_change_to_a_packed_input_is_named_as_the_caller_passed_it(form, part, name):
    """The residual of a packed call watched its parts as q, k and v: "v was modified", of an array never passed."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 8))
    packed = rng.standard_normal((2, 5, 3, 4, 8) if form == "qkv" else (2, 5, 2, 4, 8))
    out, residual = (cuflash.attention_qkvpacked(packed, return_residual=True) if form == "qkv" else
                     cuflash.attention_kvpacked(q, packed, return_residual=True))
    packed[0, 0, part, 0, 0] += 1
    with pytest.raises(ValueError, match=re.escape(name) + " was modified in place"):
        cuflash.attention_backward(np.ones_like(out), residual)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(shape=(1, 2, 8, 8), seed=1, p=1.5), ValueError, r"p must lie in \[0, 1 - 2\*\*-32\], got 1.5$"),
    (dict(shape=(1, 2, 8, 8), seed=1, p=float("nan")), ValueError, r"p must lie in \[0, 1 - 2\*\*-32\], got nan$"),
    (dict(shape=(1, 2, 8, 8), seed=1, p="0.5"), TypeError, "p must be a float"),
    (dict(shape=(1, 2, 8, 8), seed=-1, p=0.5), ValueError, r"seed must be an int in \[0, 2\*\*64\)"),
    (dict(shape=(1, 2, 8, 8), seed=2**70, p=0.5), ValueError, r"seed must be an int in \[0, 2\*\*64\)"),
    (dict(shape=(1, 1, 2**70, 1), seed=1, p=0.5), ValueError, r"shape \(1, 1, 1180591620717411303424, 1\) has "
                                                                r"dimensions that multiply to"),
    # a zero dimension beside huge ones: NumPy's "array is too big" and a reshape error named nothing of cuflash's
    (dict(shape=(2**40, 2**40, 0, 1, 1), seed=1, p=0.5), ValueError, "more than an array can index"),
    (dict(shape=(1, 2**70, 0, 4), seed=1, p=0.5), ValueError, "more than an array can index"),
    (dict(shape=(1, 2, 8, 8), seed=None, p=0.5), ValueError, "seed is required"),
    (dict(shape=(1, 2, 8, 8), seed=1, p=1e-12), ValueError, r"p must be 0 or lie in \[2\*\*-32, 1 - 2\*\*-32\]"),
    (dict(shape=(1, -2, 8, 8), seed=1, p=0.5), TypeError, "shape must be a tuple of ints >= 0"),
    (dict(shape=(8, 8), seed=1, p=0.5), ValueError, "shape must be"),
    (dict(shape="1,2,8,8", seed=1, p=0.5), TypeError, "shape must be a tuple"),
])
def test_dropout_mask_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cuflash.dropout_mask(**kwargs)


# ------------------------------------------------------------------------------------------------ review 2026-11-27
def test_result_buffers_must_not_overlap_option_arrays():
    """``out=`` (and ``dq=``) over the caller's bias would overwrite it before the backward reads it again."""
    q, k, v = _qkv()
    bias = np.zeros((2, 2, 40, 40), np.float32)
    inside = bias.reshape(-1)[:q.size].reshape(q.shape)  # q's shape and dtype, in the bias's memory
    with pytest.raises(ValueError, match="out shares memory with bias"):
        cuflash.attention(q, k, v, bias=bias, out=inside)
    o, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
    with pytest.raises(ValueError, match="dq shares memory with bias"):
        cuflash.attention_backward(o, q, k, v, o, lse, bias=bias, dq=inside)
    assert not bias.any()  # nothing was written
    assert cuflash.attention(q, k, v, bias=bias, out=np.empty_like(inside)) is not None  # a buffer of its own: fine


@pytest.mark.parametrize("p", [pytest.param(__import__("fractions").Fraction(10**17 - 1, 10**17), id="fraction"),
                               pytest.param(np.nextafter(np.longdouble(1), np.longdouble(0)), id="longdouble")])
def test_dropout_p_that_rounds_to_one_is_refused(p):
    """Below 1 as given, 1.0 as the float64 every backend computes with: refused naming dropout_p (it divided by
    1 - p = 0 inside the backend)."""
    if float(p) != 1.0:
        pytest.skip("this platform's longdouble is float64: no value below 1 rounds to 1")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"dropout_p must lie in \[0, 1 - 2\*\*-32\], got .*\(it is 1.0 as a float64\)"):
        cuflash.attention(q, k, v, dropout_p=p, seed=1)
    with pytest.raises(ValueError, match="dropout_p"):
        cuflash.reference.attention(q, k, v, dropout_p=p, dropout_mask=np.ones((2, 2, 40, 40), bool))


@pytest.mark.parametrize("dtype,cap,ok", [(np.float32, 1e-40, False), (np.float16, 1e-39, False),
                                          (np.float32, 2e-38, True), (np.float64, 1e-300, True),
                                          (np.float64, 1e-310, False)])
def test_softcap_below_the_smallest_normal_is_refused(dtype, cap, ok):
    """A cap that is 0 (or subnormal, flushed on a GPU) in the working precision gave 0/0 = NaN for a zero score."""
    q, k, v = _qkv(dtype=dtype)
    q[0, 0] = 0  # zero scores
    if not ok:
        with pytest.raises(ValueError, match="softcap must be a real > 0"):
            cuflash.attention(q, k, v, softcap=cap)
        return
    out, lse = check_forward(lambda *a, **o: cuflash.attention(*a, **o, return_lse=True),
                             Case(q, k, v, q, dict(softcap=cap)))  # the rule of the (long double) reference
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_big_endian_q_with_its_own_value_head_dim():
    """head_dim_v != head_dim with a byte-swapped q: the same result as native q (it was refused as "k and v must
    have the same shape")."""
    q, k, v = _qkv()
    v = v[..., :8].copy()
    want = cuflash.attention(q, k, v, return_lse=True)
    got = cuflash.attention(q.astype(q.dtype.newbyteorder()), k, v, return_lse=True)
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
    out = np.empty_like(want[0])  # native order: the result's dtype, taken as out= too
    assert cuflash.attention(q.astype(q.dtype.newbyteorder()), k, v, out=out) is out


@pytest.mark.parametrize("k_shape,v_shape,match", [
    ((2, 40, 2, 16), (2, 40, 2, 8), None),  # head_dim_v of its own: fine
    ((2, 40, 2, 16), (2, 41, 2, 16), "same seqlen_k and heads_kv"),
])
def test_messages_show_the_callers_layout(k_shape, v_shape, match):
    """With layout="bhsd" a wrong shape is reported as the caller passed it, not transposed."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 2, 40, 16)).astype(np.float32)
    k = rng.standard_normal(k_shape).astype(np.float32).transpose(0, 2, 1, 3).copy()  # (b, h, s, d)
    v = rng.standard_normal(v_shape).astype(np.float32).transpose(0, 2, 1, 3).copy()
    if match is None:  # accepted: the result of the same arrays in the bshd layout, transposed (the same sums)
        got = cuflash.attention(q, k, v, layout="bhsd")
        want = cuflash.attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)))
        np.testing.assert_array_equal(got, want.transpose(0, 2, 1, 3))
        return
    with pytest.raises(ValueError, match=match) as info:
        cuflash.attention(q, k, v, layout="bhsd")
    assert str(tuple(k.shape)) in str(info.value) and str(tuple(v.shape)) in str(info.value)
    o, lse = cuflash.attention(q, q, q, layout="bhsd", return_lse=True)
    with pytest.raises(ValueError, match=r"dout must have q's shape \(2, 2, 40, 16\), got \(2, 2, 39, 16\)"):
        cuflash.attention_backward(o[:, :, :39], q, q, q, o, lse, layout="bhsd")


def test_padding_for_head_dim_v_names_the_argument():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="^v is a numpy.ma.MaskedArray"):
        cuflash.attention(q, k, np.ma.masked_array(v[..., :8]))


@pytest.mark.parametrize("name,options", [
    ("bias", dict(bias=np.full((4, 4), 1e300))),
    ("bias", dict(bias=np.broadcast_to(np.array([0.0, -1e39]).reshape(2, 1, 1), (2, 4, 4)))),
    ("alibi_slopes", dict(alibi_slopes=np.array([1.0, 1e39]))),
    ("mod_arrays\\['x'\\]", dict(score_mod="score + x", mod_arrays={"x": 1e300})),
    ("mod_arrays\\['x'\\]", dict(score_mod="score + x[h]", mod_arrays={"x": np.array([0.0, -4e38])})),
])
def test_float64_operands_past_the_working_precision_are_refused(name, options):
    """With float32 inputs the modifiers compute in float32: a float64 operand past its largest became inf there
    (NaN outputs, a RuntimeWarning at most), as scale and softcap are refused; inf itself and values that fit
    pass."""
    q, k, v = (np.random.default_rng(1).standard_normal((1, 4, 2, 8)).astype(np.float32) for _ in range(3))
    with pytest.raises(ValueError, match=f"^{name} holds finite values beyond the largest float32"):
        cuflash.attention(q, k, v, **options)
    fits = cuflash.attention(q, k, v, bias=np.array([0.0, -3e38, -np.inf, 0.0]))  # float64 bias within float32
    assert np.isfinite(fits).all()
    wide = cuflash.attention(*(x.astype(np.float64) for x in (q, k, v)), **options)  # float64 inputs: it fits
    assert wide.dtype == np.float64


@pytest.mark.parametrize("value", [np.ma.masked_array(2.0, mask=True), np.ma.masked_array([1.0, 2.0])])
def test_masked_mod_arrays_are_refused_zero_dimensional_ones_too(value):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"mod_arrays\['s'\] is a numpy.ma.MaskedArray"):
        cuflash.attention(q, k, v, score_mod="score * s[0]" if value.ndim else "score * s", mod_arrays={"s": value})


@pytest.mark.parametrize("p", [1e-10, 2.0**-33, np.float32(1e-12)])
def test_a_dropout_p_below_2_to_the_minus_32_is_refused(p):
    """Below 2**-32 the keep-mask (32-bit randoms against floor(p * 2**32)) drops nothing, yet the kept elements were
    scaled by 1 / (1 - p); the CUDA kernels' backward took that threshold of 0 for no dropout and left the scale out of
    dS alone (float64 dq off by a relative p on the emulator). 2**-32 itself is the smallest p that drops."""
    q, k, v = _qkv(dtype=np.float64)
    with pytest.raises(ValueError, match=r"dropout_p must be 0 or lie in \[2\*\*-32, 1 - 2\*\*-32\]"):
        cuflash.attention(q, k, v, dropout_p=p, seed=1)
    with pytest.raises(ValueError, match=r"dropout_p must be 0 or lie in \[2\*\*-32"):
        cuflash.attention_varlen(q[0], k[0], v[0], np.array([0, 40], np.int32), np.array([0, 40], np.int32),
                                 dropout_p=p, seed=1)
    out = cuflash.attention(q, k, v, dropout_p=2.0**-32, seed=1)
    assert np.isfinite(out).all()


def test_seqlens_beyond_int32_are_refused():
    """Lengths are kept as int32 (the kernels'): a key sequence longer than 2**31 - 1 (a broadcast view holds one) with
    seqlens_k = 2**32 + 1 wrapped to 1 and returned the first key's value alone, silently."""
    q = np.ones((1, 1, 1, 1), np.float16)
    k = np.broadcast_to(np.ones((1, 1, 1, 1), np.float16), (1, 2**32 + 5, 1, 1))
    for n in (2**32 + 1, 2**31):
        with pytest.raises(ValueError, match=r"seqlens_k values must lie in \[0, 2147483647\] \(int32\)"):
            cuflash.attention(q, k, k, seqlens_k=np.array([n], np.int64))


def test_masked_seqlens_are_refused():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="seqlens_k is a numpy.ma.MaskedArray"):
        cuflash.attention(q, k, v, seqlens_k=np.ma.masked_array([9, 5], mask=[0, 1]))


@pytest.mark.parametrize("backend,variable", [("numpy", "CUFLASH_BLAS"), ("emulate", "CUFLASH_EMULATE_SCHEDULE"),
                                              ("emulate", "CUFLASH_EMULATE_STACK_KIB")])
def test_a_kvcache_call_refused_for_the_environment_leaves_the_cache(backend, variable, monkeypatch):
    """The environment is checked before the new tokens are appended (it was read after: the cache was written)."""
    monkeypatch.setenv(variable, "bogus")
    q = np.ones((1, 1, 2, 64), np.float16)
    kc, vc, kn = np.zeros((1, 8, 2, 64), np.float16), np.zeros((1, 8, 2, 64), np.float16), q.copy()
    with pytest.raises(ValueError, match=variable):
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([3], np.int32), k_new=kn, v_new=kn,
                                       backend=backend)
    assert not kc.any() and not vc.any()


def test_an_in_place_change_of_the_residuals_lse_is_detected():
    q, k, v = _qkv()
    out, res = cuflash.attention(q, k, v, causal=True, return_residual=True)
    cuflash.attention_backward(out, res)
    res.lse[...] += 1.0
    with pytest.raises(ValueError, match="lse was modified in place"):
        cuflash.attention_backward(out, res)


@pytest.mark.parametrize("shape", ["plain", "batch 1", "one query", "one head", "a view"])
def test_a_residual_pickles_and_its_copy_gives_the_same_gradients(shape):
    """A residual (and attention_vjp's vjp) held its options as a mappingproxy, which neither pickle nor deepcopy takes
    ("cannot pickle 'mappingproxy' object", naming nothing of cuflash's); a BlockMask and attention_varlen_vjp's vjp
    pickled. A copy carries the saved arrays: its backward checks them and gives the original's bits; its options stay
    read-only."""
    import copy
    import pickle

    q, k, v = _qkv()
    # a copy's strides differ from the original's where a dimension is 1 or the array is a view: the fingerprint
    # held the strides, and the copy refused its own unchanged arrays as modified in place
    q = {"plain": q, "batch 1": q[:1], "one query": q[:, -1:], "one head": q[:, :, :1], "a view": q[:, ::2]}[shape]
    k, v = (k[:1], v[:1]) if shape == "batch 1" else (k[:, :, :1], v[:, :, :1]) if shape == "one head" else (k, v)
    out, res = cuflash.attention(q, k, v, causal=True, dropout_p=0.25, return_residual=True)
    dout = np.ones_like(out)
    want = cuflash.attention_backward(dout, res)
    for twin in (pickle.loads(pickle.dumps(res)), copy.deepcopy(res)):
        assert twin.seed == res.seed and dict(twin.options) == dict(res.options)
        with pytest.raises(TypeError):
            twin.options["causal"] = False  # read-only, as the original's
        for a, b in zip(cuflash.attention_backward(dout, twin), want):
            assert np.array_equal(a, b)
        twin.out[0, 0, 0, 0] += 1.0  # the copy's own arrays are watched
        with pytest.raises(ValueError, match="out was modified in place"):
            cuflash.attention_backward(dout, twin)
    _, vjp = cuflash.attention_vjp(q, k, v, causal=True)
    for a, b in zip(pickle.loads(pickle.dumps(vjp))(dout), vjp(dout)):
        assert np.array_equal(a, b)


def test_an_in_place_change_of_a_block_masks_arrays_is_detected():
    """The residual fingerprinted q, k, v, out, lse, a bias, seqlens and mod_arrays but not the BlockMask's arrays,
    which a caller can make writeable again: zeroing them after the forward gave the gradients of another mask (dq
    off by 1.06) with no error."""
    q, k, v = _qkv()
    bm = cuflash.BlockMask.from_dense(np.tril(np.ones((q.shape[1], k.shape[1]), bool)), block=(4, 4))
    out, res = cuflash.attention(q, k, v, block_mask=bm, return_residual=True)
    cuflash.attention_backward(np.ones_like(out), res)
    arrays = [bm.states] + [a for a in bm.values.values() if isinstance(a, np.ndarray)]
    changed = next(a for a in arrays if a is not bm.states)
    changed.setflags(write=True)
    changed[...] = 0
    with pytest.raises(ValueError, match="block_mask.values.* was modified in place"):
        cuflash.attention_backward(np.ones_like(out), res)


def test_a_non_native_out_buffer_is_named_by_its_byte_order():
    """Results are in the machine's byte order: a '>f4' out for '>f4' inputs is refused, and the message said "out
    must have dtype float32 (q's), got >f4", as if its dtype were another."""
    q, k, v = (a.astype(a.dtype.newbyteorder(">" if np.little_endian else "<")) for a in _qkv())
    with pytest.raises(TypeError, match="out must have dtype float32 \\(q's\\) in this machine byte order, got [<>]f4"):
        cuflash.attention(q, k, v, out=np.empty(q.shape, q.dtype))


def test_empty_result_buffers_and_caches_are_accepted():
    """NumPy gives an empty array zero strides: it was refused as "a broadcast or stride-tricks view"."""
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    buf = z(0, 4, 2, 16)
    assert cuflash.attention(z(0, 4, 2, 16), z(0, 4, 2, 16), z(0, 4, 2, 16), out=buf) is buf
    out, res = cuflash.attention(z(0, 4, 2, 16), z(0, 4, 2, 16), z(0, 4, 2, 16), return_residual=True)
    dq = z(0, 4, 2, 16)
    assert cuflash.attention_backward(out, res, dq=dq)[0] is dq
    got = cuflash.attention_with_kvcache(z(0, 1, 4, 32), z(0, 16, 2, 32), z(0, 16, 2, 32),
                                         cache_seqlens=np.zeros(0, np.int32), k_new=z(0, 1, 2, 32),
                                         v_new=z(0, 1, 2, 32))
    assert got.shape == (0, 1, 4, 32)


def _strict(call):
    """``call()`` under np.seterr(all="raise") and with warnings as errors (python -W error)."""
    import warnings

    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        return call()


def test_numpys_raise_setting_and_warnings_as_errors_change_nothing():
    """cuflash's arithmetic ignores NumPy's floating-point settings (cuflash/_fp.py), but casts outside it did not:
    dbias rounded to a float16 bias (underflow as a rule), merge_attention_states' final rounding, the range check of
    a float64 bias of 1e-300 under float32 inputs, and the testing helpers' roundings raised under
    np.seterr(all="raise"); each now gives the bits of the default settings."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 16, 1, 8)).astype(np.float16) for _ in range(4))
    bias = (rng.standard_normal((1, 1, 16, 16)) * 8).astype(np.float16)

    def dbias():
        out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True, backend="numpy")
        return cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias, return_dbias=True, backend="numpy")

    q3, k3, v4 = q * 3, k * 3, v * np.float16(1e-4)
    parts = [cuflash.attention(q3, k3[:, s], v4[:, s], return_lse=True) for s in (slice(0, 8), slice(8, 16))]

    def merged():
        return cuflash.merge_attention_states([p[0] for p in parts], [p[1] for p in parts])

    def tiny_bias():
        q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
        return (cuflash.attention(q32, k32, v32, bias=np.full((16, 16), 1e-300), backend="numpy"),)

    for call in (dbias, merged, tiny_bias):
        want = call()
        for got, w in zip(_strict(call), want):
            assert got.tobytes() == w.tobytes(), call.__name__
    small = np.full((1, 4, 1, 2), 3e-6)  # the reference rounded to float16 is a subnormal
    with np.errstate(under="ignore"):
        small16 = small.astype(np.float16)
    _strict(lambda: cuflash.testing.assert_attention_close(small16, small, small16))


def test_the_float64_backward_near_the_largest_float64():
    """V and dO near 1e308: the backward's power-of-two shifts (_GradShifts) multiplied the scale by 2^shift in a
    Python float first, an OverflowError past float64's range under default settings. dQ and dK are ~1e615 (the
    long-double reference): inf of the right sign is their correctly rounded float64 value; dV is finite."""
    if np.finfo(np.longdouble).max <= np.finfo(np.float64).max:
        pytest.skip("this platform's longdouble is float64: no reference holds gradients past float64's range")
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((1, 20, 2, 8)) for _ in range(4))
    v, dout = v / np.abs(v).max() * 1e308, dout / np.abs(dout).max() * 1e308
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy")
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="numpy")
    want = cuflash.reference.attention_backward(dout, q, k, v, compute_dtype=np.longdouble)
    with np.errstate(over="ignore", invalid="ignore"):
        naive = cuflash.reference.attention_backward(dout, q, k, v, compute_dtype=np.float64)
    for g, w, n, name in zip(grads, want, naive, ("dq", "dk", "dv")):
        past = np.abs(w) > np.finfo(np.float64).max
        np.testing.assert_array_equal(np.isinf(g), past)
        np.testing.assert_array_equal(np.sign(g[past]), np.sign(w[past]).astype(np.float64))
        assert_attention_close(g, w, n, mult=3, name=name)  # the finite ones (all of dV) by the rule
    assert np.isfinite(grads[2]).all()


def test_a_scale_past_float32s_range_over_log2e_warns_not():
    """The kernels' scale * log2(e) rounded to float32: a float32 scale above 2.36e38 overflows there (README's first
    range limit) and printed NumPy's overflow warning (an error under -W error) on the emulated and CUDA backends."""
    from types import SimpleNamespace

    from cuflash.cuda import launch

    assert _strict(lambda: launch._scale_log2(SimpleNamespace(scale=3e38))) == np.float32(np.inf)
    tiny = _strict(lambda: launch._scale_log2(SimpleNamespace(scale=1e-40)))  # rounded once, to a subnormal
    assert tiny == np.float32(1e-40 * np.log2(np.e)) and 0 < tiny < np.finfo(np.float32).tiny


def test_a_numpy_subclass_from_a_module_named_like_jax_is_a_buffer():
    """The JAX refusal read "jax" anywhere in the array type's top-level module: a NumPy subclass of a user module
    ajax_buffers was refused as out= ("a JAX array, which JAX never lets change")."""
    import types

    module = types.ModuleType("ajax_buffers")
    exec("import numpy as np\nclass Buffer(np.ndarray):\n    pass\n", module.__dict__)
    q, k, v = _qkv()
    out = np.zeros_like(q).view(module.Buffer)
    assert cuflash.attention(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, cuflash.attention(q, k, v))


def test_a_tiny_longdouble_operand_fits_under_numpys_raise_setting():
    """The range check's branch for numbers cast a longdouble mod_arrays scalar of 1e-300 to float32 under
    errstate(over="ignore") only: FloatingPointError (underflow) under np.seterr(all="raise")."""
    q, k, v = _qkv()
    ops = dict(score_mod="score + c", mod_arrays={"c": np.longdouble(1e-300)})
    want = cuflash.attention(q, k, v, **ops)
    assert _strict(lambda: cuflash.attention(q, k, v, **ops)).tobytes() == want.tobytes()
