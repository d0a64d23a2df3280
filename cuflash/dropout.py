"""Attention dropout as a pure function of (seed, batch, head, row, column).

FlashAttention never stores the dropout mask: the backward regenerates it. cuflash makes the
keep-mask a counter-based random function so that the NumPy backend, the reference and the CUDA
kernels (``kernels/philox.cuh``) compute the same bits:

    bits(b, h, i, j) = Philox4x32-10(key = (seed mod 2³², seed >> 32),
                                     counter = (j >> 2, i, h, b))[j & 3]
    keep(b, h, i, j) = bits >= threshold(p),   threshold(p) = min(floor(p · 2³²), 2³² − 1)

``b`` is the flattened batch index, ``h`` the query head. One Philox call serves four adjacent
columns. Kept probabilities are scaled by ``1 / (1 − p)`` after the softmax normalization; the
log-sum-exp is that of the undropped scores.
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Optional, Sequence

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
#: the 32-bit halves of a uint64 viewed as two uint32: (low, high) in memory order on a little-endian machine
_LOW, _HIGH = (0, 1) if sys.byteorder == "little" else (1, 0)


def philox4x32(counter: Sequence[Any], key: Sequence[int]) -> tuple[Any, Any, Any, Any]:
    """Philox-4x32-10 (Salmon et al., SC'11). ``counter``: 4 uint32 arrays (broadcast together),
    ``key``: 2 uint32 scalars. Returns the 4 output words as uint32 arrays (C-contiguous)."""
    return tuple(np.array(w, order="C") for w in _words(counter, key))  # type: ignore[return-value]


def _words(counter: Sequence[Any], key: Sequence[int]) -> tuple[Any, Any, Any, Any]:
    """:func:`philox4x32`'s words as views into the rounds' buffers (two of them strided): a caller that reads
    them once (a comparison with the threshold) copies nothing.

    Each round's two 32x32 -> 64-bit products go into preallocated uint64 buffers and are taken apart as views of
    their uint32 halves, not by shifts, masks and casts (6 array operations per round, the same bits); the XORs
    write into two uint32 buffers in place. Two pairs of product buffers take turns: the low halves of one
    round's products are the next round's c1 and c3, read while that round writes the other pair. No temporary is
    allocated in the rounds (a tile's were ~8 MiB each, faulted in anew)."""
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=np.uint32) for c in counter))
    shape = c0.shape
    products = [np.empty(shape, np.uint64) for _ in range(4)]
    x0, x2 = np.empty(shape, np.uint32), np.empty(shape, np.uint32)
    k0, k1 = np.uint32(key[0]), np.uint32(key[1])
    with np.errstate(over="ignore"):
        for r in range(10):
            w0, w1 = products[2 * (r % 2)], products[2 * (r % 2) + 1]
            np.multiply(c0, _M0, out=w0, dtype=np.uint64)  # c0, c2 read here, before x0, x2 are written below
            np.multiply(c2, _M1, out=w1, dtype=np.uint64)
            h0, l0 = _halves(w0)
            h1, l1 = _halves(w1)
            np.bitwise_xor(h1, c1, out=x0)
            x0 ^= k0
            np.bitwise_xor(h0, c3, out=x2)
            x2 ^= k1
            c0, c1, c2, c3 = x0, l1, x2, l0
            k0, k1 = k0 + _W0, k1 + _W1
    return c0, c1, c2, c3


def _halves(w: Any) -> tuple[Any, Any]:
    """The high and low uint32 halves of a uint64 array, as strided views."""
    v = w[..., None].view(np.uint32)  # (..., 2): a 0-d array has no axis of its own to view along
    return v[..., _HIGH], v[..., _LOW]


#: the largest dropout probability: the keep-mask compares 32-bit random numbers with ``p · 2³²``, so a larger ``p``
#: would still keep an element with probability 2⁻³² while the kept ones are scaled by ``1 / (1 − p)``: a biased
#: output (its expectation 2³² (1 − p) times the undropped one; at p = 0.9999999999999999, 2·10⁶)
MAX_P = 1.0 - 2.0 ** -32
#: the smallest dropout probability but 0: below it ``threshold(p)`` is 0 and nothing is dropped, while the kept
#: elements would still be scaled by ``1 / (1 - p)`` (the CUDA kernels' backward took a threshold of 0 for no dropout
#: and left that scale out of dS alone: float64 gradients off by a relative p)
MIN_P = 2.0 ** -32


def threshold(p: float) -> int:
    """Bits below this value are dropped: P(drop) = threshold / 2³² ≈ p."""
    return min(int(np.floor(p * 2.0 ** 32)), 2 ** 32 - 1)


def keep_mask(seed: int, p: float, batch: Any, head: Any, rows: Any, cols: Any) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Boolean keep-mask over broadcast index arrays ``batch, head, rows, cols``.

    Column ``j`` takes word ``j & 3`` of the Philox block at counter ``(j >> 2, row, head, batch)``. When ``cols``
    is a run of consecutive columns along the last axis (a tile's), each block is computed once for its four
    columns (:func:`_keep_run`): a quarter of the Philox work and temporaries, the same bits."""
    key = (seed & 0xFFFFFFFF, seed >> 32)
    run = _column_run(cols)
    if run is not None and all(np.shape(x)[-1:] in ((), (1,)) for x in (batch, head, rows)):
        return _keep_run(key, p, batch, head, rows, *run)
    b, h, i, j = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (batch, head, rows, cols)))
    words = philox4x32((j >> 2, i, h, b), key)
    lane = (j & 3).astype(np.intp)
    bits = np.choose(lane, words)
    keep: np.ndarray[Any, np.dtype[np.bool_]] = bits >= np.uint32(threshold(p))
    return keep


def _column_run(cols: Any) -> Optional[tuple[int, int, int]]:
    """``(first column, count, ndim)`` if ``cols`` is ``first + arange(count)`` along its last axis (every other
    axis of length 1), else None."""
    c = np.asarray(cols)
    if c.ndim == 0 or c.size == 0 or c.shape[:-1] != (1,) * (c.ndim - 1) or c.dtype.kind not in "iu":
        return None
    flat = c.reshape(-1).astype(np.int64)
    if not np.array_equal(flat, flat[0] + np.arange(flat.size)):
        return None
    return int(flat[0]), int(flat.size), c.ndim


#: Philox blocks per chunk of a column run (:func:`_keep_run`): the rounds' buffers, 40 bytes a block, are allocated
#: once per chunk (2.5 MiB). Smaller chunks (2^14, in a core's L2) ran a tile alone 7% faster but the two-thread
#: forward 40% slower: each NumPy call releases and retakes the GIL that the workers share (AMD EPYC, 2026-11-27).
_CHUNK = 1 << 16


def _keep_run(key: tuple[int, int], p: float, batch: Any, head: Any, rows: Any, first: int, count: int,
              ndim: int) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """:func:`keep_mask` for the columns ``first .. first + count - 1``: the Philox blocks that hold them, each
    once, their four words laid out side by side (column ``4g + lane`` is word ``lane`` of block ``g``), cut.
    In chunks of rows of about :data:`_CHUNK` blocks, each word compared with the threshold as it is made."""
    g0, g1 = first >> 2, (first + count - 1) >> 2
    groups = np.arange(g0, g1 + 1, dtype=np.int64)
    lead = np.broadcast_shapes(*(np.shape(x) for x in (batch, head, rows)), (1,) * ndim)[:-1]
    n = math.prod(lead)
    b, h, i = (np.broadcast_to(np.asarray(x, dtype=np.int64), lead + (1,)).reshape(n, 1) for x in (batch, head, rows))
    keep = np.empty((n, groups.size, 4), dtype=np.bool_)
    cut = np.uint32(threshold(p))
    step = max(1, _CHUNK // groups.size)
    for r0 in range(0, n, step):
        r = slice(r0, r0 + step)
        for lane, word in enumerate(_words((groups[None, :], i[r], h[r], b[r]), key)):
            np.greater_equal(word, cut, out=keep[r, :, lane])
    start = first - 4 * g0
    return keep.reshape(lead + (4 * groups.size,))[..., start:start + count]


def dropout_mask(shape: Sequence[int], *, seed: int, p: float) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """The keep-mask cuflash applies, as a boolean array of ``shape = (*batch, heads, Sq, Sk)``.

    Parameters
    ----------
    shape : tuple of int
        Batch dimensions (any number), then heads, seqlen_q, seqlen_k.
    seed : int in [0, 2**64)
    p : 0 or a float in [2**-32, 1 - 2**-32]
        Dropout probability (:data:`MIN_P` at least, but 0; :data:`MAX_P` at most).
    """
    from .problem import check_dropout

    if not isinstance(shape, (tuple, list)) or not all(_is_count(s) for s in shape):
        raise TypeError(f"shape must be a tuple of ints >= 0, (*batch, heads, seqlen_q, seqlen_k), got {shape!r}")
    shape = tuple(int(s) for s in shape)
    if len(shape) < 3:
        raise ValueError(f"shape must be (*batch, heads, seqlen_q, seqlen_k), got {shape}")
    # NumPy's own errors ("maximum allowed size", "array is too big") name no argument; it refuses a shape whose
    # nonzero dimensions multiply past its index range even where another dimension is 0
    if math.prod(s for s in shape if s) > np.iinfo(np.intp).max:
        raise ValueError(f"shape {shape} has dimensions that multiply to {math.prod(s for s in shape if s)}, more "
                         f"than an array can index ({np.iinfo(np.intp).max})")
    p, seed = check_dropout(p, seed, what="p")
    if seed is None:
        raise ValueError("seed is required: an int in [0, 2**64)")
    if 0 in shape:  # nothing to draw (the index arrays below would follow the other dimensions, however large)
        return np.zeros(shape, dtype=bool)
    *batch, heads, sq, sk = shape
    nb = math.prod(batch)
    b = np.arange(nb)[:, None, None, None]
    h = np.arange(heads)[None, :, None, None]
    i = np.arange(sq)[None, None, :, None]
    j = np.arange(sk)[None, None, None, :]
    return keep_mask(seed, p, b, h, i, j).reshape(shape)


def _is_count(s: object) -> bool:
    """An integer >= 0 (NumPy integers too), not a bool."""
    if isinstance(s, (bool, np.bool_)) or not isinstance(s, numbers.Integral):
        return False
    return int(s) >= 0


def needs_seed(dropout_p: Any, seed: Optional[int]) -> bool:
    """Whether a call must draw a seed: dropout is on and none was given. An invalid ``dropout_p`` counts as
    off here: validation (``check_dropout``) names it right after."""
    try:
        return seed is None and bool(dropout_p)
    except Exception:  # noqa: BLE001 - e.g. an array's ambiguous truth value
        return False


def fresh_seed() -> int:
    """A new 64-bit seed from the operating system's entropy."""
    return int(np.random.SeedSequence().generate_state(1, dtype=np.uint64)[0])
