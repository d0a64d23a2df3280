"""The block plan: which (query tile, key tile) pairs a blocked backend visits, and how each is masked.

Causal, window, seqlens and the BlockMask all reduce here to one list of tiles, each marked
``full`` (every element visible in every sequence: no element mask at all) or ``partial``
(an element mask is built when the tile is processed). Tiles that no sequence can see are never
listed, so work is proportional to the visible area. The plan is built once per call and reused
by the forward (grouped by query tile) and the backward (grouped by key tile).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .problem import Problem, key_range, visible


@dataclass(frozen=True)
class Tile:
    i0: int
    i1: int
    k0: int
    k1: int
    full: bool


class Plan:
    """Tiles of ``block_q x block_k`` covering the visible part of a problem."""

    def __init__(self, problem: Problem, block_q: int, block_k: int):
        bm = problem.block_mask
        if bm is not None:
            # Tiles are whole multiples of the mask's blocks, so each tile reads an exact sub-grid.
            block_q = max(bm.block[0], block_q // bm.block[0] * bm.block[0])
            block_k = max(bm.block[1], block_k // bm.block[1] * bm.block[1])
        self.problem, self.block_q, self.block_k = problem, block_q, block_k
        self.len_q, self.len_k = problem.lengths
        self.tiles = [t for i0 in range(0, problem.seqlen_q, block_q)
                      for t in self._row(i0, min(i0 + block_q, problem.seqlen_q))]

    def _row(self, i0, i1):
        p = self.problem
        lo, hi = key_range(i0, i1, self.len_q, self.len_k, p.window_left, p.window_right)
        for k0 in range(lo // self.block_k * self.block_k, hi, self.block_k):
            k1 = min(k0 + self.block_k, p.seqlen_k)
            kept = self._grid(i0, i1, k0, k1)
            if kept is not None and not kept.any():
                continue
            full = self._corners_visible(i0, i1, k0, k1) and (kept is None or kept.all())
            yield Tile(i0, i1, k0, k1, full)

    def _corners_visible(self, i0, i1, k0, k1) -> bool:
        # The visible set of one sequence is an intersection of half-planes in (i, j), hence
        # convex: a rectangle lies inside it iff its four corners do.
        p = self.problem
        i = np.array([i0, i0, i1 - 1, i1 - 1])[None, :]
        j = np.array([k0, k1 - 1, k0, k1 - 1])[None, :]
        return bool(visible(i, j, self.len_q[:, None], self.len_k[:, None],
                            p.window_left, p.window_right).all())

    def _grid(self, i0, i1, k0, k1):
        bm = self.problem.block_mask
        if bm is None:
            return None
        (bq, bk), cdiv = bm.block, lambda a, b: -(-a // b)
        return bm.grid[:, :, i0 // bq:cdiv(i1, bq), k0 // bk:cdiv(k1, bk)]

    def element_mask(self, t: Tile):
        """Boolean ``(B, Hq|1, i1-i0, k1-k0)`` visibility inside a partial tile."""
        p = self.problem
        i = np.arange(t.i0, t.i1)[None, None, :, None]
        j = np.arange(t.k0, t.k1)[None, None, None, :]
        keep = visible(i, j, self.len_q[:, None, None, None], self.len_k[:, None, None, None],
                       p.window_left, p.window_right)
        grid = self._grid(t.i0, t.i1, t.k0, t.k1)
        if grid is not None:
            bq, bk = p.block_mask.block
            rows = (np.arange(t.i0, t.i1) // bq) - t.i0 // bq
            cols = (np.arange(t.k0, t.k1) // bk) - t.k0 // bk
            keep = keep & grid[:, :, rows][:, :, :, cols]
        return keep

    def by_query(self):
        """Tiles grouped by query tile, in order: the forward's outer loop."""
        return _group(self.tiles, lambda t: t.i0)

    def by_key(self):
        """Tiles grouped by key tile: the backward's outer loop (FA2 Algorithm 2)."""
        return _group(sorted(self.tiles, key=lambda t: (t.k0, t.i0)), lambda t: t.k0)


def _group(tiles, key):
    groups: dict[int, list[Tile]] = {}
    for t in tiles:
        groups.setdefault(key(t), []).append(t)
    return list(groups.values())
