"""Kernel specializations, THE tile table, and the forward launch description.

A :class:`KernelSpec` is the small frozen value that picks one instantiation of a kernel family
(``kernels/flash_fwd.cu``): only what changes generated code is in it (element type, head_dim,
tile sizes, warps). Everything else — lengths, strides, causal/window, seqlens, GQA, BlockMask,
scale, dropout (:func:`dropout_args`) — is a runtime argument, so one specialization per (dtype,
head_dim) serves every mask feature and the compile check stays small.

:func:`forward_launch` is the one place that turns a :class:`~cuflash.problem.Problem` into a
:class:`~cuflash.launch.LaunchSpec` (grid, block, shared memory, argument list); the CUDA backend
hands it to CuPy and the emulate backend to :mod:`cuflash.emulate`, unchanged.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from . import dropout
from .launch import LaunchSpec, kernel_source

FWD_SOURCE = "flash_fwd.cu"
FWD_KERNEL = "cuflash::flash_fwd_kernel"


@functools.lru_cache(maxsize=None)
def fwd_source() -> str:
    """The forward family's complete source (local includes inlined), read once per process."""
    return kernel_source(FWD_SOURCE)

#: head dims compiled natively; any other head_dim <= 256 runs on the next one up (zero columns).
NATIVE_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
#: element types the kernels take, by dtype name → CUDA type.
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
SUPPORTED_DTYPES = tuple(CTYPES)

#: ``kUnbounded`` in kernels/mask.cuh: "no window bound"; lengths must stay below it.
UNBOUNDED = 1 << 30
#: dynamic shared memory a block may opt into: A100 (sm_80) 163 KB, H100 (sm_90) 227 KB, sm_86/89 99 KB.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
#: sequence-length limit of the int32 index arithmetic in the kernels (see mask.cuh).
MAX_SEQLEN = UNBOUNDED - 1


@dataclass(frozen=True)
class KernelSpec:
    """One forward specialization: ``flash_fwd_kernel<T, head_dim, block_m, block_n, warps>``.

    Subclasses with the same template shape (the backward's dQ pass) change only ``kernel`` and
    :attr:`smem_bytes`.
    """

    kernel = FWD_KERNEL  # a class attribute, not a field

    dtype: str       # "float16" | "bfloat16"
    head_dim: int    # native (padded) head dim
    block_m: int     # query rows per thread block (B_r)
    block_n: int     # keys per K/V tile (B_c)
    warps: int       # block_m / warps rows per warp (16 or 32)

    def __post_init__(self):
        if self.dtype not in CTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        rows = self.block_m // self.warps
        if self.head_dim not in NATIVE_HEAD_DIMS or rows * self.warps != self.block_m or rows not in (16, 32) \
                or self.block_n % 16:
            raise ValueError(f"invalid kernel specialization {self}")

    @property
    def name_expression(self) -> str:
        return (f"{self.kernel}<{CTYPES[self.dtype]}, {self.head_dim}, {self.block_m}, "
                f"{self.block_n}, {self.warps}>")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q, K, V tiles with rows padded by 8 elements (kernel_traits.cuh)."""
        return (self.block_m + 2 * self.block_n) * (self.head_dim + 8) * 2


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    warps: int
    why: str


# ------------------------------------------------------------------------------------------------
# THE tile table. Per head_dim, for GPUs that let a block use >= 163 KB of shared memory (A100 sm_80,
# H100 sm_90) and, where that differs, for GPUs limited to 99 KB (sm_86, sm_89). Register counts are
# those of `python -m cuflash.build --check` (no spills allowed); the register file decides most rows:
# per thread, acc holds rows/warp * head_dim / 32 floats and S rows/warp * block_n / 32 floats.
# ------------------------------------------------------------------------------------------------
TILES_LARGE_SMEM = {
    32: Tile(128, 64, 4, "32 rows/warp: each K/V fragment read from smem feeds two m-tiles (halves smem "
                         "traffic per flop); acc 32 + S 64 regs; Q stays in registers; 20 KB smem"),
    64: Tile(128, 64, 4, "FA2's choice: 32 rows/warp, acc 64 + S 64 regs (~245 in all, no spill); "
                         "block_n 128 would need S = 128 regs and spill; 36 KB smem, 2 blocks/SM"),
    96: Tile(128, 64, 8, "32 rows/warp (acc 96 + S 64) spills on sm_90; 16 rows/warp x 8 warps keeps "
                         "the 128-row tile (K/V reuse across 8 warps) at ~170 regs; 53 KB smem"),
    128: Tile(128, 64, 8, "32 rows/warp needs acc 128 + S 64 and spills; 8 warps x 16 rows, ~175 regs; "
                          "70 KB smem so two blocks fit on A100/H100"),
    192: Tile(128, 64, 8, "acc 96 regs per thread at 16 rows/warp (~232 regs); 102 KB smem"),
    256: Tile(128, 64, 8, "acc 128 regs per thread at 16 rows/warp (~254 regs, the ceiling); 135 KB "
                          "smem (needs the >= 163 KB opt-in of sm_80/sm_90)"),
}
TILES_SMALL_SMEM = {  # 99 KB per block (sm_86, sm_89): only the two largest head dims must shrink
    192: Tile(64, 64, 4, "the 128-row tile needs 102 KB > 99 KB; 64 rows x 4 warps: 77 KB"),
    256: Tile(64, 32, 4, "128x64 needs 135 KB and 64x64 exactly 99 KB; 64x32: 68 KB, ~249 regs"),
}


def native_head_dim(head_dim: int) -> int:
    """The native head dim a problem of ``head_dim`` runs on (the next one up)."""
    for d in NATIVE_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {NATIVE_HEAD_DIMS[-1]} on the CUDA kernels, got {head_dim}")


def tile_for(head_dim: int, max_smem: int = SMEM_LIMIT[80]) -> Tile:
    """The table entry for a native ``head_dim`` on a GPU allowing ``max_smem`` bytes per block."""
    tile = TILES_LARGE_SMEM[head_dim]
    if _smem(tile, head_dim) > max_smem:
        tile = TILES_SMALL_SMEM.get(head_dim, tile)
    if _smem(tile, head_dim) > max_smem:
        raise ValueError(f"head_dim {head_dim} needs {_smem(tile, head_dim)} bytes of shared memory per block; "
                         f"this GPU allows {max_smem}")
    return tile


def _smem(tile: Tile, head_dim: int) -> int:
    return (tile.block_m + 2 * tile.block_n) * (head_dim + 8) * 2


def select_spec(dtype: str, head_dim: int, max_smem: int = SMEM_LIMIT[80]) -> KernelSpec:
    """The forward specialization the dispatcher runs for ``dtype`` and a (true) ``head_dim``."""
    if dtype not in CTYPES:
        raise TypeError(f"the CUDA kernels take {' or '.join(SUPPORTED_DTYPES)} inputs, got {dtype}")
    d = native_head_dim(head_dim)
    t = tile_for(d, max_smem)
    return KernelSpec(dtype, d, t.block_m, t.block_n, t.warps)


def all_specs() -> list[KernelSpec]:
    """Every forward specialization the dispatcher can select, on any supported GPU."""
    specs = []
    for dtype in SUPPORTED_DTYPES:
        for d in NATIVE_HEAD_DIMS:
            for table in (TILES_LARGE_SMEM, TILES_SMALL_SMEM):
                if d in table:
                    t = table[d]
                    spec = KernelSpec(dtype, d, t.block_m, t.block_n, t.warps)
                    if spec not in specs:
                        specs.append(spec)
    return specs


def specs_for_arch(arch: int) -> list[KernelSpec]:
    """The specializations a GPU of compute capability ``arch`` (80, 86, 89, 90) can select."""
    limit = SMEM_LIMIT[arch]
    return [s for s in all_specs() if s.smem_bytes <= limit]


# ------------------------------------------------------------------------------------------------
# Block-mask lists at the kernel's tile granularity
# ------------------------------------------------------------------------------------------------
def tile_lists(grid: np.ndarray, block: tuple[int, int], block_m: int, block_n: int,
               seqlen_q: int, seqlen_k: int):
    """The BlockMask as the kernel reads it: per (batch|1, head|1, query tile), the sorted key tiles
    that some kept mask block touches, ``n`` when mask blocks cover the whole tile and ``~n`` when
    only part of it (then the kernel checks elements against the grid).

    Returns ``(counts int32 (Bm, Hm, nM), lists int32 (Bm, Hm, nM, nN), partial: bool)``.
    """
    grid = np.asarray(grid, dtype=bool)
    bq, bk = block
    n_m, n_n = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    # mask rows/cols [lo, hi) that each kernel tile overlaps (only the part inside the sequence counts)
    m = np.arange(n_m)
    r_lo, r_hi = (m * block_m) // bq, (np.minimum((m + 1) * block_m, seqlen_q) - 1) // bq + 1
    n = np.arange(n_n)
    c_lo, c_hi = (n * block_n) // bk, (np.minimum((n + 1) * block_n, seqlen_k) - 1) // bk + 1
    # kept-block counts over each rectangle from a 2-D prefix sum
    pre = np.zeros(grid.shape[:2] + (grid.shape[2] + 1, grid.shape[3] + 1), dtype=np.int64)
    pre[:, :, 1:, 1:] = grid.cumsum(axis=2).cumsum(axis=3)
    rl, rh, cl, ch = r_lo[:, None], r_hi[:, None], c_lo[None, :], c_hi[None, :]
    count = pre[:, :, rh, ch] - pre[:, :, rl, ch] - pre[:, :, rh, cl] + pre[:, :, rl, cl]
    area = (rh - rl) * (ch - cl)
    kept, full = count > 0, count == area
    order = np.argsort(~kept, axis=-1, kind="stable").astype(np.int32)  # kept tiles first, ascending
    lists = np.where(np.take_along_axis(full, order, axis=-1), order, ~order).astype(np.int32)
    counts = kept.sum(axis=-1).astype(np.int32)
    # C order matters: the kernel indexes these flat (the fancy indexing above yields other layouts)
    return np.ascontiguousarray(counts), np.ascontiguousarray(lists), bool((kept & ~full).any())


# ------------------------------------------------------------------------------------------------
# The forward launch
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardLaunch:
    """A forward launch and the arrays it writes; :meth:`result` gives ``(out, lse)``."""

    spec: Optional[LaunchSpec]  # None when there is nothing to compute (an empty problem)
    kernel: Optional[KernelSpec]
    out: Any                    # (B, Sq, Hq, d8) in the input dtype, d8 = head_dim rounded up to 8
    lse: Any                    # (B, Hq, Sq) float32
    head_dim: int

    def result(self):
        out = self.out
        if out.shape[-1] != self.head_dim:
            out = out[..., :self.head_dim].copy()
        return out, self.lse


def dtype_of(a) -> str:
    """The kernel dtype name of an array: ``float16``, ``bfloat16`` (ml_dtypes), or ``bfloat16``
    for a ``uint16`` array holding bfloat16 bits (the documented CuPy fallback)."""
    name = np.dtype(a.dtype).name
    return "bfloat16" if name == "uint16" else name


def _aligned(xp, a, itemsize: int) -> bool:
    """cp.async copies 16-byte chunks: base address and every stride must be multiples of 16 bytes."""
    ptr = a.data.ptr if xp.__name__ == "cupy" else a.ctypes.data
    return (ptr % 16 == 0 and a.strides[-1] == itemsize
            and all(s % 16 == 0 for s, n in zip(a.strides[:-1], a.shape[:-1]) if n > 1))


def _prepare(xp, a, d8: int):
    """``a`` itself when the kernel can read it in place, else a contiguous copy with the head dim
    zero-padded to ``d8`` (a multiple of 8: whole 16-byte chunks)."""
    itemsize = a.dtype.itemsize
    if a.shape[-1] == d8 and _aligned(xp, a, itemsize):
        return a
    padded = xp.zeros(a.shape[:-1] + (d8,), dtype=a.dtype)
    padded[..., :a.shape[-1]] = a
    return padded


def _elem_strides(a):
    return [np.int64(s // a.dtype.itemsize) for s in a.strides[:3]]  # batch, row, head


def dropout_args(problem) -> tuple:
    """``(seed_lo, seed_hi, threshold)`` as uint32 and ``rescale = 1/(1-p)`` as float32: the kernels' dropout
    arguments (:mod:`cuflash.dropout`'s keep-mask). Without dropout ``(0, 0, 0, 1.0)``: threshold 0 keeps
    every element and the kernels skip the generator."""
    p = problem.dropout_p
    if not p:
        return np.uint32(0), np.uint32(0), np.uint32(0), np.float32(1.0)
    if problem.seed is None:
        raise ValueError("dropout_p > 0 needs a seed (cuflash.attention draws one when seed=None)")
    seed = int(problem.seed)
    return (np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32), np.uint32(dropout.threshold(p)),
            np.float32(1.0 / (1.0 - p)))


def check_launch_limits(problem, what: str):
    """The grid is (tiles, heads, batch) and indices are int32: reject what the kernels cannot address."""
    b, sq, hq, _ = problem.q.shape
    sk = problem.k.shape[1]
    if max(sq, sk) > MAX_SEQLEN:
        raise ValueError(f"sequence lengths must be below 2**30 on the CUDA kernels, got {sq}, {sk}")
    if hq > 65535 or b > 65535:
        raise ValueError(f"the CUDA {what} launches one block per (tile, head, batch): heads ({hq}) and "
                         f"flattened batch ({b}) must each be at most 65535; split the batch")


def window_args(problem) -> tuple:
    """``(left, right)`` as the kernels take them: ``kUnbounded`` (mask.cuh) for no bound."""
    clamp = lambda w: np.int32(UNBOUNDED if w is None else min(w, UNBOUNDED))  # noqa: E731
    return clamp(problem.window_left), clamp(problem.window_right)


def score_multiplier(problem) -> np.float32:
    """scale * log2(e) in fp32: the one multiply per score of every kernel (base-2 softmax)."""
    return np.float32(problem.scale * np.log2(np.e))


def mask_args(xp, bm, block_q: int, block_k: int, seqlen_q: int, seqlen_k: int, transposed: bool):
    """The BlockMask as a kernel reads it: index lists per tile (per key tile when ``transposed``) and,
    when mask blocks are finer than the kernel tiles, the grid for element checks (original orientation)."""
    if bm is None:
        return (None, None, np.int64(0), np.int64(0), np.int32(0),
                None, np.int64(0), np.int64(0), np.int32(0), np.int32(0), np.int32(0))
    gb, gh, nq, nk = bm.grid.shape
    if transposed:
        counts, lists, partial = tile_lists(bm.grid.transpose(0, 1, 3, 2), bm.block[::-1], block_k, block_q,
                                            seqlen_k, seqlen_q)
    else:
        counts, lists, partial = tile_lists(bm.grid, bm.block, block_q, block_k, seqlen_q, seqlen_k)
    n_tiles = counts.shape[-1]
    t_b, t_h = (gh * n_tiles if gb > 1 else 0), (n_tiles if gh > 1 else 0)
    cells, c_b, c_h, mbq, mbk, mnk = None, 0, 0, 0, 0, 0
    if partial:
        cells = xp.asarray(np.ascontiguousarray(bm.grid, dtype=np.uint8))
        c_b, c_h = (gh * nq * nk if gb > 1 else 0), (nq * nk if gh > 1 else 0)
        mbq, mbk, mnk = bm.block[0], bm.block[1], nk
    i32, i64 = np.int32, np.int64
    counts, lists = np.ascontiguousarray(counts), np.ascontiguousarray(lists)  # indexed flat by the kernels
    return (xp.asarray(counts), xp.asarray(lists), i64(t_b), i64(t_h), i32(lists.shape[-1]),
            cells, i64(c_b), i64(c_h), i32(mbq), i32(mbk), i32(mnk))


def forward_launch(problem, *, max_smem: int = SMEM_LIMIT[80], spec: Optional[KernelSpec] = None) -> ForwardLaunch:
    """The launch description of the forward kernel for ``problem`` (CuPy or NumPy arrays alike).

    Allocates ``out``/``lse`` on ``problem.xp``; the arguments reference the problem's arrays (or
    padded copies when head_dim is not a multiple of 8 or the arrays are not 16-byte aligned).
    """
    xp = problem.xp
    dtype = dtype_of(problem.q)
    b, sq, hq, d = problem.q.shape
    sk, hkv = problem.k.shape[1], problem.k.shape[2]
    if spec is None:
        spec = select_spec(dtype, d, max_smem)
    if spec.dtype != dtype or spec.head_dim < d:
        raise ValueError(f"kernel {spec} cannot run a {dtype} problem of head_dim {d}")
    check_launch_limits(problem, "forward")
    n_m = -(-sq // spec.block_m)
    d8 = -(-d // 8) * 8
    out = xp.empty((b, sq, hq, d8), dtype=problem.q.dtype)
    lse = xp.empty((b, hq, sq), dtype=np.float32)
    if b == 0 or sq == 0 or hq == 0:
        return ForwardLaunch(None, spec, out, lse, d)

    q, k, v = (_prepare(xp, a, d8) for a in (problem.q, problem.k, problem.v))
    i32, i64 = np.int32, np.int64
    args = (
        q, k, v, out, lse,
        *_elem_strides(q), *_elem_strides(k), *_elem_strides(v), *_elem_strides(out),
        i64(hq * sq), i64(sq),
        i32(sq), i32(sk), i32(d8), i32(hq // hkv),
        problem.seqlens_q, problem.seqlens_k,
        score_multiplier(problem), *window_args(problem),
        *mask_args(xp, problem.block_mask, spec.block_m, spec.block_n, sq, sk, transposed=False),
        *dropout_args(problem),
    )
    launch = LaunchSpec(
        source=fwd_source(),
        name_expression=spec.name_expression,
        grid=(n_m, hq, b),
        block=(spec.threads, 1, 1),
        shared_bytes=spec.smem_bytes,
        args=args,
    )
    return ForwardLaunch(launch, spec, out, lse, d)
