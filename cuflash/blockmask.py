"""Block-sparse masks (FlashAttention, Algorithm 5): a boolean grid of (query block, key block).

A False block is never computed: its scores count as -inf. The grid has shape
``(batch|1, heads|1, ceil(Sq/block_q), ceil(Sk/block_k))`` where ``batch`` is the product of the
batch dimensions. Kernels consume it as sorted int32 lists of kept key blocks per query block
(:meth:`BlockMask.kv_lists`) and, for the backward, kept query blocks per key block
(:meth:`BlockMask.q_lists`).
"""
from __future__ import annotations

import numpy as np


DEFAULT_BLOCK = (128, 128)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_block(block):
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"block must be a pair (block_q, block_k) of positive ints, got {block!r}")
    return int(block[0]), int(block[1])


class BlockMask:
    """A boolean grid over (query block, key block) pairs; False blocks are skipped.

    Parameters
    ----------
    grid : array_like of bool, shape ``(nq, nk)``, ``(heads|1, nq, nk)`` or ``(batch|1, heads|1, nq, nk)``
        ``grid[b, h, i, j]`` keeps query block ``i`` with key block ``j`` for sequence ``b``, head ``h``.
    block : (int, int)
        Rows per query block and columns per key block.
    seqlen_q, seqlen_k : int, optional
        The sequence lengths the grid was built for (used by :meth:`to_dense`); default
        ``nq * block_q`` and ``nk * block_k``.
    """

    def __init__(self, grid, *, block=DEFAULT_BLOCK, seqlen_q=None, seqlen_k=None):
        grid = np.asarray(grid)
        if grid.dtype != np.bool_:
            raise TypeError(f"grid must be a boolean array, got dtype {grid.dtype}")
        grid = grid.copy()  # the mask is a value: later changes to the caller's array must not leak in
        if not 2 <= grid.ndim <= 4:
            raise ValueError(f"grid must have shape (batch|1, heads|1, n_q_blocks, n_k_blocks), got {grid.shape}")
        self.grid = grid.reshape((1,) * (4 - grid.ndim) + grid.shape)
        self.grid.setflags(write=False)
        self.block = _check_block(block)
        nq, nk = self.grid.shape[2:]
        self.seqlen_q = nq * self.block[0] if seqlen_q is None else int(seqlen_q)
        self.seqlen_k = nk * self.block[1] if seqlen_k is None else int(seqlen_k)
        if _cdiv(self.seqlen_q, self.block[0]) != nq or _cdiv(self.seqlen_k, self.block[1]) != nk:
            raise ValueError(f"grid {self.grid.shape[2:]} does not cover seqlen_q={self.seqlen_q}, "
                             f"seqlen_k={self.seqlen_k} in blocks of {self.block}")

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_grid(cls, grid, *, block=DEFAULT_BLOCK, seqlen_q=None, seqlen_k=None):
        """Wrap an explicit boolean grid (see the class docstring for its shape)."""
        return cls(grid, block=block, seqlen_q=seqlen_q, seqlen_k=seqlen_k)

    @classmethod
    def from_dense(cls, mask, *, block=DEFAULT_BLOCK):
        """Coarsen an element mask ``(..., Sq, Sk)``: a block is kept if ANY of its elements is True.

        Pass the same dense mask's element rule to the kernel only through ``causal``/``window``:
        a BlockMask keeps whole blocks, so a partially True block attends to all its elements.
        """
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or not 2 <= mask.ndim <= 4:
            raise ValueError(f"mask must be a boolean array (batch|1, heads|1, Sq, Sk), got {mask.dtype} {mask.shape}")
        bq, bk = _check_block(block)
        sq, sk = mask.shape[-2:]
        nq, nk = _cdiv(sq, bq), _cdiv(sk, bk)
        padded = np.zeros(mask.shape[:-2] + (nq * bq, nk * bk), dtype=bool)
        padded[..., :sq, :sk] = mask
        grid = padded.reshape(mask.shape[:-2] + (nq, bq, nk, bk)).any(axis=(-3, -1))
        return cls(grid, block=(bq, bk), seqlen_q=sq, seqlen_k=sk)

    @classmethod
    def _from_rule(cls, seqlen_q, seqlen_k, block, left, right):
        """Blocks that contain at least one element visible under the (left, right) diagonal band."""
        from .tiling import band_grid  # tiling imports this module

        bq, bk = _check_block(block)
        keep = band_grid(seqlen_q, seqlen_k, bq, bk, left, right)
        return cls(keep, block=(bq, bk), seqlen_q=seqlen_q, seqlen_k=seqlen_k)

    @classmethod
    def causal(cls, seqlen_q, seqlen_k=None, *, block=DEFAULT_BLOCK):
        """Blocks on or below the bottom-right aligned causal diagonal."""
        return cls._from_rule(seqlen_q, seqlen_q if seqlen_k is None else seqlen_k, block, None, 0)

    @classmethod
    def sliding_window(cls, seqlen_q, seqlen_k=None, *, window, block=DEFAULT_BLOCK):
        """Blocks that meet the band ``window=(left, right)`` (elements, ``None`` unbounded)."""
        left, right = window
        return cls._from_rule(seqlen_q, seqlen_q if seqlen_k is None else seqlen_k, block, left, right)

    @classmethod
    def global_local(cls, seqlen_q, seqlen_k=None, *, global_blocks=1, local_blocks=1, block=DEFAULT_BLOCK):
        """BigBird/Longformer style: the first ``global_blocks`` query rows and key columns are
        dense, and every query block sees key blocks within ``local_blocks`` of its diagonal."""
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        bq, bk = _check_block(block)
        nq, nk = _cdiv(seqlen_q, bq), _cdiv(seqlen_k, bk)
        qi, kj = np.arange(nq)[:, None], np.arange(nk)[None, :]
        keep = (np.abs(qi - kj) <= local_blocks) | (qi < global_blocks) | (kj < global_blocks)
        return cls(keep, block=(bq, bk), seqlen_q=seqlen_q, seqlen_k=seqlen_k)

    @classmethod
    def strided(cls, seqlen_q, seqlen_k=None, *, stride, local_blocks=0, block=DEFAULT_BLOCK):
        """Sparse-Transformer style: query block ``i`` sees key block ``j`` when
        ``i % stride == j % stride``, plus the band ``|i - j| <= local_blocks``."""
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        bq, bk = _check_block(block)
        nq, nk = _cdiv(seqlen_q, bq), _cdiv(seqlen_k, bk)
        qi, kj = np.arange(nq)[:, None], np.arange(nk)[None, :]
        keep = (qi % stride == kj % stride) | (np.abs(qi - kj) <= local_blocks)
        return cls(keep, block=(bq, bk), seqlen_q=seqlen_q, seqlen_k=seqlen_k)

    # ---------------------------------------------------------------- properties
    @property
    def shape(self):
        return self.grid.shape

    @property
    def density(self) -> float:
        """Fraction of kept blocks (the seed's sparsity s)."""
        return float(self.grid.mean()) if self.grid.size else 0.0

    def to_dense(self, seqlen_q=None, seqlen_k=None):
        """Element mask ``(batch|1, heads|1, Sq, Sk)`` that this grid keeps."""
        sq = self.seqlen_q if seqlen_q is None else seqlen_q
        sk = self.seqlen_k if seqlen_k is None else seqlen_k
        bq, bk = self.block
        return self.grid[:, :, np.arange(sq) // bq][:, :, :, np.arange(sk) // bk]

    def check_fits(self, batch, heads, seqlen_q, seqlen_k):
        """Raise ``ValueError`` unless this grid matches a problem of the given sizes."""
        b, h, nq, nk = self.grid.shape
        want = (_cdiv(seqlen_q, self.block[0]), _cdiv(seqlen_k, self.block[1]))
        if (nq, nk) != want:
            raise ValueError(f"block_mask grid has {nq}x{nk} blocks of {self.block}, but seqlen_q={seqlen_q}, "
                             f"seqlen_k={seqlen_k} need {want[0]}x{want[1]}")
        if b not in (1, batch) or h not in (1, heads):
            raise ValueError(f"block_mask grid leading dims must be (1 or batch={batch}, 1 or heads={heads}), "
                             f"got ({b}, {h})")

    def refine(self, block_q: int, block_k: int) -> "BlockMask":
        """The same mask on a finer grid; the current blocks must be multiples of the new ones."""
        bq, bk = self.block
        if bq % block_q or bk % block_k:
            raise ValueError(f"block_mask blocks {self.block} must be multiples of ({block_q}, {block_k})")
        nq, nk = _cdiv(self.seqlen_q, block_q), _cdiv(self.seqlen_k, block_k)
        grid = self.grid[:, :, (np.arange(nq) * block_q) // bq][:, :, :, (np.arange(nk) * block_k) // bk]
        return BlockMask(grid, block=(block_q, block_k), seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k)

    def kv_lists(self):
        """Per query block, the sorted kept key blocks: ``counts (B|1, H|1, nq)``,
        ``indices (B|1, H|1, nq, nk)`` int32 (entries past ``counts`` are padding)."""
        return _lists(self.grid)

    def q_lists(self):
        """Per key block, the sorted kept query blocks (the backward's transposed lists)."""
        return _lists(self.grid.transpose(0, 1, 3, 2))

    # ---------------------------------------------------------------- display
    def __repr__(self):
        b, h, nq, nk = self.grid.shape
        head = (f"BlockMask(shape={self.grid.shape}, block={self.block}, seqlen_q={self.seqlen_q}, "
                f"seqlen_k={self.seqlen_k}, density={self.density:.3f})")
        if nq > 32 or nk > 32:
            return head
        rows = ["".join("█" if x else "·" for x in row) for row in self.grid[0, 0]]
        note = "" if b == h == 1 else "  (batch 0, head 0)"
        return head + note + "\n" + "\n".join("  " + r for r in rows)


def _lists(grid):
    # A stable argsort of "not kept" puts kept block indices first, in increasing order.
    order = np.argsort(~grid, axis=-1, kind="stable").astype(np.int32)
    counts = grid.sum(axis=-1).astype(np.int32)
    return counts, order
