"""Sequence-parallel attention: ring attention (and the Ulysses all-to-all), exact, on MPI or NCCL.

Design
------
Each of ``P`` ranks holds its part of the query sequence and of the key/value sequence (``layout``:
contiguous slices, or the causal-balanced zigzag of :mod:`cuflash.distributed.layout`). The result on each rank is
that rank's rows of single-device attention over the whole sequence.

**Forward (ring; Liu et al. 2023, "Ring Attention with Blockwise Transformers").** In ``P`` steps every K/V block
visits every rank: at step ``t`` rank ``r`` holds the block of rank ``(r - t) mod P``. It posts the non-blocking
send of that block to rank ``r + 1`` and the receive of the next one from rank ``r - 1`` first, then attends its
queries to the block while the transfer runs (double buffering), then waits. Each (query segment, key segment)
pair is an ordinary cuflash problem whose visibility is the global causal/window band seen from the pair's corner:
for queries at global rows ``[a, a+n)`` and keys at ``[c, c+m)`` of sequences of lengths ``Lq, Lk``, key ``c + j``
is visible to query ``a + i`` iff ``a + i + OFF - left <= c + j <= a + i + OFF + right`` (``OFF = Lk - Lq``), which
is the backends' own rule ``i + off - left' <= j <= i + off + right'`` (``off = m - n``) with both bounds shifted by
``delta = a + OFF - c - (m - n)``: ``left' = left - delta``, ``right' = right + delta`` (negative values are fine:
:func:`cuflash.problem.visible` and ``kernels/mask.cuh`` evaluate the same inequalities). The pair's problem is built
by :func:`cuflash.problem.make_problem` and ``dataclasses.replace`` of its window; a bound that cuts nothing
becomes ``None`` (unmasked tiles), and a pair that sees nothing is skipped (the block still travels on: the ring
needs it downstream). Partial results are combined by the log-sum-exp merge of :func:`cuflash.merge_attention_states`
(the same code, :func:`cuflash.merge.merge_parts`), with the running ``(out, lse)`` kept in float32 (float64 for
float64) and rounded to the input dtype once at the end.

**Backward (FA2 Algorithm 2 per block, ring-flash-attention's scheme).** With the global ``lse`` from the forward,
``P = exp(S - lse)`` of any block is the final probability, so every pair's gradients are exact partial sums:
``dQ`` accumulates on the rank that owns the queries, while the ``dK, dV`` of a block accumulate as they travel
with it. At step ``t`` rank ``r`` adds its contribution to the accumulator that arrived from rank ``r - 1`` (the
sum over the ranks the block visited before) and sends it on to ``r + 1``; after ``P`` hops it reaches its owner,
complete. K/V move as in the forward (overlapped with the pair computations); the accumulators move one step
behind (the wait for step ``t - 1``'s accumulator comes after step ``t``'s computation). Accumulators travel in
float32 (float64): a sum of ``P`` partial gradients rounded to 16 bits at every hop would lose bits the
single-device backward keeps. Moving K, V and dK, dV (rather than Q, dO, lse and dQ, the other exact ring) sends fewer
bytes whenever ``heads_kv <= heads``, and only ``heads_kv / heads`` of them with grouped-query attention.

**What travels, per step:** K and V of one block (input dtype); in the backward also dK and dV accumulators (float32).
**Memory per rank:** the local q, k, v, out, two K/V blocks (the one in use, the one arriving), the running
``(out, lse)`` (backward: ``dQ`` and three dK/dV accumulators: the one added to, the one arriving, the one still being
sent), and one pair's tiles inside the backend: all ``O(local sequence)``, independent of the total length and of
``P``. The blocks and accumulators are made before the first transfer (:class:`_Slots`).

On NumPy arrays the pairs run on the ``numpy`` backend with q, k, v upcast to float32 (float64) first, which is what
that backend does internally anyway, so partial results come back unrounded; on CuPy they run the CUDA kernels
(16-bit in, 16-bit partial out) and only the merge is in float32.

**Ulysses (``method="ulysses"``; Jacobs et al. 2023, "DeepSpeed Ulysses").** An all-to-all turns "all heads, local
sequence" into "``H/P`` heads, whole sequence", each rank runs one ordinary attention call over the whole sequence
for its heads (causal and window exactly as on one device, no merge), and a second all-to-all returns the rows.
Two all-to-alls of activations per call instead of ``P - 1`` K/V hops; needs ``heads`` and ``heads_kv`` divisible
by ``P``. Memory per rank is ``L·H/P`` per tensor, the same element count as the local slice.

Every call first validates its arguments locally (TypeError/ValueError naming the argument, before any
communication), then all ranks exchange their local lengths and a checksum of shapes, dtype and options in one
small all-gather, so that a mismatch between ranks raises the same ValueError on every rank instead of a hang. An
exception in a rank's pair computations later in the call is held until the ring is done, the rank passing every
block on meanwhile, and then raised on every rank (:class:`comms.Failure`); so is a failure to allocate the call's
buffers (made, and the outcome agreed, before the first transfer: :func:`comms.together`) or to join its results
(before the last exchange).
"""
from __future__ import annotations

import contextlib
import dataclasses
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import backends
from .._fp import ignore_fp_errors
from ..residual import fingerprint
from ..merge import merge_parts
from ..options import check_keywords, snapshot
from ..problem import (_check_window, array_module, check_backward, check_current_device, check_flags, make_problem,
                       stats_dtype)
from . import comm as comms
from .layout import check_layout, chunk_bounds

METHODS = ("ring", "ulysses")


@dataclass(frozen=True)
class Segment:
    """``[start, stop)`` of the global sequence, held at ``offset`` of a rank's local array."""

    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass
class Setup:
    """One validated distributed call: the local problem, the adapter, the global layout and options."""

    problem: object
    transport: object
    module: object  # the backend
    method: str
    left: Optional[int]  # the global window, causal included, as single-device attention would apply it
    right: Optional[int]
    off: int  # Lk - Lq of the whole sequences
    q_segs: list  # per rank: [Segment, ...]
    kv_segs: list
    kv_len: list  # per rank: local key/value length
    q_len: list

    rank = property(lambda self: self.transport.rank)
    size = property(lambda self: self.transport.size)
    xp = property(lambda self: self.problem.xp)
    work = property(lambda self: stats_dtype(self.problem.dtype))
    # The numpy backend computes in float32/float64 whatever the input: giving it upcast arrays returns unrounded
    # partial results at no extra cost.
    upcast = property(lambda self: self.module.__name__.rsplit(".", 1)[-1] == "numpy")


# ------------------------------------------------------------------------------------------------ public functions
_DOC_OPTIONS = """
    comm : mpi4py.MPI.Comm or cupy.cuda.nccl.NcclCommunicator
        The ranks holding the parts of the sequence. MPI takes NumPy arrays (CuPy arrays are staged through the host
        unless ``CUFLASH_MPI_CUDA_AWARE=1``); NCCL takes CuPy arrays on the communicator's GPU.
    causal : bool, default False
        Causal over the whole sequences, aligned bottom-right as :func:`cuflash.attention`: global query ``i`` sees
        global key ``j`` iff ``j <= i + (Lk - Lq)``.
    window : (int or None, int or None), optional
        Local attention over global positions, as :func:`cuflash.attention`.
    scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    layout : {"contiguous", "zigzag"}, default "contiguous"
        How the sequences are laid out over ranks (:func:`cuflash.distributed.shard_sequence`). ``"contiguous"``
        takes any lengths per rank; ``"zigzag"`` balances causal work and expects the lengths it cuts. Not the axis
        order that ``layout`` means on :func:`cuflash.attention`: here q, k, v are always ``(..., seqlen, heads,
        head_dim)`` (its ``"bshd"``).
    method : {"ring", "ulysses"}, default "ring"
        ``"ring"``: K/V blocks circulate (any head counts). ``"ulysses"``: all-to-all to whole sequences of
        ``heads / P`` heads (needs ``heads`` and ``heads_kv`` divisible by the number of ranks).
    precision : {"ieee", "3xtf32", "tf32"}, default "ieee"
        The arithmetic of float32 inputs on the CUDA kernels of each block, as for :func:`cuflash.attention`.
    backend : {None, "numpy", "cuda", "emulate"}
        The backend of each block's attention, as in :func:`cuflash.attention`.

    Every rank calls with the same options and its own part of q, k, v (the batch, head and head_dim sizes and the
    dtype must agree across ranks; sequence lengths may differ). Masks that are not a band over global positions
    (``seqlens``, ``block_mask``) and dropout are not supported here."""


def ring_attention(q, k, v, comm, *, causal=False, window=None, scale=None, return_lse=False, layout="contiguous",
                   method="ring", precision="ieee", backend=None):
    """Exact attention over a sequence split across ranks; each rank gets its own rows of the result.

    Parameters
    ----------
    q : array, shape ``(..., local_seqlen_q, heads, head_dim)``
        This rank's queries; float16, bfloat16, float32 or float64 (NumPy or CuPy).
    k, v : array, shape ``(..., local_seqlen_k, heads_kv, head_dim)``
        This rank's keys and values; ``heads % heads_kv == 0``.
    return_lse : bool, default False
        Also return the log-sum-exp of this rank's rows over the whole key sequence (what the backward needs).
    {options}

    Returns
    -------
    out : array, q's shape and dtype
        This rank's rows of ``attention(q_whole, k_whole, v_whole)``.
    lse : array, shape ``(..., heads, local_seqlen_q)``, float32 (float64 for float64 input)
        Only when ``return_lse``.
    """
    return _forward(q, k, v, comm, causal=causal, window=window, scale=scale, return_lse=return_lse, layout=layout,
                    method=method, precision=precision, backend=backend)


def _forward(q, k, v, comm, *, refused=None, **options):
    """:func:`ring_attention` with ``options`` (its defaults for those not given); ``refused``: an error of the caller's
    own checks (:func:`ring_attention_vjp`'s), raised on this rank after the metadata exchange, with every other rank
    raising one naming it."""
    options = {**ring_attention.__kwdefaults__, **options}
    return_lse = options.pop("return_lse")

    def check(problem):  # every argument is checked before any communication, and the outcome exchanged
        if refused is not None:
            raise refused
        check_flags(return_lse=return_lse)

    with contextlib.ExitStack() as scope:
        s, buffers = _setup(q, k, v, comm, what="forward", scope=scope, extra=check, prepare=_forward_buffers,
                            **options)
        if s.method == "ulysses":
            from . import ulysses

            out, lse = ulysses.forward(s)
        else:
            out, lse = _ring_forward(s, buffers)
    p = s.problem
    out = p.unflatten(out, p.q.shape[1:])
    lse = p.unflatten(lse, (p.heads_q, p.seqlen_q))
    return (out, lse) if return_lse else out


def ring_attention_backward(dout, q, k, v, out, lse, comm, *, causal=False, window=None, scale=None,
                            layout="contiguous", method="ring", precision="ieee", deterministic=False, backend=None):
    """Gradients of :func:`ring_attention`: each rank gets dQ, dK, dV of its own q, k, v.

    Parameters
    ----------
    dout : array, q's shape and dtype
        Gradient of the loss with respect to this rank's ``out``.
    q, k, v : this rank's arrays, as for :func:`ring_attention`
    out, lse : this rank's results of ``ring_attention(..., return_lse=True)`` with the same options.
    deterministic : bool, default False
        Passed to each block's backward (see :func:`cuflash.attention_backward`). The ring's own sums run in a fixed
        order, so with ``deterministic=True`` (or on NumPy) the gradients are bitwise reproducible.
    {options}

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtype of this rank's q, k, v
    """
    return _backward(dout, q, k, v, out, lse, comm, causal=causal, window=window, scale=scale, layout=layout,
                     method=method, precision=precision, deterministic=deterministic, backend=backend)


def ring_attention_vjp(q, k, v, comm, **options):
    """JAX-style ``(out, vjp)`` for :func:`ring_attention`: ``vjp(dout)`` returns this rank's ``(dq, dk, dv)``.

    Takes the options of :func:`ring_attention` (except ``return_lse``) and ``deterministic``. Like
    :func:`cuflash.attention_vjp` it keeps references (no copies) and detects a later in-place change of q, k, v or
    out; the check is agreed among ranks first, so a change on one rank raises ValueError on every rank. The options
    are kept as the forward saw them (a ``window`` list is copied: the caller may reuse it).
    Both ``ring_attention_vjp`` and ``vjp`` are collective: every rank must call them.
    """
    try:
        check_keywords("ring_attention_vjp", options, ring_attention, also=("deterministic",),
                       refused={"return_lse": "the lse is kept inside vjp"})
        # Frozen now, as attention_vjp's residual does: a window given as a list that the caller changes before vjp()
        # would otherwise give the gradients of another mask than the saved lse's, silently.
        options = snapshot(options)
        deterministic = options.pop("deterministic", False)
        check_flags(deterministic=deterministic)  # now, as attention_vjp does: not after the forward's communication
    except Exception as exc:  # noqa: BLE001 - raised in the forward's exchange: on one rank alone, the others waited
        _forward(q, k, v, comm, refused=exc)  # raises exc, with the default options (it fails before they are compared)
        raise  # not reached: every rank raises once one rank's checks failed
    out, lse = _forward(q, k, v, comm, return_lse=True, **options)
    saved = {"q": q, "k": k, "v": v, "out": out}
    prints = {name: fingerprint(a) for name, a in saved.items()}

    def vjp(dout):
        changed = [name for name, a in saved.items() if fingerprint(a) != prints[name]]
        return _backward(dout, q, k, v, out, lse, comm, deterministic=deterministic, changed=changed, **options)

    return out, vjp


for _fn in (ring_attention, ring_attention_backward):
    _fn.__doc__ = _fn.__doc__.replace("{options}", _DOC_OPTIONS.strip("\n").lstrip())


# ------------------------------------------------------------------------------------------------ setup
def _setup(q, k, v, comm, *, causal, window, scale, layout, method, precision, backend, what, scope, extra=None,
           flag=0, prepare=None):
    """``(Setup, buffers)``: validate locally, then agree with the other ranks on lengths and options (one small
    all-gather, which also carries whether this rank's checks failed: every rank raises then,
    :func:`comms.allgather_checked`). Then the Setup and, for the ring, ``prepare(setup)``'s buffers are made, and a
    failure there (out of memory on one rank) agreed (:func:`comms.together`) before the first transfer. ``scope``
    (an ExitStack around the whole call) takes the backend's call scope."""
    problem = failure = None
    try:
        problem, module, signature = _local_checks(q, k, v, causal=causal, window=window, scale=scale, layout=layout,
                                                   method=method, precision=precision, backend=backend, what=what,
                                                   extra=extra, scope=scope)
    except Exception as exc:  # noqa: BLE001 - raised after the exchange, on every rank
        failure = exc
    local = [0, 0, 0, 0] if problem is None else [problem.seqlen_q, problem.seqlen_k, zlib.crc32(signature.encode()),
                                                  flag]
    xp = problem.xp if problem is not None else comms.module_of(q)
    transport, meta = comms.allgather_checked(comm, xp, local, failure)
    size = transport.size
    _agree(meta, signature, transport.rank)
    # after the agreement, so that every rank raises it: a rank raising alone leaves the others in the all-gather
    if method == "ulysses" and (problem.heads_q % size or problem.heads_kv % size):
        raise ValueError(f"method='ulysses' splits heads over ranks: heads ({problem.heads_q}) and heads_kv "
                         f"({problem.heads_kv}) must be divisible by the number of ranks ({size}); use method='ring'")
    q_len, kv_len = [int(x) for x in meta[:, 0]], [int(x) for x in meta[:, 1]]
    lq, lk = sum(q_len), sum(kv_len)
    left, right = _check_window(window, causal, lq + lk)

    def made():
        s = Setup(problem, transport, module, method, left, right, lk - lq,
                  _segments(q_len, layout, "q"), _segments(kv_len, layout, "k"), kv_len, q_len)
        return s, (prepare(s) if prepare is not None and method == "ring" else None)
    return comms.together(transport, made)


def _local_checks(q, k, v, *, causal, window, scale, layout, method, precision, backend, what, extra, scope):
    """``(problem, backend module, signature)`` of this rank's call, checked without communication; the signature
    (what every rank must agree on) as text. The backend's scope for the call's steps (``call_scope``, where it has
    one) is entered into ``scope`` here: the NumPy backend reads CUFLASH_BLAS and CUFLASH_NUM_THREADS as it starts
    (a malformed value on one rank is then refused before the exchange, as every check here), and its steps keep
    that one reading (another thread changing CUFLASH_BLAS mid-ring mixed MKL's and OpenBLAS's bits)."""
    array_module(q, k, v, names=("q", "k", "v"), foreign=False)  # NumPy or CuPy only here: the error says so
    problem = make_problem(q, k, v, causal=causal, window=window, scale=scale, precision=precision)
    if problem.xp is not np:  # before any transfer: a NCCL send from another GPU fails on this rank only
        check_current_device(problem.xp.cuda.Device().id, q=q, k=k, v=v)
    check_layout(layout)
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, one of {', '.join(map(repr, METHODS))}, got {type(method).__name__} "
                        f"{method!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    module = backends.select(problem, backend)
    scope.enter_context(getattr(module, "call_scope", contextlib.nullcontext)())
    if extra is not None:
        extra(problem)
    signature = repr((what, problem.batch_shape, problem.heads_q, problem.heads_kv, problem.head_dim,
                      str(problem.dtype), problem.scale, bool(causal), _window_key(window), str(layout), str(method),
                      problem.precision, None if backend is None else str(backend)))  # str: np.str_ has its own repr
    return problem, module, signature


def _window_key(window):
    return None if window is None else tuple(None if w is None else int(w) for w in window)


def _agree(meta, signature, rank):
    """Raise the same ValueError on every rank when the ranks' calls do not match."""
    flags = meta[:, 3]
    if flags.any():
        bad = [int(r) for r in np.flatnonzero(flags)]
        raise ValueError(f"q, k, v or out were modified in place after ring_attention_vjp on rank(s) {bad}: the "
                         f"gradients would be those of other values; call ring_attention_vjp again")
    crcs = meta[:, 2]
    differ = [int(r) for r in np.flatnonzero(crcs != crcs[0])]
    if differ:
        raise ValueError(f"the ranks' calls do not match: rank(s) {differ} differ from rank 0 in the batch shape, "
                         f"heads, heads_kv, head_dim, dtype or options (must be equal on every rank; only sequence "
                         f"lengths may differ). This rank ({rank}) has {signature}")


def _segments(lengths, layout, name):
    """Per rank, its segments of the global sequence (global start, stop, local offset)."""
    size = len(lengths)
    if layout == "contiguous":
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
        return [[Segment(int(starts[r]), int(starts[r + 1]), 0)] for r in range(size)]
    total = sum(lengths)
    edges = chunk_bounds(total, 2 * size)
    out = []
    for r in range(size):
        late = 2 * size - 1 - r
        segs = [Segment(edges[r], edges[r + 1], 0)]
        segs.append(Segment(edges[late], edges[late + 1], segs[0].size))
        if sum(s.size for s in segs) != lengths[r]:
            raise ValueError(f"layout='zigzag': rank {r} holds {lengths[r]} positions of {name}, but the zigzag layout "
                             f"of a sequence of {total} over {size} ranks gives it {sum(s.size for s in segs)}; cut "
                             f"the sequence with cuflash.distributed.shard_sequence(..., layout='zigzag')")
        out.append(segs)
    return out


# ------------------------------------------------------------------------------------------------ one pair
def pair_window(s: Setup, qs: Segment, ks: Segment):
    """``(left', right')`` of the pair's own problem, or None when no query of ``qs`` sees a key of ``ks``.

    Global visibility: ``lo <= gj - gi <= hi`` with ``lo = OFF - left``, ``hi = OFF + right``. Over the pair,
    ``gj - gi`` ranges over ``[c - (a + n - 1), c + m - 1 - a]``; a side whose bound lies outside that range cuts
    nothing and becomes ``None``."""
    a, n, c, m = qs.start, qs.size, ks.start, ks.size
    if n == 0 or m == 0:
        return None
    d_min, d_max = c - (a + n - 1), c + m - 1 - a
    lo = None if s.left is None else s.off - s.left
    hi = None if s.right is None else s.off + s.right
    if (lo is not None and d_max < lo) or (hi is not None and d_min > hi):
        return None
    delta = (a + s.off - c) - (m - n)
    left = None if lo is None or d_min >= lo else s.left - delta
    right = None if hi is None or d_max <= hi else s.right + delta
    return left, right


def _pair_problem(s: Setup, q, k, v, bounds):
    p = make_problem(q, k, v, scale=s.problem.scale, precision=s.problem.precision)
    return dataclasses.replace(p, window_left=bounds[0], window_right=bounds[1])


def _seq(x, seg: Segment, axis=1):
    index = [slice(None)] * x.ndim
    index[axis] = slice(seg.offset, seg.offset + seg.size)
    return x[tuple(index)]


def _cast(s: Setup, x):
    return x.astype(s.work, copy=False) if s.upcast else x


def _neighbors(s: Setup):
    return (s.rank + 1) % s.size, (s.rank - 1) % s.size


class _Slots:
    """Transfer buffers, all made before the ring's first transfer and the outcome agreed (:func:`comms.together`): a
    rank failing to make one mid-ring (out of memory on one GPU) left the others waiting for ever in the transfers it
    would have made. ``per`` flat buffers of the largest block's elements for each of two arrays (K and V, or dK and
    dV); a step's buffer is a view of the first elements of one, in the shape of the block it holds (blocks differ in
    length from rank to rank)."""

    def __init__(self, s: Setup, per, dtype):
        p = s.problem
        self.lead = (p.batch,)
        self.tail = (p.heads_kv, p.head_dim)
        self.elements = p.batch * max(s.kv_len) * p.heads_kv * p.head_dim
        self.kv_len = s.kv_len
        self.per = per
        self.flat = [s.xp.empty(self.elements, dtype=dtype) for _ in range(2 * per)]

    def pair(self, i, owner):
        """Slot ``i`` of both arrays as buffers for rank ``owner``'s block, ``(batch, kv_len[owner], heads_kv,
        head_dim)``."""
        shape = self.lead + (self.kv_len[owner],) + self.tail
        return tuple(self.flat[j][:int(np.prod(shape))].reshape(shape) for j in (i, self.per + i))

    def owned(self, x, dtype):
        """``x`` (a view of a slot) in ``dtype``, copied where it holds less than its slot (not to keep the largest
        block's memory alive in a result)."""
        return x.astype(dtype, copy=x.size != self.elements)


# ------------------------------------------------------------------------------------------------ ring forward
@ignore_fp_errors  # as the one-device call: -W error or np.seterr(all="raise") failed one rank's casts and sums
def _ring_forward(s: Setup, buffers):
    """``(out (B, n, Hq, D) in q's dtype, lse (B, Hq, n))`` of this rank's rows (see the module docstring), with the
    buffers of :func:`_forward_buffers`."""
    p = s.problem
    nxt, prv = _neighbors(s)
    q, k_cur, v_cur, accs, slots = buffers
    failure = comms.Failure()
    for t in range(s.size):
        src = (s.rank - t) % s.size
        in_flight = []
        with _completed_on_error(in_flight):
            pending = comms._Done()
            if t < s.size - 1:  # post the next block's transfer first: it runs while this block is computed
                # into slot t % 2: the block held now arrived in the other one and is sent on from there meanwhile
                k_next, v_next = slots.pair(t % 2, (src - 1) % s.size)
                pending = s.transport.start([(k_cur, nxt, comms.TAG_K), (v_cur, nxt, comms.TAG_V)],
                                            [(k_next, prv, comms.TAG_K), (v_next, prv, comms.TAG_V)])
                in_flight.append(pending)
            failure.attempt(_forward_pairs, s, q, k_cur, v_cur, src, accs, pending)
            pending.wait()
        if t < s.size - 1:
            k_cur, v_cur = k_next, v_next
    # joined before the last exchange, so that a failure to (out of memory) is raised on every rank too
    out_lse = failure.attempt(lambda: (s.xp.concatenate([a[0] for a in accs], axis=1).astype(p.dtype, copy=False),
                                       s.xp.concatenate([a[1] for a in accs], axis=2)))
    failure.raise_together(s.transport)
    return out_lse


def _forward_buffers(s: Setup):
    """What the forward holds through the ring, made before its first transfer (:func:`_setup`): q (upcast for the
    NumPy backend), this rank's K/V block as sent first, the running ``(out, lse)`` per query segment, the transfer
    slots (:class:`_Slots`)."""
    xp, p, work = s.xp, s.problem, s.work
    accs = [(xp.zeros((p.batch, seg.size, p.heads_q, p.head_dim), dtype=work),
             xp.full((p.batch, p.heads_q, seg.size), -np.inf, dtype=work)) for seg in s.q_segs[s.rank]]
    slots = _Slots(s, 2 if s.size > 1 else 0, p.k.dtype)
    return _cast(s, p.q), xp.ascontiguousarray(p.k), xp.ascontiguousarray(p.v), accs, slots


def _forward_pairs(s: Setup, q, k_cur, v_cur, src, accs, pending):
    """One ring step's pair computations: this rank's query segments against the segments of rank ``src``'s K/V block
    that their windows let them see, each merged into its running ``(out, lse)`` in ``accs``."""
    for i, qs in enumerate(s.q_segs[s.rank]):
        for ks in s.kv_segs[src]:
            bounds = pair_window(s, qs, ks)
            if bounds is None:
                continue
            pp = _pair_problem(s, _seq(q, qs), _cast(s, _seq(k_cur, ks)), _cast(s, _seq(v_cur, ks)), bounds)
            o, lse = s.module.forward(pp)
            accs[i] = merge_parts(s.xp, [accs[i][0], o], [accs[i][1], lse], s.work, unseen=True)
            pending.poke()


@contextlib.contextmanager
def _completed_on_error(handles):
    """A ring step while the transfers of ``handles`` (a list the step appends to as it posts them) run; should the
    step raise, they are completed before the error leaves. MPI reads a send buffer and writes a receive buffer until
    its request completes: abandoned, those buffers would be freed under it (2 ranks whose every pair computation
    raised aborted with "malloc(): invalid size"), as NCCL's transfers on their stream would run on memory CuPy may
    hand out again. The other ranks posted the matching transfers in the same step, so they complete whether or not
    those ranks raised too."""
    try:
        yield
    except BaseException:
        for handle in handles:  # a handle's wait() may come twice: the adapters' are idempotent
            with contextlib.suppress(Exception):  # the step's error is the one to see
                handle.wait()
        raise


# ------------------------------------------------------------------------------------------------ backward
def _backward(dout, q, k, v, out, lse, comm, *, causal=False, window=None, scale=None, layout="contiguous",
              method="ring", precision="ieee", deterministic=False, backend=None, changed=()):
    saved = {}

    def check(problem):  # before any communication, and the outcome exchanged (a flag wrong on one rank only)
        check_flags(deterministic=deterministic)
        saved["arrays"] = check_backward(problem, dout, out, lse)

    with contextlib.ExitStack() as scope:
        s, buffers = _setup(q, k, v, comm, causal=causal, window=window, scale=scale, layout=layout, method=method,
                            precision=precision, backend=backend, what="backward", extra=check,
                            flag=int(bool(changed)), scope=scope,
                            prepare=lambda s: _backward_buffers(s, *saved["arrays"]))
        if s.method == "ulysses":
            from . import ulysses

            dq, dk, dv = ulysses.backward(s, *saved["arrays"], deterministic)
        else:
            dq, dk, dv = _ring_backward(s, buffers, deterministic)
    p = s.problem
    return (p.unflatten(dq, p.q.shape[1:]), p.unflatten(dk, p.k.shape[1:]), p.unflatten(dv, p.v.shape[1:]))


@ignore_fp_errors  # as the forward: dK += the carried block (inf + -inf) raised outside Failure.attempt on one rank
def _ring_backward(s: Setup, buffers, deterministic):
    """This rank's ``(dq, dk, dv)``: dQ stays, dK/dV accumulators travel with their block back to its owner. With
    the buffers of :func:`_backward_buffers`."""
    xp, p = s.xp, s.problem
    nxt, prv = _neighbors(s)
    rows, dq, k_cur, v_cur, slots, acc = buffers
    carried = None  # (pending, dk_in, dv_in): the accumulator of the block arriving next, from rank - 1
    failure = comms.Failure()
    for t in range(s.size):
        src = (s.rank - t) % s.size
        in_flight = [carried[0]] if carried is not None else []
        with _completed_on_error(in_flight):
            pending = comms._Done()
            if t < s.size - 1:
                k_next, v_next = slots.pair(t % 2, (src - 1) % s.size)  # as in the forward
                pending = s.transport.start([(k_cur, nxt, comms.TAG_K), (v_cur, nxt, comms.TAG_V)],
                                            [(k_next, prv, comms.TAG_K), (v_next, prv, comms.TAG_V)])
                in_flight.append(pending)
            # Accumulator slots (three per gradient): step t's in (2t) % 3, the one arriving from rank - 1 in
            # (2t + 1) % 3: neither the one still being sent (step t - 1's, 2t - 2) nor the one added in after the
            # wait (step t - 1's arrival, 2t - 1) is written before the step is done with it.
            dk_blk, dv_blk = acc.pair(2 * t % 3, src)
            dk_blk[...] = 0
            dv_blk[...] = 0
            failure.attempt(_backward_pairs, s, rows, k_cur, v_cur, src, (dq, dk_blk, dv_blk), pending,
                            deterministic)
            if carried is not None:  # what the ranks before this one added to the block: waited for only now
                carried[0].wait()
                dk_blk += carried[1]
                dv_blk += carried[2]
            if s.size > 1:
                # On to rank + 1; after the last step that is the block's owner. The receive is the accumulator of
                # the block this rank holds next (after the last step: its own block, complete).
                dk_in, dv_in = acc.pair((2 * t + 1) % 3, (src - 1) % s.size)
                handle = s.transport.start([(dk_blk, nxt, comms.TAG_DK), (dv_blk, nxt, comms.TAG_DV)],
                                           [(dk_in, prv, comms.TAG_DK), (dv_in, prv, comms.TAG_DV)])
                in_flight.append(handle)
                carried = (handle, dk_in, dv_in)
            else:
                carried = (comms._Done(), dk_blk, dv_blk)
            pending.wait()
        if t < s.size - 1:
            k_cur, v_cur = k_next, v_next
    carried[0].wait()
    grads = failure.attempt(lambda: (xp.concatenate(dq, axis=1).astype(p.dtype, copy=False),  # as in the forward
                                     acc.owned(carried[1], p.dtype), acc.owned(carried[2], p.dtype)))
    failure.raise_together(s.transport)
    return grads


def _backward_buffers(s: Setup, dout, out, lse):
    """What the backward holds through the ring, made before its first transfer (see :func:`_forward_buffers`): the
    rows of each query segment (q, dO, O, lse), their dQ, this rank's K/V block, the K/V slots, and the dK/dV
    accumulators' slots (float32, float64 for float64: three per gradient, one where nothing travels)."""
    xp, p, work = s.xp, s.problem, s.work
    q, do, o = _cast(s, p.q), _cast(s, dout), _cast(s, out)
    mine = s.q_segs[s.rank]
    rows = [(xp.ascontiguousarray(_seq(q, qs)), xp.ascontiguousarray(_seq(do, qs)),
             xp.ascontiguousarray(_seq(o, qs)), xp.ascontiguousarray(_seq(lse, qs, axis=2))) for qs in mine]
    dq = [xp.zeros((p.batch, qs.size, p.heads_q, p.head_dim), dtype=work) for qs in mine]
    kv = _Slots(s, 2 if s.size > 1 else 0, p.k.dtype)
    acc = _Slots(s, 3 if s.size > 1 else 1, work)
    return rows, dq, xp.ascontiguousarray(p.k), xp.ascontiguousarray(p.v), kv, acc


def _backward_pairs(s: Setup, rows, k_cur, v_cur, src, grads, pending, deterministic):
    """One ring step's pair computations in the backward: each pair's dQ added to this rank's ``dq`` of its query
    segment, its dK, dV to the accumulators ``dk_blk``, ``dv_blk`` of rank ``src``'s block (``grads``)."""
    dq, dk_blk, dv_blk = grads
    for i, qs in enumerate(s.q_segs[s.rank]):
        for ks in s.kv_segs[src]:
            bounds = pair_window(s, qs, ks)
            if bounds is None:
                continue
            q_i, do_i, o_i, lse_i = rows[i]
            pp = _pair_problem(s, q_i, _cast(s, _seq(k_cur, ks)), _cast(s, _seq(v_cur, ks)), bounds)
            g_q, g_k, g_v = s.module.backward(pp, do_i, o_i, lse_i, deterministic=deterministic)
            dq[i] += g_q.astype(s.work, copy=False)
            _seq(dk_blk, ks)[...] += g_k.astype(s.work, copy=False)
            _seq(dv_blk, ks)[...] += g_v.astype(s.work, copy=False)
            pending.poke()
