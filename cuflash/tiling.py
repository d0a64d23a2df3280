"""The tile schedule: which (query tile, key tile) pairs a blocked kernel visits, and how each is masked.

Causal, window, per-sequence lengths and the BlockMask all reduce here to one rule. A tile of
``block_q x block_k`` elements is

* **skipped** when no sequence sees any of its elements (or the BlockMask drops every mask block
  it overlaps, in every sequence and head): it is never yielded;
* **full** when every element is visible in every sequence and the BlockMask keeps every block it
  overlaps in every sequence and head: no element mask is built;
* **partial** otherwise: the kernel builds an element mask (:meth:`Schedule.element_mask`).

A :class:`Schedule` holds four integers per query tile (the hull of visited key tiles and the range
of full ones), so it costs O(number of query tiles) memory whatever the sequence length; tiles are
generated lazily, one query tile (:meth:`Schedule.row`, the forward) or one key tile
(:meth:`Schedule.column`, the backward) at a time, and the totals (:meth:`Schedule.counts`) are
computed from the ranges without visiting tiles. The BlockMask's grid is classified into kept /
fully kept tiles at once (:func:`classify_grid`), vectorized over any tile size.

Rows of one sequence see an interval of key columns (the visibility rule is an intersection of
half-planes, so the visible set is convex), which is what makes ranges enough: the key columns a
block of rows sees form an interval per sequence, and the tiles every element of which is visible
form an interval too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from .problem import check_int, visible


def cdiv(a, b):
    return -(-a // b)


# --------------------------------------------------------------------------------------------
# Argument checks of the public entry points (once per call or construction, never per tile)
# --------------------------------------------------------------------------------------------
def _lengths_arg(x, name: str, full: int):
    """Per-sequence lengths as int64 ``(B,)`` in ``[0, full]`` (a scalar is one sequence); None stays None."""
    if x is None:
        return None
    a = np.asarray(x)
    if a.size and (a.dtype.kind not in "iu"):  # floats would be truncated, bools read as 0/1
        raise TypeError(f"{name} must be ints (a scalar or a 1-D array of per-sequence lengths), got dtype {a.dtype}")
    if a.ndim > 1:
        raise ValueError(f"{name} must be a scalar or a 1-D array of per-sequence lengths, got shape {a.shape}")
    a = np.atleast_1d(a.astype(np.int64))
    if a.size and (a.min() < 0 or a.max() > full):  # a sequence longer than the padded one reads past it
        raise ValueError(f"{name} values must lie in [0, {full}], got range [{a.min()}, {a.max()}]")
    return a


@dataclass(frozen=True)
class Tile:
    """Rows ``[i0, i1)`` against keys ``[k0, k1)``; ``full``: no element mask needed."""

    i0: int
    i1: int
    k0: int
    k1: int
    full: bool


# --------------------------------------------------------------------------------------------
# Visible key columns per block of rows and sequence (vectorized problem.key_range)
# --------------------------------------------------------------------------------------------
def _seen_columns(q_lo, q_hi, len_q, len_k, left, right):
    """Per (row block, sequence): the half-open key interval ``[lo, hi)`` that some row of
    ``[q_lo, q_hi)`` sees (empty: ``hi <= lo``), and the interval ``[a, b)`` that every row sees.

    ``q_lo``/``q_hi``: ``(n, 1)``; ``len_q``/``len_k``: ``(B,)``. The union is
    :func:`cuflash.problem.key_range` for one sequence, vectorized (``tests/test_tiling.py``
    holds the two equal).
    """
    off = len_k - len_q
    rows_hi = np.minimum(q_hi, len_q)                       # rows past a sequence's length see nothing
    live = rows_hi > q_lo
    if left is not None and right is not None and left + right < 0:  # an empty band (a ring's pair window may be
        live = np.zeros_like(live)  # negative on either side): no row sees a key, though the rows' union would span
    lo = np.zeros(np.broadcast(q_lo, len_k).shape, dtype=np.int64) if left is None \
        else np.maximum(q_lo + off - left, 0)
    hi = np.broadcast_to(len_k, lo.shape) if right is None else np.minimum(rows_hi - 1 + off + right + 1, len_k)
    hi = np.where(live, hi, lo)
    # every row of the block sees [a, b): the last row's left edge, the first row's right edge
    every = q_hi <= len_q
    a = np.zeros_like(lo) if left is None else np.maximum(q_hi - 1 + off - left, 0)
    b = np.broadcast_to(len_k, a.shape) if right is None else np.minimum(q_lo + off + right + 1, len_k)
    b = np.where(every, b, a)
    return lo, hi, a, b


def _union_length(lo, hi):
    """Total length of the union of intervals ``[lo, hi)`` along the last axis (empty ones allowed)."""
    hi = np.where(hi > lo, hi, lo)
    order = np.argsort(lo, axis=-1, kind="stable")
    lo, hi = np.take_along_axis(lo, order, -1), np.take_along_axis(hi, order, -1)
    reach = np.maximum.accumulate(hi, axis=-1)
    before = np.concatenate([np.full(lo.shape[:-1] + (1,), np.iinfo(np.int64).min), reach[..., :-1]], axis=-1)
    return np.maximum(hi - np.maximum(lo, before), 0).sum(axis=-1)


# --------------------------------------------------------------------------------------------
# BlockMask grids at tile granularity
# --------------------------------------------------------------------------------------------
def classify_grid(grid, block, block_q: int, block_k: int, seqlen_q: int, seqlen_k: int):
    """Classify a BlockMask grid ``(Bm, Hm, nqb, nkb)`` into tiles of ``block_q x block_k``.

    Returns ``(kept, full)``, boolean ``(Bm, Hm, n_q_tiles, n_k_tiles)``: ``kept`` when some mask
    block that the tile overlaps (inside the sequence) is kept, ``full`` when all of them are.
    Vectorized by a 2-D prefix sum: no Python loop over tiles, any tile size.
    """
    grid = np.asarray(grid, dtype=bool)
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise ValueError(f"block must be a pair (rows, columns) of ints >= 1, got {block!r}")
    # a 0-row mask block would divide by zero (NumPy warns and every tile comes out kept)
    bq, bk = check_int(block[0], "block rows", 1), check_int(block[1], "block columns", 1)
    block_q, block_k = check_int(block_q, "block_q", 1), check_int(block_k, "block_k", 1)
    seqlen_q, seqlen_k = check_int(seqlen_q, "seqlen_q"), check_int(seqlen_k, "seqlen_k")
    want = (cdiv(seqlen_q, bq), cdiv(seqlen_k, bk))
    if grid.ndim != 4 or grid.shape[2:] != want:  # a smaller grid would be indexed past its end
        raise ValueError(f"grid must have shape (batch|1, heads|1, {want[0]}, {want[1]}) for blocks of {bq} x {bk} "
                         f"over seqlen_q={seqlen_q}, seqlen_k={seqlen_k}, got {grid.shape}")
    n_q, n_k = cdiv(seqlen_q, block_q), cdiv(seqlen_k, block_k)
    m, n = np.arange(n_q), np.arange(n_k)
    r_lo, r_hi = (m * block_q) // bq, (np.minimum((m + 1) * block_q, seqlen_q) - 1) // bq + 1
    c_lo, c_hi = (n * block_k) // bk, (np.minimum((n + 1) * block_k, seqlen_k) - 1) // bk + 1
    # counts up to the grid's size: int32 where it fits (half the memory and time of int64 at N = 1M: 1.6 GiB)
    dt = np.int32 if grid.shape[2] * grid.shape[3] < 2 ** 31 else np.int64
    pre = np.zeros(grid.shape[:2] + (grid.shape[2] + 1, grid.shape[3] + 1), dtype=dt)
    np.cumsum(grid, axis=2, dtype=dt, out=pre[:, :, 1:, 1:])
    np.cumsum(pre[:, :, 1:, 1:], axis=3, out=pre[:, :, 1:, 1:])
    rl, rh, cl, ch = r_lo[:, None], r_hi[:, None], c_lo[None, :], c_hi[None, :]
    count = pre[:, :, rh, ch]
    count -= pre[:, :, rl, ch]
    count -= pre[:, :, rh, cl]
    count += pre[:, :, rl, cl]
    return count > 0, count == (rh - rl) * (ch - cl)


# --------------------------------------------------------------------------------------------
# The schedule
# --------------------------------------------------------------------------------------------
class Schedule:
    """The tiles of ``block_q x block_k`` that a blocked kernel visits for one problem.

    Build it from a :class:`~cuflash.problem.Problem` (:meth:`for_problem`) or from the rule's
    parameters directly. Per query tile ``i`` it keeps ``lo[i], hi[i]`` (the key tiles some
    sequence sees, a hull) and ``full_lo[i], full_hi[i]`` (the key tiles every element of which
    is visible in every sequence); everything else is derived lazily.
    """

    def __init__(self, seqlen_q: int, seqlen_k: int, block_q: int, block_k: int, *, len_q=None, len_k=None,
                 left: Optional[int] = None, right: Optional[int] = None, block_mask=None):
        # checked once here: the per-tile methods trust these (a negative length gave an empty grid, a float tile
        # was truncated, a negative window or a length past the padded one a wrong schedule)
        self.seqlen_q, self.seqlen_k = check_int(seqlen_q, "seqlen_q"), check_int(seqlen_k, "seqlen_k")
        self.block_q, self.block_k = check_int(block_q, "block_q", 1), check_int(block_k, "block_k", 1)
        # any int: ring attention's pair windows are the global band seen from a pair, shifted, and may be negative
        left = None if left is None else check_int(left, "left", None)
        right = None if right is None else check_int(right, "right", None)
        self.left, self.right, self.block_mask = left, right, block_mask
        lq, lk = _lengths_arg(len_q, "len_q", self.seqlen_q), _lengths_arg(len_k, "len_k", self.seqlen_k)
        if lq is not None and lk is not None and lq.shape != lk.shape:
            raise ValueError(f"len_q and len_k must have one length per sequence each, got shapes {lq.shape} and "
                             f"{lk.shape}")
        # one side given: the other is the full length for each of its sequences
        shape = (lq if lq is not None else lk if lk is not None else np.zeros(1)).shape
        self.len_q = np.full(shape, self.seqlen_q, dtype=np.int64) if lq is None else lq
        self.len_k = np.full(shape, self.seqlen_k, dtype=np.int64) if lk is None else lk
        self.n_q, self.n_k = cdiv(self.seqlen_q, self.block_q), cdiv(self.seqlen_k, self.block_k)
        if self.len_q.size == 0:  # no sequence at all: nothing to visit
            self.len_q = self.len_k = np.zeros(1, dtype=np.int64)
        i0 = np.arange(self.n_q, dtype=np.int64)[:, None] * self.block_q
        lo, hi, a, b = _seen_columns(i0, np.minimum(i0 + self.block_q, self.seqlen_q),
                                     self.len_q, self.len_k, left, right)
        live = hi > lo
        bk = self.block_k
        # hull of the key tiles some sequence sees
        self.lo = np.where(live, lo, np.iinfo(np.int64).max).min(axis=1) // bk
        self.hi = cdiv(np.where(live, hi, 0).max(axis=1), bk)
        self.hi = np.maximum(self.hi, np.minimum(self.lo, self.n_k))
        self.lo = np.minimum(self.lo, self.hi)
        # key tiles inside [a, b) in every sequence: k0 >= a and k1 <= b (k1 clipped to seqlen_k)
        f_lo = cdiv(a.max(axis=1), bk)
        b_min = b.min(axis=1)
        f_hi = np.where(b_min >= self.seqlen_k, self.n_k, b_min // bk)
        ok = (b > a).all(axis=1) & (f_hi > f_lo)
        self.full_lo = np.where(ok, f_lo, 0)
        self.full_hi = np.where(ok, f_hi, 0)
        self._seq_lo, self._seq_hi = lo, hi  # (n_q, B): kept only while small (see _seq_intervals)
        if lo.size > 4 * self.n_q:
            self._seq_lo = self._seq_hi = None
        self._grid = None
        if block_mask is not None:
            kept, full = mask_tiles(block_mask, self.block_q, self.block_k)
            self._grid = (kept.any(axis=(0, 1)), full.all(axis=(0, 1)))

    @classmethod
    def for_problem(cls, problem, block_q: int, block_k: int) -> "Schedule":
        len_q, len_k = problem.lengths
        return cls(problem.seqlen_q, problem.seqlen_k, block_q, block_k, len_q=len_q, len_k=len_k,
                   left=problem.window_left, right=problem.window_right, block_mask=problem.block_mask)

    # ---------------------------------------------------------------- per tile
    def _extent(self, i, t):
        i0, k0 = i * self.block_q, t * self.block_k
        return i0, min(i0 + self.block_q, self.seqlen_q), k0, min(k0 + self.block_k, self.seqlen_k)

    def _seq_intervals(self, rows):
        """Per query tile in ``rows`` and sequence: the key interval ``[lo, hi)`` some row sees."""
        if self._seq_lo is not None:
            return self._seq_lo[rows], self._seq_hi[rows]
        i0 = np.asarray(rows, dtype=np.int64)[:, None] * self.block_q
        lo, hi, _, _ = _seen_columns(i0, np.minimum(i0 + self.block_q, self.seqlen_q),
                                     self.len_q, self.len_k, self.left, self.right)
        return lo, hi

    def _kept(self, rows, ts):
        """Whether some sequence sees an element of tile ``(rows[n], ts[n])`` (pairs inside the hull)."""
        rows, ts = np.asarray(rows), np.asarray(ts)
        if len(self.len_q) == 1 or rows.size == 0:
            return np.ones(rows.shape, dtype=bool)  # one sequence: the hull is exact
        lo, hi = self._seq_intervals(rows)
        k0 = ts[:, None] * self.block_k
        k1 = np.minimum(k0 + self.block_k, self.seqlen_k)
        return ((k0 < hi) & (k1 > lo) & (hi > lo)).any(axis=1)

    def row_tiles(self, i: int):
        """Key tile indices of query tile ``i`` and whether each is full: two arrays."""
        ts = np.arange(self.lo[i], self.hi[i])
        full = (ts >= self.full_lo[i]) & (ts < self.full_hi[i])
        if len(self.len_q) == 1 and self._grid is None:  # one sequence, no BlockMask: the hull is exact
            return ts, full
        kept = full.copy()
        kept[~full] = self._kept(np.full(int((~full).sum()), i), ts[~full])
        if self._grid is not None:
            g_kept, g_full = self._grid
            kept &= g_kept[i, ts]
            full &= g_full[i, ts]
        return ts[kept], full[kept]

    def row(self, i: int) -> Iterator[Tile]:
        """The tiles of query tile ``i``, in key order (FA2's forward inner loop)."""
        return self._tiles(i, *self.row_tiles(i), by_row=True)

    def _tiles(self, n: int, ts, full, by_row: bool) -> Iterator[Tile]:
        for t, f in zip(ts.tolist(), full.tolist()):
            yield Tile(*(self._extent(n, t) if by_row else self._extent(t, n)), f)

    def rows(self) -> Iterator[tuple[int, Iterator[Tile]]]:
        """``(i, tiles)`` for every query tile that visits at least one key tile (the hull's rows hold some that a
        BlockMask or every sequence's length drops whole)."""
        for i in np.nonzero(self.hi > self.lo)[0].tolist():
            ts, full = self.row_tiles(i)
            if ts.size:
                yield i, self._tiles(i, ts, full, by_row=True)

    def column_tiles(self, t: int):
        """Query tile indices that visit key tile ``t`` and whether each tile is full."""
        rows = np.nonzero((self.lo <= t) & (t < self.hi))[0]
        full = (self.full_lo[rows] <= t) & (t < self.full_hi[rows])
        kept = full.copy()
        kept[~full] = self._kept(rows[~full], np.full(int((~full).sum()), t))
        if self._grid is not None:
            g_kept, g_full = self._grid
            kept &= g_kept[rows, t]
            full &= g_full[rows, t]
        return rows[kept], full[kept]

    def column(self, t: int) -> Iterator[Tile]:
        """The tiles of key tile ``t``, in query order (FA2's backward inner loop)."""
        return self._tiles(t, *self.column_tiles(t), by_row=False)

    def columns(self) -> Iterator[tuple[int, Iterator[Tile]]]:
        """``(t, tiles)`` for every key tile that some query tile visits."""
        for t in range(self.n_k):
            if ((self.lo <= t) & (t < self.hi)).any():
                rows, full = self.column_tiles(t)
                if rows.size:
                    yield t, self._tiles(t, rows, full, by_row=False)

    # ---------------------------------------------------------------- totals
    def counts(self) -> tuple[int, int]:
        """``(visited, full)`` numbers of tiles, computed from the ranges (no loop over tiles).

        With a BlockMask the tile grid is classified once, O(n_q · n_k) booleans: the mask's own
        grid is of that size already.
        """
        if self._grid is not None:
            kept, full = self.kept_grid(), self.full_grid()
            return int(kept.sum()), int(full.sum())
        full = int(np.maximum(self.full_hi - self.full_lo, 0).sum())
        if len(self.len_q) == 1:
            return int((self.hi - self.lo).sum()), full
        # several sequences: the union of their tile intervals, per query tile
        i0 = np.arange(self.n_q, dtype=np.int64)[:, None] * self.block_q
        lo, hi, _, _ = _seen_columns(i0, np.minimum(i0 + self.block_q, self.seqlen_q),
                                     self.len_q, self.len_k, self.left, self.right)
        t_lo = lo // self.block_k
        t_hi = np.where(hi > lo, cdiv(hi, self.block_k), t_lo)
        return int(_union_length(t_lo, t_hi).sum()), full

    def row_ranges(self):
        """``(lo, hi)``: per query tile, the half-open range of key tiles visited (without a
        BlockMask and with one sequence, exactly the visited tiles)."""
        return self.lo.copy(), self.hi.copy()

    def _band_grid(self, lo_attr, hi_attr):
        t = np.arange(self.n_k)
        return (t >= getattr(self, lo_attr)[:, None]) & (t < getattr(self, hi_attr)[:, None])

    def kept_grid(self):
        """Boolean ``(n_q, n_k)`` of visited tiles (dense: for BlockMask construction, the IO model
        and kernels' tile lists; O(n_q · n_k))."""
        if len(self.len_q) == 1:
            keep = self._band_grid("lo", "hi")
            return keep if self._grid is None else keep & self._grid[0]
        keep = np.zeros((self.n_q, self.n_k), dtype=bool)
        for i in range(self.n_q):
            keep[i, self.row_tiles(i)[0]] = True
        return keep

    def full_grid(self):
        """Boolean ``(n_q, n_k)`` of full tiles (see the module docstring)."""
        full = self._band_grid("full_lo", "full_hi")
        if self._grid is not None:
            full &= self._grid[1]
        return full

    # ---------------------------------------------------------------- element masks
    def element_mask(self, tile: Tile, batch=None, heads=None, dtype=None):
        """Boolean ``(B|len(batch), Hm|1, i1-i0, k1-k0)`` visibility inside a tile.

        ``batch``: indices of the sequences wanted (default all); ``heads``: indices of the query
        heads wanted, used only when the BlockMask has one grid per head; ``dtype``: the working precision of the
        BlockMask rule's floats (:meth:`BlockMask.keep`).
        """
        i = np.arange(tile.i0, tile.i1)[None, None, :, None]
        j = np.arange(tile.k0, tile.k1)[None, None, None, :]
        len_q, len_k = self.len_q, self.len_k
        if batch is not None and len(len_q) > 1:
            len_q, len_k = len_q[batch], len_k[batch]
        keep = visible(i, j, len_q[:, None, None, None], len_k[:, None, None, None], self.left, self.right)
        bm = self.block_mask
        if bm is not None:  # the mask's own element test (its grid, and its rule inside partial blocks)
            gb, gh = bm.states.shape[:2]
            b = (np.arange(gb) if batch is None or gb == 1 else np.asarray(batch))[:, None, None, None]
            h = (np.arange(gh) if heads is None or gh == 1 else np.asarray(heads))[None, :, None, None]
            keep = keep & bm._keep(b, h, i, j, dtype)  # the tile's own indices: in the mask
        return keep


def mask_tiles(block_mask, block_q: int, block_k: int):
    """A BlockMask at tile granularity: ``(kept, full)`` boolean ``(Bm, Hm, n_q_tiles, n_k_tiles)``, a tile kept when
    some mask block it overlaps is not skipped, full when every one of them is full."""
    def make():
        args = (block_mask.block, block_q, block_k, block_mask.seqlen_q, block_mask.seqlen_k)
        kept, full = classify_grid(block_mask.grid, *args)[0], classify_grid(block_mask.full, *args)[1]
        kept.flags.writeable = full.flags.writeable = False  # shared by every call with this mask
        return kept, full

    # once per mask and tile size (BlockMask.derived): every call classified the whole grid again, 4 s at N = 1M
    return block_mask.derived(("mask tiles", block_q, block_k), make)


def band_grid(seqlen_q: int, seqlen_k: int, block_q: int, block_k: int, left=None, right=None):
    """Boolean ``(n_q, n_k)``: tiles of one sequence that contain an element visible under the
    ``(left, right)`` band (all True without one). ``BlockMask.causal``/``sliding_window`` and the
    IO model use it."""
    return Schedule(seqlen_q, seqlen_k, block_q, block_k, left=left, right=right).kept_grid()


#: most key-range splits of a split-KV forward (the combine reads every split's partial row)
MAX_KV_SPLITS = 16


def kv_splits(sm_count: int, blocks: int, key_tiles: int) -> int:
    """``num_splits=None`` of the KV-cache forward on the CUDA kernels (flash-decoding), the one place it is chosen.

    ``blocks``: thread blocks of the unsplit grid (query tiles x heads x batch); ``key_tiles``: key tiles of the
    longest sequence. A grid that already gives every SM a block gains nothing from splitting, and a split's fixed
    costs (its Q tile load, the partial written in float32 and read back by the combine) want at least 2 key tiles
    to work on, so: enough splits to put about one block on each SM, at most one per 2 key tiles and at most
    :data:`MAX_KV_SPLITS`; 1 when the grid is already that large.
    """
    # O(1) checks (called once per KV-cache call): blocks=0 divided by zero
    for name, value, low in (("sm_count", sm_count, 1), ("blocks", blocks, 1), ("key_tiles", key_tiles, 0)):
        check_int(value, name, low)
    if blocks >= sm_count or key_tiles < 4:
        return 1
    return max(1, min(cdiv(sm_count, blocks), key_tiles // 2, MAX_KV_SPLITS))
