"""cuflash.attention_varlen, attention_varlen_backward and attention_varlen_vjp: ragged batches packed along the
token axis with int32 cumulative offsets.

The main property: every result matches the float64 reference at the usual rule (2x / 3x the naive same-dtype
error plus the floor), computed on the padded batch with seqlens_q/seqlens_k (where sequence i is batch entry i, so
b-dependent modifiers and dropout have one meaning in both) and, for options that do not read b, on each unpacked
sequence alone; cuflash.attention on the padded batch agrees at the same rule. Hypothesis draws ragged batches with
empty and length-1 sequences. Then memory that follows the real tokens, determinism, the vjp, and every bad input
refused before any computation with an error naming the argument.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference
from cuflash.backends import numpy as nb
from cuflash.testing import _input_dtype as _dtype, assert_attention_close, reference_dtype

import test_api_conveniences as conveniences


# ============================================================================================ helpers
def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def ragged(rng, len_q, len_k, hq, hkv, d, dtype):
    """Packed q, k, v, dout and their offsets."""
    cq, ck = offsets(len_q), offsets(len_k)
    q, dout = (rng.standard_normal((cq[-1], hq, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((ck[-1], hkv, d)).astype(dtype) for _ in range(2))
    return q, k, v, dout, cq, ck


def pad(x, cu, length):
    """Packed ``(total, ...)`` -> padded ``(batch, length, ...)``, zeros past each sequence."""
    out = np.zeros((len(cu) - 1, length) + x.shape[1:], dtype=x.dtype)
    for i in range(len(cu) - 1):
        out[i, :cu[i + 1] - cu[i]] = x[cu[i]:cu[i + 1]]
    return out


def pack(x, cu, axis=1):
    """Padded ``(batch, length, ...)`` (rows on ``axis``) -> packed rows (on ``axis - 1``)."""
    parts = [np.take(x[i], np.arange(cu[i + 1] - cu[i]), axis=axis - 1) for i in range(len(cu) - 1)]
    return np.concatenate(parts, axis=axis - 1) if parts else x[0]


class Padded:
    """The padded batch of a ragged one, and the float64 reference, naive baseline and term magnitudes on it."""

    def __init__(self, q, k, v, dout, cq, ck, options):
        self.cq, self.ck = cq, ck
        lq, lk = np.diff(cq), np.diff(ck)
        self.sq, self.sk = int(lq.max(initial=0)), int(lk.max(initial=0))
        self.arrays = [pad(q, cq, self.sq), pad(k, ck, self.sk), pad(v, ck, self.sk), pad(dout, cq, self.sq)]
        self.options = {**options, "seqlens_q": lq.astype(np.int32), "seqlens_k": lk.astype(np.int32)}
        p, seed = self.options.pop("dropout_p", 0.0), self.options.pop("seed", None)
        self.cuflash_options = dict(self.options, dropout_p=p, seed=seed) if p else dict(self.options)
        shape = (len(lq), q.shape[1], self.sq, self.sk)
        self.drop = dict(dropout_mask=cuflash.dropout_mask(shape, seed=seed, p=p), dropout_p=p) if p else {}

    def forward(self, dtype):
        """``(out, lse)`` packed: the reference (``dtype`` = :func:`cuflash.testing.reference_dtype`) or the naive
        computation in ``dtype``."""
        q, k, v, _ = self.arrays
        out, lse = reference.attention(q, k, v, return_lse=True, compute_dtype=dtype, **self.options, **self.drop)
        return pack(out, self.cq), pack(lse, self.cq, axis=2)

    def backward(self, dtype):
        q, k, v, do = self.arrays
        dq, dk, dv = reference.attention_backward(do, q, k, v, compute_dtype=dtype, **self.options, **self.drop)
        return pack(dq, self.cq), pack(dk, self.ck), pack(dv, self.ck)

    def magnitudes(self):
        q, k, v, do = self.arrays
        return reference.term_magnitudes(q, k, v, do, **self.options, **self.drop)


def check_varlen(q, k, v, dout, cq, ck, options, *, backward=True):
    """Forward (and backward) of attention_varlen held to the rule against the padded float64 reference.

    Returns ``(padded, out, lse, grads)``: the :class:`Padded` batch, the results it checked, and ``grads =
    (dq, dk, dv)`` (None without ``backward``), so that a caller checks them further without computing them again."""
    padded = Padded(q, k, v, dout, cq, ck, options)
    mags = padded.magnitudes()
    out, lse = cuflash.attention_varlen(q, k, v, cq, ck, return_lse=True, **options)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    refs, bases = padded.forward(reference_dtype(q.dtype)), padded.forward(q.dtype)
    for name, x, r, b in zip(("out", "lse"), (out, lse), refs, bases):
        assert_attention_close(x, r, b, mult=2, name=name, magnitude=mags[name])
    grads = None
    if backward:
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, **options)
        for name, g, a in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            assert g.shape == a.shape and g.dtype == a.dtype, name
        refs, bases = padded.backward(reference_dtype(q.dtype)), padded.backward(q.dtype)
        for name, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bases):
            assert_attention_close(g, r, b, mult=3, name=name, magnitude=mags[name])
    return padded, out, lse, grads


# ============================================================================================ hypothesis
@st.composite
def ragged_cases(draw, dtypes=("float32", "float64", "float16")):
    dtype = _dtype(draw(st.sampled_from(dtypes)))
    n = draw(st.integers(1, 5))
    length = st.one_of(st.sampled_from([0, 1, 2, 17, 33]), st.integers(0, 40))
    len_q = [draw(length) for _ in range(n)]
    len_k = len_q if draw(st.booleans()) else [draw(length) for _ in range(n)]  # self-attention or not
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    d = draw(st.integers(1, 24))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    opts = {}
    if draw(st.booleans()):
        opts["causal"] = True
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 40))
        opts["window"] = (draw(side), draw(side))
    if draw(st.booleans()):
        opts["scale"] = draw(st.floats(0.1, 2.0))
    if draw(st.booleans()):
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, (n, hq) if draw(st.booleans()) else hq).astype(np.float32)
    if draw(st.booleans()):
        opts["softcap"] = draw(st.sampled_from([1.0, 5.0]))
    mod = draw(st.sampled_from([None, "score", "mask", "bias"]))
    max_q, max_k = max(len_q), max(len_k)
    if mod == "score":  # an operand per sequence and one per position within the sequence
        opts["score_mod"] = "score + w[b] - 0.1 * u[kv_idx]"
        opts["mod_arrays"] = {"w": rng.standard_normal(n).astype(np.float32),
                              "u": rng.standard_normal(max_k).astype(np.float32)}
    elif mod == "mask":
        opts["mask_mod"] = "kv_idx <= q_idx + b or kv_idx == 0"
    elif mod == "bias":
        opts["bias"] = rng.standard_normal((hq, max_q, max_k)).astype(np.float32)
    if draw(st.booleans()):
        opts["dropout_p"] = draw(st.sampled_from([0.1, 0.5]))
        opts["seed"] = draw(st.integers(0, 2**64 - 1))
    return ragged(rng, len_q, len_k, hq, hkv, d, dtype), opts


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(ragged_cases())
def test_matches_the_padded_reference(case):
    (q, k, v, dout, cq, ck), options = case
    check_varlen(q, k, v, dout, cq, ck, options)


# ============================================================================================ fixed cases
LEN_Q = [5, 0, 17, 1, 40, 3]
LEN_K = [7, 3, 17, 0, 33, 1]
PER_SEQUENCE = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (4, 2)},
    "causal_window_scale": {"causal": True, "window": (9, None), "scale": 0.3},
    "alibi_softcap": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625], np.float32), "softcap": 4.0,
                      "causal": True},
}
DTYPES = ["float64", "float32", "float16", "bfloat16"]


@pytest.mark.parametrize("name", sorted(PER_SEQUENCE))
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_sequence_matches_the_reference_on_its_slice(name, dtype):
    """Options that do not read b: sequence i of the packed result against the float64 reference of sequence i
    alone (unpacked slices, batch 1), and cuflash.attention on the padded batch against the same reference."""
    rng = np.random.default_rng(7)
    q, k, v, dout, cq, ck = ragged(rng, LEN_Q, LEN_K, 4, 2, 24, _dtype(dtype))
    options = PER_SEQUENCE[name]
    padded, out, lse, grads = check_varlen(q, k, v, dout, cq, ck, options, backward=True)
    assert all(g.dtype == x.dtype and g.shape == x.shape for g, x in zip(grads, (q, k, v)))
    for i in range(len(LEN_Q)):
        rows, keys = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        qi, ki, vi, doi = q[None, rows], k[None, keys], v[None, keys], dout[None, rows]
        ref, ref_lse = reference.attention(qi, ki, vi, return_lse=True, compute_dtype=reference_dtype(q.dtype),
                                           **options)
        base, base_lse = reference.attention(qi, ki, vi, return_lse=True, compute_dtype=q.dtype, **options)
        mags = reference.term_magnitudes(qi, ki, vi, doi, **options)
        assert_attention_close(out[rows], ref[0], base[0], mult=2, name=f"out[{i}]", magnitude=mags["out"])
        assert_attention_close(lse[:, rows], ref_lse[0], base_lse[0], mult=2, name=f"lse[{i}]",
                               magnitude=mags["lse"])
        if dtype == "bfloat16":  # gradients checked by check_varlen above, with the bfloat16 rule (tests/cases.py)
            continue
        refs = reference.attention_backward(doi, qi, ki, vi, compute_dtype=reference_dtype(q.dtype), **options)
        bases = reference.attention_backward(doi, qi, ki, vi, compute_dtype=q.dtype, **options)
        for name_g, g, r, b, at in zip(("dq", "dk", "dv"), grads, refs, bases, (rows, keys, keys)):
            assert_attention_close(g[at], r[0], b[0], mult=3, name=f"{name_g}[{i}]", magnitude=mags[name_g])
    # the padded batch through cuflash.attention holds to the same rule
    qp, kp, vp, _ = padded.arrays
    out_p, lse_p = cuflash.attention(qp, kp, vp, return_lse=True, **padded.options)
    mags = padded.magnitudes()
    for name_r, x, r, b in zip(("out", "lse"), (pack(out_p, cq), pack(lse_p, cq, axis=2)),
                               padded.forward(reference_dtype(q.dtype)),
                               padded.forward(q.dtype)):
        assert_attention_close(x, r, b, mult=2, name=name_r, magnitude=mags[name_r])


def test_dropout_is_the_padded_batch_mask():
    """Sequence b's keep-mask is the one attention draws for batch entry b of the padded batch: the results agree
    with cuflash.attention on the padded batch (both at the rule against the reference with that mask)."""
    rng = np.random.default_rng(3)
    q, k, v, dout, cq, ck = ragged(rng, LEN_Q, LEN_K, 2, 1, 16, np.float64)
    options = {"dropout_p": 0.3, "seed": 12345, "causal": True}
    padded, out, _, _ = check_varlen(q, k, v, dout, cq, ck, options)
    qp, kp, vp, _ = padded.arrays
    out_p = cuflash.attention(qp, kp, vp, **padded.cuflash_options)
    np.testing.assert_allclose(out, pack(out_p, cq), rtol=1e-12, atol=1e-12)


def test_drawn_seed_is_returned_and_reproduces():
    rng = np.random.default_rng(4)
    q, k, v, _, cq, ck = ragged(rng, [4, 9], [6, 2], 2, 2, 8, np.float32)
    out, seed = cuflash.attention_varlen(q, k, v, cq, ck, dropout_p=0.5)
    assert isinstance(seed, int)
    np.testing.assert_array_equal(out, cuflash.attention_varlen(q, k, v, cq, ck, dropout_p=0.5, seed=seed))


def test_no_sequences_and_only_empty_sequences():
    q, k, v = (np.zeros((0, 2, 8), np.float32) for _ in range(3))
    for cu in (np.zeros(1, np.int32), np.zeros(4, np.int32)):
        out, lse = cuflash.attention_varlen(q, k, v, cu, cu, return_lse=True)
        assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
        grads = cuflash.attention_varlen_backward(out, q, k, v, out, lse, cu, cu)
        assert all(g.shape == (0, 2, 8) for g in grads)


def test_max_seqlen_upper_bound_changes_nothing():
    rng = np.random.default_rng(5)
    q, k, v, _, cq, ck = ragged(rng, LEN_Q, LEN_K, 2, 1, 8, np.float32)
    a = cuflash.attention_varlen(q, k, v, cq, ck, causal=True)
    b = cuflash.attention_varlen(q, k, v, cq, ck, causal=True, max_seqlen_q=40, max_seqlen_k=100)
    np.testing.assert_array_equal(a, b)


# ============================================================================================ properties
def test_bitwise_for_any_thread_count(monkeypatch):
    rng = np.random.default_rng(6)
    q, k, v, dout, cq, ck = ragged(rng, [300, 0, 7, 600, 1], [300, 2, 7, 600, 40], 4, 2, 16, np.float32)
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("CUFLASH_NUM_THREADS", threads)
        out, lse = cuflash.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True)
        results.append((out, lse) + cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=True))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_memory_follows_the_real_tokens():
    """One long sequence and many short ones: the extra memory of the forward and backward (a fixed tile budget
    plus a few arrays of the real tokens: 7 and 13 MiB when written) stays below half of one padded array
    (batch x max length: 64 MiB), let alone the padded batch's work."""
    rng = np.random.default_rng(8)
    lens = [1024] + [8] * 255
    q, k, v, dout, cq, ck = ragged(rng, lens, lens, 2, 2, 32, np.float32)
    padded_bytes = len(lens) * max(lens) * q.shape[1] * q.shape[2] * q.itemsize
    tracemalloc.start()
    try:
        out, lse = cuflash.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True)
        fwd = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=True)
        bwd = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fwd < padded_bytes / 2 and bwd < padded_bytes / 2, (fwd, bwd, padded_bytes)


def test_vjp_equals_backward_and_detects_in_place_changes():
    rng = np.random.default_rng(9)
    q, k, v, dout, cq, ck = ragged(rng, [5, 0, 12], [5, 4, 12], 4, 2, 8, np.float64)
    options = dict(causal=True, dropout_p=0.2)
    out, vjp = cuflash.attention_varlen_vjp(q, k, v, cq, ck, **options)
    assert isinstance(vjp.seed, int)
    out2, lse = cuflash.attention_varlen(q, k, v, cq, ck, return_lse=True, causal=True, dropout_p=0.2, seed=vjp.seed)
    np.testing.assert_array_equal(out, out2)
    want = cuflash.attention_varlen_backward(dout, q, k, v, out2, lse, cq, ck, causal=True, dropout_p=0.2,
                                             seed=vjp.seed)
    for g, w in zip(vjp(dout), want):
        np.testing.assert_array_equal(g, w)
    k[0, 0, 0] += 1
    with pytest.raises(ValueError, match=r"\bk was modified in place"):
        vjp(dout)
    k[0, 0, 0] -= 1
    for g, w in zip(vjp(dout), want):  # the same values again: the same gradients
        np.testing.assert_array_equal(g, w)
    cq[1:] = [7, 7, 17]  # other sequence boundaries: another problem
    with pytest.raises(ValueError, match=r"cu_seqlens_q was modified in place"):
        vjp(dout)


def test_vjp_keeps_the_window_list_as_the_forward_saw_it():
    """The caller's window list changed after the forward does not reach the backward (it was kept by reference)."""
    rng = np.random.default_rng(10)
    q, k, v, dout, cq, ck = ragged(rng, [9, 3, 12], [9, 5, 12], 4, 2, 8, np.float64)
    window = [3, 0]
    out, vjp = cuflash.attention_varlen_vjp(q, k, v, cq, ck, window=window)
    window[0] = 100
    lse = cuflash.attention_varlen(q, k, v, cq, ck, return_lse=True, window=(3, 0))[1]
    want = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, window=(3, 0))
    for g, w in zip(vjp(dout), want):
        np.testing.assert_array_equal(g, w)


def test_arrays_of_another_library_come_back_in_their_type():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    q, k, v, dout, cq, ck = ragged(rng, [3, 5], [4, 5], 2, 1, 8, np.float32)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    out = cuflash.attention_varlen(tq, tk, tv, torch.from_numpy(cq), torch.from_numpy(ck), causal=True)
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), cuflash.attention_varlen(q, k, v, cq, ck, causal=True))


def test_inputs_unchanged():
    rng = np.random.default_rng(11)
    arrays = ragged(rng, LEN_Q, LEN_K, 2, 1, 8, np.float32)
    before = [a.copy() for a in arrays]
    q, k, v, dout, cq, ck = arrays
    out, lse = cuflash.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True)
    cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=True)
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fn", [cuflash.attention_varlen, cuflash.attention_varlen_backward],
                         ids=lambda f: f.__name__)
def test_docstrings_are_complete_numpydoc(fn):
    assert "{varlen}" not in fn.__doc__
    conveniences.test_docstrings_are_complete_numpydoc(fn)


def test_exported():
    for name in ("attention_varlen", "attention_varlen_backward", "attention_varlen_vjp"):
        assert name in cuflash.__all__ and callable(getattr(cuflash, name))


# ============================================================================================ errors
@pytest.fixture
def no_computation(monkeypatch):
    """Reaching a backend at all means validation came too late."""
    def fail(*args, **kwargs):
        raise AssertionError("a backend was called: validation must happen before any computation")

    for name in ("forward_varlen", "backward_varlen", "forward", "backward"):
        monkeypatch.setattr(nb, name, fail)


_rng = np.random.default_rng(0)
Q, K, V, DOUT, CQ, CK = ragged(_rng, [3, 0, 5], [4, 2, 5], 4, 2, 8, np.float32)

# (id, changes to the call's arguments, exception type, regex naming the argument)
ERRORS = [
    ("cu_q-int64", dict(cu_seqlens_q=CQ.astype(np.int64)), TypeError, r"cu_seqlens_q must be an int32 array"),
    ("cu_k-float", dict(cu_seqlens_k=CK.astype(np.float32)), TypeError, r"cu_seqlens_k must be an int32 array"),
    ("cu_q-list", dict(cu_seqlens_q=CQ.tolist()), TypeError, r"cu_seqlens_q must be an int32 array"),
    ("cu_q-2d", dict(cu_seqlens_q=CQ[None]), ValueError, r"cu_seqlens_q must be an int32 array .*shape \(1, 4\)"),
    ("cu_q-empty", dict(cu_seqlens_q=CQ[:0]), ValueError, r"cu_seqlens_q must be an int32 array"),
    ("cu_q-start", dict(cu_seqlens_q=CQ + 1), ValueError, r"cu_seqlens_q must start at 0"),
    ("cu_k-not-monotonic", dict(cu_seqlens_k=np.array([0, 4, 3, 11], np.int32)), ValueError,
     r"cu_seqlens_k must be non-decreasing"),
    ("cu_q-last", dict(cu_seqlens_q=np.array([0, 3, 3, 7], np.int32)), ValueError,
     r"cu_seqlens_q\[-1\] must equal the packed array's token count 8"),
    ("cu_k-last", dict(cu_seqlens_k=np.array([0, 4, 6, 12], np.int32)), ValueError, r"cu_seqlens_k\[-1\]"),
    ("cu-count", dict(cu_seqlens_k=np.array([0, 11], np.int32)), ValueError,
     r"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences"),
    ("max_q-small", dict(max_seqlen_q=4), ValueError, r"max_seqlen_q must be at least the longest sequence \(5\)"),
    ("max_q-int32", dict(max_seqlen_q=2**31), ValueError, r"max_seqlen_q must be .* below 2\*\*31"),
    ("bias-too-many", dict(max_seqlen_q=2**31 - 1, max_seqlen_k=2**31 - 1, bias=np.ones((3, 1, 1, 1), np.float32)),
     ValueError, r"bias: the problem's .* more elements than an array can index"),
    ("max_k-float", dict(max_seqlen_k=5.0), TypeError, r"max_seqlen_k must be an int"),
    ("max_k-bool", dict(max_seqlen_k=True), TypeError, r"max_seqlen_k must be an int"),
    ("q-4d", dict(q=Q[None]), ValueError, r"q must be packed as \(total_tokens, heads, head_dim\)"),
    ("k-2d", dict(k=K[:, 0]), ValueError, r"k must be packed"),
    ("heads", dict(q=Q[:, :3]), ValueError, r"heads of q \(3\) must be a multiple"),
    ("dtype", dict(k=K.astype(np.float64)), TypeError, r"q, k, v must share one dtype"),
    ("block_mask", dict(block_mask=cuflash.BlockMask.causal(8, block=(4, 4))), ValueError,
     r"block_mask is not supported by attention_varlen"),
    ("window", dict(window=(-1, 0)), ValueError, r"window left"),
    ("scale", dict(scale=float("nan")), ValueError, r"scale"),
    ("dropout", dict(dropout_p=1.0), ValueError, r"dropout_p"),
    ("alibi-shape", dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes must be"),
    ("bias-shape", dict(bias=np.ones((4, 5, 6), np.float32)), ValueError, r"bias must be"),
    ("mod-extent", dict(score_mod="score + w[q_idx]", mod_arrays={"w": np.ones(4, np.float32)}), ValueError,
     r"w"),
    # backend="emulate" computes varlen now (tests/test_kernels_emulated_varlen.py); the "cuda" backend takes CuPy
    # arrays only
    ("backend-cuda-numpy", dict(backend="cuda"), (TypeError, RuntimeError), r"backend 'cuda'"),
    ("backend-name", dict(backend="tpu"), ValueError, r"unknown backend 'tpu'"),
    ("return_lse", dict(return_lse=1), TypeError, r"return_lse must be a bool"),
    ("precision-name", dict(precision="TF32"), ValueError, r"precision must be one of 'ieee', '3xtf32', 'tf32'"),
    ("precision-type", dict(precision=None), TypeError, r"precision must be one of .* got NoneType"),
    ("precision-float16", dict(q=Q.astype(np.float16), k=K.astype(np.float16), v=V.astype(np.float16),
                               precision="3xtf32"), ValueError, r"float16 inputs take only precision='ieee'"),
]


@pytest.mark.usefixtures("no_computation")
@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_bad_input_is_refused_naming_the_argument(changes, exc, match):
    args = dict(q=Q, k=K, v=V, cu_seqlens_q=CQ, cu_seqlens_k=CK)
    args.update(changes)
    q, k, v, cq, ck = (args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
    with pytest.raises(exc, match=match):
        cuflash.attention_varlen(q, k, v, cq, ck, **args)
    if "backend" not in changes and "return_lse" not in changes:  # the backward refuses what the forward refuses
        out, lse = np.zeros_like(Q), np.zeros((4, 8), np.float32)
        with pytest.raises(exc, match=match):
            cuflash.attention_varlen_backward(DOUT[:q.shape[0]] if q.ndim == 3 else DOUT, q, k, v, out, lse, cq, ck,
                                              **args)


BACKWARD_ERRORS = [
    ("lse-shape", dict(lse=np.zeros((8, 4), np.float32)), ValueError, r"lse must have shape \(heads, total_q\)"),
    ("lse-dtype", dict(lse=np.zeros((4, 8), np.float64)), TypeError, r"lse must be float32"),
    ("out-shape", dict(out=np.zeros((7, 4, 8), np.float32)), ValueError, r"out must have q's packed shape"),
    ("dout-dtype", dict(dout=DOUT.astype(np.float64)), TypeError, r"dout must have q's dtype"),
    ("seed", dict(dropout_p=0.1), ValueError, r"seed is required when dropout_p > 0"),
    ("dbias", dict(return_dbias=True), ValueError, r"return_dbias is not supported by attention_varlen_backward"),
    ("deterministic", dict(deterministic="yes"), TypeError, r"deterministic must be a bool"),
]


@pytest.mark.usefixtures("no_computation")
@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in BACKWARD_ERRORS], ids=[c[0] for c in BACKWARD_ERRORS])
def test_bad_backward_input_is_refused_naming_the_argument(changes, exc, match):
    args = dict(dout=DOUT, out=np.zeros_like(Q), lse=np.zeros((4, 8), np.float32))
    args.update(changes)
    dout, out, lse = (args.pop(n) for n in ("dout", "out", "lse"))
    with pytest.raises(exc, match=match):
        cuflash.attention_varlen_backward(dout, Q, K, V, out, lse, CQ, CK, **args)


def test_offsets_in_the_other_byte_order_are_converted_not_refused():
    """Big-endian int32 offsets are int32 (q, k, v and every option are converted to native order likewise)."""
    swapped = [c.astype(c.dtype.newbyteorder()) for c in (CQ, CK)]
    assert not swapped[0].dtype.isnative and np.array_equal(swapped[0], CQ)
    out, lse = cuflash.attention_varlen(Q, K, V, CQ, CK, return_lse=True)
    out_s, lse_s = cuflash.attention_varlen(Q, K, V, *swapped, return_lse=True)
    assert np.array_equal(out, out_s) and np.array_equal(lse, lse_s)
    grads = cuflash.attention_varlen_backward(DOUT, Q, K, V, out, lse, *swapped)
    assert all(np.array_equal(a, b) for a, b in zip(grads, cuflash.attention_varlen_backward(DOUT, Q, K, V, out, lse,
                                                                                          CQ, CK)))
