"""attention_with_kvcache in the CUDA kernels (the forward over a contiguous or paged cache, kernels/kv_tile.cuh;
split-KV and its combine, kernels/combine.cuh), run on the CPU by cuflash.emulate.

- contiguous and paged caches (shuffled pages, page sizes that divide neither the tile nor the capacity), 1 and 3
  splits and the num_splits=None heuristic, fp16/bf16/float32 (the wide kernels) and float64, GQA, causal, window,
  ALiBi, softcap, empty caches and a decode-shaped query: out and lse at the rule against the float64 reference (per
  sequence and on the padded batch), the append written in place and nothing else (tests/test_kvcache.py's
  check_call);
- more splits than key tiles (empty splits merge with weight 0), and a sequence no split sees (out 0, lse -inf);
- the split heuristic (cuflash.tiling.kv_splits) and that it splits decode-shaped calls;
- a small hypothesis sweep over test_kvcache's cache strategy on backend="emulate".
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cuflash
from cuflash import reference, tiling
from cuflash.cuda import launch as launches
from cuflash.problem import make_kvcache_problem
from cuflash.testing import _input_dtype as _dtype, assert_attention_close

from emulated_support import pytestmark  # noqa: F401  (marks the module)
from test_kvcache import Cache, cache_cases, check_call

EMU = {"backend": "emulate"}
OPTIONS = {
    "causal": {"causal": True},
    "window_alibi": {"window": (9, 2), "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625], np.float32)},
    "softcap": {"softcap": 5.0, "causal": True},
}


def _call(dtype, page, splits, name, seqlen_q=3, new=2, lens=(5, 0, 31), seed=31):
    rng = np.random.default_rng(seed)
    dt = _dtype(dtype)
    cache = Cache(rng, len(lens), 45, 2, 24, dt, page)
    q = rng.standard_normal((len(lens), seqlen_q, 4, 24)).astype(dt)
    k_new = v_new = None
    if new:
        k_new, v_new = (rng.standard_normal((len(lens), new, 2, 24)).astype(dt) for _ in range(2))
    return check_call(q, cache, np.array(lens, np.int32), k_new, v_new,
                      dict(OPTIONS[name], num_splits=splits, **EMU))


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("page", [None, 7], ids=["contiguous", "paged7"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_kvcache_kernels_match_the_reference(dtype, page, splits):
    _call(dtype, page, splits, "causal")


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_kvcache_options(name):
    _call("float16", 5, 2, name)


@pytest.mark.parametrize("precision, baseline", [("3xtf32", np.float32), ("tf32", reference.TF32)])
def test_precision_reaches_the_kvcache_kernels(monkeypatch, precision, baseline):
    """attention_with_kvcache takes precision= as attention does (it had no such option): the float32 kernels run
    the arithmetic asked for, at the rule against the naive computation in that arithmetic (TF32: inputs rounded to
    TF32, tests/wide_support.py), and give other bits than IEEE's."""
    asked = []
    wide_math = launches.specs.wide_math
    monkeypatch.setattr(launches.specs, "wide_math", lambda dtype, precision, cc: asked.append(precision) or
                        wide_math(dtype, precision, cc))
    rng = np.random.default_rng(32)
    cache = Cache(rng, 3, 45, 2, 24, np.float32, 7)
    q = rng.standard_normal((3, 3, 4, 24)).astype(np.float32)
    lens = np.array([5, 0, 31], np.int32)
    call = dict(cache_seqlens=lens, causal=True, num_splits=2, **cache.kwargs(), **EMU)
    out = cuflash.attention_with_kvcache(q, cache.k, cache.v, precision=precision, **call)
    assert asked and set(asked) == {precision}
    assert not np.array_equal(out, cuflash.attention_with_kvcache(q, cache.k, cache.v, **call))
    keys, values = cache.logical(cache.k), cache.logical(cache.v)
    padded = dict(seqlens_k=lens, causal=True)
    ref = reference.attention(q, keys, values, compute_dtype=np.float64, **padded)
    base = reference.attention(q, keys, values, compute_dtype=baseline, **padded)
    assert_attention_close(out, ref, base, mult=2, name="out",
                           magnitude=reference.term_magnitudes(q, keys, values, **padded)["out"])


def test_bfloat16_bits_declared_by_dtype_are_the_bfloat16_call():
    """dtype="bfloat16" over uint16 arrays (CuPy without ml_dtypes) as attention takes it (the KV cache had no dtype
    option): the same bits as the ml_dtypes.bfloat16 call, out, lse and the appended caches, paged and split."""
    rng = np.random.default_rng(33)
    bf16 = _dtype("bfloat16")
    cache = Cache(rng, 2, 40, 2, 16, bf16, 8)
    q = rng.standard_normal((2, 3, 4, 16)).astype(bf16)
    k_new, v_new = (rng.standard_normal((2, 2, 2, 16)).astype(bf16) for _ in range(2))
    call = dict(cache_seqlens=np.array([4, 19], np.int32), causal=True, num_splits=2, return_lse=True,
                **cache.kwargs(), **EMU)
    k_bits, v_bits = cache.k.view(np.uint16).copy(), cache.v.view(np.uint16).copy()
    out, lse = cuflash.attention_with_kvcache(q, cache.k, cache.v, k_new=k_new, v_new=v_new, **call)
    out_bits, lse_bits = cuflash.attention_with_kvcache(q.view(np.uint16), k_bits, v_bits, k_new=k_new.view(np.uint16),
                                                        v_new=v_new.view(np.uint16), dtype="bfloat16", **call)
    assert out_bits.dtype == np.uint16
    np.testing.assert_array_equal(out_bits, out.view(np.uint16))
    np.testing.assert_array_equal(lse_bits, lse)
    np.testing.assert_array_equal(k_bits, cache.k.view(np.uint16))
    np.testing.assert_array_equal(v_bits, cache.v.view(np.uint16))


def test_float64_paged_split():
    _call("float64", 6, 3, "window_alibi", seqlen_q=1, new=1)


def test_float64_paged_gather_reads_only_used_table_entries():
    """Entries of block_table past a sequence's used pages may hold anything: float64 gathers its pages first, and it
    gathered every entry (99 raised IndexError, after the new token had been written)."""
    rng = np.random.default_rng(0)
    k_cache, v_cache = rng.standard_normal((4, 4, 1, 32)), rng.standard_normal((4, 4, 1, 32))
    table = np.array([[0, 1, 99]], np.int32)  # 3 + 1 = 4 keys: entry 0 only
    q, k_new = rng.standard_normal((1, 1, 2, 32)), rng.standard_normal((1, 1, 1, 32))
    lens = np.array([3], np.int32)
    want_k, want_v = k_cache.copy(), v_cache.copy()
    want = cuflash.attention_with_kvcache(q, want_k, want_v, cache_seqlens=lens, k_new=k_new, v_new=k_new,
                                          block_table=table, backend="numpy")
    got = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=k_new,
                                         block_table=table, backend="emulate")
    assert np.array_equal(k_cache, want_k) and np.array_equal(v_cache, want_v)
    ref = reference.attention(q, want_k[:1], want_v[:1], compute_dtype=np.longdouble)
    naive = reference.attention(q, want_k[:1], want_v[:1], compute_dtype=np.float64)
    assert_attention_close(got, ref, naive)


def test_more_splits_than_key_tiles_and_empty_sequences():
    """64 splits of a few key tiles: most splits see nothing (lse -inf, weight 0); an empty cache with no new
    token is seen by no split: out 0, lse -inf (check_call asserts it against the reference)."""
    out, lse = _call("float16", 7, 64, "causal", new=0, lens=(5, 0, 40))
    assert np.isneginf(lse[1]).all() and not out[1].any()


def test_long_paged_cache_split():
    """A cache of several key tiles per split, pages (48) that straddle tiles, 5 splits."""
    rng = np.random.default_rng(32)
    cache = Cache(rng, 2, 300, 2, 32, np.float16, page_size=48)
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float16)
    check_call(q, cache, np.array([300, 129], np.int32), None, None, dict(num_splits=5, causal=True, **EMU))


def test_split_heuristic():
    assert tiling.kv_splits(108, 200, 64) == 1        # the grid fills the GPU already
    assert tiling.kv_splits(108, 8, 2) == 1           # too few key tiles to share
    assert tiling.kv_splits(108, 8, 64) == 14         # ~one block per SM
    assert tiling.kv_splits(132, 1, 1000) == tiling.MAX_KV_SPLITS
    assert tiling.kv_splits(108, 4, 10) == 5          # at least 2 key tiles per split
    # a decode-shaped call (one query, few heads, a long cache) is split by default
    rng = np.random.default_rng(33)
    q = rng.standard_normal((1, 1, 2, 32)).astype(np.float16)
    k = rng.standard_normal((1, 1024, 1, 32)).astype(np.float16)
    problem = make_kvcache_problem(q, k, k, cache_seqlens=np.array([1000], np.int32))
    assert launches.forward_kvcache_launch(problem).num_splits > 1


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cache_cases(dtypes=("float16", "float32")))
def test_cache_cases_on_the_kernels(case):
    q, cache, lens, k_new, v_new, opts = case
    check_call(q, cache, lens, k_new, v_new, dict(opts, **EMU))


def _split_case(poison, dtype=np.float16, seqlen_q=1, length=200, causal=False):
    rng = np.random.default_rng(0)
    q = np.abs(rng.standard_normal((1, seqlen_q, 1, 64))).astype(dtype)
    k, v = (rng.standard_normal((1, 256, 1, 64)).astype(dtype) for _ in range(2))
    poison(q, k)
    return q, k, v, np.array([length], np.int32), causal


@pytest.mark.parametrize("name", ["nan-in-split-0", "nan-one-split-sees", "plus-inf", "float64-low-lse"])
def test_split_kv_combine_keeps_nan_inf_and_every_finite_lse(name):
    """The combine of split-KV decode (kernels/combine.cuh): a NaN a row saw came out as 0 (CUDA's max, fmaxf,
    drops a NaN, and a NaN m counted as "no key seen"), a +inf lse as NaN (exp(inf - inf)), and a finite float64
    lse below -1e308 as "no key seen". Each split count gives what the unsplit kernel and the reference give."""
    def nan_at(j):
        return lambda q, k: k.__setitem__((0, j, 0, 0), np.nan)

    q, k, v, lens, causal = {
        "nan-in-split-0": lambda: _split_case(nan_at(5), seqlen_q=100, causal=True),
        "nan-one-split-sees": lambda: _split_case(nan_at(199)),
        "plus-inf": lambda: _split_case(lambda q, k: k.__setitem__((0, 10, 0, 0), np.inf)),
        "float64-low-lse": lambda: _split_case(
            lambda q, k: (q.__setitem__((Ellipsis, 0), 1e154), q.__setitem__((Ellipsis, slice(1, None)), 0),
                          k.__setitem__((Ellipsis, 0), -1.5e154), k.__setitem__((Ellipsis, slice(1, None)), 0)),
            dtype=np.float64, length=40),
    }[name]()
    options = dict(causal=causal, window=(3, 0) if name == "nan-one-split-sees" else None,
                   scale=1.0 if name == "float64-low-lse" else None)
    with np.errstate(all="ignore"):
        want, want_lse = reference.attention(q, k[:, :lens[0]], v[:, :lens[0]], return_lse=True, **options)
        naive = reference.attention(q, k[:, :lens[0]], v[:, :lens[0]], compute_dtype=q.dtype, **options)
        for splits in (1, 2, 3):
            out, lse = cuflash.attention_with_kvcache(q, k.copy(), v.copy(), cache_seqlens=lens, num_splits=splits,
                                                      return_lse=True, backend="emulate", **options)
            np.testing.assert_array_equal(np.isnan(out), np.isnan(want), err_msg=f"{splits} splits")
            np.testing.assert_array_equal(lse.astype(np.float64) == np.inf, want_lse == np.inf)
            np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse))
            finite = ~np.isnan(want)
            if name == "float64-low-lse" and splits > 1:
                # seen (it was taken for "no key": out 0, lse -inf), but merged through lse = -1.5e308, whose
                # rounding (1e292) swallows each split's log(l_s): the lse merge's limit, as in merge_attention_states
                np.testing.assert_allclose(lse, want_lse, rtol=1e-15)
                seen = v[:, :lens[0]]  # each split's output is a weighted mean of its keys' values, and so is
                assert np.all((out >= seen.min(axis=1)) & (out <= seen.max(axis=1)))  # their merge: within V's range
                assert not np.array_equal(out, np.zeros_like(out))
            elif finite.any():  # the finite rows, by the rule
                assert_attention_close(out[finite], want[finite], naive[finite])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_paged_cache_of_no_pages(dtype):
    """A paged cache with no pages at all, every sequence empty and the block table's entries -1 (never read): out 0
    and lse -inf, as on the NumPy backend. The float64 kernel, which gathers the pages first (it has no paged loads),
    took page 0 for the unused entries and raised a bare IndexError when there is no page 0."""
    q = np.ones((2, 1, 2, 8), dtype)
    cache = np.zeros((0, 4, 1, 8), dtype)  # 0 pages of 4 tokens
    table = np.full((2, 2), -1, np.int32)
    out, lse = cuflash.attention_with_kvcache(q, cache, cache.copy(), cache_seqlens=np.zeros(2, np.int32),
                                              block_table=table, return_lse=True, backend="emulate")
    np.testing.assert_array_equal(out, np.zeros_like(q))
    np.testing.assert_array_equal(lse, np.full((2, 2, 1), -np.inf))


def test_a_kernel_that_fails_to_compile_leaves_the_caches_as_they_were(monkeypatch):
    """The append of k_new/v_new runs before the kernels are compiled (their launches read the new keys): a compiler
    that failed them (a C compiler named by CUFLASH_EMULATE_CXX, Ctrl-C during the build) left k_new written into the
    caches of a call that raised. The append is undone now when the call raises."""
    import cuflash.emulate

    def fails(*_, **__):
        raise cuflash.emulate.CompileError("the compiler failed")

    monkeypatch.setattr(cuflash.emulate, "compile", fails)
    rng = np.random.default_rng(0)
    q, k_new, v_new = (rng.standard_normal((1, 1, 1, 16)).astype(np.float32) for _ in range(3))
    k_cache, v_cache = np.zeros((1, 8, 1, 16), np.float32), np.zeros((1, 8, 1, 16), np.float32)
    with pytest.raises(cuflash.emulate.CompileError, match="the compiler failed"):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([2], np.int32), k_new=k_new,
                                       v_new=v_new, backend="emulate")
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("d,extra", [(12, 0), (16, 2)])
def test_the_kernels_read_the_keys_appended_by_the_same_call(d, extra):
    """A head dim that is no multiple of 8 (12), or a cache view whose rows are 72 bytes apart, makes the launch copy
    the caches as it is prepared: prepared before the append (a change that compiled the kernels first), the kernel
    read the caches without k_new, where its key dominates (out 100). Appending first, undone if the call raises."""
    rng = np.random.default_rng(0)
    q = np.ones((1, 1, 1, d), np.float32)
    k_new, v_new = np.full((1, 1, 1, d), 5, np.float32), np.full((1, 1, 1, d), 100, np.float32)
    k_cache, v_cache = (rng.standard_normal((1, 8, 1, d + extra)).astype(np.float32)[..., :d] for _ in range(2))
    want = cuflash.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(), cache_seqlens=np.array([3], np.int32),
                                         k_new=k_new, v_new=v_new, backend="numpy")
    out = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([3], np.int32), k_new=k_new,
                                        v_new=v_new, backend="emulate")
    np.testing.assert_array_equal(k_cache[0, 3], k_new[0, 0])
    ref = reference.attention(q, k_cache[:, :4], v_cache[:, :4])
    naive = reference.attention(q, k_cache[:, :4], v_cache[:, :4], compute_dtype=np.float32)
    for got in (out, want):
        assert_attention_close(got, ref, naive)
