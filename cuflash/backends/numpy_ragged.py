"""The NumPy backend's ragged calls: a varlen batch or a KV cache runs as one :class:`~cuflash.problem.Problem` per
sequence, over views of the packed arrays (or of the cache's pages), all on the backend's one pool (:func:`run_many`),
so each sequence's bits are those it would have alone. :func:`append_kvcache` (the in-place append of new keys and
values) is array-level and shared by every backend."""
from __future__ import annotations

import contextlib

import numpy as np

from ..merge import merge_parts
from ..problem import KVCacheProblem, VarlenProblem, stats_dtype
from .numpy import BLOCK_K, _Scratch, _work_dtype, backward_work, forward_work, run_many

#: Bytes of keys and values gathered from a paged cache (or upcast) per batch of sequences of forward_kvcache:
#: sequences are run in groups of about this size, so the copies never hold the whole cache at once.
KV_GATHER_BYTES = 64 << 20


def _live(len_q, len_k):
    """Sequences with queries and keys: the others keep the preset out = 0, lse = -inf (and zero gradients)."""
    return [i for i in range(len(len_q)) if len_q[i] > 0 and len_k[i] > 0]


def forward_varlen(problem: VarlenProblem):
    """``out (total_q, Hq, D)`` in q's dtype and ``lse (Hq, total_q)``: each sequence is a batch-1 problem over
    views of the packed arrays, and all their work items share one pool (memory and time follow the real tokens)."""
    out = np.zeros(problem.q.shape, dtype=problem.dtype)
    lse = np.full((problem.heads_q, problem.total_q), -np.inf, dtype=stats_dtype(problem.dtype))
    live = _live(*problem.lengths)
    scratch = _Scratch()
    results = run_many(forward_work(problem.sequence(i), scratch=scratch) for i in live)
    for i, (o, l) in zip(live, results):
        q0, q1 = problem.offsets_q[i:i + 2]
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def backward_varlen(problem: VarlenProblem, dout, out, lse, *, deterministic=False):
    """``(dq, dk, dv)`` packed like ``q``, ``k``, ``v`` (FA2 Algorithm 2 per sequence, one pool)."""
    grads = tuple(np.zeros(a.shape, dtype=problem.dtype) for a in (problem.q, problem.k, problem.v))
    live = _live(*problem.lengths)
    scratch = _Scratch()
    results = run_many(backward_work(*problem.sequence(i, dout, out, lse), scratch=scratch) for i in live)
    for i, (gq, gk, gv) in zip(live, results):
        (q0, q1), (k0, k1) = problem.offsets_q[i:i + 2], problem.offsets_k[i:i + 2]
        grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1] = gq[0], gk[0], gv[0]
    return grads


@contextlib.contextmanager
def append_kvcache(problem: KVCacheProblem):
    """Write ``k_new``/``v_new`` into the caches at positions ``cache_seqlens + [0, S_new)`` (one scatter each) for
    the body of the ``with``: an exception there (a kernel that fails to compile, Ctrl-C, an environment variable
    changed meanwhile) writes back what the slots held, so a call that raises leaves the caches as they were. Every
    backend appends before it computes (its kernels read the new keys from the caches, through copies some launches
    make of them as they are prepared), so the undo is of the slots written, the size of ``k_new``."""
    if not problem.seqlen_new:
        yield
        return
    b = np.arange(problem.batch)[:, None]
    pos = problem.cache_host[:, None] + np.arange(problem.seqlen_new)[None, :]
    at = (b, pos) if not problem.paged else (problem.table_host[b, pos // problem.page_size], pos % problem.page_size)
    before = problem.k_cache[at], problem.v_cache[at]  # advanced indexing: copies
    problem.k_cache[at] = problem.k_new
    problem.v_cache[at] = problem.v_new
    try:
        yield
    except BaseException:
        problem.k_cache[at], problem.v_cache[at] = before
        raise


def _sequence_kv(problem: KVCacheProblem, b: int):
    """Sequence ``b``'s keys and values as ``(1, L, Hkv, D)``: a view of a contiguous cache, or its pages gathered
    (a copy of that sequence's cache only)."""
    n = int(problem.lengths_k[b])
    if not problem.paged:
        return problem.k_cache[b:b + 1, :n], problem.v_cache[b:b + 1, :n]
    pages = problem.pages(b)
    shape = (1, -1) + problem.k_cache.shape[2:]
    return (problem.k_cache[pages].reshape(shape)[:, :n], problem.v_cache[pages].reshape(shape)[:, :n])


def _split_works(problem: KVCacheProblem, b: int, scratch):
    """The work of sequence ``b``: one forward, or ``num_splits`` forwards over consecutive runs of whole key tiles
    (tiles of ``ceil(L / num_splits)`` keys, at most :data:`BLOCK_K`), each a partial result to merge."""
    sub = problem.sequence(b, *_sequence_kv(problem, b))
    splits = problem.num_splits or 1
    if splits == 1:
        return [forward_work(sub, scratch=scratch)]
    n = int(problem.lengths_k[b])
    bk = max(1, min(BLOCK_K, -(-n // splits)))
    tiles = -(-n // bk)
    # More splits than key tiles leave some empty: they add nothing to the merge, and num_splits = 10**9 would make a
    # billion of them; min(splits, tiles) gives the same non-empty ranges (one tile each), hence the same bits.
    splits = max(1, min(splits, tiles))
    return [forward_work(sub, block_k=bk, scratch=scratch, cast=False,
                         key_tiles=(s * tiles // splits, (s + 1) * tiles // splits)) for s in range(splits)]


def _groups(problem: KVCacheProblem, live):
    """Consecutive live sequences in groups whose keys and values copied (gathered pages, upcasts) stay near
    :data:`KV_GATHER_BYTES`; a contiguous cache in the working dtype is read through views: one group."""
    per_key = 2 * problem.heads_kv * problem.head_dim * _work_dtype(problem).itemsize
    copied = problem.paged or problem.dtype != _work_dtype(problem)
    group, size = [], 0
    for b in live:
        cost = int(problem.lengths_k[b]) * per_key if copied else 0
        if group and size + cost > KV_GATHER_BYTES:
            yield group
            group, size = [], 0
        group.append(b)
        size += cost
    if group:
        yield group


def forward_kvcache(problem: KVCacheProblem):
    """Append the new tokens, then ``out (B, Sq, Hq, D)`` and ``lse (B, Hq, Sq)`` of each sequence's queries
    against its ``cache_seqlens + S_new`` keys. With ``num_splits > 1`` the key range is split and the parts merged
    by log-sum-exp (:func:`cuflash.merge.merge_parts`, in the working dtype, rounded once): what the CUDA
    split-KV kernel and its combine step compute."""
    wt = _work_dtype(problem)
    out = np.zeros(problem.q.shape, dtype=problem.dtype)
    lse = np.full((problem.batch, problem.heads_q, problem.seqlen_q), -np.inf, dtype=wt)
    # CUFLASH_NUM_THREADS and CUFLASH_BLAS were read (a malformed value refused) as the call started (the backend's
    # entry, _blas.one_call), before the append: a refused call leaves the caches alone
    with append_kvcache(problem):
        return _forward_kvcache(problem, wt, out, lse)


def _forward_kvcache(problem, wt, out, lse):
    scratch = _Scratch()
    live = _live(np.full(problem.batch, problem.seqlen_q), problem.lengths_k)
    for group in _groups(problem, live):
        works = [_split_works(problem, b, scratch) for b in group]
        results = iter(run_many(w for ws in works for w in ws))
        for b, ws in zip(group, works):
            parts = [next(results) for _ in ws]
            o, l = parts[0] if len(parts) == 1 else merge_parts(
                np, [p[0] for p in parts], [p[1] for p in parts], wt, unseen=True)  # as the unsplit call
            out[b], lse[b] = o[0], l[0]
    return out, lse
