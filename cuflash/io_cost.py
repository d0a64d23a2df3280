"""HBM bytes moved by standard attention and by the tiled (FlashAttention) kernel.

The FlashAttention paper's byte ledger, line by line, with the real tile sizes instead of the
asymptotic ``B_c = M/4d``:

* standard attention (Algorithm 0) writes ``S`` and ``P`` to memory and reads them back:
  ``4·N·d + 4·N²`` elements per head for ``Sq = Sk = N`` (one more ``2·N²`` when a mask is
  applied as its own pass); its backward (Algorithm 3) reads ``P``, ``dP``, ``dS`` again;
* the tiled kernel never writes ``S`` or ``P``: FA2's loop order (a thread block per query tile,
  key/value tiles streamed through on-chip memory, which is what ``kernels/flash_fwd.cu`` does)
  reads ``Q`` once, ``K``/``V`` once per query tile that visits them, and writes ``O`` and the
  log-sum-exp once. Algorithm 1's order (``order="fa1"``: key tiles outer, query tiles inner)
  is the one Theorem 2 counts: ``T_c·(2·B_c·d + T_r·(3·B_r·d + 4·B_r))`` elements, i.e.
  ``Θ(N²d²/M)`` when the tiles are sized from the on-chip memory ``M``;
* a block-sparse mask (Proposition 4) or a causal/window band removes whole tile pairs from the
  tiled ledger, so its ``N²`` terms scale with the visited fraction; standard attention still
  materializes every score.

Byte sizes: ``Q, K, V, O, S, P`` (and ``dO, dQ, dK, dV, dP, dS``) in the input dtype; softmax
statistics (``m, ℓ``, ``lse``, ``D``) and the backward's ``dQ`` accumulator in float32 (float64
for float64 inputs). Counts are per (batch, query head) and summed over all of them; grouped K/V
heads are counted once per query head (each query head's thread blocks read them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .problem import check_int
from .tiling import Schedule, classify_grid

OPS = ("fwd", "bwd", "fwd_bwd")
ORDERS = ("fa2", "fa1")


@dataclass(frozen=True)
class IOCost:
    """HBM traffic of one attention call, in bytes.

    ``standard`` and ``tiled`` are totals; the ledgers map each line of the seeds' tables
    (``"write S"``, ``"read K, V per visited tile"``, ...) to its bytes. ``tiles`` gives, per tiled
    kernel (``"fwd"``, ``"bwd"``), the ``(block_q, block_k)`` its ledger used, and ``visited`` the
    ``(visited, total)`` numbers of (query tile, key tile) pairs over all batches and heads.
    """

    #: unhashable, as its dict fields are (frozen made a hash of the fields that raised "unhashable type: 'dict'")
    __hash__ = None  # type: ignore[assignment]

    op: str
    standard: int
    tiled: int
    tiles: dict = field(default_factory=dict)
    visited: dict = field(default_factory=dict)
    standard_ledger: dict = field(default_factory=dict)
    tiled_ledger: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """How many times more bytes standard attention moves than the tiled kernel (1 for an empty problem, where
        neither moves any)."""
        if not self.tiled:
            return 1.0 if not self.standard else math.inf
        return self.standard / self.tiled

    def __str__(self):
        tiles = ", ".join(f"{k} tiles {bq}x{bk}, {self.visited[k][0]}/{self.visited[k][1]} visited"
                          for k, (bq, bk) in self.tiles.items())
        lines = [f"io_cost({self.op}): standard {self.standard / 1e6:,.1f} MB, tiled {self.tiled / 1e6:,.1f} MB "
                 f"({self.ratio:.1f}x less; {tiles})"]
        for title, ledger in (("standard", self.standard_ledger), ("tiled", self.tiled_ledger)):
            lines += [f"  {title:8s} {name:56s} {b / 1e6:>14,.1f} MB" for name, b in ledger.items()]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Sizes:
    """Element sizes in bytes: ``x`` for tensors in the input dtype, ``f`` for statistics."""

    x: int
    f: int


def _sizes(dtype) -> _Sizes:
    want = f"dtype must be float16, bfloat16, float32 or float64, got {dtype!r}"
    if dtype is None:  # np.dtype(None) is float64
        raise ValueError(want)
    try:
        name = "bfloat16" if str(dtype) in ("bfloat16", "bf16") else np.dtype(dtype).name
    except (TypeError, ValueError):  # NumPy's own "data type 'foo' not understood" does not say which argument
        raise ValueError(want) from None
    if name not in ("float16", "bfloat16", "float32", "float64"):
        raise ValueError(want)
    item = 2 if name == "bfloat16" else np.dtype(name).itemsize
    return _Sizes(item, 8 if name == "float64" else 4)


def default_tiles(head_dim: int, op: str = "fwd", cc: int = 80) -> tuple[int, int]:
    """``(query rows, keys)`` per tile of the CUDA kernel for ``head_dim`` on a GPU of compute capability
    ``cc``: the forward's ``(block_m, block_n)`` from THE tile table, or the backward main kernel's (a thread
    block owns ``block_n`` keys and visits query tiles of ``block_m`` rows)."""
    from .cuda import specs

    cc = _check_cc(cc)
    spec = specs.select("fwd" if op == "fwd" else "bwd", "float16", head_dim, specs.SMEM_LIMIT[cc], cc=cc)
    return spec.block_m, spec.block_n


# --------------------------------------------------------------------------------------------
# Which tile pairs the kernel visits
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Visits:
    """Totals over the visited (query tile, key tile) pairs of all (batch, head) pairs (expected values under a
    ``density``): what the tiled ledgers need, without keeping the ``(nq, nk)`` grid."""

    pairs: float       # visited pairs
    total: int         # all pairs
    pairs_rows: float  # Σ over visited pairs of the query tile's height
    pairs_cols: float  # Σ over visited pairs of the key tile's width
    kv_seen: float     # key rows of the key tiles some query tile visits (a key tile no query sees is never loaded)
    rows_unseen: float = 0.0  # query rows of the query tiles that visit no key tile (no keys, a window past them)


def _band_visits(lo, hi, rows, cols, n_bh: int, density: Optional[float]) -> _Visits:
    """:class:`_Visits` of a band: query tile ``i`` visits key tiles ``[lo[i], hi[i])`` in every (batch, head).

    O(nq + nk) from the schedule's ranges (a dense grid took 2 GB at 1M tokens): the sums are the grid's, exact in
    integers; ``kv_seen`` uses the same per-key-tile visit counts and formula as :func:`_grid_visits`."""
    width = hi - lo
    col_pre = np.concatenate([[0], np.cumsum(cols)])
    n_k = len(cols)
    # per key tile, how many query tiles visit it: +1 at lo, -1 at hi, summed along the keys
    cover = np.cumsum(np.bincount(lo, minlength=n_k + 1) - np.bincount(hi, minlength=n_k + 1))[:n_k][None, None]
    scale = float(n_bh) if density is None else float(n_bh) * float(density)
    if density is None:
        seen = (cover > 0).astype(np.float64)
    else:
        seen = 1.0 - (1.0 - float(density)) ** cover
    unseen = (width == 0) if density is None else (1.0 - float(density)) ** width  # per query tile
    return _Visits(pairs=float(width.sum()) * scale, total=n_bh * len(rows) * n_k,
                   pairs_rows=float((width * rows).sum()) * scale,
                   pairs_cols=float((col_pre[hi] - col_pre[lo]).sum()) * scale,
                   kv_seen=float((seen @ cols).sum()) * n_bh, rows_unseen=float((unseen * rows).sum()) * n_bh)


def _grid_visits(keep: np.ndarray, rows, cols, n_bh: int, density: Optional[float]) -> _Visits:
    """:class:`_Visits` of a boolean ``(B|1, H|1, nq, nk)`` grid of visited pairs (a BlockMask's: as large as the
    mask's own grid)."""
    visit = _visit_counts(keep, n_bh, density)
    if density is None:
        seen = keep.any(axis=2).astype(np.float64)  # (Bm|1, Hm|1, nk)
        unseen = (~keep.any(axis=3)).astype(np.float64)  # (Bm|1, Hm|1, nq)
    else:
        seen = 1.0 - (1.0 - float(density)) ** keep.sum(axis=2)
        unseen = (1.0 - float(density)) ** keep.sum(axis=3)
    reps = n_bh // (keep.shape[0] * keep.shape[1])
    return _Visits(pairs=float(visit.sum()), total=n_bh * visit.size,
                   pairs_rows=float((visit * rows[:, None]).sum()), pairs_cols=float((visit * cols[None, :]).sum()),
                   kv_seen=float((seen @ cols).sum()) * reps, rows_unseen=float((unseen @ rows).sum()) * reps)


# --------------------------------------------------------------------------------------------
# Ledgers
# --------------------------------------------------------------------------------------------
def _standard_fwd(sq, sk, d, s: _Sizes, masked: bool) -> dict:
    both = sq > 0 and sk > 0  # a product with an empty side reads nothing: its result is empty, or zeros
    ledger = {"read Q, K (S = QK^T)": (sq + sk) * d * s.x * both,
              "write S": sq * sk * s.x}
    if masked:
        ledger["mask: read S, write S"] = 2 * sq * sk * s.x
    ledger["softmax: read S, write P"] = 2 * sq * sk * s.x
    ledger["read P, V (O = PV)"] = (sq * sk + sk * d) * s.x * both
    ledger["write O"] = sq * d * s.x
    return ledger


def _standard_bwd(sq, sk, d, s: _Sizes) -> dict:
    nn, both = sq * sk, sq > 0 and sk > 0  # (as _standard_fwd) with an empty side, only the zero gradients written
    return {"dV = P^T dO: read P, dO; write dV": ((nn + sq * d) * both + sk * d) * s.x,
            "dP = dO V^T: read dO, V; write dP": ((sq * d + sk * d) * both + nn) * s.x,
            "dS = P*(dP - D): read P, dP; write dS": 3 * nn * s.x,
            "dQ = dS K: read dS, K; write dQ": ((nn + sk * d) * both + sq * d) * s.x,
            "dK = dS^T Q: read dS, Q; write dK": ((nn + sq * d) * both + sk * d) * s.x}


def _tiled_fwd(v: _Visits, n_bh, rows, d, s: _Sizes, order: str) -> dict:
    """Tiled forward. ``v``: the visited pairs' totals over the ``n_bh`` (batch, head) pairs (fractional under a
    ``density``); ``rows``: real tile heights."""
    pairs_rows, pairs_cols, kv_seen = v.pairs_rows, v.pairs_cols, v.kv_seen
    sq = n_bh * float(rows.sum())
    if order == "fa2":  # a query tile that visits no key tile never loads Q_i (flash_fwd.cu: with the first K_j)
        return {"read Q": (sq - v.rows_unseen) * d * s.x,
                "read K, V per visited tile": 2 * pairs_cols * d * s.x,
                "write O": sq * d * s.x,
                "write lse": sq * s.f}
    # Algorithm 1: a key tile is loaded once per (batch, head) if any query tile visits it.
    return {"read K, V (once per key tile)": 2 * kv_seen * d * s.x,
            "read Q, O per visited tile": 2 * pairs_rows * d * s.x,
            "read m, l per visited tile": 2 * pairs_rows * s.f,
            "write O per visited tile": pairs_rows * d * s.x,
            "write m, l per visited tile": 2 * pairs_rows * s.f,
            # line 2 initializes O, l, m in HBM; Theorem 2 leaves that out, but a row no key tile visits keeps it as
            # its result (0 where no key is seen), so its zeros are written once
            "initialize O, m, l of rows no key tile visits": v.rows_unseen * (d * s.x + 2 * s.f)}


def _tiled_bwd(v: _Visits, n_bh, rows, cols, d, s: _Sizes) -> dict:
    """FA2 backward as ``kernels/flash_bwd.cu`` runs it: a preprocess pass, a thread block per key
    tile streaming the query tiles that see it (dQ added to an fp32 workspace by atomics; K_j, V_j loaded only
    when some query tile does), and a pass converting the workspace to dQ. dK, dV are written for every key (zeros
    where no query sees it)."""
    sq, sk = n_bh * float(rows.sum()), n_bh * float(cols.sum())
    pairs_rows, kv_seen = v.pairs_rows, v.kv_seen
    return {"preprocess: read dO, O, lse; write D, L, zero dQ acc": 2 * sq * d * s.x + 3 * sq * s.f + sq * d * s.f,
            "read K, V (key tiles some query tile sees)": 2 * kv_seen * d * s.x,
            "read Q, dO per visited tile": 2 * pairs_rows * d * s.x,
            "read L, D per visited tile": 2 * pairs_rows * s.f,
            "dQ acc: read+write per visited tile": 2 * pairs_rows * d * s.f,
            "write dK, dV": 2 * sk * d * s.x,
            "convert: read dQ acc, write dQ": sq * d * (s.f + s.x)}


def _visit_counts(keep: np.ndarray, n_bh: int, density: Optional[float]) -> np.ndarray:
    """(nq, nk) visit counts over all (batch, head) pairs."""
    # A (1, 1, nq, nk) pattern repeats over every (batch, head); a per-(b, h) one is summed as is.
    reps = n_bh // (keep.shape[0] * keep.shape[1])
    counts = keep.sum(axis=(0, 1)).astype(np.float64) * reps
    return counts if density is None else counts * float(density)


def _tile_extent(n: int, block: int) -> np.ndarray:
    """Real sizes of the tiles covering ``n`` (the last one ragged)."""
    starts = np.arange(0, n, block)
    return np.minimum(starts + block, n) - starts


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------
def io_cost(*, seqlen_q: int, head_dim: int, seqlen_k: Optional[int] = None, batch: int = 1, heads: int = 1,
            dtype="float16", op: str = "fwd", causal: bool = False, window=None, block_mask=None,
            density: Optional[float] = None, block_q: Optional[int] = None, block_k: Optional[int] = None,
            bwd_block_q: Optional[int] = None, bwd_block_k: Optional[int] = None, order: str = "fa2",
            cc: int = 80) -> IOCost:
    """HBM bytes of standard attention and of the tiled kernels for one attention call.

    Parameters
    ----------
    seqlen_q, seqlen_k : int
        Query and key lengths (``seqlen_k`` defaults to ``seqlen_q``).
    head_dim, batch, heads : int
        ``heads`` counts query heads.
    dtype : str or numpy dtype
        Element type of Q, K, V, O (``"float16"``, ``"bfloat16"``, ``"float32"``, ...).
    op : {"fwd", "bwd", "fwd_bwd"}
        ``fwd_bwd`` adds the two; the standard backward reuses the forward's stored P.
    causal, window, block_mask
        As for :func:`cuflash.attention`; they remove tile pairs from the tiled ledgers.
    density : float, optional
        Fraction of tile pairs visited, when no ``block_mask`` is given (Proposition 4's ``s``).
    block_q, block_k : int, optional
        Forward tile: query rows and keys per tile; default: the CUDA forward kernel's tile table.
    bwd_block_q, bwd_block_k : int, optional
        Backward tile: query rows per streamed tile and keys per thread block; default: the CUDA
        backward kernel's tile table.
    order : {"fa2", "fa1"}
        Loop order of the tiled forward: FA2's (the cuflash kernel) or Algorithm 1's (Theorem 2).
    cc : {80, 86, 89, 90}
        Compute capability whose tile table row gives the default tiles (the H100's, 90, has rows of its own).

    Returns
    -------
    IOCost
        Totals and per-line ledgers in bytes.
    """
    from .blockmask import BlockMask
    from .problem import _check_window

    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    # the sizes as Python ints: the ledgers multiply them, and a NumPy int (np.int32(70000)) would wrap silently
    seqlen_q, seqlen_k, head_dim, batch, heads = _check_args(
        op=op, order=order, density=density, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, batch=batch,
        heads=heads).values()
    _check_cc(cc)
    tile_sizes = dict(block_q=block_q, block_k=block_k, bwd_block_q=bwd_block_q, bwd_block_k=bwd_block_k)
    _check_args(op=op, order=order, density=None, **{n: t for n, t in tile_sizes.items() if t is not None})
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cuflash.BlockMask or None, got {type(block_mask).__name__}")
    if block_mask is not None and density is not None:
        raise ValueError("density stands for a block mask's fraction of visited tiles: give block_mask or density, "
                         "not both")
    sizes, n_bh = _sizes(dtype), batch * heads
    left, right = _check_window(window, causal, seqlen_q + seqlen_k)  # the causal bool checked there too
    shape = dict(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, left=left, right=right,
                 block_mask=block_mask, density=density)
    # the standard algorithm's mask pass: for a rule that masks something (window=(None, None) masks nothing)
    masked = left is not None or right is not None or block_mask is not None or density is not None
    std, tiled, tiles, visited = {}, {}, {}, {}
    if op in ("fwd", "fwd_bwd"):
        bq, bk = _tiles(head_dim, "fwd", block_q, block_k, cc)
        v, rows, cols = _tiling(bq, bk, **shape)
        std.update(_per_bh(_standard_fwd(seqlen_q, seqlen_k, head_dim, sizes, masked), n_bh, "fwd: "))
        tiled.update(_prefixed(_tiled_fwd(v, n_bh, rows, head_dim, sizes, order), "fwd: "))
        tiles["fwd"], visited["fwd"] = (bq, bk), (int(round(v.pairs)), v.total)
    if op in ("bwd", "fwd_bwd"):
        bq, bk = _tiles(head_dim, "bwd", bwd_block_q, bwd_block_k, cc)
        v, rows, cols = _tiling(bq, bk, **shape)
        std.update(_per_bh(_standard_bwd(seqlen_q, seqlen_k, head_dim, sizes), n_bh, "bwd: "))
        tiled.update(_prefixed(_tiled_bwd(v, n_bh, rows, cols, head_dim, sizes), "bwd: "))
        tiles["bwd"], visited["bwd"] = (bq, bk), (int(round(v.pairs)), v.total)
    if op != "fwd_bwd":  # one op: drop the "fwd: " / "bwd: " prefixes
        std = {k.split(": ", 1)[1]: b for k, b in std.items()}
        tiled = {k.split(": ", 1)[1]: b for k, b in tiled.items()}
    tiled = {k: int(round(b)) for k, b in tiled.items()}
    return IOCost(op=op, standard=sum(std.values()), tiled=sum(tiled.values()), tiles=tiles, visited=visited,
                  standard_ledger=std, tiled_ledger=tiled)


def _check_cc(cc) -> int:
    from .cuda.specs import SMEM_LIMIT

    if isinstance(cc, bool) or not isinstance(cc, (int, np.integer)) or int(cc) not in SMEM_LIMIT:
        raise ValueError(f"cc must be a compute capability the kernels know ({', '.join(map(str, SMEM_LIMIT))}), "
                         f"got {cc!r}")
    return int(cc)


#: the sizes that may be 0
EMPTY_OK = ("seqlen_q", "seqlen_k", "batch", "heads")


def _check_args(*, op, order, density, **sizes) -> dict:
    """The checked ``sizes``, as Python ints in the order given."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order != "fa2" and op == "bwd":
        raise ValueError(f"order is the forward's loop order; op='bwd' has one (FA2's), got order={order!r}")
    # lengths, batch and heads may be 0 (an empty problem, as attention takes one); head dim and tiles not
    sizes = {name: check_int(val, name, 0 if name in EMPTY_OK else 1) for name, val in sizes.items()}
    if density is not None and (isinstance(density, (bool, np.bool_)) or not isinstance(
            density, (int, float, np.integer, np.floating))):
        raise TypeError(f"density must be a number in [0, 1], got {type(density).__name__}")
    if density is not None and not 0.0 <= float(density) <= 1.0:
        raise ValueError(f"density must be a number in [0, 1], got {density!r}")
    return sizes


def _tiles(head_dim, op, block_q, block_k, cc) -> tuple[int, int]:
    if block_q is None or block_k is None:
        dq, dk = default_tiles(head_dim, op, cc)
        block_q, block_k = block_q or dq, block_k or dk
    return int(block_q), int(block_k)


def _tiling(block_q, block_k, *, batch, heads, seqlen_q, seqlen_k, left, right, block_mask, density):
    """``(visits, query tile heights, key tile widths)``: :class:`_Visits` over all (batch, head) pairs of the tile
    pairs the schedule (:mod:`cuflash.tiling`) visits; ``kv_seen`` under a ``density`` is the expected count with
    each pair kept independently."""
    rows, cols = _tile_extent(seqlen_q, block_q), _tile_extent(seqlen_k, block_k)
    sched = Schedule(seqlen_q, seqlen_k, block_q, block_k, left=left, right=right)
    n_bh = batch * heads
    if block_mask is None:  # one sequence, no mask: the row ranges are exactly the visited tiles
        return _band_visits(*sched.row_ranges(), rows, cols, n_bh, density), rows, cols
    block_mask.check_fits(batch, heads, seqlen_q, seqlen_k, sizes="the arguments seqlen_q, seqlen_k are")
    keep = sched.kept_grid()[None, None] & classify_grid(block_mask.grid, block_mask.block, block_q, block_k,
                                                         seqlen_q, seqlen_k)[0]
    return _grid_visits(keep, rows, cols, n_bh, density), rows, cols


def _per_bh(ledger: dict, n_bh: int, prefix: str) -> dict:
    return {prefix + k: int(b) * n_bh for k, b in ledger.items()}


def _prefixed(ledger: dict, prefix: str) -> dict:
    return {prefix + k: float(b) for k, b in ledger.items()}
