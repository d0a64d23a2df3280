"""Validation of the ragged calls: packed sequences with cumulative offsets (FA2's ``flash_attn_varlen_func``,
:class:`VarlenProblem`) and KV caches, contiguous or paged (FA2's ``flash_attn_with_kvcache``,
:class:`KVCacheProblem`). Each reduces to :class:`cuflash.problem.Problem` per sequence and keeps what the kernels
read on the device (offsets, cache lengths, page table)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .core import (FLOAT_DTYPES, Problem, _check_element_type, _check_modifiers, _check_precision, _check_qkv,
                   _check_scale, _check_window, _is_cupy, _overlap, array_module, check_dropout,
                   check_one_place_per_element, dtype_name, native, stats_dtype)


def _host_ints(x):
    """A NumPy/CuPy integer array as a host int64 array (for CuPy a copy, hence a synchronization)."""
    return np.asarray(x.get() if _is_cupy(x) else x).astype(np.int64)


def _check_int32(x, name, form, xp, like):
    """``x`` an int32 array (either byte order) of the call's array module, on the device of ``like`` (q: the
    kernels read it through a raw pointer); returned in native byte order with its host int64 copy."""
    if not (isinstance(x, np.ndarray) or _is_cupy(x)):
        raise TypeError(f"{name} must be an int32 array {form}, got {type(x).__name__}")
    if array_module(like, x, names=("q", name)) is not xp:
        raise TypeError(f"{name} must be a {xp.__name__} array like q, k, v (the same library and device)")
    x = native(x)
    if x.dtype != np.int32:
        raise TypeError(f"{name} must be an int32 array {form} (FlashAttention-2's convention), got dtype {x.dtype}")
    return x, _host_ints(x)


def check_offsets(x, name, total: int, xp, like):
    """Cumulative offsets ``[0, len_0, len_0 + len_1, ..., total]``: an int32 array ``(batch + 1,)``, starting at 0,
    non-decreasing, ending at ``total`` (the packed array's token count). Returns ``(x, host int64 copy)``."""
    form = "of shape (batch + 1,): [0, len_0, len_0 + len_1, ..., total_tokens]"
    x, host = _check_int32(x, name, form, xp, like)
    if host.ndim != 1 or host.size < 1:
        raise ValueError(f"{name} must be an int32 array {form}, got shape {tuple(host.shape)}")
    if host[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {host[0]}")
    steps = np.diff(host)
    if (steps < 0).any():
        at = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0), got {name}[{at}] = {host[at]} > "
                         f"{name}[{at + 1}] = {host[at + 1]}")
    if host[-1] != total:
        raise ValueError(f"{name}[-1] must equal the packed array's token count {total}, got {host[-1]}")
    return x, host


def _check_max_seqlen(value, name, lengths):
    """``max_seqlen_*``: None (computed) or an int no smaller than the longest sequence. It is what a CUDA grid is
    sized by without reading the offsets back, so an upper bound is accepted; a smaller value would cut sequences.
    At most 2**31 - 1: positions are int32 in the kernels and the modifier language."""
    longest = int(lengths.max(initial=0))
    if value is None:
        return longest
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if not longest <= value < 2**31:
        raise ValueError(f"{name} must be at least the longest sequence ({longest}) and below 2**31 (int32 "
                         f"positions), got {value}")
    return int(value)


@dataclass(frozen=True)
class VarlenProblem:
    """One validated ragged-batch call: sequences packed along the token axis (FA2's varlen layout).

    ``q``: ``(total_q, Hq, D)``, ``k``/``v``: ``(total_k, Hkv, D)``; sequence ``i`` is rows
    ``offsets_q[i]:offsets_q[i + 1]`` of ``q`` and ``offsets_k[i]:offsets_k[i + 1]`` of ``k``, ``v``.
    ``cu_seqlens_q/k`` are the caller's int32 offsets on ``xp``; ``offsets_q/k`` their host copies.
    ``max_seqlen_q/k`` bound every sequence's length (the extents of modifier operands indexed by ``q_idx`` /
    ``kv_idx``, and what a CUDA grid is sized by). ``mods`` are built with the extents ``b`` = sequences,
    ``q_idx``/``kv_idx`` = ``max_seqlen_q/k``; :meth:`sequence` gives sequence ``i`` as a :class:`Problem` that
    reads them at ``b = i``.
    """

    kind = "varlen"
    #: what the kernels' launch code reads of a padded Problem: a varlen call has no BlockMask (refused by
    #: make_varlen_problem)
    block_mask = None

    xp: Any
    q: Any
    k: Any
    v: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    offsets_q: Any
    offsets_k: Any
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    causal: bool
    window_left: Optional[int]
    window_right: Optional[int]
    dropout_p: float = 0.0
    seed: Optional[int] = None
    element_type: str = ""
    mods: Any = None
    #: the float32 arithmetic of the CUDA kernels (:data:`PRECISIONS`), as :attr:`Problem.precision`
    precision: str = "ieee"

    batch = property(lambda self: len(self.offsets_q) - 1)
    total_q = property(lambda self: self.q.shape[0])
    total_k = property(lambda self: self.k.shape[0])
    heads_q = property(lambda self: self.q.shape[1])
    heads_kv = property(lambda self: self.k.shape[1])
    head_dim = property(lambda self: self.q.shape[2])
    dtype = property(lambda self: self.q.dtype)
    group = property(lambda self: self.q.shape[1] // self.k.shape[1])
    bf16_bits = property(lambda self: self.element_type == "bfloat16" and dtype_name(self.q.dtype) == "uint16")

    @property
    def lengths(self):
        """Per-sequence lengths ``(len_q, len_k)``, host int64 ``(batch,)``."""
        return np.diff(self.offsets_q), np.diff(self.offsets_k)

    def sequence(self, i: int, dout=None, out=None, lse=None):
        """Sequence ``i`` as a batch-1 :class:`Problem` over views of the packed arrays (no copy), and the views of
        ``dout``, ``out`` (packed like ``q``) and ``lse`` (``(Hq, total_q)``) for it when given."""
        q0, q1 = (int(x) for x in self.offsets_q[i:i + 2])
        k0, k1 = (int(x) for x in self.offsets_k[i:i + 2])
        p = Problem(self.xp, self.q[None, q0:q1], self.k[None, k0:k1], self.v[None, k0:k1], (1,), self.scale,
                    self.causal, self.window_left, self.window_right, None, None, None, self.dropout_p, self.seed,
                    self.element_type, self.mods, self.precision, batch_offset=i)
        if dout is None:
            return p
        return p, dout[None, q0:q1], out[None, q0:q1], lse[None, :, q0:q1]


def make_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                        causal=False, scale=None, window=None, block_mask=None, dropout_p=0.0, seed=None,
                        dtype=None, bias=None, alibi_slopes=None, softcap=None, score_mod=None, mask_mod=None,
                        mod_arrays=None, precision="ieee") -> VarlenProblem:
    """Validate a ragged-batch call (:func:`cuflash.attention_varlen`) and return its :class:`VarlenProblem`."""
    xp = array_module(q, k, v, names=("q", "k", "v"))
    q, k, v = native(q), native(k), native(v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 3:
            raise ValueError(f"{name} must be packed as (total_tokens, heads, head_dim), got shape {tuple(a.shape)}")
    element_type = _check_element_type(q, dtype)
    _check_qkv(q, k, v, element_type)
    precision = _check_precision(precision, element_type)
    if block_mask is not None:
        raise ValueError("block_mask is not supported by attention_varlen: a BlockMask's grid has fixed sequence "
                         "lengths; mask within each sequence with mask_mod (q_idx, kv_idx are positions in the "
                         "sequence, b its index), window or causal")
    cu_q, off_q = check_offsets(cu_seqlens_q, "cu_seqlens_q", q.shape[0], xp, q)
    cu_k, off_k = check_offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0], xp, q)
    if off_q.size != off_k.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"{off_q.size - 1} and {off_k.size - 1}")
    max_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q", np.diff(off_q))
    max_k = _check_max_seqlen(max_seqlen_k, "max_seqlen_k", np.diff(off_k))
    scale = _check_scale(scale, q.shape[-1], q.dtype)
    left, right = _check_window(window, causal, max_q + max_k)
    dropout_p, seed = check_dropout(dropout_p, seed)
    batch = off_q.size - 1
    extents = {"b": batch, "h": q.shape[1], "q_idx": max_q, "kv_idx": max_k}
    mods = _check_modifiers(xp, (batch,), extents, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap,
                            score_mod=score_mod, mask_mod=mask_mod, mod_arrays=mod_arrays, like=q)
    return VarlenProblem(xp, q, k, v, cu_q, cu_k, off_q, off_k, max_q, max_k, scale, bool(causal), left, right,
                         dropout_p, seed, element_type, mods, precision)


def check_varlen_backward(problem: VarlenProblem, dout, out, lse):
    """Validate the varlen backward's ``dout``, ``out`` (``q``'s packed shape and dtype) and ``lse`` (``(heads,
    total_q)``, the statistics dtype, as the forward returns it)."""
    xp = array_module(dout, out, lse, names=("dout", "out", "lse"))
    dout, out, lse = native(dout), native(out), native(lse)
    if xp is not problem.xp:
        raise TypeError("dout, out, lse must live on the same array module as q, k, v")
    for name, a in (("dout", dout), ("out", out)):
        if tuple(a.shape) != tuple(problem.q.shape):
            raise ValueError(f"{name} must have q's packed shape {tuple(problem.q.shape)}, got {tuple(a.shape)}")
        if a.dtype != problem.dtype:
            raise TypeError(f"{name} must have q's dtype {problem.dtype}, got {a.dtype}")
    want = (problem.heads_q, problem.total_q)
    if tuple(lse.shape) != want:
        raise ValueError(f"lse must have shape (heads, total_q) = {want}, got {tuple(lse.shape)}")
    if lse.dtype != stats_dtype(problem.dtype):
        raise TypeError(f"lse must be {stats_dtype(problem.dtype)} (what the forward returns), got {lse.dtype}")
    return dout, out, lse


# --------------------------------------------------------------------------------------------
# Inference with a KV cache (FA2's flash_attn_with_kvcache)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVCacheProblem:
    """One validated call of :func:`cuflash.attention_with_kvcache`.

    ``q``: ``(B, Sq, Hq, D)``. Contiguous cache: ``k_cache``/``v_cache`` ``(B, capacity, Hkv, D)``; paged
    (``block_table`` given): ``(num_pages, page_size, Hkv, D)`` with ``block_table`` ``(B, max_blocks)`` int32, so
    that position ``p`` of sequence ``b`` lives at ``[block_table[b, p // page_size], p % page_size]``.
    ``k_new``/``v_new``: ``(B, S_new, Hkv, D)`` or None, written at positions ``cache_seqlens[b] + [0, S_new)``;
    sequence ``b`` then attends to its first ``cache_seqlens[b] + S_new`` keys (:attr:`lengths_k`). ``*_host`` are
    host copies of the int32 arrays. ``mods``: ALiBi and softcap, with ``b`` the sequence index.
    """

    kind = "kvcache"
    #: what the kernels' launch code reads of a padded Problem: no BlockMask or dropout in a KV-cache call
    block_mask = None
    dropout_p = 0.0
    seed = None

    xp: Any
    q: Any
    k_cache: Any
    v_cache: Any
    cache_seqlens: Any
    cache_host: Any
    k_new: Any
    v_new: Any
    block_table: Any
    table_host: Any
    num_splits: Optional[int]
    scale: float
    causal: bool
    window_left: Optional[int]
    window_right: Optional[int]
    element_type: str = ""
    mods: Any = None
    #: the float32 arithmetic of the CUDA kernels (:data:`PRECISIONS`), as :attr:`Problem.precision`
    precision: str = "ieee"

    batch = property(lambda self: self.q.shape[0])
    seqlen_q = property(lambda self: self.q.shape[1])
    heads_q = property(lambda self: self.q.shape[2])
    heads_kv = property(lambda self: self.k_cache.shape[2])
    head_dim = property(lambda self: self.q.shape[3])
    dtype = property(lambda self: self.q.dtype)
    group = property(lambda self: self.q.shape[2] // self.k_cache.shape[2])
    bf16_bits = property(lambda self: self.element_type == "bfloat16" and dtype_name(self.q.dtype) == "uint16")
    paged = property(lambda self: self.block_table is not None)
    page_size = property(lambda self: self.k_cache.shape[1] if self.block_table is not None else None)
    seqlen_new = property(lambda self: 0 if self.k_new is None else self.k_new.shape[1])

    @property
    def capacity(self) -> int:
        """Positions a sequence can hold: the cache's length, or ``max_blocks * page_size`` when paged."""
        if self.block_table is None:
            return self.k_cache.shape[1]
        return self.block_table.shape[1] * self.k_cache.shape[1]

    @property
    def lengths_k(self):
        """Keys each sequence attends to, ``cache_seqlens + S_new``: host int64 ``(B,)``."""
        return self.cache_host + self.seqlen_new

    def pages(self, b: int):
        """Host page indices holding sequence ``b``'s first :attr:`lengths_k` ``[b]`` positions (paged only)."""
        used = -(-int(self.lengths_k[b]) // self.page_size)
        return self.table_host[b, :used]

    def sequence(self, b: int, k, v):
        """Sequence ``b`` as a batch-1 :class:`Problem` of its queries against ``k``, ``v`` ``(1, L, Hkv, D)`` (its
        keys, a view of the contiguous cache or gathered pages); modifiers read at ``b``."""
        return Problem(self.xp, self.q[b:b + 1], k, v, (1,), self.scale, self.causal, self.window_left,
                       self.window_right, None, None, None, 0.0, None, self.element_type, self.mods, self.precision,
                       batch_offset=b)


def _check_cache_arrays(q, k_cache, v_cache, paged: bool):
    """Shapes and dtypes of q and the caches (``k_new``/``v_new`` are checked against them after)."""
    kv = "(num_pages, page_size, heads_kv, head_dim)" if paged else "(batch, capacity, heads_kv, head_dim)"
    if q.ndim != 4:
        raise ValueError(f"q must have shape (batch, seqlen_q, heads, head_dim), got {tuple(q.shape)}")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if a.ndim != 4:
            raise ValueError(f"{name} must have shape {kv}, got {tuple(a.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape {kv}, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if not paged and k_cache.shape[0] != q.shape[0]:
        raise ValueError(f"k_cache must have q's batch {q.shape[0]} as its first dimension {kv} (a paged cache "
                         f"takes block_table), got {tuple(k_cache.shape)}")
    if paged and k_cache.shape[1] < 1:
        raise ValueError(f"k_cache's page_size must be >= 1, got shape {tuple(k_cache.shape)}")
    if q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"head_dim of q ({q.shape[-1]}) and k_cache/v_cache ({k_cache.shape[-1]}) must match")
    if q.shape[-1] < 1 or q.shape[2] < 1 or k_cache.shape[2] < 1:
        raise ValueError(f"heads and head_dim must be >= 1, got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if q.shape[2] % k_cache.shape[2]:
        raise ValueError(f"heads of q ({q.shape[2]}) must be a multiple of heads of k_cache ({k_cache.shape[2]})")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if a.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {a.dtype}")


def _check_new(q, k_cache, k_new, v_new):
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: give both (the tokens to append) or neither")
    if k_new is None:
        return
    want = (q.shape[0], None, k_cache.shape[2], k_cache.shape[3])
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if a.ndim != 4 or tuple(a.shape[:1] + a.shape[2:]) != want[:1] + want[2:]:
            raise ValueError(f"{name} must have shape (batch, seqlen_new, heads_kv, head_dim) = ({want[0]}, "
                             f"seqlen_new, {want[2]}, {want[3]}), got {tuple(a.shape)}")
        if a.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {a.dtype}")
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new and v_new must have the same shape, got {tuple(k_new.shape)} and "
                         f"{tuple(v_new.shape)}")


def _check_writable(caches: dict, others: dict):
    """The caches receive the new tokens in place: writable, native byte order (a converted copy would take the
    write instead), and sharing no memory with each other or with the arrays read."""
    for name, a in caches.items():
        if isinstance(a, np.ndarray) and not a.flags.writeable:
            raise ValueError(f"{name} is read-only: k_new/v_new are appended into the cache in place")
        if isinstance(a, np.ndarray) and not a.dtype.isnative:
            raise ValueError(f"{name} has non-native byte order: the new tokens are written into it in place, which "
                             f"a converted copy would not see; pass a native-order array")
    if _overlap(*caches.values()):
        raise ValueError("k_cache and v_cache share memory: writing the new keys would overwrite values")
    for name, a in others.items():
        for cache, c in caches.items():
            if hasattr(a, "nbytes") and _overlap(a, c):  # arrays (a list or a number holds no memory of a cache)
                raise ValueError(f"{name} shares memory with {cache}, which the call writes into: pass a copy")


def _check_cache_seqlens(cache_seqlens, xp, q, seqlen_new, capacity):
    batch = q.shape[0]
    form = f"of shape (batch,) = ({batch},): the tokens already in each sequence's cache"
    x, host = _check_int32(cache_seqlens, "cache_seqlens", form, xp, q)
    if host.shape != (batch,):
        raise ValueError(f"cache_seqlens must be an int32 array {form}, got shape {tuple(host.shape)}")
    if host.size and host.min() < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {host.min()} for sequence {int(np.argmin(host))}")
    over = host + seqlen_new > capacity
    if over.any():
        b = int(np.argmax(over))
        raise ValueError(f"cache_seqlens + seqlen_new must fit the cache's capacity {capacity}: sequence {b} holds "
                         f"{host[b]} tokens and {seqlen_new} new ones")
    return x, host


def _check_table_form(block_table, xp, q):
    """``block_table``: an int32 array ``(batch, max_blocks)``; returned with its host copy."""
    form = "of shape (batch, max_blocks): page indices into k_cache, v_cache"
    batch = q.shape[0]
    x, host = _check_int32(block_table, "block_table", form, xp, q)
    if host.ndim != 2 or host.shape[0] != batch:
        raise ValueError(f"block_table must be an int32 array {form} with batch = {batch}, got shape "
                         f"{tuple(host.shape)}")
    return x, host


def _check_table_pages(host, num_pages, page_size, lengths, start, seqlen_new):
    """Every entry a sequence uses (its first ``ceil(length / page_size)``) is a page of the cache; entries past
    that are never read (tables padded with -1 are fine). Pages may be shared for reading (a common prefix), but
    a page that receives new tokens must be used once in all: two writers, or a writer and a reader, of one page
    would see each other's tokens."""
    used_blocks = -(-lengths // page_size)
    used = np.arange(host.shape[1])[None, :] < used_blocks[:, None]
    bad = used & ((host < 0) | (host >= num_pages))
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_table[{b}, {j}] = {host[b, j]} is not a page of the cache (0 <= page < {num_pages}); "
                         f"sequence {b} uses its first {used_blocks[b]} entries")
    if seqlen_new:
        first, last = start // page_size, (start + seqlen_new - 1) // page_size
        j = np.arange(host.shape[1])[None, :]
        written = host[(j >= first[:, None]) & (j <= last[:, None]) & used]
        counts = np.bincount(host[used], minlength=num_pages)
        shared = written[counts[written] > 1]
        if shared.size:
            raise ValueError(f"block_table: page {int(shared[0])} receives new tokens but is used more than once "
                             f"(by two sequences, or twice by one): a page written by a sequence must be its alone")


def _check_splits(num_splits):
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int >= 1 or None, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1 or None, got {num_splits}")
    return int(num_splits)


def make_kvcache_problem(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None,
                         num_splits=None, causal=False, window=None, alibi_slopes=None, softcap=None,
                         scale=None, dtype=None, precision="ieee") -> KVCacheProblem:
    """Validate a call of :func:`cuflash.attention_with_kvcache` and return its :class:`KVCacheProblem`."""
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k_new": k_new, "v_new": v_new}
    given = {name: a for name, a in arrays.items() if a is not None or name in ("q", "k_cache", "v_cache")}
    xp = array_module(*given.values(), names=tuple(given))
    if k_new is not None:  # before native(): a converted copy of a cache would receive the write
        # every array the call reads, the block table and lengths too: the kernels read them after the append
        _check_writable({"k_cache": k_cache, "v_cache": v_cache},
                        {"q": q, "k_new": k_new, "v_new": v_new, "cache_seqlens": cache_seqlens,
                         "block_table": block_table, "alibi_slopes": alibi_slopes})
    q, k_cache, v_cache, k_new, v_new = (None if a is None else native(a) for a in arrays.values())
    if k_new is not None:  # the NumPy/CuPy views of the caches (of another library's: what DLPack shares)
        for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_one_place_per_element(name, a, "a cache the new tokens are written into")
    element_type = _check_element_type(q, dtype)
    if element_type not in FLOAT_DTYPES:
        raise TypeError(f"q must be floating point ({', '.join(FLOAT_DTYPES)}), got {q.dtype}")
    precision = _check_precision(precision, element_type)
    paged = block_table is not None
    _check_cache_arrays(q, k_cache, v_cache, paged)
    _check_new(q, k_cache, k_new, v_new)
    batch, seqlen_new = q.shape[0], 0 if k_new is None else k_new.shape[1]
    capacity = k_cache.shape[1]
    table = table_host = None
    if paged:
        table, table_host = _check_table_form(block_table, xp, q)
        capacity = table_host.shape[1] * k_cache.shape[1]
    cache, cache_host = _check_cache_seqlens(cache_seqlens, xp, q, seqlen_new, capacity)
    if paged:
        _check_table_pages(table_host, k_cache.shape[0], k_cache.shape[1], cache_host + seqlen_new, cache_host,
                           seqlen_new)
    scale = _check_scale(scale, q.shape[-1], q.dtype)
    left, right = _check_window(window, causal, q.shape[1] + capacity)
    extents = {"b": batch, "h": q.shape[2], "q_idx": q.shape[1], "kv_idx": capacity}
    mods = _check_modifiers(xp, (batch,), extents, bias=None, alibi_slopes=alibi_slopes, softcap=softcap,
                            score_mod=None, mask_mod=None, mod_arrays=None, like=q)
    return KVCacheProblem(xp, q, k_cache, v_cache, cache, cache_host, k_new, v_new, table, table_host,
                          _check_splits(num_splits), scale, bool(causal), left, right, element_type, mods, precision)
