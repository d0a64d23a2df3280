"""Head-parallel sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) over the same adapters.

Rank ``r`` holds all heads of its part of the sequence. One all-to-all gives it heads ``[r·H/P, (r+1)·H/P)`` of the
whole sequence (pasted in global order, whatever the layout); it runs one ordinary attention call (or backward) on
them, causal and window applied exactly as on one device; a second all-to-all returns each rank its rows of every
head. See :mod:`cuflash.distributed.ring` for the comparison with the ring.
"""
from __future__ import annotations

import functools

from . import comm as comms
from ..problem import make_problem, stats_dtype


def _heads(x, rank, per, axis):
    index = [slice(None)] * x.ndim
    index[axis] = slice(rank * per, (rank + 1) * per)
    return x[tuple(index)]


def _rows(x, segs, axis):
    """``x``'s rows of the given global segments (``x`` holds the whole sequence), concatenated in order."""
    xp = _xp(x)
    parts = []
    for seg in segs:
        index = [slice(None)] * x.ndim
        index[axis] = slice(seg.start, seg.stop)
        parts.append(x[tuple(index)])
    return xp.ascontiguousarray(parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=axis))


def _xp(x):
    from ..problem import array_module

    return array_module(x, names=("x",), foreign=False)


def to_heads(s, tensors, segs, lengths):
    """Sequence-parallel → head-parallel. ``tensors``: ``[(local array, seq axis, head axis), ...]`` (one
    exchange for all); returns, per tensor, a callable giving this rank's heads over the whole sequence in global
    order: the caller pastes the parts inside its guarded computation (:func:`comms.together`), as these whole-sequence
    arrays are the call's largest allocation, and a rank failing to make one must still reach the exchange after."""
    received, sends, recvs = comms.together(s.transport, lambda: _to_heads_buffers(s, tensors, lengths))
    s.transport.start(sends, recvs).wait()
    return [functools.partial(_paste, s.xp, parts, segs, seq_axis) for parts, seq_axis in received]


def _to_heads_buffers(s, tensors, lengths):
    """The buffers of :func:`to_heads`' exchange: per tensor ``(parts, seq axis)`` (this rank's own heads, and a buffer
    per other rank that its part lands in), the sends and the receives."""
    xp, size, rank = s.xp, s.size, s.rank
    sends, recvs, received = [], [], []
    for i, (x, seq_axis, head_axis) in enumerate(tensors):
        per = x.shape[head_axis] // size
        parts = []
        for src in range(size):
            shape = list(x.shape)
            shape[seq_axis], shape[head_axis] = lengths[src], per
            if src == rank:
                parts.append(xp.ascontiguousarray(_heads(x, rank, per, head_axis)))
            else:
                buf = xp.empty(tuple(shape), dtype=x.dtype)
                recvs.append((buf, src, comms.TAG_A2A + i))
                parts.append(buf)
        for dst in range(size):
            if dst != rank:
                sends.append((xp.ascontiguousarray(_heads(x, dst, per, head_axis)), dst, comms.TAG_A2A + i))
        received.append((parts, seq_axis))
    return received, sends, recvs


def _paste(xp, parts, segs, axis):
    """Each rank's local rows (``parts[r]``, laid out as ``segs[r]``) pasted into global order."""
    pieces = []
    for part, rank_segs in zip(parts, segs):
        for seg in rank_segs:
            index = [slice(None)] * part.ndim
            index[axis] = slice(seg.offset, seg.offset + seg.size)
            pieces.append((seg.start, part[tuple(index)]))
    pieces.sort(key=lambda item: item[0])
    return xp.concatenate([x for _, x in pieces], axis=axis)


def to_rows(s, tensors):
    """Head-parallel → sequence-parallel. ``tensors``: ``[(whole-sequence array of this rank's heads, segs per rank,
    seq axis, head axis), ...]``; returns, per tensor, this rank's rows of all heads. Each side of the exchange is
    guarded (:func:`comms.together`): a rank failing to join the parts it received is told to every rank before any
    goes on to the call's next exchange."""
    received, sends, recvs = comms.together(s.transport, lambda: _to_rows_buffers(s, tensors))
    s.transport.start(sends, recvs).wait()
    return comms.together(s.transport, lambda: [s.xp.concatenate(parts, axis=head_axis)
                                                for parts, head_axis in received])


def _to_rows_buffers(s, tensors):
    """The buffers of :func:`to_rows`' exchange, as :func:`_to_heads_buffers`."""
    xp, size, rank = s.xp, s.size, s.rank
    sends, recvs, received = [], [], []
    for i, (x, segs, seq_axis, head_axis) in enumerate(tensors):
        parts = []
        for src in range(size):
            if src == rank:
                parts.append(_rows(x, segs[rank], seq_axis))
            else:
                shape = list(x.shape)
                shape[seq_axis] = sum(seg.size for seg in segs[rank])
                buf = xp.empty(tuple(shape), dtype=x.dtype)
                recvs.append((buf, src, comms.TAG_A2A + i))
                parts.append(buf)
        for dst in range(size):
            if dst != rank:
                sends.append((_rows(x, segs[dst], seq_axis), dst, comms.TAG_A2A + i))
        received.append((parts, head_axis))
    return received, sends, recvs


def _whole_problem(s, q, k, v):
    """The single-device problem of this rank's heads over the whole sequences (causal/window as the user gave)."""
    p = s.problem
    return make_problem(q, k, v, scale=p.scale, window=(s.left, s.right), precision=p.precision)


def forward(s):
    p = s.problem
    qkv = _gather_qkv(s)
    out, lse = comms.together(s.transport, lambda: s.module.forward(_whole_problem(s, *_pasted(qkv))))
    out, lse = to_rows(s, [(out, s.q_segs, 1, 2), (lse, s.q_segs, 2, 1)])
    return out, lse.astype(stats_dtype(p.dtype), copy=False)


def _pasted(parts):
    return [paste() for paste in parts]


def _gather_qkv(s):
    p = s.problem
    return (to_heads(s, [(p.q, 1, 2)], s.q_segs, s.q_len)
            + to_heads(s, [(p.k, 1, 2), (p.v, 1, 2)], s.kv_segs, s.kv_len))


def backward(s, dout, out, lse, deterministic):
    qkv = _gather_qkv(s)
    rows = to_heads(s, [(dout, 1, 2), (out, 1, 2), (lse, 2, 1)], s.q_segs, s.q_len)
    dq, dk, dv = comms.together(s.transport, lambda: s.module.backward(_whole_problem(s, *_pasted(qkv)),
                                                                       *_pasted(rows), deterministic=deterministic))
    dq, = to_rows(s, [(dq, s.q_segs, 1, 2)])
    dk, dv = to_rows(s, [(dk, s.kv_segs, 1, 2), (dv, s.kv_segs, 1, 2)])
    return dq, dk, dv
