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
#: The largest ``size`` (number of ranks) taken. A communicator's size is a C ``int`` in MPI (``MPI_Comm_size``) and
#: NCCL (``ncclCommCount``), so no rank count exceeds this; a larger one is a mistake of the caller (a length passed
#: as ``size``), refused rather than answered with a layout of billions of empty parts.
MAX_SIZE = 2**31 - 1


def check_layout(layout) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {', '.join(map(repr, LAYOUTS))}, got {type(layout).__name__} "
                        f"{layout!r}")
    if layout in ("bshd", "bhsd"):
        # cuflash.attention's layout is an axis order; here the same keyword names the sharding of the sequence, and
        # a caller moving from one to the other would otherwise only read that "bshd" is not "zigzag"
        raise ValueError(f"layout={layout!r} is an axis order, but in cuflash.distributed layout is how the sequence "
                         f"is sharded over ranks: one of {', '.join(map(repr, LAYOUTS))}. The arrays have one axis "
                         f"order: q, k, v (..., seqlen, heads, head_dim) as cuflash.attention's 'bshd' (pass 'bhsd' "
                         f"arrays as x.swapaxes(-3, -2)); the sharding helpers cut along their axis argument "
                         f"(default -3)")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def _check_int(name, x):
    """``x`` as a Python int; TypeError for anything else (a bool, read as 0 or 1, and a float included)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
    return int(x)  # Python ints: a NumPy int64 would overflow in the edge arithmetic below


def _check_rank(size, rank):
    size, rank = _check_int("size", size), _check_int("rank", rank)
    if not 1 <= size <= MAX_SIZE or not 0 <= rank < size:
        raise ValueError(f"need 1 <= size <= 2**31 - 1 (a communicator's size is a C int) and 0 <= rank < size, got "
                         f"size={size}, rank={rank}")
    return size, rank


def chunk_edge(length: int, parts: int, i: int) -> int:
    """Edge ``i`` (of ``0..parts``) of ``[0, length)`` cut as ``numpy.array_split`` does (earlier chunks one
    longer): the first ``i`` chunks hold ``i·base`` positions and one more each for those of the ``extra``.
    Computed alone in O(1), so that one rank's segments cost nothing whatever the number of ranks."""
    base, extra = divmod(length, parts)
    return i * base + min(i, extra)


def chunk_bounds(length: int, parts: int) -> list[int]:
    """``parts + 1`` edges cutting ``[0, length)`` as ``numpy.array_split`` does (earlier chunks one longer)."""
    return [chunk_edge(length, parts, i) for i in range(parts + 1)]


def local_segments(length, size, rank, *, layout="contiguous") -> tuple[tuple[int, int], ...]:
    """The global positions ``((start, stop), ...)`` that ``rank`` of ``size`` holds of a sequence of ``length``.

    Parameters
    ----------
    length : int
        Total sequence length.
    size, rank : int
        Number of ranks (``1 <= size <= 2**31 - 1``, :data:`MAX_SIZE`: a communicator's size is a C int) and this
        rank.
    layout : {"contiguous", "zigzag"}

    Returns
    -------
    tuple of (start, stop)
        One segment for ``"contiguous"``, two for ``"zigzag"`` (chunks ``rank`` and ``2·size - 1 - rank``), in the
        order the local array holds them. Useful for position-dependent inputs (rotary embeddings) of local tokens.
    """
    check_layout(layout)
    size, rank = _check_rank(size, rank)
    length = _check_int("length", length)
    if length < 0:
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    # only this rank's edges: O(1), where the list of all size + 1 edges made a large size hang
    if layout == "contiguous":
        return ((chunk_edge(length, size, rank), chunk_edge(length, size, rank + 1)),)
    late = 2 * size - 1 - rank
    return ((chunk_edge(length, 2 * size, rank), chunk_edge(length, 2 * size, rank + 1)),
            (chunk_edge(length, 2 * size, late), chunk_edge(length, 2 * size, late + 1)))


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
        As for :func:`local_segments`.
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
        if any(a != b for i, (a, b) in enumerate(zip(part.shape, parts[0].shape)) if i != axis):
            # concatenate's own error names no argument and counts dimensions from the front
            want = tuple("any" if i == axis else n for i, n in enumerate(parts[0].shape))
            raise ValueError(f"parts[{rank}] has shape {part.shape}, but every part must have parts[0]'s shape except "
                             f"along axis {axis} (the sequence): ({', '.join(map(str, want))})")
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

    xp, failure = None, None
    try:  # every rank takes part in the exchange below, this one's own error then raised on every rank
        check_layout(layout)
        xp = _module(x)
        axis = _axis(x, axis)
        rest = tuple(d for i, d in enumerate(x.shape) if i != axis)
        signature = repr((x.ndim, axis, rest, str(x.dtype), layout))
    except Exception as exc:  # noqa: BLE001 - raised after the exchange, on every rank
        failure = exc
    local = [0, 0] if failure is not None else [x.shape[axis], zlib.crc32(signature.encode())]
    transport, meta = comms.allgather_checked(comm, xp or comms.module_of(x), local, failure)
    differ = [int(r) for r in np.flatnonzero(meta[:, 1] != meta[0, 1])]
    if differ:
        raise ValueError(f"gather_sequence: rank(s) {differ} differ from rank 0 in the dimensions other than axis "
                         f"{axis}, the dtype or the layout; this rank has {signature}")
    def buffers():  # the contiguous copy and every receive buffer, made before any transfer
        mine = xp.ascontiguousarray(x)
        parts = []
        for src in range(transport.size):
            shape = list(mine.shape)
            shape[axis] = int(meta[src, 0])
            parts.append(mine if src == transport.rank else xp.empty(tuple(shape), dtype=mine.dtype))
        return mine, parts

    # one rank out of memory (P times its data) raises on every rank, as in the ring: it left the others waiting
    mine, parts = comms.together(transport, buffers)
    others = [src for src in range(transport.size) if src != transport.rank]
    transport.start([(mine, src, comms.TAG_GATHER) for src in others],
                    [(parts[src], src, comms.TAG_GATHER) for src in others]).wait()
    return unshard_sequence(parts, layout=layout, axis=axis)
