"""Blocked NumPy backend: FlashAttention-2 Algorithm 1 (forward) and Algorithm 2 (backward).

The CPU product. Work is cut into items of (a block of (batch, head) pairs, one query tile) for
the forward and (a block of pairs, one dQ accumulator) for the backward; each item streams the
tiles of the schedule (:mod:`cuflash.tiling`) through one score buffer, so extra memory is a fixed
budget per worker (:data:`TILE_ELEMENTS` scores in the forward; :data:`BACKWARD_TILE_ELEMENTS` and
a few buffers of that size in the backward) plus O(B·H·N·d) for inputs upcast to the working
dtype, outputs, statistics and the backward's row operands (:class:`_Rows`, of the blocks in flight): S and P
never exist beyond one tile, whatever B·H is. Items are
spread over a thread pool (NumPy's ufuncs and BLAS release the GIL on large tiles) and every
product runs on one BLAS thread (:mod:`._blas`): what an item computes depends only on the problem
and the tile sizes, never on the thread count, so results are bitwise the same for any
``CUFLASH_NUM_THREADS``, any BLAS setting and any number of concurrent callers.

float32 softmax is computed in base 2 (see :class:`_Exp`); the log-sum-exp is returned in natural
units and the backward converts it back once per row.
Row sums of P come from a matrix-vector product (a pass that BLAS does at memory speed).
Statistics are float32 (float64 for float64 input); float16/bfloat16 inputs are upcast to float32
once, O(N·d).
"""
from __future__ import annotations

import collections
import contextvars
import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from .._fp import ignore_fp_errors
from .._lazy import lazy_property
from ..dropout import keep_mask
from ..problem import Problem, stats_dtype, visible
from ..tiling import Schedule, Tile
from ._blas import (add_product, call_threads, describe, normal_exp, one_call, one_choice, products, single_threaded,
                    worker_single_threaded)

#: Default tile of one head, measured on 2 cores (fp32, N = 4096, 4 heads, d = 64 and 128):
#: see ``benchmarks/numpy_backend.py``.
BLOCK_Q, BLOCK_K = 512, 512
#: Scores per work item of the forward over all its heads: the score buffer of one worker. Four heads'
#: tiles: a quarter of the NumPy calls per score (each one releases and retakes the GIL, which the workers
#: contend for between calls; a causal diagonal tile's strips make four calls of each kind). Measured on 2
#: cores, fp32, N = 4096, 4 heads: two heads per item 2-15% faster than one (d = 64); four 1-2% faster than
#: two without a mask and 7-9% with causal=True (9 rounds each, 2026-11-27; float64 -3% to +4%). Many small
#: heads are batched up to this size, and a grouped-query head group too wide for it gets shorter query tiles.
TILE_ELEMENTS = 4 * BLOCK_Q * BLOCK_K
#: The same for the backward, two heads' tiles too. It holds several buffers of this size per worker (P, dP,
#: dropout's keep-mask). Measured on 2 cores, fp32, N = 4096, 4 heads, against one head per item (7 rounds): 5-7%
#: faster at head_dim 64, within noise at 128.
BACKWARD_TILE_ELEMENTS = 2 * BLOCK_Q * BLOCK_K
#: Elements of one head's tile from which the forward runs an item's heads in turn (:meth:`_Forward._heads_in_turn`):
#: half a full tile. Below it the stacked stages are faster: B = 64, S = 128, 8 heads (128 x 128 tiles) took 1.13-2.0x
#: their time in turn, MQA with 64 query heads (32 x 512) 1.16-1.38x (two threads, AMD EPYC, A/B in one process).
HEADS_IN_TURN_ELEMENTS = BLOCK_Q * BLOCK_K // 2
#: Query rows per key/value head from which K^T is copied contiguous (see _keys_transposed).
KT_COPY_ROWS = 64
#: Parts of the copy of K^T (or of [V | 1]) that the workers share (:class:`_Together`).
KT_COPY_PARTS = 4
#: Query rows per strip of a partial tile (_Masks.strips): a causal diagonal tile costs 5/8 of its products.
STRIP_ROWS = 128
#: dQ accumulators of the backward: a constant, so dQ's summation order never depends on threads.
DQ_CHUNKS = 4
#: what this backend computes (checked once, by cuflash.backends.select)
DTYPES = ("float16", "bfloat16", "float32", "float64")
BF16_BITS = False
MAX_HEAD_DIM = None
ARRAYS = "numpy"
MODIFIERS = True  # score and mask modifiers (cuflash.mods), evaluated tile by tile
VARLEN = True  # ragged batches: forward_varlen, backward_varlen
KVCACHE = True  # KV caches, contiguous or paged, split key ranges: forward_kvcache
LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)


def available():
    return True, "always available"


#: the scope of an operation made of several calls of this backend (a ring's steps): one BLAS for all of them
call_scope = one_call


def details():
    """For the list of backends: which BLAS runs the tile products, and why."""
    return describe()


def _entry(fn):
    """A backend entry point: one BLAS for the whole call (:func:`one_choice`), NumPy's floating-point errors ignored
    (:func:`cuflash._fp.ignore_fp_errors`; non-finite inputs reach exactly the results that see them,
    :func:`_seen_product`, and padding is zeroed, :func:`_without_padding`)."""
    return one_choice(ignore_fp_errors(fn))


#: the event a call's workers look at between tiles (:func:`_run`): set when the calling thread leaves the call early
_STOP: contextvars.ContextVar = contextvars.ContextVar("cuflash_numpy_stop", default=None)


class _Stopped(Exception):
    """A worker's item abandoned because its call was left (Ctrl-C in the caller, an error in another item)."""


def _check_stop():
    """Between tiles: end the item if its call was left (an item of a long backward ran for minutes after Ctrl-C)."""
    stop = _STOP.get()
    if stop is not None and stop.is_set():
        raise _Stopped


def _run(fn, items, consume=None):
    """``fn(x)`` for every item on the worker threads, BLAS on one thread throughout.

    ``consume(x, result)`` is called in item order as results arrive (never concurrently); at
    most a few items per worker are in flight, so results that ``consume`` folds away (the
    backward's dQ accumulators) never all exist at once.
    """
    items = list(items)
    threads = call_threads()  # parsed before any work: a malformed value fails there, naming the variable
    consume = consume or (lambda x, r: None)
    with single_threaded():
        if len(items) < 2 or threads < 2:
            for x in items:
                consume(x, fn(x))
            return

        def run(x):
            with worker_single_threaded(), np.errstate(all="ignore"):  # NumPy 1's is per thread (_entry)
                return fn(x)

        window = 4 * threads
        stop = threading.Event()
        token = _STOP.set(stop)  # before the contexts are copied: every item sees this call's event
        try:
            with ThreadPoolExecutor(min(threads, len(items))) as pool:
                pending = collections.deque()
                try:
                    for x in items:
                        # in a copy of the caller's context: the call's one BLAS (_blas.one_choice)
                        pending.append((x, pool.submit(contextvars.copy_context().run, run, x)))
                        if len(pending) >= window:
                            y, future = pending.popleft()
                            consume(y, future.result())
                    while pending:
                        y, future = pending.popleft()
                        consume(y, future.result())
                except BaseException:  # Ctrl-C or an item's error: the running items end at their next tile, the
                    stop.set()  # others never start, and the pool's exit waits for them before BLAS is restored
                    for _, future in pending:
                        future.cancel()
                    raise
        finally:
            _STOP.reset(token)


class _Scratch(threading.local):
    """Per-thread flat buffers, reused from tile to tile (and item to item) within one call."""

    def get(self, name, shape, dtype):
        n = math.prod(shape)
        buf = getattr(self, name, None)
        if buf is None or buf.size < n or buf.dtype != dtype:
            # the old buffer goes first: the peak is then the largest buffer, not the order of the sizes asked for
            buf = None
            setattr(self, name, None)
            buf = np.empty(max(n, 1), dtype=dtype)
            setattr(self, name, buf)
        return buf[:n].reshape(shape)


# --------------------------------------------------------------------------------------------
# Layout: tiles and blocks of (batch, kv head) pairs
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    block_q: int
    block_k: int
    chunks: tuple  # ((batch slice, kv-head slice), ...): the pairs of one item, all query heads of each


def layout(problem: Problem, block_q=None, block_k=None, elements=TILE_ELEMENTS) -> Layout:
    """Tile sizes and pair blocks for a problem: a tile over all heads of an item stays within
    ``elements`` scores (unless the caller fixes a larger tile)."""
    g = problem.group
    fixed = block_q is not None or block_k is not None
    bq = max(1, min(block_q or BLOCK_Q, max(problem.seqlen_q, 1)))
    bk = max(1, min(block_k or BLOCK_K, max(problem.seqlen_k, 1)))
    if not fixed and g * bq * bk > elements:  # a wide query-head group: shorter tiles
        bk = max(1, min(bk, elements // g))
        bq = max(1, elements // (g * bk))
    bm = problem.block_mask
    if bm is not None:
        # Tiles that are whole multiples of the mask's blocks, or whole divisors of them, skip exactly the blocks it
        # skips (any tile is exact: it tests the elements of blocks it only partly covers); a divisor, not the block,
        # where the block is larger than the tile, so that the tile keeps its budget (a 8192-row block made the tile
        # O(N^2)). A tile spanning the whole sequence stays as it is, so that a BlockMask of the same elements as
        # window= gives the same tiles, hence the same bits.
        if bq < problem.seqlen_q:
            bq = _fitted(bq, bm.block[0])
        if bk < problem.seqlen_k:
            bk = _fitted(bk, bm.block[1])
    per_pair = g * bq * bk
    b, hkv = problem.batch, problem.heads_kv
    pairs = max(1, elements // per_pair)
    if pairs >= hkv:  # whole batches of heads per item
        nb = max(1, pairs // hkv)
        chunks = tuple((slice(b0, min(b0 + nb, b)), slice(0, hkv)) for b0 in range(0, b, nb))
    else:
        chunks = tuple((slice(b0, b0 + 1), slice(h0, min(h0 + pairs, hkv)))
                       for b0 in range(b) for h0 in range(0, hkv, pairs))
    return Layout(bq, bk, chunks)


def _fitted(tile: int, block: int) -> int:
    """The tile side nearest below ``tile`` that is a multiple of ``block`` (a smaller block) or divides it, if that
    keeps half the tile at least; else ``tile`` itself (exact too, its elements tested: a block of 1031 rows has no
    divisor but 1 below 512, and 1-row tiles took 2400x the time)."""
    if block <= tile:
        return tile // block * block
    divisor = max(d for d in range(1, tile + 1) if block % d == 0)
    return divisor if 2 * divisor >= tile else tile


def _work_dtype(problem):
    return stats_dtype(problem.dtype)


def _grouped(x, problem, dtype):
    """(B, S, H, D) → (B, Hkv, H/Hkv, S, D) in the working dtype.

    A view when the dtype already matches: BLAS takes each (S, D) slice with its row stride as
    the leading dimension, so no copy is needed; float16/bfloat16 are upcast once, O(N·d).
    """
    b, s, h, d = x.shape
    return x.transpose(0, 2, 1, 3).astype(dtype, copy=False).reshape(b, problem.heads_kv, h // problem.heads_kv, s, d)


def _without_padding(x, lengths):
    """``x`` (grouped: batch first, rows on axis -2) with its rows past each sequence's length ``lengths[b]`` at 0,
    as the CUDA kernels fill them on load. Then nothing the padding holds (an uninitialized buffer's NaN or 3e38)
    enters a bound, a finiteness check, the guarded path or a product's rounding: a sequence's bits are those of
    zero padding, and no overflow there raises a RuntimeWarning. A copy only where some padding element is not 0
    (one pass over the padding to tell)."""
    if lengths is None:
        return x
    rows = x.shape[-2]
    dirty = [(b, int(n)) for b, n in enumerate(lengths) if n < rows and np.any(x[b, ..., int(n):, :])]
    if not dirty:
        return x
    x = x.copy()
    for b, n in dirty:
        x[b, ..., n:, :] = 0
    return x


def _padding_lengths(problem):
    """``(len_q, len_k)`` where the batch is padded (``seqlens_q``/``seqlens_k``), else ``(None, None)``."""
    padded = problem.seqlens_q is not None or problem.seqlens_k is not None
    return problem.lengths if padded else (None, None)


def _result_zeros(grouped_shape, problem, wt):
    """Zeros of the grouped shape ``(B, Hkv, g, S, D)`` (a result: ``out``, dQ, dK, dV) whose memory is in the
    caller's axis order (``problem.layout``): ``(B, S, H, D)`` for ``"bshd"``, so that :func:`_ungroup` of it is
    C-contiguous and the caller gets a contiguous result in either layout without a copy (the writes of a tile's
    rows are strided then, at no measurable cost)."""
    b, hkv, g, s, d = grouped_shape
    if problem.layout == "bhsd":
        return np.zeros(grouped_shape, dtype=wt)
    return np.zeros((b, s, hkv, g, d), dtype=wt).transpose(0, 2, 3, 1, 4)


def _keys_transposed(problem, k, matmul):
    """K^T as (B, Hkv, 1, D, Sk), and the parts that fill it (see :class:`_Together`), or no parts for a view.
    A contiguous copy when NumPy's matmul (OpenBLAS) runs the products and enough query rows share it: the product
    Q K^T then runs as a plain (non-transposed) GEMM, about 8% faster in OpenBLAS for head_dim 64 (and 3% for 128)
    than through the transposed view; decode-shaped calls (a few query rows against long keys) keep the view, where
    copying K would cost more than the products. MKL's gemm reads the view within 2% of the copy's speed, less than
    the copy costs (forward 1.5% faster without it at N = 4096, equal at 16384; A/B in one process, 2 cores), and
    the copy's O(N·d) per block of heads is saved."""
    kt = np.swapaxes(k, -1, -2)
    if matmul is not np.matmul or problem.seqlen_q * problem.group < KT_COPY_ROWS:
        return kt, []
    out = np.empty(kt.shape, dtype=kt.dtype)

    def part(s0, s1):
        # In blocks of keys: NumPy copies a transposed array in the destination's order, reading K with a stride
        # of H·d elements, which misses the cache at every element; a block of 256 keys stays in L1 (2.3 -> 1.0 ms
        # for 4 heads of 4096 x 64 float32 on this machine).
        for b0 in range(s0, s1, 256):
            out[..., b0:min(b0 + 256, s1)] = kt[..., b0:min(b0 + 256, s1)]

    return out, [functools.partial(part, *keys) for keys in _key_parts(kt.shape[-1])]


def _key_parts(n):
    """The ranges of keys ``(s0, s1)`` in which the workers copy K or V (:class:`_Together`): at most
    :data:`KT_COPY_PARTS`, whole blocks of 256 keys each."""
    step = 256 * max(1, -(-n // (256 * KT_COPY_PARTS)))
    return [(s0, min(s0 + step, n)) for s0 in range(0, n, step)]


class _Together:
    """Work that several workers need at once, split into parts: every worker that asks before it is done takes
    parts until none is left, then waits for the others' and for ``finish(results)``. A block's preparation
    (:func:`_per_chunk`) is needed by the first items of every worker together (items run one block of heads after
    another); done by one worker while the others waited, it cost 2 x 2.5 ms of idle time in a 92 ms forward on
    2 cores (fp32, N = 4096, 4 heads, d = 64). An error in a part is raised in every waiting worker."""

    def __init__(self, parts, finish):
        self._todo = collections.deque(enumerate(parts))  # popleft is atomic: each part runs once
        self._results = [None] * len(parts)
        self._left, self._finish = len(parts), finish
        self._done = threading.Condition()
        self._value = self._error = None
        if not parts:
            self._value = finish([])

    def __call__(self):
        while True:
            try:
                n, part = self._todo.popleft()
            except IndexError:
                break
            try:
                result, error = part(), None
            except BaseException as exc:  # noqa: BLE001 (raised below, in every worker)
                result, error = None, exc
            with self._done:
                self._results[n], self._left = result, self._left - 1
                self._error = self._error or error
                if self._left == 0:
                    if self._error is None:
                        try:
                            self._value = self._finish(self._results)
                        except BaseException as exc:  # noqa: BLE001
                            self._error = exc
                    self._finish = self._results = None  # what the parts made lives on in the value only
                    self._done.notify_all()
        with self._done:
            self._done.wait_for(lambda: self._left == 0)
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(frozen=True)
class _Prepared:
    """What the items of one block of (batch, kv head) pairs share."""

    kt: np.ndarray                # K^T (see _keys_transposed)
    bounds: Optional["_Bounds"]  # None where they do not apply
    v_nonfinite: bool             # some element of V is not finite (the forward's _seen_product)
    any_nonfinite: bool           # some element of Q, K, V or ``also`` is (the backward's _seen_product; forward: V)
    v1: Optional[np.ndarray] = None  # [V | 1] where the forward folds the row sum into P V (_rowsum_in_pv)
    v_scale: float = 1.0          # a power of two the forward runs V at (:func:`_v_scale`)


class _PerBlock:
    """Work made once per block of (batch, kv head) pairs (a ``chunk``) by the workers that first ask for it:
    ``make(chunk)`` gives the ``(parts, finish)`` of a :class:`_Together`."""

    def __init__(self, make):
        self._make, self._lock, self._made = make, threading.Lock(), {}

    def __call__(self, chunk):
        key = self._key(chunk)
        with self._lock:
            together = self._made.get(key)
            if together is None:
                together = self._made[key] = _Together(*self._make(chunk))
        return together()

    def release(self, chunk):
        """Forget the block's work once no item needs it any more (its arrays are freed with the last reference)."""
        with self._lock:
            self._made.pop(self._key(chunk), None)

    @staticmethod
    def _key(chunk):
        return tuple((x.start, x.stop) for x in chunk)


def _per_chunk(problem, rule, q, k, v, wt, matmul, also=(), ones_column=False, forward=False) -> _PerBlock:
    """What a block of (batch, kv head) pairs needs before its first tile (a :class:`_Prepared`), made by the workers
    that first ask for it (:class:`_PerBlock`): K^T (:func:`_keys_transposed`), the block's :class:`_Bounds` and
    whether its inputs (and ``also``, arrays of the same leading axes) are finite: one block's infinity never slows
    or changes another's products. So this O(N·d) preparation runs on the workers, one block beside another, instead
    of on one core before the pool starts (3.7 ms of a 70 ms causal forward at N = 4096 on 2 cores).

    ``forward``: the forward's preparation, which needs to know only whether V is finite (its products meet only V's
    elements against zeros of P; its NumPy warnings are silenced whatever the inputs)."""
    bounded = _Bounds.applies(problem)

    def parts(chunk):  # a closure, not a method: nothing here refers back to the _PerBlock (no cycle to collect)
        qc, kc, vc = q[chunk], k[chunk], v[chunk]
        kt, copy = _keys_transposed(problem, kc, matmul)
        norms = [functools.partial(_Bounds.row_norms, x) for x in (kc, vc)] if bounded else []
        # With the norms, V's largest row norm stands in for max|V| (the pass below only where it does not settle
        # the question); the forward needs no other check.
        exact = [] if bounded else [functools.partial(_largest, vc)]
        others = [] if forward else [functools.partial(_nonfinite, x) for x in (qc, kc) + tuple(x[chunk] for x in also)]
        v1, ones = _with_ones(vc) if ones_column else (None, [])

        def finish(results):
            kv = results[len(copy):len(copy) + len(norms)]
            checks = results[len(copy) + len(norms):][:len(exact) + len(others)]
            kmax, vmax = (_Bounds.largest(x) for x in kv) if kv else (None, None)
            bounds = _Bounds(problem, rule, kmax, vmax, wt) if kv else None
            v_nonfinite, v_scale = _v_checks(problem, wt, vc, vmax, checks[0] if exact else None)
            return _Prepared(kt, bounds, v_nonfinite, v_nonfinite or any(checks[len(exact):]), v1, v_scale)

        return copy + norms + exact + others + ones, finish

    return _PerBlock(parts)


def _v_checks(problem, wt, v, vnorm, vmax):
    """``(whether V holds an infinity or NaN, the power of two it runs at (:func:`_v_scale`))``, from ``vmax = max|V|``
    (:func:`_largest`) or, where the bounds computed them instead, from V's largest row norms ``vnorm``: an upper
    bound on max|V| (raised by the rounding of d squares) that settles both for every V but those near the dtype's
    largest or not finite, where the exact pass decides as before (same results, one pass fewer). (The padding past
    the sequences' lengths holds zeros here: :func:`_without_padding`.)"""
    if vmax is None:
        bound = float(np.max(vnorm, initial=0.0)) * (1 + 2.0 ** -8)
        if math.isfinite(bound) and _v_scale(problem, wt, bound) == 1.0:
            return False, 1.0
        vmax = _largest(v)
    if not math.isfinite(vmax):  # an infinity or NaN in V: the scale from the finite values
        return True, _v_scale(problem, wt, _largest_finite(v))
    return False, _v_scale(problem, wt, vmax)


#: Working dtypes whose forward sums the rows of P in the product when MKL runs it (:func:`_rowsum_in_pv`).
ROWSUM_IN_PV = ("float64",)


def _rowsum_in_pv(problem, wt, matmul):
    """Whether the forward takes l (FA2 Alg. 1 line 10) as the last column of P [V | 1] instead of a ``gemv`` pass
    over P. float64's 2 x 512 x 512 tile (4 MiB when measured; four heads' 8 MiB now) outgrows the 2 MiB L2 of this
    machine's cores, so the ``gemv`` streams it from L3 (0.15 ms a tile, float32's 0.045); MKL's ``dgemm`` takes the
    65th column for 0.06 ms. On two threads (A/B in one process, N = 4096, 4 heads): float64 1-9% faster (one thread
    3-7%); float32 up to 6% slower, OpenBLAS within 2% either way: neither folds. Dropout scales P before the
    product and l is of the undropped P, so it keeps the ``gemv``. [V | 1] is a copy of V per block of heads,
    O(N·d)."""
    return wt.name in ROWSUM_IN_PV and matmul is not np.matmul and not problem.dropout_p \
        and problem.seqlen_q * problem.group >= KT_COPY_ROWS  # decode-shaped: copying V would cost more


def _with_ones(v):
    """[V | 1] and the parts that fill it (:class:`_Together`)."""
    v1 = np.empty(v.shape[:-1] + (v.shape[-1] + 1,), dtype=v.dtype)

    def part(s0, s1):
        v1[..., s0:s1, :-1] = v[..., s0:s1, :]
        v1[..., s0:s1, -1] = 1

    return v1, [functools.partial(part, *keys) for keys in _key_parts(v.shape[-2])]


def _ungroup(x):
    b, hkv, g, s, d = x.shape
    return x.reshape(b, hkv * g, s, d).transpose(0, 2, 1, 3)


class _Masks:
    """The invisible elements of partial tiles, as booleans shaped to broadcast over a score tile.

    Without a BlockMask and with one length for every sequence, a tile inside the sequences is
    masked by the band alone, which depends only on the tile's offset from the diagonal and its
    shape: such masks come from a cache kept across calls (:func:`_band`; the diagonal tiles of a
    causal problem all share one), the others are built per tile.
    """

    def __init__(self, sched, problem):
        self.sched, self.problem = sched, problem
        len_q, len_k = sched.len_q, sched.len_k
        self.uniform = (sched.block_mask is None and (len_q == len_q[0]).all() and (len_k == len_k[0]).all())
        self.len_q, self.len_k = int(len_q[0]), int(len_k[0])

    def _mask(self, tile, chunk) -> "_TileMask":
        if self.uniform and tile.i1 <= self.len_q and tile.k1 <= self.len_k:
            shape = (tile.i1 - tile.i0, tile.k1 - tile.k0)
            band = _band if shape[0] * shape[1] <= BLOCK_Q * BLOCK_K else _band.__wrapped__  # larger: not kept
            return band(tile.i0 - tile.k0 + self.len_k - self.len_q, *shape, self.sched.left, self.sched.right)
        problem = self.problem
        bs, hs = chunk
        heads = np.arange(problem.heads_q).reshape(problem.heads_kv, problem.group)[hs].reshape(-1)
        # (nb, Hm|1, bq, bk); a BlockMask rule's floats in the working precision, as in the kernels
        keep = self.sched.element_mask(tile, batch=np.arange(problem.batch)[bs], heads=heads,
                                       dtype=_work_dtype(problem))
        nb, h = keep.shape[:2]
        keep = keep.reshape(nb, -1, problem.group, *keep.shape[2:]) if h > 1 else keep[:, :, None]
        return _TileMask(~keep)

    def settled(self, tiles, chunk):
        """``tiles`` as their elements make them: a partial tile whose element mask hides nothing is full, one that
        hides everything is dropped. A partial block of a BlockMask larger than the tile holds such tiles, which
        then take the path, hence give the bits, of the same elements asked for by window= or causal=. A mask
        modifier decides apart (as in :meth:`every_row_sees_two`)."""
        bm = self.problem.block_mask
        if bm is None or (bm.block[0] <= self.sched.block_q and bm.block[1] <= self.sched.block_k) or \
                (self.problem.mods is not None and self.problem.mods.mask is not None):
            return list(tiles)  # no tile lies inside a larger block: a partial tile has seen and hidden elements
        out = []
        for tile in tiles:
            mask = None if tile.full else self._mask(tile, chunk)
            if mask is None or not mask.none_seen:
                out.append(replace(tile, full=True) if mask is not None and mask.none_hidden else tile)
        return out

    def every_row_sees_two(self, tile, chunk):
        """Whether every row of ``tile`` sees at least two of its keys (then no row of it can see one key only). From
        the element mask, so that a BlockMask and window= of the same elements decide alike; False where a mask
        modifier decides."""
        if self.problem.mods is not None and self.problem.mods.mask is not None:
            return False
        if tile.full:
            return tile.k1 - tile.k0 >= 2
        return self._mask(tile, chunk).two

    def hidden_from(self, tile, chunk):
        """``(c0, hidden[..., c0:])``: the mask from the tile's first column with a hidden element (a strip of a
        causal diagonal tile hides only its last columns: the masking pass touches only those)."""
        return self._mask(tile, chunk).start

    def strips(self, tile, chunk, rows=None):
        """A partial tile as strips of ``rows`` query rows (:data:`STRIP_ROWS`), each cut to the key columns that
        some of its elements see (strips that see nothing dropped): tile skipping at a finer grain than the tile,
        so that a causal diagonal tile costs (n + 1) / 2n of its products in n strips. Taken from the element mask,
        so that the same elements give the same strips, hence the same bits, however they were asked for (a
        BlockMask or window=). A full tile, or one no taller than a strip, is itself."""
        rows = rows or STRIP_ROWS
        if tile.full or tile.i1 - tile.i0 <= rows:
            return (tile,)
        i0, k0 = tile.i0, tile.k0
        return tuple(Tile(i0 + r0, i0 + r1, k0 + c0, k0 + c1, full)
                     for r0, r1, c0, c1, full in self._mask(tile, chunk).cut(rows))


class _TileMask:
    """The hidden elements of one partial tile (read-only booleans, ``(nb, 1|Hkv, 1|G, rows, cols)``) and what the
    forward derives from them, each computed on first use. Shared between threads: a value two threads compute at
    once is the same value."""

    def __init__(self, hidden):
        hidden.flags.writeable = False
        self.hidden, self._cuts = hidden, {}

    @lazy_property
    def none_hidden(self):
        return not self.hidden.any()

    @lazy_property
    def none_seen(self):
        return bool(self.hidden.all())

    @lazy_property
    def two(self):
        return bool(((~self.hidden).sum(axis=-1) >= 2).all())

    @lazy_property
    def start(self):
        cols = np.flatnonzero(self.hidden.reshape(-1, self.hidden.shape[-1]).any(axis=0))
        c0 = int(cols[0]) if cols.size else self.hidden.shape[-1]
        return c0, self.hidden[..., c0:]

    def cut(self, rows):
        """Strips of ``rows`` rows as ``(r0, r1, c0, c1, full)`` relative to the tile (see :meth:`_Masks.strips`)."""
        cut = self._cuts.get(rows)
        if cut is None:
            keep = ~self.hidden.reshape(-1, *self.hidden.shape[-2:])
            seen, every = keep.any(axis=0), keep.all(axis=0)
            cut = []
            for r0 in range(0, seen.shape[0], rows):
                r1 = min(r0 + rows, seen.shape[0])
                cols = np.flatnonzero(seen[r0:r1].any(axis=0))
                if cols.size:
                    c0, c1 = int(cols[0]), int(cols[-1]) + 1
                    cut.append((r0, r1, c0, c1, bool(every[r0:r1, c0:c1].all())))
            self._cuts[rows] = cut
        return cut


@functools.lru_cache(maxsize=16)
def _band(diag, rows, cols, left, right):
    """The mask of a ``rows x cols`` tile inside the sequences of a band (no BlockMask, one length for every sequence),
    whose first row sits ``diag`` columns right of its first column's diagonal: all it depends on. Kept across calls
    (at most 16 tiles, 4 MiB of booleans at the default tile): the first diagonal tile of a causal call used to build
    it, its strips and its column span (~2 ms of each call at N = 4096 on this 2-core machine)."""
    big = np.iinfo(np.int64).max  # inside the sequences: only the band hides elements
    keep = visible(np.arange(rows)[:, None] + diag, np.arange(cols)[None, :], big, big, left, right)
    return _TileMask(~keep[None, None, None])


def _mask_scores(s, masks, tile, chunk, fill=-np.inf):
    """Set invisible scores of a partial tile to -inf (before the row max: a masked score must not raise m_i),
    or invisible probabilities to 0 (``fill=0``, after ``exp``). Set, not added: a NaN or infinite score that a
    row does not see must not reach it."""
    if not tile.full:
        c0, hidden = masks.hidden_from(tile, chunk)
        np.copyto(s[..., c0:], fill, where=hidden)


class _Mods:
    """The call's score and mask modifiers (:class:`cuflash.mods.Modifiers`) on one tile of one item, in the
    grouped (nb, nh_kv, G, rows, keys) layout of the scores (query head h = kv head * G + g)."""

    def __init__(self, problem, wt):
        self.problem, self.wt, self.mods = problem, wt, problem.mods
        self.len_q, self.len_k = problem.lengths

    @staticmethod
    def active(problem) -> bool:
        return problem.mods is not None

    def env(self, tile, chunk, score=None):
        p = self.problem
        bs, hs = chunk
        col = lambda x: np.asarray(x).reshape(-1, 1, 1, 1, 1)  # noqa: E731
        heads = np.arange(p.heads_q).reshape(p.heads_kv, p.group)[hs]
        env = dict(b=col(np.arange(p.batch)[bs] + p.batch_offset), h=heads[None, :, :, None, None],
                   q_len=col(self.len_q[bs]),
                   kv_len=col(self.len_k[bs]), q_idx=np.arange(tile.i0, tile.i1).reshape(1, 1, 1, -1, 1),
                   kv_idx=np.arange(tile.k0, tile.k1).reshape(1, 1, 1, 1, -1))
        if score is not None:
            env["score"] = score
        return env

    def score(self, s, tile, chunk, keep_s0=False):
        """Apply the score modifier to the natural scores ``s`` in place; return them as they were (``keep_s0``)."""
        if self.mods.score is None:
            return None
        s0 = s.copy() if keep_s0 else None
        s[...] = self.mods.score.evaluate(self.env(tile, chunk, s), self.mods.values, self.wt)
        return s0

    def mask(self, s, tile, chunk, fill=-np.inf):
        """The mask modifier: scores it removes become -inf (every tile, before the row max), or their
        probabilities 0 (``fill=0``, after ``exp``)."""
        if self.mods.mask is not None:
            keep = self.mods.mask.evaluate(self.env(tile, chunk), self.mods.values, self.wt)  # working precision
            np.copyto(s, fill, where=~np.broadcast_to(keep, s.shape))

    def factor(self, expr, s0, tile, chunk):
        return expr.evaluate(self.env(tile, chunk, s0), self.mods.values, self.wt)

    def backprop(self, ds, s0, tile, chunk):
        """dS of the modified scores → that of the unmodified ones (masked entries, dS = 0, stay 0)."""
        f = self.factor(self.mods.dscore, s0, tile, chunk)
        np.multiply(ds, f, out=ds, where=ds != 0)

    def dbias(self, ds, s0, tile, chunk, part, k0):
        """Add this tile's dbias (dS times d mod/d bias) into ``part``: the item's share of the bias's compact
        (B|1, H|1, Sq|1, Sk|1) shape, at the item's batch/head block and this tile's rows, keys (or summed); ``part``
        starts at key ``k0`` (its key column's first: the tile may be a strip of fewer keys).
        Only where dS != 0, as in :meth:`backprop` and the reference: the factor of a score the row does not see (a
        mask's, a padding row's) may be NaN with finite inputs (``sqrt(q_idx - kv_idx)`` above a causal diagonal)."""
        f = self.factor(self.mods.dbias, s0, tile, chunk)
        g = np.multiply(ds, f, where=ds != 0, out=np.zeros_like(ds))
        g = g.reshape(g.shape[0], -1, *g.shape[3:])  # (nb, nh, rows, keys)
        bias = self.mods.values["cuflash_bias"]
        axes = tuple(i for i, (n, c) in enumerate(zip(bias.shape, self.mods.bias_compact)) if c == 1 and n > 1)
        g = g.sum(axis=axes, keepdims=True) if axes else g
        rows = slice(tile.i0, tile.i1) if part.shape[2] > 1 else slice(None)
        cols = slice(tile.k0 - k0, tile.k1 - k0) if part.shape[3] > 1 else slice(None)
        part[:, :, rows, cols] += g


def _dropout_scale(problem, tile, chunk, dtype):
    """Keep-mask of a tile scaled by 1/(1-p), as (nb, nh, G, bq, bk); None without dropout."""
    if not problem.dropout_p:
        return None
    bs, hs = chunk
    heads = np.arange(problem.heads_q).reshape(problem.heads_kv, problem.group)[hs].reshape(-1)
    b = (np.arange(problem.batch)[bs] + problem.batch_offset)[:, None, None, None]
    h = heads[None, :, None, None]
    i = np.arange(tile.i0, tile.i1)[None, None, :, None]
    j = np.arange(tile.k0, tile.k1)[None, None, None, :]
    keep = keep_mask(problem.seed, problem.dropout_p, b, h, i, j)
    z = keep.astype(dtype) * dtype.type(1.0 / (1.0 - problem.dropout_p))
    return z.reshape(z.shape[0], -1, problem.group, *z.shape[2:])


@dataclass(frozen=True)
class _Exp:
    """How scores become probabilities for one working dtype.

    float32: base 2. Q is multiplied once by ``scale·log2(e)`` (one rounding of each Q element, of
    the size of the naive computation's own rounding of ``S·scale``; the float32 rule holds errors
    to twice the naive float32 computation's), so scores come out of the product ready for ``exp2``,
    which NumPy evaluates twice as fast as ``exp`` and to < 1 ulp.
    float64, and any dtype with a score modifier (it takes natural scores, ``scale·q·k``): base e, the
    scale folded into Q only when it is a power of two (exact), else applied to each score tile: the
    naive float64 computation is the reference itself, and the rule leaves no room for an extra
    rounding of Q.
    """

    fold: Optional[float]   # multiplies Q (None: Q as is)
    tile: Optional[float]   # multiplies each score tile (None: nothing to do)
    exp: Callable
    log: Callable
    bits: float             # base-2 exponent per unit of score (1 for base 2, log2(e) for base e)
    floor: Optional[float] = None  # the smallest argument of ``exp`` with a normal result (see _exp)
    normal: Optional[Callable] = None  # ``exp`` for arguments with normal results only (:func:`._blas.normal_exp`)


def _exp_rule(problem, wt, q) -> _Exp:
    """``q``: the problem's Q in the working dtype ``wt``."""
    if wt == np.float32 and (problem.mods is None or problem.mods.score is None):
        factor = wt.type(problem.scale * LOG2E)
        fold = _foldable(q, factor, wt)
        return _Exp(factor if fold else None, None if fold else factor, np.exp2, np.log2, 1.0,
                    wt.type(np.finfo(wt).minexp), normal_exp(wt, 2) or np.exp2)
    scale = wt.type(problem.scale)
    exact = problem.scale != 0 and math.frexp(problem.scale)[0] in (0.5, -0.5) and _foldable(q, scale, wt)
    floor = wt.type(math.ceil(np.finfo(wt).minexp * LN2)) if wt == np.float64 else None
    return _Exp(scale if exact else None, None if exact else scale, np.exp, np.log, LOG2E, floor,
                (normal_exp(wt, 0) if wt == np.float64 else None) or np.exp)


def _foldable(q, factor, wt) -> bool:
    """Whether Q times ``factor`` stays finite: a factor above 1 can push an element near the dtype's largest
    past it (q = 3e38 with head_dim 1) where ``scale * (q . k)``, scaled after the product, is an ordinary
    number; then the factor multiplies each score tile instead. One pass over Q, and only for such factors."""
    if abs(float(factor)) <= 1 or q.size == 0:
        return True
    with np.errstate(invalid="ignore"):
        top = float(np.nanmax(np.abs(q)))
    return not top * abs(float(factor)) > float(np.finfo(wt).max)


def _exp(s, rule, clamp=True, normal=False):
    """``exp`` of shifted scores (all <= 0, or -inf) in place.

    NumPy's SIMD float32 ``exp2`` and float64 ``exp`` leave the vector path for every element whose
    result is 0 or subnormal: 2.5-30 ns each against 0.25 ns (measured: a causal diagonal tile, half
    -inf, takes 6x the time of an unmasked one; a tile of far-below-max scores over 10x). So unless the
    caller knows every argument is finite and has a normal result (``clamp=False``), the arguments are
    clamped to the smallest one with a normal result (``floor``) and that result is subtracted after:
    exactly 0 where the argument was at or below ``floor`` (masked scores included), and elsewhere a
    change below ``exp(floor)``, the smallest normal number, far under the rounding of a sum whose
    largest term is 1. Two passes, cheaper than the detour from a few per cent of such elements on.
    ``normal``: the caller knows every result is a normal number (:class:`_Bounds`), whether or not an input is
    infinite: then ``rule.normal`` (MKL's VML), whose detour costs more still. The clamped path keeps NumPy's
    ``exp``: its results are those of the unclamped one that a call with an infinite input takes (a row that does
    not see the infinity keeps its bits).
    """
    if normal:
        return rule.normal(s, out=s)
    if rule.floor is None or not clamp:
        return rule.exp(s, out=s)
    np.maximum(s, rule.floor, out=s)  # NaN stays NaN
    rule.exp(s, out=s)
    s -= rule.exp(rule.floor)
    return s


class _Bounds:
    """Cauchy-Schwarz bounds on a work item's scores, ``|S_ij| <= U_i = |q_i| max_j |k_j|`` (times the score
    scale), in base-2 exponents. They decide, without a pass over the scores, two things:

    *Whether the online softmax may stop tracking the row max* (:meth:`fixed_shift`). FA2 Algorithm 1
    subtracts the running max ``m_i`` before each ``exp`` (line 10) only to keep the exponentials in
    range; ``acc / l`` does not depend on the shift. A query tile takes shift 0 (``P = exp(S)``: no row-max
    pass, no subtraction, no rescaling of ``l`` and ``acc``) from its first key tile when every row sees two
    keys in that tile, else from its second once every row has seen a key (a row that sees one key only
    must keep the weight exp(0) = 1 for it and return its value exactly; both tests rest on the elements,
    not on how a mask was asked for, so a BlockMask and window= of the same elements keep the same bits),
    and when, with ``p`` the dtype's precision and ``e_min``/``e_max`` its exponent range,

    - ``U + log2(Sk) + log2(max|V|, 1) + log2(1/(1 - dropout)) <= e_max - 8``: ``exp(S)``, ``l`` and ``acc``
      cannot overflow;
    - ``U + log2(Sk) <= log2(max|V|) - 2p - e_tiny`` (``2^e_tiny`` the smallest subnormal, and ``U <= -e_min``):
      every ``exp(S)``, a masked score's too, is a normal number (so ``exp`` stays on NumPy's vector path and
      masks are applied after it, as zeros), and what products ``P V`` lose to underflow stays below
      ``2^(-2p)`` of ``max|V|``, as with the shifted form.

    ``max|V|`` enters the first test through its upper bound ``r`` (the largest row norm of V), the second through
    its lower bound ``r / sqrt(d)``.

    *Whether a shifted tile can produce an argument of ``exp`` below ``e_min``* (:meth:`normal`): when no
    argument can, and none is masked, the clamp of :func:`_exp` is skipped.

    A NaN or infinity in Q, K or V fails both tests (comparisons with NaN are false). The decisions depend
    only on the item's data, never on the thread count. The rounding differs from the shifted form's as
    any other choice of shift would (the float64 reference shifts by the exact row max; both stay within
    the tolerance of the naive computation).
    """

    @staticmethod
    def row_norms(x):
        """The row norms of a block's K or V, (nb, nh, 1, Sk), computed in the working dtype with no copy (an overflow
        gives inf, which fails the tests): one pass of einsum, 5x faster than a max and a min over the strided V."""
        with np.errstate(over="ignore", invalid="ignore"):
            return np.sqrt(np.einsum("...d,...d->...", x, x))

    @staticmethod
    def largest(norms):
        """The largest of :meth:`row_norms` per (batch, kv head) pair, (nb, nh, 1) float64. For V, max|V| lies between
        this norm r and r / sqrt(d) (below, the upper end bounds overflow, the lower one underflow)."""
        return norms.max(axis=-1, initial=0.0).astype(np.float64)

    def __init__(self, problem, rule, kmax, vnorm, wt):
        """``kmax``, ``vnorm``: :meth:`largest` of the block's K and V row norms (the padding past the sequences'
        lengths holds zeros here, :func:`_without_padding`: a huge value there made the lower bound on the max|V| of
        a sequence's tiny values too high, and P V fell into the subnormals)."""
        fi = np.finfo(wt)
        drop = -math.log2(1.0 - problem.dropout_p) if problem.dropout_p else 0.0
        with np.errstate(divide="ignore"):
            vlog = np.log2(vnorm) + 2.0 ** -6  # -inf for a norm of 0
            vlog_low = vlog - 0.5 * math.log2(max(problem.v.shape[-1], 1)) - 2.0 ** -5
        nk = math.log2(max(problem.seqlen_k, 1))
        scale = abs(float(rule.tile)) if rule.tile is not None else 1.0
        # per (batch, kv head): the Cauchy-Schwarz factor with room for the rounding of the norms (d ulps), and the
        # limits on U
        self.kbound = (kmax * scale * rule.bits * (1 + 2.0 ** -8))[..., None]
        top = fi.maxexp - 8 - nk - drop - np.maximum(vlog, 0.0)
        # a norm of 0 gives no lower bound on max|V| (the limit is then -inf: no fixed shift): the squares of elements
        # below 2^(e_min / 2) (2^-75 in float32) vanish in the working dtype, and V of such elements is not V = 0
        bottom = vlog_low - 2 * (fi.nmant + 1) - (fi.minexp - fi.nmant) - nk
        self.limit = np.minimum(np.minimum(top, bottom), -fi.minexp)[..., None]
        self.normal_limit = -fi.minexp
        self.bits = rule.bits

    @staticmethod
    def applies(problem):
        """Worth their O(N d) norms when enough query rows share them; never with a score modifier (scores
        not bounded by the inputs' norms)."""
        return (problem.mods is None or problem.mods.score is None) and problem.seqlen_q * problem.group >= KT_COPY_ROWS

    def rows(self, q_i):
        """``U`` of the item's rows (``q_i`` scaled as it enters the product): NaN for a row of norm 0 against an
        infinite bound (a K near the dtype's largest), which fails the tests as any NaN does, without a warning."""
        with np.errstate(over="ignore", invalid="ignore"):
            return np.sqrt(np.einsum("...d,...d->...", q_i, q_i)) * self.kbound + 1.0

    def fixed_shift(self, u):
        return bool(np.all(u <= self.limit))

    def normal(self, u, m_safe):
        """Every argument ``S - m`` of the tile's ``exp`` is at least ``e_min`` (its result normal)."""
        return bool(np.all(self.normal_rows(u, m_safe)))

    def normal_rows(self, u, m_safe):
        """Per row: its arguments ``S - m`` of ``exp`` are at least ``e_min`` (False for a NaN)."""
        return u + m_safe * self.bits <= self.normal_limit


def _rows_dot(a, b):
    """``rowsum(a ∘ b)`` over the last axis, summed in one order whatever the operands' strides: einsum sums a last
    axis that is not contiguous in another order, so dQ and dK's last bits followed the layout of the caller's out=
    buffer or dout (a Fortran-ordered dout changed 5236 of 8192 elements of dK). Such an operand is copied first."""
    a, b = (x if x.strides[-1] == x.itemsize else np.ascontiguousarray(x) for x in (a, b))
    return np.einsum("...d,...d->...", a, b)


def _largest(x) -> float:
    """max |x| (inf or NaN where ``x`` is not finite; 0 for none): two reductions, no temporary."""
    if x.size == 0:
        return 0.0
    hi, lo = float(x.max()), float(x.min())
    return math.nan if math.isnan(hi) or math.isnan(lo) else max(abs(hi), abs(lo))


def _largest_finite(x) -> float:
    """max |x| over the finite elements (0 for none): a temporary, for the rare V that is not finite."""
    with np.errstate(invalid="ignore"):
        finite = np.abs(x[np.isfinite(x)])
    return float(finite.max()) if finite.size else 0.0


def _v_scale(problem, wt, vmax: float) -> float:
    """The power of two the forward multiplies V by (and divides the output by): 1 unless FA2's unnormalized
    accumulator ``acc = sum_j exp(S_j - m) V_j`` (Alg. 1 line 10, divided by l only at line 12), up to
    ``Sk max|V| / (1 - dropout)``, could overflow where the output itself, an average of rows of V, cannot (V near
    the dtype's largest). Exact, but for the rounding of elements of V pushed into the subnormals, far below the
    output's own rounding."""
    fi = np.finfo(wt)
    if not math.isfinite(vmax) or vmax == 0:
        return 1.0
    need = math.log2(vmax) + math.log2(max(problem.seqlen_k, 1)) - math.log2(1.0 - problem.dropout_p)
    excess = math.ceil(need - (fi.maxexp - 4))
    return 1.0 if excess <= 0 else math.ldexp(1.0, -excess)


def _nonfinite(*arrays) -> bool:
    """Whether any of ``arrays`` holds an infinity or NaN (one O(N·d) pass each, about 0.2 ms per million float32
    elements here): only then do the products need :func:`_seen_product`."""
    return any(not np.isfinite(x).all() for x in arrays)


def _seen_product(a, b, guarded, out=None, matmul=np.matmul, add=False, zeros="a"):
    """``a @ b`` in which a zero of the operand named by ``zeros`` contributes nothing, even against an infinity or
    NaN in the other; with ``add``, ``out += a @ b`` (:func:`._blas.add_product`, the same way whether ``guarded`` or
    not: a result that meets no non-finite term has the same bits either way).

    The operand with the zeros is P or dS, zero exactly where an element is invisible (or its probability
    underflowed); the other holds rows of V, dO, K or Q. IEEE's ``0 * inf = NaN`` would let a key that a row does not
    see (a mask's, or padding in the same tile) or a query row past its sequence poison results that do not depend on
    it. ``guarded`` (some operand of the call is not finite) is false for finite inputs, where this is plain
    ``a @ b``. Otherwise the finite part goes through BLAS with the non-finite elements as 0, and each result element
    that meets a non-finite term with a nonzero factor is set to what that term makes of it: +inf or -inf, or NaN for
    a NaN term or infinities of both signs (what any order of summation gives; a NaN among the zeros' operand
    propagates through BLAS). ``zeros="b"`` serves the backward's ``dV^T += dO^T P`` and ``dK^T += Q^T dS``.
    """
    if not guarded:
        return add_product(matmul, a, b, out) if add else matmul(a, b, out=out)
    x, y = (a, b) if zeros == "a" else (b, a)  # x holds the zeros, y the values that may not be finite
    finite = np.isfinite(y)
    y0 = np.where(finite, y, 0)
    a0, b0 = (a, y0) if zeros == "a" else (y0, b)
    r = add_product(matmul, a0, b0, out) if add else matmul(a0, b0, out=out)
    if finite.all():
        return r

    def meets(xm, ym):  # which results a term of x's mask times one of y's mask reaches, in the product's order
        xm, ym = xm.astype(r.dtype), ym.astype(r.dtype)
        return (xm @ ym if zeros == "a" else ym @ xm) > 0

    pos, neg, up, down = x > 0, x < 0, y == np.inf, y == -np.inf
    plus, minus = meets(pos, up) | meets(neg, down), meets(pos, down) | meets(neg, up)  # terms that are +inf, -inf
    nan = meets(x != 0, np.isnan(y)) | (plus & minus) | np.isnan(r)  # x's NaN too
    if add:  # out + inf: NaN where the sum so far is -inf, as the product's inf would make it
        r[...] = np.where(nan, np.nan, np.where(plus, r + np.inf, np.where(minus, r - np.inf, r)))
    else:
        r[...] = np.where(nan, np.nan, np.where(plus, np.inf, np.where(minus, -np.inf, r)))
    return r


def _stacked(x, extra, axis, scratch, name):
    """``x`` with one more row (``axis=-2``) or column (``axis=-1``) after its last, holding ``extra`` (a scalar, or
    one value per column or row of ``x``), in the thread's scratch buffer ``name``: the operands that carry a
    per-row shift through a product, ``[A | -c] [B ; 1] = A B - c``."""
    shape = list(x.shape)
    shape[axis] += 1
    out = scratch.get(name, tuple(shape), x.dtype)
    if axis == -1:
        out[..., :-1] = x
        out[..., -1] = extra
    else:
        out[..., :-1, :] = x
        out[..., -1, :] = extra
    return out


def _scores(q_i, kt_j, rule, out, matmul=np.matmul):
    """S of a tile, in the rule's units, into ``out``."""
    matmul(q_i, kt_j, out=out)
    if rule.tile is not None:
        out *= rule.tile
    return out


def _plan(problem, block_q, block_k, schedule, elements=TILE_ELEMENTS):
    lay = layout(problem, block_q, block_k, elements)
    if schedule is not None:
        chunks = layout(problem, schedule.block_q, schedule.block_k, elements).chunks
        lay = Layout(schedule.block_q, schedule.block_k, chunks)
    return lay, schedule or Schedule.for_problem(problem, lay.block_q, lay.block_k)


@dataclass(frozen=True)
class _Work:
    """One problem's work for the pool: ``items`` (``(cost, work)`` pairs, independent of each other; lower cost
    first), ``item(work)`` computing one, ``fold(work, result)`` taking results in item order (or None) and
    ``finish()`` returning the problem's results once every item has run."""

    items: list
    item: Callable
    finish: Callable
    fold: Optional[Callable] = None


def run_many(works):
    """Run the items of several problems' :class:`_Work` on one pool and return each one's ``finish()``.

    Forward items (no ``fold``) run longest first over all problems; items with a ``fold`` keep each problem's own
    item order, which fixes its summation order. What an item computes never depends on the others, so each
    problem's results are bitwise those of running it alone, whatever the thread count."""
    works = list(works)
    tagged = [(cost, n, w) for n, work in enumerate(works) for cost, w in work.items]
    if all(work.fold is None for work in works):
        tagged.sort(key=lambda x: x[0])  # stable: ties keep problem and item order

    def consume(x, result):
        fold = works[x[1]].fold
        if fold is not None:
            fold(x[2], result)

    _run(lambda x: works[x[1]].item(x[2]), tagged, consume)
    return [work.finish() for work in works]


@_entry
def forward(problem: Problem, *, block_q=None, block_k=None, schedule=None):
    """Return ``out (B, Sq, Hq, D)`` in q's dtype and ``lse (B, Hq, Sq)``."""
    return run_many([forward_work(problem, block_q=block_q, block_k=block_k, schedule=schedule)])[0]


def _in_range(tiles, key_tiles, block_k):
    """The tiles whose key tile index lies in ``key_tiles = (t0, t1)`` (all of them for None)."""
    if key_tiles is None:
        return tiles
    t0, t1 = key_tiles
    return [t for t in tiles if t0 <= t.k0 // block_k < t1]


def forward_work(problem: Problem, *, block_q=None, block_k=None, schedule=None, scratch=None, key_tiles=None,
                 cast=True):
    """The forward of one problem as :class:`_Work`. ``scratch`` shares the per-thread tile buffers between the
    problems of one pool; ``key_tiles = (t0, t1)`` visits only key tiles ``t0 <= t < t1`` (one part of a split key
    range: the partial ``out`` and ``lse`` over those keys, for :func:`cuflash.merge.merge_parts`); ``cast=False``
    leaves ``out`` in the working dtype (a part to be merged is rounded once, after the merge)."""
    return _Forward(problem, block_q, block_k, schedule, scratch, key_tiles, cast).work()


@dataclass
class _RowBlock:
    """One work item's query rows Q_i of a block of pairs and their running state (FA2 Alg. 1 lines 4-8: m_i, l_i,
    acc, the unnormalized O_i), with what decides their shift (:class:`_Bounds`)."""

    chunk: tuple
    i0: int
    q_i: np.ndarray          # Q_i, the scale folded in (rule.fold)
    kt: np.ndarray           # K^T of the block
    v_j: np.ndarray          # V, or [V | 1] with the row sum in the product; times v_scale where that is not 1
    v_scale: float
    bounds: Optional["_Bounds"]
    guarded: bool            # V holds an infinity or NaN (see _seen_product)
    u: Optional[np.ndarray]  # the rows' bounds U (see _Bounds)
    bounded: bool            # every |S| is bounded: shift 0 may be taken
    fixed: bool              # shift 0 from here on (m_i = 0)
    m_i: np.ndarray
    l_i: np.ndarray          # with the row sum in the product, acc's last column
    acc: np.ndarray


class _Forward:
    """FA2 Algorithm 1 on one problem: each work item is one query tile (the outer loop, line 3) of one block of
    (batch, kv head) pairs (:func:`layout`), over the key tiles the schedule gives it; what the items share is made
    here, once, or by the first items that need it (:func:`_per_chunk`)."""

    def __init__(self, problem, block_q, block_k, schedule, scratch, key_tiles, cast):
        self.problem, self.key_tiles, self.cast = problem, key_tiles, cast
        self.wt = wt = _work_dtype(problem)
        len_q, len_k = _padding_lengths(problem)
        q, k, v = (_without_padding(_grouped(x, problem, wt), n)
                   for x, n in ((problem.q, len_q), (problem.k, len_k), (problem.v, len_k)))
        self.q, self.v = q, v
        # the outputs first: a problem too large for memory (a zero-stride batch of 2**30) fails here at once, before
        # the plan lists its blocks of (batch, head) pairs (that took minutes and gigabytes before a bare MemoryError)
        self.out = _result_zeros(q.shape, problem, wt)
        self.lse = np.full(q.shape[:-1], -np.inf, dtype=wt)
        self.lay, self.sched = _plan(problem, block_q, block_k, schedule)
        self.rule = _exp_rule(problem, wt, q)
        self.matmul = products()  # NumPy's or MKL's (CUFLASH_BLAS), one choice for the whole call
        self.fold = _rowsum_in_pv(problem, wt, self.matmul)
        self.prepared = _per_chunk(problem, self.rule, q, k, v, wt, self.matmul, ones_column=self.fold, forward=True)
        self.ones = np.ones(self.lay.block_k, dtype=wt)
        self.scratch, self.masks = scratch or _Scratch(), _Masks(self.sched, problem)
        self.modifiers = _Mods(problem, wt) if _Mods.active(problem) else None

    def work(self) -> _Work:
        # Longest rows first (a causal problem's last query tiles visit the most key tiles), so that the workers
        # finish together; each item's result is independent of the order. Among items of equal length, one block of
        # heads after another: the workers then share that block's K and V (measured on 2 shared cores, N = 4096,
        # 4 heads, head_dim 64: 7% faster than interleaving the heads).
        lo, hi = self.sched.lo, self.sched.hi
        if self.key_tiles is not None:
            lo, hi = np.maximum(lo, self.key_tiles[0]), np.minimum(hi, self.key_tiles[1])
        rows = sorted((i for i in range(self.sched.n_q) if hi[i] > lo[i]), key=lambda i: (lo[i] - hi[i], i))
        return _Work([(int(lo[i] - hi[i]), (chunk, i)) for chunk in self.lay.chunks for i in rows], self._item,
                     self._finish)

    def _finish(self):
        problem = self.problem
        return (_ungroup(self.out).astype(problem.dtype if self.cast else self.wt, copy=False),
                self.lse.reshape(problem.batch, problem.heads_q, problem.seqlen_q))

    def _item(self, work):
        """Lines 4-13 for the query tile ``i`` of the block ``chunk``."""
        chunk, i = work
        tiles = self.masks.settled(_in_range(list(self.sched.row(i)), self.key_tiles, self.lay.block_k), chunk)
        if not tiles:
            return
        block = self._row_block(chunk, tiles)
        for n, tile in enumerate(tiles):
            _check_stop()
            for t in self.masks.strips(tile, chunk):  # a partial tile: row strips cut to the keys they see
                self._strip(block, t, first=n == 0 and t is not tile)
            if n == 0 and len(tiles) > 1:
                self._to_shift_zero(block)
        self._write(block)

    def _row_block(self, chunk, tiles) -> _RowBlock:
        """Lines 4-5: Q_i loaded (the scale folded in), m_i, l_i and acc initialized, the shift decided."""
        bs, hs = chunk
        wt, fold, prep = self.wt, self.fold, self.prepared(chunk)
        i0, i1 = tiles[0].i0, tiles[0].i1
        q_i = self.q[bs, hs, :, i0:i1, :]
        if self.rule.fold is not None:
            q_i = q_i * self.rule.fold  # the scale (in base 2 for float32) folded into Q once
        bounds = prep.bounds
        u = bounds.rows(q_i) if bounds is not None else None
        # shift 0 from the first key tile where every row sees two keys in it (none can be a one-key row); in a first
        # tile cut into strips, from the first strip where every row does (a causal call's first diagonal tile: only
        # its first strip holds the row that sees one key)
        bounded = u is not None and bounds.fixed_shift(u)
        fixed = bounded and self.masks.every_row_sees_two(tiles[0], chunk)
        d = q_i.shape[-1]
        acc = np.zeros(q_i.shape[:-1] + (d + fold,), dtype=wt)  # with fold, [O | l]: P [V | 1] = [P V | rowsum P]
        l_i = acc[..., d] if fold else np.zeros(q_i.shape[:-1], dtype=wt)
        v_j = prep.v1 if fold else self.v[bs, hs]
        if prep.v_scale != 1.0:  # V near the dtype's largest: run it scaled down (a copy; [V | 1]'s ones stay 1)
            v_j = v_j * np.concatenate([np.full(d, prep.v_scale, wt), np.ones(int(fold), wt)])
        # only V meets zeros of P in a product (Q, K: masked scores are set, not computed)
        return _RowBlock(chunk, i0, q_i, prep.kt, v_j, prep.v_scale, bounds, prep.v_nonfinite, u, bounded, fixed,
                         np.full(q_i.shape[:-1], 0 if fixed else -np.inf, dtype=wt), l_i, acc)

    def _strip(self, block, t, first):
        """Lines 6-11 for the strip ``t`` of a key tile (a whole tile, or rows of a partial one); ``first``: a strip of
        the first tile, cut into strips, where the block's rows may take shift 0 strip by strip."""
        chunk, masks, modifiers, wt = block.chunk, self.masks, self.modifiers, self.wt
        r = slice(t.i0 - block.i0, t.i1 - block.i0)
        if block.fixed and t.full and modifiers is None and not self.problem.dropout_p and not block.guarded and \
                (t.i1 - t.i0) * (t.k1 - t.k0) >= HEADS_IN_TURN_ELEMENTS:
            return self._heads_in_turn(block, t, r)
        s = self.scratch.get("s", block.q_i.shape[:-2] + (t.i1 - t.i0, t.k1 - t.k0), wt)
        _scores(block.q_i[..., r, :], block.kt[..., t.k0:t.k1], self.rule, s, self.matmul)
        shift0 = block.fixed or (first and block.bounded and masks.every_row_sees_two(t, chunk))
        if shift0 and not block.fixed:
            block.m_i[..., r] = 0  # these rows shift by 0 from here on; the switch to it leaves them as they are
        if shift0:  # line 10 with m_i = 0 (see _Bounds): every |S| is bounded, masked ones too
            self.rule.normal(s, out=s)  # and every exp(S) is a normal number
            if modifiers is not None:
                modifiers.mask(s, t, chunk, fill=0.0)
            _mask_scores(s, masks, t, chunk, fill=0.0)
        else:
            self._online(s, t, block, r)
        if not self.fold:
            block.l_i[..., r] += s @ self.ones[:t.k1 - t.k0]  # l is of the undropped P: lse stays dropout-free
        z = _dropout_scale(self.problem, t, chunk, wt)
        if z is not None:
            s *= z
        _seen_product(s, block.v_j[..., t.k0:t.k1, :], block.guarded, block.acc[..., r, :], self.matmul,
                      add=True)  # line 11

    def _heads_in_turn(self, block, t, r):
        """Lines 8-11 of a full tile at shift 0 (nothing to mask, drop or modify: the bulk of a call), the item's heads
        one after another: each head's S_ij, exp(S_ij) and P_ij V_j run while its tile (1 MiB at 512 x 512 float32) is
        in the core's L2, where the four heads' tile taken stage by stage (4 MiB) went through L3 between the stages.
        The same products, per head, as the stacked ones (NumPy's matmul, like MKL's batch call, runs one gemm per
        matrix). Measured against the stacked stages, A/B in one process (AMD EPYC, products in OpenBLAS, N = 4096,
        4 heads, 5-7 interleaved rounds): two threads float32 0.91-0.96x the time, float64 0.90-0.95x; one thread
        0.98-0.99x; N = 16384 0.95-1.00x. The backward, tried the same way (whole strips and 256-row strips per
        head), was not faster: its P and dP of one head already take 2 MiB. Only for tiles of at least
        :data:`HEADS_IN_TURN_ELEMENTS` per head: smaller ones (short sequences, MQA's 32-row tiles of 64 heads) fit
        in L2 stacked, and their calls per head cost more than the cache saves."""
        lead = block.q_i.shape[:-2]
        kt, v = (np.broadcast_to(x, lead + x.shape[-2:]) for x in (block.kt, block.v_j))  # K, V shared by a group
        s = self.scratch.get("s", (t.i1 - t.i0, t.k1 - t.k0), self.wt)
        ones = self.ones[:t.k1 - t.k0]
        for h in np.ndindex(lead):
            _scores(block.q_i[h][r], kt[h][:, t.k0:t.k1], self.rule, s, self.matmul)  # line 8
            self.rule.normal(s, out=s)  # line 10 with m_i = 0 (see _Bounds)
            if not self.fold:
                l_h = block.l_i[h]
                l_h[r] += s @ ones
            add_product(self.matmul, s, v[h][t.k0:t.k1], block.acc[h][r])  # line 11

    def _online(self, s, t, block, r):
        """Lines 9-10 on the rows ``r`` of one (strip of a) tile, in place: the running max ``m_i``, ``P = exp(S -
        m_i)`` into ``s``, ``l_i`` and ``acc`` rescaled to the new max. ``guarded`` (V holds an infinity or NaN): no
        clamping of ``exp`` (a subnormal weight of a NaN value is a NaN term, as in the reference), and a rescale by
        ``alpha = 0`` empties ``acc`` (the earlier terms' weights are 0 now: ``inf * 0`` must not turn them into a
        NaN)."""
        chunk, modifiers, rule = block.chunk, self.modifiers, self.rule
        m_i, l_i, acc = block.m_i[..., r], block.l_i[..., r], block.acc[..., r, :]
        if modifiers is not None:
            modifiers.score(s, t, chunk)
            modifiers.mask(s, t, chunk)
        _mask_scores(s, self.masks, t, chunk)
        m_new = np.maximum(m_i, s.max(axis=-1))  # line 9
        # A row that saw nothing yet (-inf) or an infinite or NaN score: shift by 0, as the float64 reference
        # does, so that +inf gives lse = +inf (and NaN outputs), never -inf - -inf or inf - inf in lse.
        m_safe = np.where(np.isfinite(m_new), m_new, 0)
        s -= m_safe[..., None]
        u = None if block.u is None else block.u[..., r]
        normal = t.full and modifiers is None and u is not None and block.bounds.normal(u, m_safe)
        _exp(s, rule, clamp=not normal and not block.guarded, normal=normal)  # line 10
        alpha = rule.exp(m_i - m_safe)
        if not self.fold:  # else l_i is acc's last column
            l_i *= alpha
        acc *= alpha[..., None]
        if block.guarded:
            np.copyto(acc, 0, where=(alpha == 0)[..., None])
        m_i[...] = m_new

    def _to_shift_zero(self, block):
        """After the first key tile: from shift m_i to shift 0 where the bounds allow, unless a row has seen one key
        only so far (l = 1): rescaled, its value would come back rounded, where one key returns exactly its value (a
        row of a shorter sequence in an item whose other rows see more tiles)."""
        if block.fixed or not block.bounded or not np.all(block.m_i > -np.inf) or not np.all(block.l_i != 1):
            return
        alpha = self.rule.exp(block.m_i)
        if not self.fold:
            block.l_i *= alpha
        block.acc *= alpha[..., None]
        block.fixed, block.m_i = True, np.zeros_like(block.m_i)

    def _write(self, block):
        """Lines 12-13: O_i = acc / l_i and L_i = m_i + log(l_i), in natural-log units."""
        (bs, hs), i0, wt, rule = block.chunk, block.i0, self.wt, self.rule
        i1, d = i0 + block.q_i.shape[-2], block.q_i.shape[-1]
        seen = block.l_i != 0  # a NaN sum propagates; only rows that saw no key get 0 and -inf
        out = self.out[bs, hs, :, i0:i1, :]
        np.divide(block.acc[..., :d], np.where(seen, block.l_i, 1)[..., None], out=out)  # no temporary
        if block.v_scale != 1.0:
            out *= wt.type(1.0 / block.v_scale)
            if not self.problem.dropout_p and not block.guarded:  # an average of finite rows of V: finite, but
                big = np.finfo(wt).max  # acc / l may round to 1 + ulp of them, past the largest (V at it)
                np.clip(out, -big, big, out=out)
        with np.errstate(divide="ignore"):
            nat = (block.m_i.astype(np.float64) + rule.log(np.where(seen, block.l_i, 1).astype(np.float64))) * (
                LN2 * rule.bits)
        self.lse[bs, hs, :, i0:i1] = np.where(seen, nat, -np.inf)


def _largest_row(x, wt) -> float:
    """log2 of an upper bound on the largest row norm ``|x_i|`` of ``x`` (last axis), and so on its largest element:
    one einsum pass in ``wt`` (as :meth:`_Bounds.row_norms`), raised to what squares lose in the subnormals; where
    the squares overflow, or ``x`` is not finite, ``sqrt(d)`` times the largest finite element (-inf: no element)."""
    if x.size == 0:
        return -math.inf
    d, fi = x.shape[-1], np.finfo(wt)
    with np.errstate(over="ignore", invalid="ignore"):
        r = float(np.sqrt(np.einsum("...d,...d->...", x, x).max()))
    if math.isfinite(r):
        return math.log2(max(r, math.sqrt(d * float(fi.tiny))))
    m = _largest(x)
    m = m if math.isfinite(m) else _largest_finite(x)
    return math.log2(m) + 0.5 * math.log2(d) if m > 0 else -math.inf


class _GradShifts:
    """Powers of two that keep the backward's intermediates in range where only the gradients need be: ``(ec, eq,
    ek)``, all 0 (nothing changes) unless a bound says that some intermediate
    could overflow although the gradients fit: V or dO near the dtype's largest (dP = dO V^T and dP - D overflow,
    dS = P (dP - D) fits), or Q or K near it with ``|scale| < 1`` (the sums of dS Q and dS K, multiplied by the
    scale only at the end).

    With ``a, b, x, y`` the largest row norm of dO, V, Q, K (their padding past the sequences' lengths at 0,
    :func:`_without_padding`: 3e38 there shifted every sequence's dS into the subnormals) and ``z = 1/(1 - dropout)``
    (O_i an average of rows of V, times z at most; Cauchy-Schwarz; the rows of P sum to 1):

    - ``|dP_ij| z, |D_i|, |dP_ij z - D_i|, |dS_ij| <= C = 2 a b z`` (every partial sum of the products too);
    - ``|sum_i dS_ij Q_i| <= Sq (H/Hkv) x C`` (the rows of the group's heads), ``|sum_j dS_ij K_j| <= y C``
      (2 y C with room for P's rounding).

    ``ec`` brings C to ``2^(e_max - 4)`` at most, ``eq`` and ``ek`` the two sums. The backward then takes dO at
    ``2^-ec`` in dP and D (Alg. 2 lines 13, 14; dV keeps dO as it is), Q at ``2^(ec - eq)`` in dK's sums and K at
    ``2^(ec - ek)`` in dQ's, and multiplies dK by ``scale 2^eq``, dQ by ``scale 2^ek`` (:func:`_unscale`) and dbias
    by ``2^ec``. Powers of two are exact but for elements pushed into the subnormals, some ``2^-250`` of the largest
    terms at most (each shift is the least that fits), so a call that needs none is bitwise what it was and one that
    does differs only where it would have overflowed. Float16 inputs (at most 65504) never need one: no pass. Else
    one einsum pass over Q, K, V and dO, in blocks of rows that the first items of every worker share (as
    :func:`_per_chunk`; 1.2 ms for four 2048 x 8 x 64 float32 arrays on one core, 10x that per block of heads):
    the shifts depend only on the data, never on the threads."""

    def __init__(self, problem, wt, q, k, v, do):
        """``q, k, v, do``: (B, S, H, D) in ``wt`` (the rows lie together: einsum reads them 1.7x faster than
        through the grouped view)."""
        self.problem, self.wt = problem, wt
        self._together = None
        if problem.dtype.kind == "f":  # the inputs' own largest element bounds every row norm: no pass
            big = math.log2(float(np.finfo(problem.dtype).max))
            if self.shifts(*(big + 0.5 * math.log2(max(t.shape[-1], 1)) for t in (do, v, q, k))) == (0, 0, 0):
                return
        arrays = (do, v, q, k)
        spans = [_key_parts(x.shape[1]) for x in arrays]
        parts = [functools.partial(_largest_row, x[:, s0:s1], wt) for x, sp in zip(arrays, spans) for s0, s1 in sp]
        ends = np.cumsum([len(sp) for sp in spans]).tolist()

        def finish(results):
            return self.shifts(*(max(results[e0:e1], default=-math.inf) for e0, e1 in zip([0] + ends[:-1], ends)))

        self._together = _Together(parts, finish)

    def shifts(self, a, b, x, y):
        """From log2 of the row norms."""
        problem, fi = self.problem, np.finfo(self.wt)
        over = lambda bound: max(0, math.ceil(bound - (fi.maxexp - 4))) if bound > -math.inf else 0  # noqa: E731
        chain = 1 + a + b - math.log2(1.0 - problem.dropout_p)
        return (over(chain), over(chain + math.log2(max(problem.seqlen_q * problem.group, 1)) + x),
                over(chain + 1 + y))

    def __call__(self):
        return (0, 0, 0) if self._together is None else self._together()


def _unscale(x, scale, shift):
    """``x * scale * 2^shift`` in place (:class:`_GradShifts`): by ``scale`` itself when ``shift`` is 0 (the
    unscaled code's rounding), else by ``scale 2^shift`` where that is a normal number of the dtype (one rounding as
    well), else by ``scale`` and then ``2^shift``."""
    if shift == 0:
        x *= scale
        return x
    try:
        f = math.ldexp(float(scale), shift)
    except OverflowError:  # past float64's range (V and dO near 1e308): by scale, then 2^shift (inf where it is)
        f = math.inf
    fi = np.finfo(x.dtype)
    if fi.tiny <= abs(f) <= fi.max:
        x *= x.dtype.type(f)
    else:
        x *= scale
        np.ldexp(x, shift, out=x)
    return x


@dataclass(frozen=True)
class _Rows:
    """The backward's operands of one block's query rows, made once per block (:func:`_row_operands`) instead of once
    per tile of every key column (their copies and norms took 6% of a float32 backward at N = 4096)."""

    q1: np.ndarray           # [Q·fold | -L] (..., Sq, d + 1): S - L in one product (Alg. 2 line 11)
    do1: np.ndarray          # [dO·2^-ec | -D]: dP - D in one product (line 14)
    big_d: np.ndarray        # D = rowsum(dO·2^-ec ∘ O) (..., Sq)
    normal: Optional[np.ndarray]  # per row, every exp(S - L) is normal (:meth:`_Bounds.normal_rows`); None: unbounded


def _row_operands(rule, q, do, o, lse_r, big_d, shifts, prepared, bounded) -> _PerBlock:
    """The :class:`_Rows` of each block of pairs, filled by the workers that first ask for it, rows in parts (as
    :func:`_keys_transposed`'s copy); ``shifts()``: the call's :class:`_GradShifts`, ``prepared``: its
    :func:`_per_chunk` (for the block's bounds)."""

    def parts(chunk):
        bs, hs = chunk
        qc, doc = q[bs, hs], do[bs, hs]
        d = qc.shape[-1]
        rows = _Rows(np.empty(qc.shape[:-1] + (d + 1,), qc.dtype), np.empty(qc.shape[:-1] + (d + 1,), qc.dtype),
                     np.empty(qc.shape[:-1], qc.dtype), np.empty(qc.shape[:-1], bool) if bounded else None)

        def fill(r0, r1):
            r, ec = slice(r0, r1), shifts()[0]
            qs, dop = rows.q1[..., r, :d], rows.do1[..., r, :d]
            if rule.fold is None:
                qs[...] = qc[..., r, :]
            else:
                np.multiply(qc[..., r, :], rule.fold, out=qs)  # the scale (in base 2 for float32) folded into Q
            rows.q1[..., r, d] = -lse_r[bs, hs, :, r]
            if ec:  # D from the scaled dO too (the unscaled one may have overflowed)
                np.ldexp(doc[..., r, :], -ec, out=dop)
                rows.big_d[..., r] = _rows_dot(dop, o[bs, hs, :, r, :])
            else:
                dop[...] = doc[..., r, :]
                rows.big_d[..., r] = big_d[bs, hs, :, r]
            np.negative(rows.big_d[..., r], out=rows.do1[..., r, d])
            if bounded:
                bounds = prepared(chunk).bounds
                rows.normal[..., r] = bounds.normal_rows(bounds.rows(qs), lse_r[bs, hs, :, r])

        return [functools.partial(fill, r0, r1) for r0, r1 in _key_parts(qc.shape[-2])], lambda _: rows

    return _PerBlock(parts)


@_entry
def backward(problem: Problem, dout, out, lse, *, block_q=None, block_k=None, schedule=None,
             deterministic=False, dbias=False):
    """FA2 Algorithm 2: ``(dq, dk, dv)`` by recomputing P from ``lse``; no N×N buffer.

    Always bitwise reproducible (``deterministic`` is accepted for the API's sake)."""
    return run_many([backward_work(problem, dout, out, lse, block_q=block_q, block_k=block_k, schedule=schedule,
                                   dbias=dbias)])[0]


def backward_work(problem: Problem, dout, out, lse, *, block_q=None, block_k=None, schedule=None, dbias=False,
                  scratch=None):
    """The backward of one problem as :class:`_Work` (its dQ accumulators folded in item order)."""
    return _Backward(problem, dout, out, lse, block_q, block_k, schedule, dbias, scratch).work()


@dataclass
class _Column:
    """What the strips of one key column ``[k0, k1)`` of one block of pairs share (FA2 Alg. 2 lines 6-7): the
    column's K_j, K_j^T and V_j^T (with a row of ones where the shifts ride in the products), the row operands, the
    gradient shifts and the accumulators dK_j^T, dV_j^T (and the block's share of dbias)."""

    chunk: tuple
    k0: int
    rows: "_Rows"
    shifts: tuple            # (ec, eq, ek) of _GradShifts
    bounds: Optional["_Bounds"]
    guarded: bool            # some input of the block is not finite (see _seen_product)
    fold_lse: bool           # S - L in the product [Q | -L] [K^T ; 1]
    fold_d: bool             # dP - D in the product [dO | -D] [V^T ; 1]
    k_j: np.ndarray
    kt_j: np.ndarray
    kt1_j: Optional[np.ndarray]
    vt_j: np.ndarray         # V_j^T, or [V_j^T ; 1] with fold_d
    dkt_j: np.ndarray
    dvt_j: np.ndarray
    part: Optional[np.ndarray]  # this column's share of dbias


class _Backward:
    """FA2 Algorithm 2 on one problem: its key columns (the outer loop, line 5) dealt to work items, each a block
    of (batch, kv head) pairs (:func:`layout`) and one of ``slots`` dQ accumulators; what the items share is made
    here, once, or by the first items that need it (:func:`_per_chunk`, :func:`_row_operands`)."""

    def __init__(self, problem, dout, out, lse, block_q, block_k, schedule, dbias, scratch):
        self.problem, self.dbias = problem, dbias
        self.wt = wt = _work_dtype(problem)
        len_q, len_k = _padding_lengths(problem)
        q, k, v, do, o = (_without_padding(_grouped(x, problem, wt), n) for x, n in
                          ((problem.q, len_q), (problem.k, len_k), (problem.v, len_k), (dout, len_q), (out, len_q)))
        self.q, self.k, self.v, self.do = q, k, v, do
        self.rule = rule = _exp_rule(problem, wt, q)
        lse_r = np.asarray(lse, dtype=np.float64).reshape(q.shape[:-1]) / (LN2 * rule.bits)  # in the rule's base
        self.lay, self.sched = _plan(problem, block_q, block_k, schedule, BACKWARD_TILE_ELEMENTS)  # after the rows
        # rows that saw nothing (-inf), and padding rows past a sequence's length whatever their lse holds (a NaN
        # there made every P of the row NaN): P = exp(S - inf) = 0
        padding = np.arange(problem.seqlen_q) >= problem.lengths[0][:, None]  # (B, Sq)
        self.lse_r = lse_r = np.where(np.isneginf(lse_r) | padding[:, None, None, :], np.inf, lse_r).astype(wt)
        # P = exp(S - lse) <= 1, but past 2^p (p: the dtype's mantissa bits) the lse's rounding exceeds 1 and S - lse
        # may come out far above 0: exp overflows (float32 from |lse| ~ 2^30 in base 2), and inf * 0 makes gradients
        # NaN. There the arguments are clamped at 0 (a pass per tile, only for such huge scores): finite gradients,
        # as accurate as a float32 lse allows.
        self.coarse = bool(np.abs(lse_r[np.isfinite(lse_r)]).max(initial=0) >= 2.0 ** np.finfo(wt).nmant)
        big_d = _rows_dot(do, o)  # D = rowsum(dO ∘ O)
        # dO, and Q and K in the sums of dS Q and dS K, at powers of two where an intermediate could overflow
        bshd = lambda x, y: x if np.may_share_memory(x, y) else _ungroup(y)  # noqa: E731  (the inputs, or copies)
        self.grad_shifts = _GradShifts(problem, wt, bshd(problem.q, q), bshd(problem.k, k), bshd(problem.v, v),
                                       bshd(dout, do))
        self.matmul = products()
        self.prepared = _per_chunk(problem, rule, q, k, v, wt, self.matmul, also=(do, big_d))
        self.row_operands = _row_operands(rule, q, do, o, lse_r, big_d, self.grad_shifts, self.prepared,
                                          _Bounds.applies(problem))
        self.dq = _result_zeros(q.shape, problem, wt)
        self.dk = _result_zeros(k.shape, problem, wt)
        self.dv = _result_zeros(k.shape, problem, wt)  # not zeros_like, which writes its zeros (1.4 ms for 4 MiB)
        self.db = np.zeros(problem.mods.bias_compact, wt) if dbias else None
        self.scratch, self.masks = scratch or _Scratch(), _Masks(self.sched, problem)
        self.modifiers = _Mods(problem, wt) if _Mods.active(problem) else None
        self.modified = self.modifiers is not None and problem.mods.score is not None
        sched = self.sched
        self.columns = [t for t in range(sched.n_k) if ((sched.lo <= t) & (t < sched.hi)).any()]
        self.slots = max(1, min(DQ_CHUNKS, len(self.columns)))

    def work(self) -> _Work:
        return _Work([(0, (chunk, slot)) for chunk in self.lay.chunks for slot in range(self.slots)],
                     self._item, self._finish, self._fold)

    # Key tiles are dealt round-robin to a fixed number of dQ accumulators (O(N·d) each), summed
    # in a fixed order: dQ is bitwise the same whatever the thread count or schedule.
    def _item(self, work):
        chunk, slot = work
        dq_acc = np.zeros(self.q[chunk].shape, dtype=self.wt)
        parts: list = []
        for t in self.columns[slot::self.slots]:
            self._column(t, chunk, dq_acc, parts)
        return dq_acc, parts

    def _fold(self, work, result):  # in item order: dq = ((0 + slot 0) + slot 1) + ... per pair block; dbias likewise
        dq_part, parts = result
        self.dq[work[0]] += dq_part
        if work[1] == self.slots - 1:  # the block's last item: its K^T and row operands (O(N·d) each) go now, not at
            self.prepared.release(work[0])  # the end of the call (+65% of the backward's peak at B = H = 32, N = 512)
            self.row_operands.release(work[0])
        bs, hs = work[0]
        db, group = self.db, self.problem.group
        for k0, k1, part in parts:
            b_at = bs if db.shape[0] > 1 else slice(None)
            h_at = slice(hs.start * group, hs.stop * group) if db.shape[1] > 1 else slice(None)
            db[b_at, h_at, :, slice(k0, k1) if db.shape[3] > 1 else slice(None)] += part

    def _finish(self):
        _unscale(self.dq, self.wt.type(self.problem.scale), self.grad_shifts()[2])
        cast = lambda x: _ungroup(x).astype(self.problem.dtype, copy=False)  # noqa: E731
        grads = cast(self.dq), cast(self.dk), cast(self.dv)
        return grads + (self.db,) if self.dbias else grads

    def _dbias_part(self, chunk, k0, k1):
        """The item's share of dbias for key tile [k0, k1): zeros in the compact bias's shape there."""
        bs, hs = chunk
        problem = self.problem
        shape = problem.mods.bias_compact
        nb = len(range(problem.batch)[bs]) if shape[0] > 1 else 1
        nh = len(range(problem.heads_kv)[hs]) * problem.group if shape[1] > 1 else 1
        return np.zeros((nb, nh, shape[2], k1 - k0 if shape[3] > 1 else 1), dtype=self.wt)

    def _column(self, t, chunk, dq_acc, parts):
        """Lines 6-22 for key column ``t`` of the block ``chunk``: its strips, then dK_j and dV_j written."""
        tiles = self.masks.settled(self.sched.column(t), chunk)
        if not tiles:
            return
        col = self._column_operands(chunk, tiles[0].k0, tiles[0].k1)
        # A partial tile as row strips cut to the keys they see (as the forward's: a causal diagonal tile costs 5/8 of
        # its products). guarded: dP and dS of unseen elements may be NaN (0 * inf, inf - inf) until set to 0.
        for strip in [strip for tile in tiles for strip in self.masks.strips(tile, chunk)]:
            _check_stop()
            self._strip(strip, col, dq_acc)
        (bs, hs), k0, k1 = chunk, col.k0, tiles[0].k1
        ec, eq, _ = col.shifts
        scale = self.wt.type(self.problem.scale)
        self.dk[bs, hs, :, k0:k1, :] = np.swapaxes(_unscale(col.dkt_j.sum(axis=2, keepdims=True), scale, eq), -1, -2)
        self.dv[bs, hs, :, k0:k1, :] = np.swapaxes(col.dvt_j.sum(axis=2, keepdims=True), -1, -2)
        if col.part is not None:
            parts.append((k0, k1, np.ldexp(col.part, ec, out=col.part) if ec else col.part))

    def _column_operands(self, chunk, k0, k1) -> _Column:
        bs, hs = chunk
        prep = self.prepared(chunk)
        guarded = prep.any_nonfinite
        k_j, kt_j = self.k[bs, hs, :, k0:k1, :], prep.kt[..., k0:k1]
        vt_j = np.swapaxes(self.v[bs, hs, :, k0:k1, :], -1, -2)
        # Finite inputs without a score modifier: the shift by lse (line 11, S - L) and D (line 14, dP - D) ride in
        # the products as one more inner term each, [Q | -L] [K^T ; 1] and [dO | -D] [V^T ; 1], instead of a pass
        # over each score tile (65 terms cost MKL 2% more than 64; a pass over the tile, 33%).
        fold_lse = not guarded and not self.modified and self.rule.tile is None
        fold_d = not guarded and self.problem.dropout_p == 0  # with dropout, dP is scaled before D is subtracted
        kt1_j = _stacked(kt_j, 1, -2, self.scratch, "kt1") if fold_lse else None
        if fold_d:
            vt_j = _stacked(vt_j, 1, -2, self.scratch, "vt1")
        shape, d = self.q[bs, hs].shape[:3], self.q.shape[-1]
        # dK_j and dV_j transposed, (d, keys): MKL's gemm runs dV^T += dO^T P at 1.1-1.3x the speed of dV += P^T dO
        # (measured single-threaded on 512 x 512 tiles, head_dim 64 and 128: a transposed A slows it, a transposed B
        # does not), likewise dK^T += Q^T dS
        dkt_j = np.zeros(shape + (d, k1 - k0), dtype=self.wt)
        return _Column(chunk, k0, self.row_operands(chunk), self.grad_shifts(), prep.bounds, guarded, fold_lse,
                       fold_d, k_j, kt_j, kt1_j, vt_j, dkt_j, np.zeros(dkt_j.shape, dtype=self.wt),
                       self._dbias_part(chunk, k0, k1) if self.dbias else None)

    def _strip(self, t, col, dq_acc):
        """Lines 8-21 for the rows and keys of the strip ``t`` of column ``col``: P recomputed from L, dV_j, dP, dS,
        then dQ_i and dK_j."""
        problem, wt, rule, masks, modifiers, matmul = (self.problem, self.wt, self.rule, self.masks, self.modifiers,
                                                        self.matmul)
        chunk, rows, guarded = col.chunk, col.rows, col.guarded
        (bs, hs), (ec, eq, ek), d = chunk, col.shifts, self.q.shape[-1]
        i, c = slice(t.i0, t.i1), slice(t.k0 - col.k0, t.k1 - col.k0)  # rows; keys within the column
        q_i, do_i = self.q[bs, hs, :, i, :], self.do[bs, hs, :, i, :]
        q1_i, do1_i, d_i = rows.q1[..., i, :], rows.do1[..., i, :], rows.big_d[..., i]
        qs_i, dop_i = q1_i[..., :d], do1_i[..., :d]  # Q·fold; dO·2^-ec (D is of it too)
        tile_shape = q_i.shape[:3] + (t.i1 - t.i0, t.k1 - t.k0)
        s = self.scratch.get("s", tile_shape, wt)
        shift = self.lse_r[bs, hs, :, i]  # L of the rows, in the rule's base
        # S as the forward's (line 11), or S - L where every L is finite (a row that saw nothing has L = inf:
        # there S - L is left to the pass, as IEEE gives it; in BLAS an infinity meets the zeros of its padding)
        folded = col.fold_lse and bool(np.isfinite(shift).all())
        _scores(*((q1_i, col.kt1_j[..., c]) if folded else (qs_i, col.kt_j[..., c])), rule, s, matmul)
        s0 = None
        if modifiers is not None:
            s0 = modifiers.score(s, t, chunk, keep_s0=self.modified)
            modifiers.mask(s, t, chunk)
        _mask_scores(s, masks, t, chunk)
        if not folded:
            s -= shift[..., None]
        if self.coarse:
            np.minimum(s, 0, out=s)
        normal = t.full and modifiers is None and col.bounds is not None and bool(rows.normal[..., i].all())
        p = _exp(s, rule, clamp=not normal and not guarded, normal=normal)  # guarded: as the forward
        if guarded:  # a row whose lse is NaN (it sees a NaN score) still has P = 0 where it sees nothing
            if modifiers is not None:
                modifiers.mask(p, t, chunk, fill=0.0)
            _mask_scores(p, masks, t, chunk, fill=0.0)
        z = _dropout_scale(problem, t, chunk, wt)
        _seen_product(np.swapaxes(do_i, -1, -2), p if z is None else p * z, guarded, col.dvt_j[..., c], matmul,
                      add=True, zeros="b")  # line 16
        # line 13, dP = dO V^T (and with fold_d line 14's dP - D)
        dp = matmul(do1_i if col.fold_d else dop_i, col.vt_j[..., c], out=self.scratch.get("dp", tile_shape, wt))
        if z is not None:
            dp *= z  # dP of the dropped P, back through the keep-mask
            if guarded:  # a dropped element contributes nothing, an infinite dP (0 * inf) neither
                np.copyto(dp, 0, where=z == 0)
        if not col.fold_d:
            dp -= d_i[..., None]
        ds = np.multiply(p, dp, out=dp)
        if guarded:  # dP - D of a row or key the element does not see may be inf or NaN; P = 0 there
            np.copyto(ds, 0, where=p == 0)
        if self.modified:  # the chain rule through the score modifier (and the bias's gradient before it)
            if col.part is not None:
                modifiers.dbias(ds, s0, t, chunk, col.part, col.k0)
            modifiers.backprop(ds, s0, t, chunk)
        k_c = col.k_j[..., c, :]
        _seen_product(ds, k_c if ek == ec else np.ldexp(k_c, ec - ek), guarded, dq_acc[..., i, :], matmul,
                      add=True)  # line 20
        _seen_product(np.swapaxes(q_i if eq == ec else np.ldexp(q_i, ec - eq), -1, -2), ds, guarded,
                      col.dkt_j[..., c], matmul, add=True, zeros="b")  # line 21


# Ragged batches and KV caches (VARLEN, KVCACHE) live in cuflash/backends/numpy_ragged.py, which builds on this
# module; these entry points of the backend contract import it when first called (no import cycle).
@_entry
def forward_varlen(problem):
    from .numpy_ragged import forward_varlen

    return forward_varlen(problem)


@_entry
def backward_varlen(problem, dout, out, lse, *, deterministic=False):
    from .numpy_ragged import backward_varlen

    return backward_varlen(problem, dout, out, lse, deterministic=deterministic)


@_entry
def forward_kvcache(problem):
    from .numpy_ragged import forward_kvcache

    return forward_kvcache(problem)
