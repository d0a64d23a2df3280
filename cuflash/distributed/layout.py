"""How a sequence is laid out over ranks: ``"contiguous"`` slices or the load-balanced ``"zigzag"`` layout.

``contiguous``: rank ``r`` holds one slice ``[s_r, s_{r+1})``, in rank order. :func:`shard_sequence` cuts a sequence
of length ``L`` as ``numpy.array_split`` does (the first ``L % P`` ranks hold one more position), but
:func:`cuflash.distributed.ring_attention` accepts any lengths per rank in this layout, 0 included: each rank's
offset is the sum of the lengths of the ranks before it.

``zigzag``: the sequence is cut into ``2P`` chunks (``array_split`` again) and rank ``r`` holds chunks ``r`` and
``2P - 1 - r``, concatenated. Under a causal mask a chunk's work grows with its position, so pairing an early chunk
with a late one gives every rank the same work (the zigzag layout of the ring-flash-attention project; Llama 3's
context parallelism pairs chunks the same way, Dubey et al. 2024; Striped Attention, Brandon et al. 2023, balances by
striping single tokens instead). With contiguous slices the last rank does ``2P - 1`` times the first rank's work and
the ring runs at the pace of the slowest rank.

These functions only cut and paste arrays: no communication (see
:func:`cuflash.distributed.gather_sequence` for the collective one).
"""
from __future__ import annotations

import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def _check_rank(size, rank):
    for name, x in (("size", size), ("rank", rank)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"need size >= 1 and 0 <= rank < size, got size={size}, rank={rank}")


def chunk_bounds(length: int, parts: int) -> list[int]:
    """``parts + 1`` edges cutting ``[0, length)`` as ``numpy.array_split`` does (earlier chunks one longer)."""
    base, extra = divmod(length, parts)
    edges = [0]
    for i in range(parts):
        edges.append(edges[-1] + base + (i < extra))
    return edges


def local_segments(length, size, rank, *, layout="contiguous") -> tuple[tuple[int, int], ...]:
    """The global positions ``((start, stop), ...)`` that ``rank`` of ``size`` holds of a sequence of ``length``.

    Parameters
    ----------
    length : int
        Total sequence length.
    size, rank : int
        Number of ranks and this rank.
    layout : {"contiguous", "zigzag"}

    Returns
    -------
    tuple of (start, stop)
        One segment for ``"contiguous"``, two for ``"zigzag"`` (chunks ``rank`` and ``2·size - 1 - rank``), in the
        order the local array holds them. Useful for position-dependent inputs (rotary embeddings) of local tokens.
    """
    check_layout(layout)
    _check_rank(size, rank)
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    if layout == "contiguous":
        edges = chunk_bounds(int(length), size)
        return ((edges[rank], edges[rank + 1]),)
    edges = chunk_bounds(int(length), 2 * size)
    late = 2 * size - 1 - rank
    return ((edges[rank], edges[rank + 1]), (edges[late], edges[late + 1]))


def _axis(x, axis):
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an int, got {type(axis).__name__} {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of {x.ndim} dimensions")
    return axis % x.ndim


def _take(x, axis, start, stop):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def shard_sequence(x, size, rank, *, layout="contiguous", axis=-3):
    """This rank's part of a whole sequence: what ``rank`` passes to the distributed functions.

    Parameters
    ----------
    x : array (NumPy or CuPy), the whole sequence along ``axis``
        For example ``q`` of shape ``(..., seqlen, heads, head_dim)`` (``axis=-3``, the default).
    size, rank : int
    layout : {"contiguous", "zigzag"}
    axis : int, default -3

    Returns
    -------
    array
        ``x`` restricted to :func:`local_segments` along ``axis``: a view for ``"contiguous"``, a new array for
        ``"zigzag"`` (two chunks concatenated).
    """
    xp = _module(x)  # for either layout: a list or a masked array is refused, not sliced
    axis = _axis(x, axis)
    segments = local_segments(x.shape[axis], size, rank, layout=layout)
    if len(segments) == 1:
        return _take(x, axis, *segments[0])
    return xp.concatenate([_take(x, axis, a, b) for a, b in segments], axis=axis)


def unshard_sequence(parts, *, layout="contiguous", axis=-3):
    """The whole sequence from every rank's part (the inverse of :func:`shard_sequence`).

    Parameters
    ----------
    parts : sequence of arrays
        ``parts[r]`` is rank ``r``'s part, as :func:`shard_sequence` cut it (for ``"contiguous"`` any lengths).
    layout : {"contiguous", "zigzag"}
    axis : int, default -3

    Returns
    -------
    array
        The parts pasted back in global order along ``axis``.
    """
    if hasattr(parts, "shape") or not isinstance(parts, (list, tuple)):  # an array would be split along axis 0
        raise TypeError(f"parts must be a list or tuple of arrays (one per rank), got {type(parts).__name__}")
    parts = list(parts)
    if not parts:
        raise ValueError("parts must hold one array per rank, got none")
    check_layout(layout)
    xp = _module(parts[0], "parts[0]")
    axis = _axis(parts[0], axis)
    for rank, part in enumerate(parts):  # one library, dtype and rank count; no mask to drop
        if _module(part, f"parts[{rank}]") is not xp or part.dtype != parts[0].dtype or part.ndim != parts[0].ndim:
            raise TypeError(f"parts[{rank}] must be a {xp.__name__} array of dtype {parts[0].dtype} and "
                            f"{parts[0].ndim} dimensions like parts[0], got {type(part).__name__} {part.dtype} "
                            f"{part.ndim}-d")
    if layout == "contiguous":
        return xp.concatenate(parts, axis=axis)
    size, total = len(parts), sum(p.shape[axis] for p in parts)
    pieces = {}
    for rank, part in enumerate(parts):
        segments = local_segments(total, size, rank, layout=layout)
        want = sum(b - a for a, b in segments)
        if part.shape[axis] != want:
            raise ValueError(f"parts[{rank}] has length {part.shape[axis]} along axis {axis}, but the zigzag layout of "
                             f"a sequence of {total} over {size} ranks gives rank {rank} {want}")
        offset = 0
        for a, b in segments:
            pieces[a] = _take(part, axis, offset, offset + b - a)
            offset += b - a
    return xp.concatenate([pieces[a] for a in sorted(pieces)], axis=axis)


def _module(x, name="x"):
    from ..problem import array_module

    return array_module(x, names=(name,), foreign=False)


def gather_sequence(x, comm, *, layout="contiguous", axis=-3):
    """The whole sequence on every rank, from each rank's part (collective: every rank calls it).

    Parameters
    ----------
    x : array (NumPy or CuPy)
        This rank's part along ``axis``; the other dimensions and the dtype must agree across ranks.
    comm : mpi4py.MPI.Comm or cupy.cuda.nccl.NcclCommunicator
    layout : {"contiguous", "zigzag"}
    axis : int, default -3

    Returns
    -------
    array
        The whole sequence (:func:`unshard_sequence` of all parts). It holds ``P`` times the local data: meant for
        results and tests, not for the inside of a model whose point is to never hold the whole sequence.
    """
    import zlib

    from . import comm as comms

    check_layout(layout)
    xp = _module(x)
    axis = _axis(x, axis)
    transport = comms.transport(comm, xp)
    rest = tuple(d for i, d in enumerate(x.shape) if i != axis)
    signature = repr((x.ndim, axis, rest, str(x.dtype), layout))
    meta = transport.allgather_ints([x.shape[axis], zlib.crc32(signature.encode())])
    differ = [int(r) for r in np.flatnonzero(meta[:, 1] != meta[0, 1])]
    if differ:
        raise ValueError(f"gather_sequence: rank(s) {differ} differ from rank 0 in the dimensions other than axis "
                         f"{axis}, the dtype or the layout; this rank has {signature}")
    x = xp.ascontiguousarray(x)
    parts, sends, recvs = [], [], []
    for src in range(transport.size):
        if src == transport.rank:
            parts.append(x)
            continue
        shape = list(x.shape)
        shape[axis] = int(meta[src, 0])
        buf = xp.empty(tuple(shape), dtype=x.dtype)
        parts.append(buf)
        recvs.append((buf, src, comms.TAG_GATHER))
        sends.append((x, src, comms.TAG_GATHER))
    transport.start(sends, recvs).wait()
    return unshard_sequence(parts, layout=layout, axis=axis)
