"""Backward kernel specializations, THE backward tile table, and the backward launch descriptions.

The backward (``kernels/flash_bwd.cu``, FA2 Algorithm 2 by recomputation) is four kernels run in
order: ``preprocess`` (D = rowsum(dO∘O), L = lse·log2 e, zeroed dQ workspace), the ``main`` kernel
over key tiles (dK, dV; dQ by fp32 atomics), then either ``convert`` (dQ = scale·workspace in the
input dtype, the default) or, with ``deterministic=True``, the ``dq`` kernel over query tiles that
recomputes dQ without atomics. :func:`backward_launch` is the one place that turns a problem into
those :class:`~cuflash.launch.LaunchSpec` values; the CUDA backend hands them to CuPy and the
emulate backend to :mod:`cuflash.emulate`, unchanged.

Reproducibility: with ``deterministic=False`` the fp32 atomic additions into the dQ workspace
happen in whatever order the GPU schedules the key tiles, so dQ may differ in the last bits from
run to run (dK and dV never do: each key tile is summed by one thread block in a fixed order).
``deterministic=True`` is bitwise reproducible for dQ, dK and dV, at the price of recomputing
S, P and dP once more in a second pass over query tiles.

Dropout: the main and dq kernels take the forward's dropout arguments
(:func:`cuflash.kernels.dropout_args`: seed halves, threshold, 1/(1-p)) and regenerate the
keep bits of every recomputed P tile in registers; no mask is stored.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .kernels import (CTYPES, NATIVE_HEAD_DIMS, SMEM_LIMIT, SUPPORTED_DTYPES, KernelSpec, Tile, _elem_strides,
                      _prepare, check_launch_limits, dropout_args, dtype_of, mask_args, native_head_dim,
                      score_multiplier, window_args)
from .launch import LaunchSpec, kernel_source

BWD_SOURCE = "flash_bwd.cu"
NS = "cuflash::"


@functools.lru_cache(maxsize=None)
def bwd_source() -> str:
    """The backward family's complete source (local includes inlined), read once per process."""
    return kernel_source(BWD_SOURCE)


@dataclass(frozen=True)
class BwdSpec:
    """The main kernel: ``flash_bwd_kernel<T, head_dim, block_m, block_n, warps>``.

    A block owns ``block_n`` keys (16 per warp row group) and visits query tiles of ``block_m``
    rows; ``split = warps / (block_n / 16)`` parts share the query columns of S and the head-dim
    columns of dK/dV (kernels/bwd_traits.cuh). A warp's S^T is at most 64 query columns wide
    (``block_m / split <= 64``): its dropout keep bits fill one 32-bit register per lane
    (kernels/bwd_dropout.cuh), and wider warp tiles run out of registers anyway.
    """

    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    warps: int

    def __post_init__(self):
        if self.dtype not in CTYPES or self.head_dim not in NATIVE_HEAD_DIMS or self.block_n % 16 \
                or self.warps % (self.block_n // 16) or self.split not in (1, 2, 4) \
                or (self.block_m // self.split) % 16 or self.block_m // self.split > 64 \
                or (self.head_dim // self.split) % 16:
            raise ValueError(f"invalid backward specialization {self}")

    @property
    def split(self) -> int:
        return self.warps // (self.block_n // 16)

    @property
    def name_expression(self) -> str:
        return (f"{NS}flash_bwd_kernel<{CTYPES[self.dtype]}, {self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.warps}>")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        """K, V [block_n], Q, dO [block_m] rows of head_dim + 8; dS^T (and P^T when split) [block_n][block_m + 8];
        L and D [block_m] fp32 (BwdTraits::kSmemBytes)."""
        s = self.head_dim + 8
        elems = 2 * self.block_n * s + 2 * self.block_m * s + (1 if self.split == 1 else 2) * self.block_n * (
            self.block_m + 8)
        return 2 * elems + 8 * self.block_m


@dataclass(frozen=True)
class DqSpec(KernelSpec):
    """The deterministic dQ kernel: ``flash_bwd_dq_kernel<T, head_dim, block_m, block_n, warps>``
    (the forward's orientation: ``block_m`` query rows, 16 per warp, ``block_n`` keys per tile)."""

    kernel = NS + "flash_bwd_dq_kernel"

    @property
    def smem_bytes(self) -> int:
        """Q, dO [block_m] and K, V [block_n] rows of head_dim + 8 elements."""
        return 2 * (2 * self.block_m + 2 * self.block_n) * (self.head_dim + 8)


# ------------------------------------------------------------------------------------------------
# THE backward tile table. Register counts are ptxas -v on sm_80 / sm_90 (CUDA 13, with the dropout
# path); no spills allowed (`python -m cuflash.build --check`). Per thread the main kernel holds dK and
# dV of 16 keys x head_dim/split columns (head_dim/split fp32 registers) for the whole block, plus S^T
# and dP^T of 16 keys x block_m/split queries (block_m/split registers) while a query tile is processed.
# ------------------------------------------------------------------------------------------------
BWD_TILES_LARGE_SMEM = {
    32: Tile(64, 128, 8, "split 1: dK,dV 32 + S,dP 64 regs (168/170 regs); 128 keys per block halve the Q/dO "
                         "reloads per key; block_m 128 would be 128 query columns per warp (S,dP 128 regs); "
                         "50 KB smem"),
    64: Tile(64, 128, 8, "split 1 (FA2's 128 x 128 would need S,dP 128 regs): dK,dV 64 + S,dP 64 regs "
                         "(214/218 regs); P^T and dS^T feed dV, dK from registers; 74 KB smem"),
    96: Tile(64, 64, 8, "split 1 (64 x 128) at the register limit (253/255; it spilled 32 B without the dropout "
                        "path); split 2: dK,dV 96 + S,dP 32 regs (161/152), P^T and dS^T shared through smem; "
                        "72 KB smem"),
    128: Tile(64, 64, 8, "split 1 (64 x 128, FA2's layout) spills 228/28 B; split 2: dK,dV 128 + S,dP 32 "
                         "(171/171 regs); 89 KB smem, two blocks per SM on H100"),
    192: Tile(64, 64, 8, "split 2: dK,dV 192 + S,dP 32 regs (224/232 regs, no spill); 121 KB smem"),
    256: Tile(64, 32, 8, "split 2 (64 x 64) spilled without the dropout path (245 regs with it); split 4 over "
                         "32 keys: dK,dV 128 + S,dP 16 regs (166/156); 111 KB smem (needs the >= 163 KB opt-in "
                         "of sm_80/sm_90)"),
}
BWD_TILES_SMALL_SMEM = {  # 99 KB per block (sm_86, sm_89)
    192: Tile(64, 32, 8, "64 x 64 needs 121 KB; split 4 over 32 keys: 87 KB, 161 regs"),
    # 256: no tile (32 x 32 x 4 warps, 73 KB, spilled 68 B without the dropout path; 244/248 regs and no spill
    # with it, not yet run on a GPU): backward_launch says so.
}
#: the deterministic dQ pass (forward orientation: 16 query rows per warp; dQ 16 x head_dim in registers)
DQ_TILES = {
    32: Tile(64, 64, 4, "dQ 16 + S,dP 32 regs (160/157 regs); 27 KB smem"),
    64: Tile(128, 64, 8, "64 x 64 x 4 warps spills 8/12 B (ptxas caps it at 168 regs); 8 warps of 16 rows: 170/171 "
                         "regs, 55 KB smem"),
    96: Tile(64, 32, 4, "dQ 48 + S,dP 16 regs (162 regs); 40 KB smem"),
    128: Tile(64, 32, 4, "dQ 64 + S,dP 16 regs (167/168 regs); 52 KB smem"),
    192: Tile(64, 32, 4, "dQ 96 + S,dP 16 regs (207/212 regs); 77 KB smem, fits 99 KB GPUs"),
    256: Tile(64, 16, 4, "dQ 128 regs; 32-key tiles spilled without the dropout path (244 regs with it), "
                         "16-key tiles: 244/244 regs; 85 KB smem"),
}


def _bwd(dtype, d, t: Tile) -> BwdSpec:
    return BwdSpec(dtype, d, t.block_m, t.block_n, t.warps)


def _dq(dtype, d, t: Tile) -> DqSpec:
    return DqSpec(dtype, d, t.block_m, t.block_n, t.warps)


def select_specs(dtype: str, head_dim: int, max_smem: int = SMEM_LIMIT[80]) -> tuple[BwdSpec, DqSpec]:
    """The (main, dq) backward specializations for ``dtype`` and a (true) ``head_dim``."""
    if dtype not in CTYPES:
        raise TypeError(f"the CUDA kernels take {' or '.join(SUPPORTED_DTYPES)} inputs, got {dtype}")
    d = native_head_dim(head_dim)
    main = _bwd(dtype, d, BWD_TILES_LARGE_SMEM[d])
    if main.smem_bytes > max_smem and d in BWD_TILES_SMALL_SMEM:
        main = _bwd(dtype, d, BWD_TILES_SMALL_SMEM[d])
    if main.smem_bytes > max_smem:
        raise ValueError(f"the CUDA backward for head_dim {head_dim} needs {main.smem_bytes} bytes of shared memory "
                         f"per block; this GPU allows {max_smem} (head_dim > 192 needs an A100/H100-class GPU)")
    dq = _dq(dtype, d, DQ_TILES[d])
    return main, dq


def all_specs() -> list:
    """Every backward specialization (main and dq) the dispatcher can select, on any supported GPU."""
    out = []
    for dtype in SUPPORTED_DTYPES:
        for d in NATIVE_HEAD_DIMS:
            for table in (BWD_TILES_LARGE_SMEM, BWD_TILES_SMALL_SMEM):
                if d in table and _bwd(dtype, d, table[d]) not in out:
                    out.append(_bwd(dtype, d, table[d]))
            out.append(_dq(dtype, d, DQ_TILES[d]))
    return out


def helper_names() -> list[str]:
    """The preprocess and convert kernels, per dtype (tiny; compiled alongside)."""
    return [f"{NS}flash_bwd_{k}_kernel<{t}>" for t in CTYPES.values() for k in ("preprocess", "convert_dq")]


# ------------------------------------------------------------------------------------------------
# The backward launches
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackwardLaunch:
    """The launches of one backward, in order, and the arrays they write; :meth:`result` gives
    ``(dq, dk, dv)`` with the problem's head_dim."""

    launches: tuple  # LaunchSpec, ... (empty for an empty problem)
    kernels: tuple   # the BwdSpec / DqSpec used (for compilation)
    dq: Any          # (B, Sq, Hq, d8) in the input dtype
    dk: Any          # (B, Sk, Hkv, d8)
    dv: Any
    head_dim: int

    def result(self):
        d = self.head_dim
        if self.dq.shape[-1] == d:
            return self.dq, self.dk, self.dv
        return tuple(a[..., :d].copy() for a in (self.dq, self.dk, self.dv))


def backward_launch(problem, dout, out, lse, *, deterministic: bool = False, max_smem: int = SMEM_LIMIT[80],
                    spec: Optional[BwdSpec] = None, dq_spec: Optional[DqSpec] = None) -> BackwardLaunch:
    """The launch descriptions of the backward for ``problem`` (CuPy or NumPy arrays alike).

    ``dout``, ``out`` are ``(B, Sq, Hq, D)`` in the input dtype and ``lse`` ``(B, Hq, Sq)`` (the
    flattened arrays of :func:`cuflash.problem.check_backward`). Allocates dq, dk, dv and the fp32
    workspaces (L, D: O(B·H·Sq); the dQ accumulator: O(B·Sq·H·D), default mode only) on
    ``problem.xp``; nothing of size N². With ``problem.dropout_p > 0`` the kernels regenerate the
    forward's keep-mask from ``problem.seed``.
    """
    xp = problem.xp
    dtype = dtype_of(problem.q)
    b, sq, hq, d = problem.q.shape
    sk, hkv = problem.k.shape[1], problem.k.shape[2]
    if spec is None or dq_spec is None:
        main, dqs = select_specs(dtype, d, max_smem)
        spec, dq_spec = spec or main, dq_spec or dqs
    for s in (spec, dq_spec):
        if s.dtype != dtype or s.head_dim < d:
            raise ValueError(f"kernel {s} cannot run a {dtype} problem of head_dim {d}")
    check_launch_limits(problem, "backward")
    d8 = -(-d // 8) * 8
    dt = problem.q.dtype
    if b == 0 or sq == 0 or sk == 0:
        z = lambda s: xp.zeros(s, dtype=dt)  # noqa: E731
        return BackwardLaunch((), (), z((b, sq, hq, d8)), z((b, sk, hkv, d8)), z((b, sk, hkv, d8)), d)

    q, k, v, do, o = (_prepare(xp, a, d8) for a in (problem.q, problem.k, problem.v, dout, out))
    lse = xp.ascontiguousarray(lse, dtype=np.float32)
    lse_log2 = xp.empty((b, hq, sq), dtype=np.float32)
    dsum = xp.empty((b, hq, sq), dtype=np.float32)
    dq = xp.empty((b, sq, hq, d8), dtype=dt)
    dk = xp.empty((b, sk, hkv, d8), dtype=dt)
    dv = xp.empty((b, sk, hkv, d8), dtype=dt)
    acc = None if deterministic else xp.empty((b, sq, hq, d8), dtype=np.float32)
    acc_strides = [np.int64(s // 4) for s in acc.strides[:3]] if acc is not None else [np.int64(0)] * 3
    left, right = window_args(problem)
    i32, i64, f32 = np.int32, np.int64, np.float32
    scale_log2 = score_multiplier(problem)  # bit-identical to the forward's
    scale = f32(problem.scale)
    lse_strides = (i64(hq * sq), i64(sq))
    ctype = CTYPES[dtype]
    rows_grid = (-(-sq // 4), hq, b)
    src = bwd_source()

    launches = [LaunchSpec(
        source=src, name_expression=f"{NS}flash_bwd_preprocess_kernel<{ctype}>", grid=rows_grid, block=(128, 1, 1),
        shared_bytes=0,
        args=(o, do, lse, lse_log2, dsum, acc, *_elem_strides(o), *_elem_strides(do), *lse_strides, *acc_strides,
              i32(sq), i32(d8), problem.seqlens_q))]

    common_tail = (i32(sq), i32(sk), i32(d8), i32(hq // hkv), problem.seqlens_q, problem.seqlens_k,
                   scale_log2, scale, i32(left), i32(right))
    drop = dropout_args(problem)  # seed_lo, seed_hi, threshold, 1/(1-p): the forward's keep-mask
    n_n = -(-sk // spec.block_n)
    launches.append(LaunchSpec(
        source=src, name_expression=spec.name_expression, grid=(n_n, hkv, b), block=(spec.threads, 1, 1),
        shared_bytes=spec.smem_bytes,
        args=(q, k, v, do, dk, dv, acc, lse_log2, dsum,
              *_elem_strides(q), *_elem_strides(k), *_elem_strides(v), *_elem_strides(do),
              *_elem_strides(dk), *_elem_strides(dv), *acc_strides, *lse_strides, *common_tail,
              *mask_args(xp, problem.block_mask, spec.block_m, spec.block_n, sq, sk, transposed=True), *drop)))
    if deterministic:
        n_m = -(-sq // dq_spec.block_m)
        launches.append(LaunchSpec(
            source=src, name_expression=dq_spec.name_expression, grid=(n_m, hq, b), block=(dq_spec.threads, 1, 1),
            shared_bytes=dq_spec.smem_bytes,
            args=(q, k, v, do, dq, lse_log2, dsum,
                  *_elem_strides(q), *_elem_strides(k), *_elem_strides(v), *_elem_strides(do),
                  *_elem_strides(dq), *lse_strides, *common_tail,
                  *mask_args(xp, problem.block_mask, dq_spec.block_m, dq_spec.block_n, sq, sk, transposed=False),
                  *drop)))
    else:
        launches.append(LaunchSpec(
            source=src, name_expression=f"{NS}flash_bwd_convert_dq_kernel<{ctype}>", grid=rows_grid,
            block=(128, 1, 1), shared_bytes=0,
            args=(acc, dq, *acc_strides, *_elem_strides(dq), i32(sq), i32(d8), scale)))
    used = (spec, dq_spec) if deterministic else (spec,)
    return BackwardLaunch(tuple(launches), used, dq, dk, dv, d)
