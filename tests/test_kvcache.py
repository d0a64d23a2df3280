"""cuflash.attention_with_kvcache: in-place append into a contiguous or paged cache, then attention over each
sequence's cached keys, whole or split into parts merged by log-sum-exp.

The main property (hypothesis: ragged cache lengths including empty caches, 0 to 3 new tokens, 1 to 4 queries,
paged caches whose page size does not divide the cache length, shuffled pages, 1 to 7 splits, GQA, causal, windows,
ALiBi, softcap): the output matches the float64 reference at the usual rule, both per sequence (the reference on
that sequence's keys alone) and on the padded batch with seqlens_k; the cache holds the new tokens at
cache_seqlens + [0, S_new) and is bitwise unchanged everywhere else; q, k_new, v_new and cache_seqlens are unchanged.
Then a decode loop against full causal attention, and every bad input refused before the cache is touched.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference
from cuflash.backends import numpy as nb
from cuflash.backends import numpy_ragged
from cuflash.testing import _input_dtype as _dtype, assert_attention_close, reference_dtype

import test_api_conveniences as conveniences


# ============================================================================================ helpers
class Cache:
    """A KV cache of ``batch`` sequences with logical contents ``keys[b]``, ``values[b]`` (capacity positions each),
    stored contiguously or in shuffled pages (``page_size``, with spare pages), and its ``block_table``."""

    def __init__(self, rng, batch, capacity, hkv, d, dtype, page_size=None):
        self.keys = rng.standard_normal((batch, capacity, hkv, d)).astype(dtype)
        self.values = rng.standard_normal((batch, capacity, hkv, d)).astype(dtype)
        self.page_size, self.block_table = page_size, None
        if page_size is None:
            self.k, self.v = self.keys.copy(), self.values.copy()
            return
        blocks = -(-capacity // page_size)
        pages = rng.permutation(batch * blocks + 3)  # 3 spare pages nobody uses
        self.block_table = pages[:batch * blocks].reshape(batch, blocks).astype(np.int32)
        shape = (len(pages), page_size, hkv, d)
        self.k = rng.standard_normal(shape).astype(dtype)  # spare pages and slots past capacity: noise
        self.v = rng.standard_normal(shape).astype(dtype)
        for b in range(batch):
            for j in range(blocks):
                rows = slice(j * page_size, min((j + 1) * page_size, capacity))
                n = rows.stop - rows.start
                self.k[self.block_table[b, j], :n] = self.keys[b, rows]
                self.v[self.block_table[b, j], :n] = self.values[b, rows]

    def logical(self, k):
        """The logical ``(batch, capacity, hkv, d)`` view of a stored cache array ``k``."""
        if self.block_table is None:
            return k
        out = k[self.block_table].reshape((self.block_table.shape[0], -1) + k.shape[2:])
        return out[:, :self.keys.shape[1]]

    def kwargs(self):
        return {} if self.block_table is None else {"block_table": self.block_table}


def expected_after_append(cache, lens, k_new, v_new):
    """The logical keys and values once the new tokens are written at ``lens + [0, S_new)``."""
    keys, values = cache.keys.copy(), cache.values.copy()
    if k_new is not None:
        for b, n in enumerate(lens):
            keys[b, n:n + k_new.shape[1]] = k_new[b]
            values[b, n:n + k_new.shape[1]] = v_new[b]
    return keys, values


def check_call(q, cache, lens, k_new, v_new, options):
    """One call, held to the rule and checked for its writes (and for what it must not write)."""
    before = {name: a.copy() for name, a in dict(q=q, k_new=k_new, v_new=v_new, lens=lens).items() if a is not None}
    k_stored, v_stored = cache.k.copy(), cache.v.copy()
    out, lse = cuflash.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                              return_lse=True, **cache.kwargs(), **options)
    for name, a in before.items():  # inputs unchanged, cache_seqlens too (the caller advances it)
        np.testing.assert_array_equal(dict(q=q, k_new=k_new, v_new=v_new, lens=lens)[name], a, err_msg=name)
    keys, values = expected_after_append(cache, lens, k_new, v_new)
    np.testing.assert_array_equal(cache.logical(cache.k), keys)
    np.testing.assert_array_equal(cache.logical(cache.v), values)
    if cache.block_table is not None:  # nothing outside the written slots moved: spare pages, slots past capacity
        written = np.zeros(cache.k.shape[:2], bool)
        new = 0 if k_new is None else k_new.shape[1]
        for b, n in enumerate(lens):
            pos = np.arange(n, n + new)
            written[cache.block_table[b, pos // cache.page_size], pos % cache.page_size] = True
        np.testing.assert_array_equal(cache.k[~written], k_stored[~written])
        np.testing.assert_array_equal(cache.v[~written], v_stored[~written])
    else:
        cache.keys, cache.values = keys, values
    length = lens + (0 if k_new is None else k_new.shape[1])
    check_against_reference(q, keys, values, length, out, lse, options)
    return out, lse


def check_against_reference(q, keys, values, length, out, lse, options):
    opts = {n: options[n] for n in ("causal", "window", "alibi_slopes", "softcap", "scale") if n in options}
    padded = dict(seqlens_k=length.astype(np.int32), **opts)
    mags = reference.term_magnitudes(q, keys, values, **padded)
    ref, ref_lse = reference.attention(q, keys, values, return_lse=True, compute_dtype=reference_dtype(q.dtype),
                                       **padded)
    base, base_lse = reference.attention(q, keys, values, return_lse=True, compute_dtype=q.dtype, **padded)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_attention_close(out, ref, base, mult=2, name="out", magnitude=mags["out"])
    assert_attention_close(lse, ref_lse, base_lse, mult=2, name="lse", magnitude=mags["lse"])
    for b, n in enumerate(length):  # and each sequence alone, on its own keys
        one = dict(opts)
        if np.ndim(opts.get("alibi_slopes")) == 2:
            one["alibi_slopes"] = opts["alibi_slopes"][b]
        qb, kb, vb = q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n]
        mags_b = reference.term_magnitudes(qb, kb, vb, **one)
        ref_b = reference.attention(qb, kb, vb, compute_dtype=reference_dtype(q.dtype), **one)
        base_b = reference.attention(qb, kb, vb, compute_dtype=q.dtype, **one)
        assert_attention_close(out[b:b + 1], ref_b, base_b, mult=2, name=f"out[{b}]", magnitude=mags_b["out"])


# ============================================================================================ hypothesis
@st.composite
def cache_cases(draw, dtypes=("float32", "float64", "float16")):
    dtype = _dtype(draw(st.sampled_from(dtypes)))
    batch = draw(st.integers(1, 3))
    seqlen_q = draw(st.integers(1, 4))
    new = draw(st.integers(0, 3))
    capacity = draw(st.integers(max(new, 1), 45))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    d = draw(st.integers(1, 20))
    page = draw(st.one_of(st.none(), st.integers(1, 16)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    room = capacity - new
    lens = np.array([min(room, draw(st.sampled_from([0, 1, room, draw(st.integers(0, room))])))
                     for _ in range(batch)], np.int32)
    opts = {}
    if draw(st.booleans()):
        opts["causal"] = True
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 30))
        opts["window"] = (draw(side), draw(side))
    if draw(st.booleans()):
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, (batch, hq) if draw(st.booleans()) else hq).astype(np.float32)
    if draw(st.booleans()):
        opts["softcap"] = draw(st.sampled_from([1.0, 5.0]))
    if draw(st.booleans()):
        opts["scale"] = draw(st.floats(0.1, 2.0))
    opts["num_splits"] = draw(st.sampled_from([None, 1, 2, 3, 7]))
    cache = Cache(rng, batch, capacity, hkv, d, dtype, page)
    q = rng.standard_normal((batch, seqlen_q, hq, d)).astype(dtype)
    k_new = v_new = None
    if new or draw(st.booleans()):
        k_new, v_new = (rng.standard_normal((batch, new, hkv, d)).astype(dtype) for _ in range(2))
    return q, cache, lens, k_new, v_new, opts


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(cache_cases())
def test_matches_the_reference_and_appends_in_place(case):
    check_call(*case)


# ============================================================================================ fixed cases
@pytest.mark.parametrize("paged", [None, 5], ids=["contiguous", "paged5"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_decode_loop_equals_full_causal_attention(paged, dtype):
    """Prefill 11 tokens through the cache (seqlen_q = 11), then decode 6 tokens one at a time, advancing
    cache_seqlens as FlashAttention-2's users do: each step's output is the last row of causal attention over the
    whole prefix, at the rule against the float64 reference."""
    dt = _dtype(dtype)
    rng = np.random.default_rng(1)
    batch, total, hq, hkv, d = 2, 17, 4, 2, 16
    q, k, v = (rng.standard_normal((batch, total, h, d)).astype(dt) for h in (hq, hkv, hkv))
    cache = Cache(rng, batch, 24, hkv, d, dt, paged)
    lens = np.zeros(batch, np.int32)
    steps = [(0, 11)] + [(t, t + 1) for t in range(11, total)]
    for t0, t1 in steps:
        out = cuflash.attention_with_kvcache(q[:, t0:t1], cache.k, cache.v, cache_seqlens=lens, k_new=k[:, t0:t1],
                                             v_new=v[:, t0:t1], causal=True, **cache.kwargs())
        lens += t1 - t0
        ref = reference.attention(q[:, :t1], k[:, :t1], v[:, :t1], causal=True)[:, t0:t1]
        base = reference.attention(q[:, :t1], k[:, :t1], v[:, :t1], causal=True, compute_dtype=dt)[:, t0:t1]
        mags = reference.term_magnitudes(q[:, :t1], k[:, :t1], v[:, :t1], causal=True)
        assert_attention_close(out, ref, base, mult=2, name=f"step {t0}", magnitude=mags["out"])
    np.testing.assert_array_equal(cache.logical(cache.k)[:, :total], k)


def test_splits_agree_with_one_part():
    """num_splits only changes the summation order: every split count is at the rule, and a split into more parts
    than key tiles (empty parts) still merges exactly."""
    rng = np.random.default_rng(2)
    cache = Cache(rng, 3, 700, 2, 32, np.float32, page_size=48)
    q = rng.standard_normal((3, 2, 8, 32)).astype(np.float32)
    lens = np.array([700, 0, 333], np.int32)
    outs = {}
    for splits in (None, 1, 2, 5, 64, 1000):
        outs[splits], _ = check_call(q, cache, lens, None, None, dict(num_splits=splits, causal=True))
    np.testing.assert_array_equal(outs[None], outs[1])
    # past the key count every part holds one key: the same parts as a billion splits would leave non-empty, at once
    k_cache, v_cache = cache.k.copy(), cache.v.copy()
    many = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=cache.block_table,
                                          num_splits=10 ** 9, causal=True)
    np.testing.assert_array_equal(many, cuflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, block_table=cache.block_table, num_splits=700, causal=True))


def test_shared_prefix_pages_are_read_by_several_sequences():
    """Two sequences whose tables start with the same pages (a shared prompt): allowed, as the new tokens land on
    pages of their own."""
    rng = np.random.default_rng(3)
    page, hkv, d = 4, 1, 8
    k_cache, v_cache = (rng.standard_normal((10, page, hkv, d)).astype(np.float32) for _ in range(2))
    table = np.array([[0, 1, 2, -1], [0, 1, 3, -1]], np.int32)  # prefix of 8 tokens on pages 0, 1
    lens = np.array([8, 8], np.int32)
    q = rng.standard_normal((2, 1, 2, d)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((2, 1, hkv, d)).astype(np.float32) for _ in range(2))
    out = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                         block_table=table)
    np.testing.assert_array_equal(k_cache[2, 0], k_new[0, 0])
    np.testing.assert_array_equal(k_cache[3, 0], k_new[1, 0])
    keys = np.stack([np.concatenate([k_cache[0], k_cache[1], k_cache[p, :1]]) for p in (2, 3)])
    values = np.stack([np.concatenate([v_cache[0], v_cache[1], v_cache[p, :1]]) for p in (2, 3)])
    check_against_reference(q, keys, values, np.array([9, 9]), out, cuflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens + 1, block_table=table, return_lse=True)[1], {})


def test_seqlen_q_longer_than_the_keys_sees_nothing_causally():
    rng = np.random.default_rng(4)
    cache = Cache(rng, 1, 8, 1, 4, np.float64)
    q = rng.standard_normal((1, 5, 1, 4))
    out, lse = check_call(q, cache, np.array([2], np.int32), None, None, dict(causal=True))
    assert (out[0, :3] == 0).all() and np.isneginf(lse[0, :, :3]).all()


def test_arrays_of_another_library():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    cache = Cache(rng, 2, 10, 1, 8, np.float32)
    q = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((2, 1, 1, 8)).astype(np.float32) for _ in range(2))
    tk, tv = torch.from_numpy(cache.k), torch.from_numpy(cache.v)
    out = cuflash.attention_with_kvcache(torch.from_numpy(q), tk, tv, cache_seqlens=torch.tensor([3, 9], dtype=torch.int32),
                                         k_new=torch.from_numpy(k_new), v_new=torch.from_numpy(v_new))
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(tk[0, 3].numpy(), k_new[0, 0])  # written through the tensor's memory


def test_docstring_is_complete_numpydoc():
    conveniences.test_docstrings_are_complete_numpydoc(cuflash.attention_with_kvcache)
    assert "attention_with_kvcache" in cuflash.__all__


# ============================================================================================ errors
@pytest.fixture
def no_computation(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a backend was called: validation must happen before any computation")

    for name in ("forward_kvcache", "forward"):
        monkeypatch.setattr(nb, name, fail)
    monkeypatch.setattr(numpy_ragged, "append_kvcache", fail)


_rng = np.random.default_rng(0)
B, CAP, HQ, HKV, D, PAGE = 2, 10, 4, 2, 8, 3
Q = _rng.standard_normal((B, 1, HQ, D)).astype(np.float32)
KC, VC = (_rng.standard_normal((B, CAP, HKV, D)).astype(np.float32) for _ in range(2))
KN, VN = (_rng.standard_normal((B, 2, HKV, D)).astype(np.float32) for _ in range(2))
LENS = np.array([3, 8], np.int32)
PK, PV = (_rng.standard_normal((9, PAGE, HKV, D)).astype(np.float32) for _ in range(2))
TABLE = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)  # capacity 12: 10 positions of 8 + 2 new fit
READ_ONLY = KC.copy()
READ_ONLY.flags.writeable = False

# (id, the call's changed arguments, exception type, regex naming the argument)
ERRORS = [
    ("lens-int64", dict(cache_seqlens=LENS.astype(np.int64)), TypeError, r"cache_seqlens must be an int32 array"),
    ("lens-shape", dict(cache_seqlens=LENS[:1]), ValueError, r"cache_seqlens must be an int32 array of shape \(batch,"),
    ("lens-list", dict(cache_seqlens=[3, 8]), TypeError, r"cache_seqlens must be an int32 array"),
    ("lens-negative", dict(cache_seqlens=np.array([-1, 0], np.int32)), ValueError, r"cache_seqlens must be >= 0"),
    ("lens-overflow", dict(cache_seqlens=np.array([3, 9], np.int32)), ValueError,
     r"cache_seqlens \+ seqlen_new must fit the cache's capacity 10: sequence 1 holds 9 tokens and 2 new"),
    ("k_new-alone", dict(v_new=None), ValueError, r"k_new and v_new go together"),
    ("k_new-shape", dict(k_new=KN[:, :, :1], v_new=VN[:, :, :1]), ValueError, r"k_new must have shape"),
    ("v_new-shape", dict(v_new=VN[:, :1]), ValueError, r"k_new and v_new must have the same shape"),
    ("k_new-dtype", dict(k_new=KN.astype(np.float64)), TypeError, r"k_new must have q's dtype"),
    ("cache-dtype", dict(v_cache=VC.astype(np.float16)), TypeError, r"v_cache must have q's dtype"),
    ("cache-batch", dict(k_cache=KC[:1], v_cache=VC[:1]), ValueError, r"k_cache must have q's batch 2"),
    ("cache-shape", dict(v_cache=VC[:, :5]), ValueError, r"k_cache and v_cache must have the same shape"),
    ("cache-3d", dict(k_cache=KC[0], v_cache=VC[0]), ValueError, r"k_cache must have shape"),
    ("q-3d", dict(q=Q[0]), ValueError, r"q must have shape \(batch, seqlen_q, heads, head_dim\)"),
    ("heads", dict(q=Q[:, :, :3]), ValueError, r"heads of q \(3\) must be a multiple of heads of k_cache"),
    ("head_dim", dict(q=Q[..., :4]), ValueError, r"head_dim of q \(4\) and k_cache"),
    ("read-only", dict(k_cache=READ_ONLY), ValueError, r"k_cache is read-only"),
    ("big-endian", dict(v_cache=VC.astype(VC.dtype.newbyteorder(">"))), ValueError, r"v_cache has non-native byte"),
    ("same-array", dict(v_cache="k_cache"), ValueError, r"k_cache and v_cache share memory"),
    ("k_new-in-cache", dict(k_new=lambda k_cache: k_cache[:, 8:]), ValueError, r"k_new shares memory with k_cache"),
    ("q-in-cache", dict(q=lambda k_cache: k_cache[:, :1, :, :]), ValueError, r"q shares memory with k_cache"),
    ("q-int", dict(q=Q.astype(np.int32)), TypeError, r"(q must be floating point|k_cache must have q's dtype)"),
    ("splits-0", dict(num_splits=0), ValueError, r"num_splits must be an int >= 1 or None"),
    ("splits-bool", dict(num_splits=True), TypeError, r"num_splits must be an int >= 1 or None"),
    ("splits-float", dict(num_splits=2.0), TypeError, r"num_splits must be an int"),
    ("window", dict(window=(1, -1)), ValueError, r"window right"),
    ("alibi", dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes must be"),
    ("softcap", dict(softcap=0.0), ValueError, r"softcap"),
    ("scale", dict(scale=float("inf")), ValueError, r"scale"),
    ("return_lse", dict(return_lse="yes"), TypeError, r"return_lse must be a bool"),
    ("dtype-bf16-over-float32", dict(dtype="bfloat16"), TypeError, r"dtype='bfloat16'"),
    ("bf16-bits-on-numpy", dict(q=Q.astype(np.uint16), k_cache=KC.astype(np.uint16), v_cache=VC.astype(np.uint16),
                                k_new=KN.astype(np.uint16), v_new=VN.astype(np.uint16), dtype="bfloat16"),
     TypeError, r"backend 'numpy' takes bfloat16 as ml_dtypes.bfloat16 arrays"),
    ("precision-name", dict(precision="TF32"), ValueError, r"precision must be one of 'ieee', '3xtf32', 'tf32'"),
    ("precision-type", dict(precision=3), TypeError, r"precision must be one of .* got int"),
    ("precision-float64", dict(q=Q.astype(np.float64), k_cache=KC.astype(np.float64), v_cache=VC.astype(np.float64),
                               k_new=KN.astype(np.float64), v_new=VN.astype(np.float64), precision="tf32"),
     ValueError, r"float64 inputs take only precision='ieee'"),
    # backend="emulate" computes KV caches now (tests/test_kernels_emulated_kvcache.py); "cuda" takes CuPy arrays only
    ("backend", dict(backend="cuda"), (TypeError, RuntimeError), r"backend 'cuda'"),
    # paged
    ("table-int64", dict(k_cache=PK, v_cache=PV, block_table=TABLE.astype(np.int64)), TypeError,
     r"block_table must be an int32 array"),
    ("table-shape", dict(k_cache=PK, v_cache=PV, block_table=TABLE[:1]), ValueError,
     r"block_table must be an int32 array of shape \(batch, max_blocks\)"),
    ("table-range", dict(k_cache=PK, v_cache=PV, block_table=np.array([[0, 9, 2, 3], [4, 5, 6, 7]], np.int32)),
     ValueError, r"block_table\[0, 1\] = 9 is not a page of the cache \(0 <= page < 9\)"),
    ("table-negative", dict(k_cache=PK, v_cache=PV, block_table=np.array([[0, -1, 2, 3], [4, 5, 6, 7]], np.int32)),
     ValueError, r"block_table\[0, 1\] = -1 is not a page"),
    ("table-overflow", dict(k_cache=PK, v_cache=PV, block_table=TABLE[:, :3]), ValueError,
     r"capacity 9: sequence 1 holds 8 tokens and 2 new"),
    ("page-two-writers", dict(k_cache=PK, v_cache=PV, block_table=np.array([[0, 1, 2, 3], [4, 5, 1, 7]], np.int32),
                              cache_seqlens=np.array([3, 6], np.int32)), ValueError,
     r"block_table: page 1 receives new tokens but is used more than once"),
    ("page-writer-and-reader", dict(k_cache=PK, v_cache=PV, block_table=np.array([[0, 1, 2, 3], [1, 5, 6, 7]],
                                                                                  np.int32)),
     ValueError, r"block_table: page 1 receives new tokens"),
    # a cache whose sequences share one buffer (torch's expand, a stride-0 view): one sequence's tokens on another's
    ("cache-broadcast", dict(k_cache=np.lib.stride_tricks.as_strided(KC[:1].copy(), KC.shape, (0,) + KC.strides[1:],
                                                                     writeable=True)), ValueError,
     r"k_cache has elements that share memory"),
    # arrays the kernels read after the append, inside a cache: the append would change them under the call
    ("table-in-cache", dict(k_cache=PK, v_cache=PV, block_table=lambda k_cache: k_cache[8].reshape(-1)[:8].view(
        np.int32).reshape(2, 4)), ValueError, r"block_table shares memory with k_cache"),
    ("seqlens-in-cache", dict(cache_seqlens=lambda k_cache: k_cache[1, -1, 0, :2].view(np.int32)), ValueError,
     r"cache_seqlens shares memory with k_cache"),
    ("alibi-in-cache", dict(alibi_slopes=lambda k_cache: k_cache[1, -1, 0, :HQ]), ValueError,
     r"alibi_slopes shares memory with k_cache"),
]


@pytest.mark.usefixtures("no_computation")
@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_bad_input_is_refused_before_the_cache_is_touched(changes, exc, match):
    args = dict(q=Q, k_cache=KC.copy(), v_cache=VC.copy(), cache_seqlens=LENS, k_new=KN, v_new=VN)
    args.update(changes)
    for name, value in changes.items():  # aliases of the cache passed to this call: "k_cache", or a view of it
        if isinstance(value, str) and value == "k_cache":
            args[name] = args[value]
        elif callable(value):
            args[name] = value(args["k_cache"])
    stored = {n: args[n].copy() for n in ("k_cache", "v_cache")}
    q, k_cache, v_cache = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    with pytest.raises(exc, match=match):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, **args)
    np.testing.assert_array_equal(k_cache, stored["k_cache"])
    np.testing.assert_array_equal(v_cache, stored["v_cache"])


def _batch_past_the_grid():
    """A KV cache of 65536 sequences: one block each already passes the kernels' grid limit (batch x num_splits at
    most 65535; num_splits past the key tiles is capped, so no longer a way to reach it)."""
    b = 65536
    return dict(q=np.zeros((b, 1, 1, 8), np.float16), k_cache=np.zeros((b, 2, 1, 8), np.float16),
                v_cache=np.zeros((b, 2, 1, 8), np.float16), cache_seqlens=np.ones(b, np.int32),
                k_new=np.ones((b, 1, 1, 8), np.float16), v_new=np.ones((b, 1, 1, 8), np.float16), num_splits=1)


@pytest.mark.parametrize("backend, env, make, match", [
    ("emulate", {}, _batch_past_the_grid, r"batch \(65536\) x num_splits \(1\) must be at most 65535"),
    ("numpy", {"CUFLASH_NUM_THREADS": "many"}, None, r"CUFLASH_NUM_THREADS"),
], ids=["emulate-grid", "numpy-env"])
def test_a_call_the_backend_refuses_leaves_the_cache_as_it_was(monkeypatch, backend, env, make, match):
    """What only a backend can check (the kernels' grid limits, an environment variable) is checked before the new
    tokens are appended."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = make() if make else dict(q=Q, k_cache=KC.copy(), v_cache=VC.copy(), cache_seqlens=LENS, k_new=KN, v_new=VN)
    before = {n: args[n].copy() for n in ("k_cache", "v_cache")}
    with pytest.raises(ValueError, match=match):
        cuflash.attention_with_kvcache(backend=backend, **args)
    for n in ("k_cache", "v_cache"):
        np.testing.assert_array_equal(args[n], before[n])


def test_kvcache_splits_past_the_key_tiles_give_the_bits_of_as_many_splits_as_tiles():
    """num_splits past the key tiles leaves shares empty: the NumPy backend and the kernels cap it there (the kernels
    refused 70000 by their grid limit), with the bits of num_splits = the key tiles, on each backend; and the result
    holds to the rule of the float64 reference. The key tiles of the longest sequence (10 keys): the NumPy backend
    cuts ceil(L / num_splits) keys a tile, one key each once num_splits >= L, so 10; the kernels' one key tile holds
    all 10, so 1. (The backends sum in their own orders: they meet only through the reference.)"""
    length = LENS + KN.shape[1]
    for backend, tiles in (("numpy", int(length.max())), ("emulate", 1)):
        runs = {}
        for n in (tiles, 64, 70000):
            k_cache, v_cache = KC.copy(), VC.copy()
            runs[n] = cuflash.attention_with_kvcache(Q, k_cache, v_cache, cache_seqlens=LENS, k_new=KN, v_new=VN,
                                                     num_splits=n, backend=backend, return_lse=True)
        for n in (64, 70000):
            for name, a, b in zip(("out", "lse"), runs[n], runs[tiles]):
                np.testing.assert_array_equal(a, b, err_msg=f"{backend}: {name} of num_splits={n} vs {tiles}")
        check_against_reference(Q, k_cache, v_cache, length, *runs[64], {})


def test_unused_table_entries_are_not_read():
    """Entries past a sequence's used pages may hold anything (-1 padding): only used ones are checked."""
    table = np.array([[0, 1, -1, -1], [4, 5, 6, 7]], np.int32)
    k_cache, v_cache = PK.copy(), PV.copy()
    out = cuflash.attention_with_kvcache(Q, k_cache, v_cache, cache_seqlens=LENS, k_new=KN, v_new=VN,
                                         block_table=table)
    # the same call with those entries pointing at real (unused) pages: the same bits, the same cache
    k_same, v_same = PK.copy(), PV.copy()
    same = cuflash.attention_with_kvcache(Q, k_same, v_same, cache_seqlens=LENS, k_new=KN, v_new=VN,
                                          block_table=np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32))
    assert np.array_equal(out, same)
    assert np.array_equal(k_cache, k_same) and np.array_equal(v_cache, v_same)


def test_a_call_that_raises_after_the_append_leaves_the_caches_as_they_were(monkeypatch):
    """Every backend appends k_new/v_new before it computes (the kernels read the new keys from the caches): an
    exception after that (Ctrl-C, a worker's MemoryError, a kernel that fails to compile) left the caches appended by
    a call that raised. The append writes the slots' old contents back then."""

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(numpy_ragged, "run_many", interrupted)
    rng = np.random.default_rng(0)
    q, k_new, v_new = (rng.standard_normal((2, 1, 1, 8)).astype(np.float32) for _ in range(3))
    k_cache, v_cache = (rng.standard_normal((2, 6, 1, 8)).astype(np.float32) for _ in range(2))
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(KeyboardInterrupt):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([2, 5], np.int32), k_new=k_new,
                                       v_new=v_new, backend="numpy")
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])
