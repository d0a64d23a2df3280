"""Kernel specializations and THE tile tables of every kernel family, side by side.

A :class:`KernelSpec` is the small frozen value that picks one template instantiation: only what
changes generated code is in it (family, element type, head_dim, tile sizes, warps). Everything
else (lengths, strides, causal/window, seqlens, GQA, BlockMask, scale, dropout) travels in the
params struct at run time (:mod:`cuflash.cuda.params`), so one specialization per (family, dtype,
head_dim) serves every mask feature and the compile check stays small.

The families (``kernels/flash_fwd.cu``, ``kernels/flash_bwd.cu``):

``fwd``   FA2 Algorithm 1: a block owns ``block_m`` query rows (``block_m / warps`` per warp) and
          streams key tiles of ``block_n``.
``bwd``   FA2 Algorithm 2, transposed: a block owns ``block_n`` keys (16 per warp row group) and
          visits query tiles of ``block_m``; ``split = warps / (block_n / 16)`` parts share the query
          columns of S^T and the head-dim columns of dK/dV (``kernels/bwd_traits.cuh``).
``dq``    the deterministic dQ pass, in the forward's orientation (16 query rows per warp).

How to add a head dim
---------------------
1. Add it to :data:`NATIVE_HEAD_DIMS` (a multiple of 32: the backward computes dQ in 32-column
   chunks).
2. Add one row per family to :data:`TILES` (and a 99 KB row where the large one does not fit),
   with the reason for the choice.
3. Run ``python -m cuflash build --check``: it compiles every specialization with CuPy's compiler
   and options for sm_80 and sm_90 and fails on spills, on less than :data:`REGISTER_HEADROOM`
   spare registers, or on shared memory above the GPU's limit; tune the row until it passes.
4. The emulated kernel tests pick the new rows up from :func:`all_specs`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: head dims compiled natively; any other head_dim <= 256 runs on the next one up (zero columns).
NATIVE_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
#: element types the kernels take, by dtype name → CUDA type.
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
#: dynamic shared memory a block may opt into: A100 (sm_80) 163 KB, H100 (sm_90) 227 KB, sm_86/89 99 KB.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
#: compile targets → the compute capabilities whose GPUs run that cubin (8.x runs sm_80 code).
ARCH_FAMILIES = {80: (80, 86, 89), 90: (90,)}
#: registers per thread a kernel must leave unused (of the 255 ptxas may allocate), so that another
#: compiler version's allocation does not spill straight away.
REGISTER_HEADROOM = 8

KERNEL_NAMES = {"fwd": "cuflash::flash_fwd_kernel", "bwd": "cuflash::flash_bwd_kernel",
                "dq": "cuflash::flash_bwd_dq_kernel"}
#: kernel family → its source file in kernels/ (the backward file also holds the preprocess/convert kernels).
SOURCES = {"fwd": "flash_fwd.cu", "bwd": "flash_bwd.cu", "dq": "flash_bwd.cu"}
#: the backward's small kernels, one per element type, compiled with the bwd/dq family.
HELPERS = ("cuflash::flash_bwd_preprocess_kernel", "cuflash::flash_bwd_convert_dq_kernel")


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    warps: int
    why: str


@dataclass(frozen=True)
class KernelSpec:
    """One specialization: ``<family kernel><T, head_dim, block_m, block_n, warps>``."""

    family: str      # "fwd" | "bwd" | "dq"
    dtype: str       # "float16" | "bfloat16"
    head_dim: int    # native (padded) head dim
    block_m: int     # query rows of a tile (B_r)
    block_n: int     # keys of a tile (B_c)
    warps: int

    def __post_init__(self):
        if self.family not in KERNEL_NAMES or self.dtype not in CTYPES or self.head_dim not in NATIVE_HEAD_DIMS \
                or self.block_n % 16 or not _shape_ok(self):
            raise ValueError(f"invalid kernel specialization {self}")

    #: the modifier struct compiled in (kernels/mods.cuh; cuflash/cuda/modcode.py renders the others)
    mods: str = "cuflash::NoMods"

    @property
    def name_expression(self) -> str:
        return (f"{KERNEL_NAMES[self.family]}<{CTYPES[self.dtype]}, {self.head_dim}, {self.block_m}, "
                f"{self.block_n}, {self.warps}, {self.mods}>")

    @property
    def source(self) -> str:
        return SOURCES[self.family]

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def split(self) -> int:
        """bwd only: parts sharing a 16-key group's query columns and head-dim columns."""
        return self.warps // (self.block_n // 16)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory; rows padded by 8 elements (16 bytes) for conflict-free ldmatrix.
        The C++ traits compute the same (``kSmemBytes``); the compile check holds them equal."""
        row = self.head_dim + 8
        if self.family == "fwd":   # Q [block_m], K, V [block_n]
            return 2 * (self.block_m + 2 * self.block_n) * row
        if self.family == "dq":    # Q, dO [block_m], K, V [block_n]
            return 2 * (2 * self.block_m + 2 * self.block_n) * row
        # bwd: K, V [block_n], Q, dO [block_m] rows; dS^T (and P^T when split) [block_n][block_m + 8]; L, D fp32
        scores = (1 if self.split == 1 else 2) * self.block_n * (self.block_m + 8)
        return 2 * (2 * self.block_n * row + 2 * self.block_m * row + scores) + 8 * self.block_m

    @property
    def traits(self) -> str:
        """The C++ traits type whose ``kSmemBytes`` must equal :attr:`smem_bytes`."""
        t = {"fwd": "FwdTraits", "dq": "DqTraits", "bwd": "BwdTraits"}[self.family]
        return f"cuflash::{t}<{CTYPES[self.dtype]}, {self.head_dim}, {self.block_m}, {self.block_n}, {self.warps}>"


def _shape_ok(s: KernelSpec) -> bool:
    if s.family == "bwd":  # S^T at most 64 query columns per warp: its dropout bits fill one register per lane
        return (s.warps % (s.block_n // 16) == 0 and s.split in (1, 2, 4) and (s.block_m // s.split) % 16 == 0
                and s.block_m // s.split <= 64 and (s.head_dim // s.split) % 16 == 0)
    rows = s.block_m // s.warps
    return rows * s.warps == s.block_m and rows in (16, 32)


# ------------------------------------------------------------------------------------------------
# THE tile tables: per family and native head_dim, the row for GPUs that let a block use >= 163 KB
# of shared memory (A100 sm_80, H100 sm_90) and, where that one does not fit, the row for 99 KB GPUs
# (sm_86, sm_89). Register counts are those of `python -m cuflash build --check` (NVRTC with CuPy's
# options; no spills and REGISTER_HEADROOM spare registers required). The register file decides most
# rows. Forward, per thread: acc holds rows/warp * head_dim / 32 floats and S rows/warp * block_n / 32.
# Backward main kernel, per thread: dK and dV of 16 keys x head_dim/split columns (head_dim/split fp32
# registers) for the whole block, plus S^T and dP^T of 16 keys x block_m/split queries. dq pass: dQ of
# 16 rows x head_dim (head_dim / 2 fp32 registers) plus S and dP of 16 rows x block_n.
# ------------------------------------------------------------------------------------------------
TILES: dict[str, dict[int, tuple[Tile, Optional[Tile]]]] = {
    "fwd": {
        32: (Tile(128, 64, 4, "32 rows/warp: each K/V fragment read from smem feeds two m-tiles (halves smem "
                              "traffic per flop); acc 32 + S 64 regs; Q stays in registers; 20 KB smem"), None),
        64: (Tile(128, 64, 4, "FA2's choice: 32 rows/warp, acc 64 + S 64 regs; block_n 128 would need S = 128 "
                              "regs and spill; 36 KB smem, 2 blocks/SM"), None),
        96: (Tile(128, 64, 8, "32 rows/warp (acc 96 + S 64) spills on sm_90; 16 rows/warp x 8 warps keeps the "
                              "128-row tile (K/V reuse across 8 warps); 53 KB smem"), None),
        128: (Tile(128, 64, 8, "32 rows/warp needs acc 128 + S 64 and spills; 8 warps x 16 rows; 70 KB smem so "
                               "two blocks fit on A100/H100"), None),
        192: (Tile(128, 64, 8, "acc 96 + S 32 regs at 16 rows/warp (214/222 regs on sm_80/sm_90); 100 KB smem"),
              Tile(64, 64, 4, "the 128-row tile needs 100 KB > 99 KB; 64 rows x 4 warps: 75 KB, 220/228 regs")),
        256: (Tile(128, 32, 8, "acc 128 regs at 16 rows/warp; 64-key tiles reach 247 (nvcc 13: 255) of 255 "
                               "registers, 32-key tiles (S in 16 regs) 246; 99 KB smem: fits sm_86/sm_89 too"),
              None),
    },
    "bwd": {
        32: (Tile(64, 128, 8, "split 1: dK,dV 32 + S,dP 64 regs; 128 keys per block halve the Q/dO reloads per "
                              "key; block_m 128 would be 128 query columns per warp; 50 KB smem"), None),
        64: (Tile(64, 128, 8, "split 1 (FA2's 128 x 128 would need S,dP 128 regs): dK,dV 64 + S,dP 64 regs; "
                              "P^T and dS^T feed dV, dK from registers; 74 KB smem"), None),
        96: (Tile(64, 64, 8, "split 1 (64 x 128) sits at the register limit; split 2: dK,dV 96 + S,dP 32 regs, "
                             "P^T and dS^T shared through smem; 72 KB smem"), None),
        128: (Tile(64, 64, 8, "split 1 (64 x 128, FA2's layout) spills; split 2: dK,dV 128 + S,dP 32 regs; "
                              "89 KB smem, two blocks per SM on H100"), None),
        192: (Tile(64, 64, 8, "split 2: dK,dV 192 + S,dP 32 regs; 121 KB smem"),
              Tile(64, 32, 8, "64 x 64 needs 121 KB; split 4 over 32 keys: 87 KB")),
        256: (Tile(64, 32, 8, "split 2 (64 x 64) spilled; split 4 over 32 keys: dK,dV 128 + S,dP 16 regs; "
                              "111 KB smem (the >= 163 KB opt-in of sm_80/sm_90)"),
              None),  # 99 KB GPUs: no backward for head_dim 256 (32 x 32 x 4 warps spilled); select() says so
    },
    "dq": {
        32: (Tile(64, 64, 4, "dQ 16 + S,dP 32 regs; 27 KB smem"), None),
        64: (Tile(128, 64, 8, "64 x 64 x 4 warps spilled (ptxas caps it at 168 regs); 8 warps of 16 rows; "
                              "55 KB smem"), None),
        96: (Tile(64, 32, 4, "dQ 48 + S,dP 16 regs; 40 KB smem"), None),
        128: (Tile(64, 32, 4, "dQ 64 + S,dP 16 regs; 52 KB smem"), None),
        192: (Tile(64, 32, 4, "dQ 96 + S,dP 16 regs; 77 KB smem, fits 99 KB GPUs"), None),
        256: (Tile(64, 16, 4, "dQ 128 regs; 32-key tiles spilled, 16-key tiles fit; 85 KB smem"), None),
    },
}


#: rows that replace a table row when a score modifier is compiled in (it keeps the unmodified scores S0 in registers
#: for the backward's chain rule): only where the plain row would spill.
MODIFIED_TILES: dict[tuple[str, int], Tile] = {
    ("bwd", 192): Tile(64, 32, 8, "S0 spills the 64-key row (204 B on sm_80/sm_90); split 4 over 32 keys: 87 KB"),
}


def native_head_dim(head_dim: int) -> int:
    """The native head dim a problem of ``head_dim`` runs on (the next one up)."""
    for d in NATIVE_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {NATIVE_HEAD_DIMS[-1]} on the CUDA kernels, got {head_dim}")


def _spec(family: str, dtype: str, head_dim: int, tile: Tile) -> KernelSpec:
    return KernelSpec(family, dtype, head_dim, tile.block_m, tile.block_n, tile.warps)


def select(family: str, dtype: str, head_dim: int, max_smem: int = SMEM_LIMIT[80], *,
           modified: bool = False) -> KernelSpec:
    """The specialization of ``family`` the dispatcher runs for ``dtype`` and a (true) ``head_dim`` on a GPU
    allowing ``max_smem`` bytes of shared memory per block (``modified``: with a score modifier compiled in).
    ``dtype`` was validated by the backend."""
    d = native_head_dim(head_dim)
    rows = TILES[family][d]
    if modified and (family, d) in MODIFIED_TILES:
        rows = (MODIFIED_TILES[family, d],) + rows[1:]
    for tile in rows:
        if tile is not None and _spec(family, dtype, d, tile).smem_bytes <= max_smem:
            return _spec(family, dtype, d, tile)
    need = _spec(family, dtype, d, TILES[family][d][0]).smem_bytes
    raise ValueError(f"the CUDA {family} kernel for head_dim {head_dim} needs {need} bytes of shared memory per "
                     f"block; this GPU allows {max_smem} (head_dim {d} needs an A100/H100-class GPU)")


def all_specs(families=tuple(TILES)) -> list[KernelSpec]:
    """Every specialization the dispatcher can select on some supported GPU, in table order."""
    out: dict[KernelSpec, None] = {}
    for family in families:
        for dtype in CTYPES:
            for d in NATIVE_HEAD_DIMS:
                for tile in TILES[family][d]:
                    if tile is not None:
                        out.setdefault(_spec(family, dtype, d, tile))
    return list(out)


def specs_by_arch() -> dict[int, dict[KernelSpec, int]]:
    """Per compile target (80, 90), each specialization some GPU of its family selects, with the smallest
    shared-memory limit among those GPUs (what the compile check holds it to)."""
    out: dict[int, dict[KernelSpec, int]] = {}
    for arch, ccs in ARCH_FAMILIES.items():
        chosen: dict[KernelSpec, int] = {}
        for cc in ccs:
            limit = SMEM_LIMIT[cc]
            for family in TILES:
                for dtype in CTYPES:
                    for d in NATIVE_HEAD_DIMS:
                        try:
                            spec = select(family, dtype, d, limit)
                        except ValueError:  # head_dim 256 backward on 99 KB GPUs
                            continue
                        chosen[spec] = min(chosen.get(spec, limit), limit)
        out[arch] = chosen
    return out


def helper_names(dtype: str) -> list[str]:
    """The backward's preprocess and convert kernels for ``dtype`` (tiny; compiled with the family)."""
    return [f"{name}<{CTYPES[dtype]}>" for name in HELPERS]
