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

The float32/float64 families (``kernels/flash_fwd_wide.cu``, ``kernels/flash_bwd_wide.cu``; the same three
kernels, :data:`WIDE_TILES`) are specialized on an arithmetic, ``math`` (:data:`MATHS`): ``ffma`` (float32
FFMA), ``tf32`` / ``3xtf32`` (float32 on TF32 tensor cores, one product or CUTLASS's split into three),
``dmma`` (float64 tensor cores, ``mma.m8n8k4.f64``: A100, H100) and ``dfma`` (float64 FMA, for GPUs without
float64 tensor cores). ``wfwd``/``wbwd``/``wdq`` are their families.

How to add a head dim
---------------------
1. Add it to :data:`NATIVE_HEAD_DIMS` (a multiple of 32: the backward computes dQ in 32-column
   chunks).
2. Add one row per family to :data:`TILES` (and a 99 KB row where the large one does not fit),
   with the reason for the choice.
3. Run ``python -m cuflash build``: it compiles every specialization with CuPy's compiler
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
                "dq": "cuflash::flash_bwd_dq_kernel", "wfwd": "cuflash::flash_fwd_wide_kernel",
                "wbwd": "cuflash::flash_bwd_wide_kernel", "wdq": "cuflash::flash_bwd_wide_dq_kernel"}
#: kernel family → its source file in kernels/ (the backward file also holds the preprocess/convert kernels).
SOURCES = {"fwd": "flash_fwd.cu", "bwd": "flash_bwd.cu", "dq": "flash_bwd.cu", "wfwd": "flash_fwd_wide.cu",
           "wbwd": "flash_bwd_wide.cu", "wdq": "flash_bwd_wide.cu"}
#: the backward's small kernels, one per element type, compiled with the bwd/dq family.
HELPERS = ("cuflash::flash_bwd_preprocess_kernel", "cuflash::flash_bwd_convert_dq_kernel")
#: the same for the float32/float64 backward (wbwd/wdq).
WIDE_HELPERS = ("cuflash::flash_bwd_wide_preprocess_kernel", "cuflash::flash_bwd_wide_convert_dq_kernel")
#: the split-KV combine (kernels/combine.cuh), one per element type, compiled with the forward families:
#: ``<T, accumulator type>``.
COMBINE = "cuflash::flash_fwd_combine_kernel"
#: element types of the float32/float64 families, by dtype name → CUDA type.
WIDE_CTYPES = {"float32": "float", "float64": "double"}
#: the wide families' arithmetic (kernels/wide_mma.cuh): name → (element type, C++ type, rows of its mma tile).
#: The row count is the fragment height of the warp products: 16 for the m16n8k8 layout (and the float32 FMA
#: path, which keeps it), 8 for mma.m8n8k4.f64 (and the float64 FMA path).
MATHS = {"ffma": ("float32", "cuflash::wide::F32Fma", 16), "tf32": ("float32", "cuflash::wide::F32Tf32", 16),
         "3xtf32": ("float32", "cuflash::wide::F32Tf32x3", 16), "dmma": ("float64", "cuflash::wide::F64Dmma", 8),
         "dfma": ("float64", "cuflash::wide::F64Fma", 8)}
#: the arithmetics that stage P (and dS) through shared memory for the second product: the FMA paths, whose
#: threads need whole rows of P, where an mma's fragments are spread over a quad of lanes.
STAGED_MATHS = ("ffma", "dfma")
#: the public ``precision=`` values (cuflash.api) and, for float32, the arithmetic each selects.
PRECISIONS = {"ieee": "ffma", "3xtf32": "3xtf32", "tf32": "tf32"}
#: compute capabilities with float64 tensor cores (A100, H100): float64 runs on DMMA there, else on DFMA (sm_86/89
#: run the sm_80 cubin but have no float64 tensor-core path).
DMMA_CCS = (80, 90)


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    warps: int
    why: str


WIDE_FAMILIES = ("wfwd", "wbwd", "wdq")


def wide_math(dtype: str, precision: str = "ieee", cc: int = 80) -> str:
    """The arithmetic of the float32/float64 kernels for ``dtype``, the public ``precision`` and the GPU's compute
    capability: float32 by precision (:data:`PRECISIONS`), float64 on DMMA where the GPU has it, else DFMA."""
    if dtype == "float64":
        return "dmma" if cc in DMMA_CCS else "dfma"
    return PRECISIONS[precision]


@dataclass(frozen=True)
class KernelSpec:
    """One specialization: ``<family kernel><T, head_dim, block_m, block_n, warps>`` (the wide families:
    ``<Math, head_dim, block_m, block_n, warps>``, the math naming the element type)."""

    family: str      # "fwd" | "bwd" | "dq" | "wfwd" | "wbwd" | "wdq"
    dtype: str       # "float16" | "bfloat16" (wide families: "float32" | "float64")
    head_dim: int    # native (padded) head dim
    block_m: int     # query rows of a tile (B_r)
    block_n: int     # keys of a tile (B_c)
    warps: int

    def __post_init__(self):
        if self.wide:
            ok = (self.dtype in WIDE_CTYPES and self.math in MATHS and MATHS[self.math][0] == self.dtype
                  and self.head_dim in NATIVE_HEAD_DIMS and _wide_shape_ok(self))
        else:
            ok = (self.family in KERNEL_NAMES and self.dtype in CTYPES and self.head_dim in NATIVE_HEAD_DIMS
                  and not self.block_n % 16 and not self.math and _shape_ok(self))
        if not ok:
            raise ValueError(f"invalid kernel specialization {self}")

    #: the modifier struct compiled in (kernels/mods.cuh; cuflash/cuda/modcode.py renders the others)
    mods: str = "cuflash::NoMods"
    #: the wide families' arithmetic (:data:`MATHS`); "" for the 16-bit families
    math: str = ""

    @property
    def wide(self) -> bool:
        """A float32/float64 family (kernels/flash_*_wide.cu)."""
        return self.family in WIDE_FAMILIES

    @property
    def name_expression(self) -> str:
        first = MATHS[self.math][1] if self.wide else CTYPES[self.dtype]
        return (f"{KERNEL_NAMES[self.family]}<{first}, {self.head_dim}, {self.block_m}, "
                f"{self.block_n}, {self.warps}, {self.mods}>")

    @property
    def source(self) -> str:
        return SOURCES[self.family]

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def split(self) -> int:
        """bwd only: parts sharing a 16-key group's query columns and head-dim columns (wbwd: a group of the
        math's fragment height, 8 or 16 keys)."""
        return self.warps // (self.block_n // (MATHS[self.math][2] if self.wide else 16))

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory; rows padded by 8 elements (16 bytes) for conflict-free ldmatrix.
        The C++ traits compute the same (``kSmemBytes``); the compile check holds them equal."""
        if self.wide:
            return _wide_smem_bytes(self)
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
        if self.wide:
            t = {"wfwd": "WideFwdTraits", "wdq": "WideDqTraits", "wbwd": "WideBwdTraits"}[self.family]
            return (f"cuflash::wide::{t}<{MATHS[self.math][1]}, {self.head_dim}, {self.block_m}, {self.block_n}, "
                    f"{self.warps}>")
        t = {"fwd": "FwdTraits", "dq": "DqTraits", "bwd": "BwdTraits"}[self.family]
        return f"cuflash::{t}<{CTYPES[self.dtype]}, {self.head_dim}, {self.block_m}, {self.block_n}, {self.warps}>"


def _wide_smem_bytes(s: KernelSpec) -> int:
    """kernels/wide_traits.cuh's kSmemBytes. Tiles of head_dim columns have rows of head_dim + 4 elements; the
    forward's float64 V tile head_dim + 2 (kernels/wide_traits.cuh says why); P (or dS) staged for the FMA paths,
    and the backward's P^T, dS^T, rows of block + 4; the backward's L and D, block_m each; all in the element type."""
    size = 4 if s.dtype == "float32" else 8
    ld = s.head_dim + 4
    staged = s.math in STAGED_MATHS
    if s.family == "wfwd":
        ld_v = s.head_dim + (2 if size == 8 else 4)
        elems = s.block_m * ld + s.block_n * ld + s.block_n * ld_v + (s.block_m * (s.block_n + 4) if staged else 0)
    elif s.family == "wdq":
        elems = 2 * s.block_m * ld + 2 * s.block_n * ld + (s.block_m * (s.block_n + 4) if staged else 0)
    else:
        elems = 2 * s.block_n * ld + 2 * s.block_m * ld + 2 * s.block_n * (s.block_m + 4) + 2 * s.block_m
    return elems * size


def _wide_shape_ok(s: KernelSpec) -> bool:
    tm = MATHS[s.math][2]
    if s.family == "wbwd":  # key groups of tm keys, each split into equal parts of head-dim columns
        groups = s.block_n // tm
        return (groups * tm == s.block_n and groups >= 1 and s.warps % groups == 0 and s.block_m % 8 == 0
                and (s.head_dim // s.split) % 8 == 0 and s.head_dim % 32 == 0)
    rows = s.block_m // s.warps
    return rows * s.warps == s.block_m and rows % tm == 0 and rows // tm in (1, 2, 4) and s.block_n % 8 == 0


def _shape_ok(s: KernelSpec) -> bool:
    if s.family == "bwd":  # S^T at most 64 query columns per warp: its dropout bits fill one register per lane
        return (s.warps % (s.block_n // 16) == 0 and s.split in (1, 2, 4) and (s.block_m // s.split) % 16 == 0
                and s.block_m // s.split <= 64 and (s.head_dim // s.split) % 16 == 0)
    rows = s.block_m // s.warps
    return rows * s.warps == s.block_m and rows in (16, 32)


# ------------------------------------------------------------------------------------------------
# THE tile tables: per family and native head_dim, the row for GPUs that let a block use >= 163 KB
# of shared memory (A100 sm_80, H100 sm_90) and, where that one does not fit, the row for 99 KB GPUs
# (sm_86, sm_89). Register counts are those of `python -m cuflash build` (NVRTC with CuPy's
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
                               "two blocks fit on A100 (the H100 runs ARCH_TILES' row)"), None),
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


#: rows measured faster on one compute capability, tried there before the table's rows: (family, native head_dim,
#: compute capability) -> row. Only from a GPU run's tile sweep (``benchmarks.run``'s fig4_tiles, every candidate
#: timed side by side in one run, benchmarks/cases.py's TILE_CANDIDATES); A100 and the 99 KB GPUs keep TILES.
ARCH_TILES: dict[tuple[str, int, int], Tile] = {
    ("fwd", 128, 90): Tile(64, 128, 4, "H100 (2026-11-27, float16, N = 4096, not causal): 2.15 ms against the "
                                       "(128, 64, 8) row's 2.74 and (128, 32, 4)'s 2.16; 16 rows/warp, acc 64 + S 64 "
                                       "regs, 225 regs (234 with a modifier) on sm_90; 85 KB smem, two blocks per SM"),
    ("bwd", 128, 90): Tile(128, 64, 8, "H200 (2026-11-27, float16, N = 4096, not causal): 8.51 ms against the "
                                       "(64, 64, 8) row's 9.20; H100 (the same sweep, a run earlier): 11.47 against "
                                       "11.57; 218 regs on sm_90 (224 on sm_80), 137 KB smem, one block per SM. "
                                       "Without modifier code only (ARCH_PLAIN_ONLY)"),
}

#: the ARCH_TILES rows that run only with no modifier code compiled in (no score or mask modifier, no BlockMask): any
#: other call runs the table's row. ("bwd", 128, 90): 255 registers and 32 bytes spilled with the compile check's
#: modifier, which the compile check holds the table's row to instead.
ARCH_PLAIN_ONLY = frozenset({("bwd", 128, 90)})


#: rows that replace a table row when a score modifier is compiled in (it keeps the unmodified scores S0 in registers
#: for the backward's chain rule): only where the plain row would spill.
MODIFIED_TILES: dict[tuple[str, int], Tile] = {
    ("bwd", 192): Tile(64, 32, 8, "S0 spills the 64-key row (204 B on sm_80/sm_90); split 4 over 32 keys: 87 KB"),
}


# ------------------------------------------------------------------------------------------------
# The float32/float64 tables: family → math → head_dim → (row, None). One row each: the float32 rows and every
# float64 DFMA row fit the 99 KB of sm_86/89 (DFMA runs only there), the float64 DMMA rows the 163 KB of A100
# (DMMA runs only on sm_80/sm_90). Per thread, with r = the math's fragment rows (16 for float32, 8 for float64):
# forward acc = rows/warp * head_dim / 32 elements and S = rows/warp * block_n / 32 (a float64 element is two
# registers); backward dK and dV = r * (head_dim / split) / 32 each; dq pass dQ = rows/warp * head_dim / 32 plus S
# and dP. The register counts are `python -m cuflash build`'s (NVRTC 12.9, plain specialization; the wide
# kernels' budget is 240, wide_traits.cuh; the 3xTF32 rows since its products sum apart, kernels/wide_mma.cuh),
# which every row passes on sm_80 and sm_90 with 0 spills, plain and with
# the representative modifier; "(16 spilled ...)" records the 16-key row a row replaced.
# ------------------------------------------------------------------------------------------------
def _rows(table: dict) -> dict:
    return {d: (Tile(*row), None) for d, row in table.items()}


WIDE_TILES: dict[str, dict[str, dict[int, tuple[Tile, Optional[Tile]]]]] = {
    "wfwd": {
        "ffma": _rows({
            32: (64, 64, 4, "16 rows/warp: acc 16 + S 32 regs; P staged; 44 KB smem; 204/204 regs (sm_80/90)"),
            64: (64, 64, 4, "16 rows/warp: acc 32 + S 32 regs; P staged; 68 KB smem; 210/214 regs (sm_80/90)"),
            96: (64, 64, 4, "16 rows/warp: acc 48 + S 32 regs; P staged; 92 KB smem; 208/210 regs (sm_80/90)"),
            128: (64, 32, 4, "16 rows/warp: acc 64 + S 16 regs; P staged; 75 KB smem; 240/240 regs (sm_80/90)"),
            192: (32, 32, 2, "16 rows/warp: acc 96 + S 16 regs; P staged; 78 KB smem; 231/226 regs (sm_80/90)"),
            256: (32, 8, 2, "acc 128 regs; 8-key tiles (16 spilled 12 B); 50 KB smem; 240/240 regs (sm_80/90)"),
        }),
        "tf32": _rows({
            32: (64, 64, 4, "16 rows/warp: acc 16 + S 32 regs; 27 KB smem; 198/217 regs (sm_80/90)"),
            64: (64, 64, 4, "16 rows/warp: acc 32 + S 32 regs; 51 KB smem; 196/223 regs (sm_80/90)"),
            96: (64, 64, 4, "16 rows/warp: acc 48 + S 32 regs; 75 KB smem; 195/216 regs (sm_80/90)"),
            128: (64, 32, 4, "16 rows/warp: acc 64 + S 16 regs; 66 KB smem; 204/200 regs (sm_80/90)"),
            192: (64, 32, 4, "16 rows/warp: acc 96 + S 16 regs; 98 KB smem; 209/209 regs (sm_80/90)"),
            256: (32, 16, 2, "acc 128 regs at 16 rows/warp; 2 warps; 65 KB smem; 228/226 regs (sm_80/90)"),
        }),
        "3xtf32": _rows({
            32: (64, 64, 4, "16 rows/warp: acc 16 + S 32 regs; 27 KB smem; 212/238 regs (sm_80/90)"),
            64: (64, 64, 4, "16 rows/warp: acc 32 + S 32 regs; 51 KB smem; 240/238 regs (sm_80/90)"),
            96: (64, 64, 4, "16 rows/warp: acc 48 + S 32 regs; 75 KB smem; 240/240 regs (sm_80/90)"),
            128: (64, 16, 4, "16 rows/warp: acc 64 + S 8 regs; 50 KB smem; 237/232 regs (sm_80/90); (64, 32, 4) spilled 12 B with a modifier"),
            192: (64, 32, 4, "16 rows/warp: acc 96 + S 16 regs; 98 KB smem; 214/230 regs (sm_80/90)"),
            256: (32, 16, 2, "acc 128 regs at 16 rows/warp; 2 warps; 65 KB smem; 239/240 regs (sm_80/90)"),
        }),
        "dmma": _rows({
            32: (64, 64, 4, "16 rows/warp: acc 16 + S 32 doubles; 53 KB smem; 228/232 regs (sm_80/90)"),
            64: (64, 32, 4, "16 rows/warp: acc 32 + S 16 doubles; 68 KB smem; 218/224 regs (sm_80/90)"),
            96: (32, 32, 4, "8 rows/warp: acc 24 + S 8 doubles; 74 KB smem; 178/184 regs (sm_80/90)"),
            128: (32, 32, 4, "8 rows/warp: acc 32 + S 8 doubles; 98 KB smem; 192/196 regs (sm_80/90)"),
            192: (32, 16, 4, "8 rows/warp: acc 48 + S 4 doubles; 98 KB smem; 228/218 regs (sm_80/90)"),
            256: (32, 16, 4, "8 rows/warp: acc 64 + S 4 doubles; 130 KB smem; 240/230 regs (sm_80/90)"),
        }),
        "dfma": _rows({
            32: (32, 32, 4, "8 rows/warp: acc 8 + S 8 doubles; P staged; 36 KB smem; 132 regs (sm_80)"),
            64: (32, 32, 4, "8 rows/warp: acc 16 + S 8 doubles; P staged; 60 KB smem; 164 regs (sm_80)"),
            96: (32, 32, 4, "8 rows/warp: acc 24 + S 8 doubles; P staged; 84 KB smem; 189 regs (sm_80)"),
            128: (32, 16, 4, "8 rows/warp: acc 32 + S 4 doubles; P staged; 71 KB smem; 202 regs (sm_80)"),
            192: (16, 16, 2, "8 rows/warp: acc 48 + S 4 doubles; P staged; 76 KB smem; 238 regs (sm_80)"),
            256: (16, 8, 2, "8 rows/warp: acc 64 + S 2 doubles; P staged; 66 KB smem; 232 regs (sm_80)"),
        }),
    },
    "wbwd": {
        "ffma": _rows({
            32: (32, 32, 4, "2 key group(s) of 16 x split 2: dK, dV 8 regs each; 27 KB smem; 158/156 regs (sm_80/90)"),
            64: (32, 64, 8, "4 key group(s) of 16 x split 2: dK, dV 16 regs each; 69 KB smem; 180/182 regs (sm_80/90)"),
            96: (32, 32, 4, "2 key group(s) of 16 x split 2: dK, dV 24 regs each; 59 KB smem; 184/184 regs (sm_80/90)"),
            128: (32, 32, 4, "2 key group(s) of 16 x split 2: dK, dV 32 regs each; 75 KB smem; 204/189 regs (sm_80/90)"),
            192: (16, 32, 8, "2 key group(s) of 16 x split 4: dK, dV 24 regs each; 79 KB smem; 184/171 regs (sm_80/90)"),
            256: (16, 16, 4, "1 key group(s) of 16 x split 4: dK, dV 32 regs each; 68 KB smem; 196/168 regs (sm_80/90)"),
        }),
        "tf32": _rows({
            32: (32, 32, 4, "2 key group(s) of 16 x split 2: dK, dV 8 regs each; 27 KB smem; 150/150 regs (sm_80/90)"),
            64: (32, 64, 8, "4 key group(s) of 16 x split 2: dK, dV 16 regs each; 69 KB smem; 180/166 regs (sm_80/90)"),
            96: (32, 32, 4, "2 key group(s) of 16 x split 2: dK, dV 24 regs each; 59 KB smem; 182/178 regs (sm_80/90)"),
            128: (32, 32, 4, "2 key group(s) of 16 x split 2: dK, dV 32 regs each; 75 KB smem; 180/184 regs (sm_80/90)"),
            192: (16, 32, 8, "2 key group(s) of 16 x split 4: dK, dV 24 regs each; 79 KB smem; 171/172 regs (sm_80/90)"),
            256: (16, 16, 4, "1 key group(s) of 16 x split 4: dK, dV 32 regs each; 68 KB smem; 204/196 regs (sm_80/90)"),
        }),
        "3xtf32": _rows({
            32: (32, 32, 4, "2 key group(s) of 16 x split 2: dK, dV 8 regs each; 27 KB smem; 150/150 regs (sm_80/90)"),
            64: (32, 64, 8, "4 key group(s) of 16 x split 2: dK, dV 16 regs each; 69 KB smem; 174/170 regs (sm_80/90)"),
            96: (32, 32, 4, "2 key group(s) of 16 x split 2: dK, dV 24 regs each; 59 KB smem; 170/168 regs (sm_80/90)"),
            128: (32, 32, 4, "2 key group(s) of 16 x split 2: dK, dV 32 regs each; 75 KB smem; 192/192 regs (sm_80/90)"),
            192: (16, 32, 8, "2 key group(s) of 16 x split 4: dK, dV 24 regs each; 79 KB smem; 150/152 regs (sm_80/90)"),
            256: (16, 16, 4, "1 key group(s) of 16 x split 4: dK, dV 32 regs each; 68 KB smem; 155/153 regs (sm_80/90)"),
        }),
        "dmma": _rows({
            32: (32, 32, 8, "4 key group(s) of 8 x split 2: dK, dV 4 doubles each; 54 KB smem; 142/136 regs (sm_80/90)"),
            64: (32, 32, 8, "4 key group(s) of 8 x split 2: dK, dV 8 doubles each; 86 KB smem; 160/156 regs (sm_80/90)"),
            96: (32, 32, 8, "4 key group(s) of 8 x split 2: dK, dV 12 doubles each; 118 KB smem; 171/170 regs (sm_80/90)"),
            128: (16, 32, 8, "4 key group(s) of 8 x split 2: dK, dV 16 doubles each; 109 KB smem; 206/193 regs (sm_80/90)"),
            192: (16, 16, 4, "2 key group(s) of 8 x split 2: dK, dV 24 doubles each; 103 KB smem; 238/238 regs (sm_80/90)"),
            256: (16, 16, 8, "2 key group(s) of 8 x split 4: dK, dV 16 doubles each; 135 KB smem; 202/188 regs (sm_80/90)"),
        }),
        "dfma": _rows({
            32: (32, 32, 8, "4 key group(s) of 8 x split 2: dK, dV 4 doubles each; 54 KB smem; 153 regs (sm_80)"),
            64: (32, 32, 8, "4 key group(s) of 8 x split 2: dK, dV 8 doubles each; 86 KB smem; 174 regs (sm_80)"),
            96: (16, 32, 8, "4 key group(s) of 8 x split 2: dK, dV 12 doubles each; 85 KB smem; 199 regs (sm_80)"),
            128: (16, 16, 4, "2 key group(s) of 8 x split 2: dK, dV 16 doubles each; 71 KB smem; 225 regs (sm_80)"),
            192: (16, 8, 4, "1 key group(s) of 8 x split 4: dK, dV 12 doubles each; 76 KB smem; 194 regs (sm_80)"),
            256: (8, 8, 4, "1 key group(s) of 8 x split 4: dK, dV 16 doubles each; 67 KB smem; 226 regs (sm_80)"),
        }),
    },
    "wdq": {
        "ffma": _rows({
            32: (64, 32, 4, "16 rows/warp: dQ 16 + S, dP 16 regs each; dS staged; 36 KB smem; 194/194 regs (sm_80/90)"),
            64: (64, 32, 4, "16 rows/warp: dQ 32 + S, dP 16 regs each; dS staged; 60 KB smem; 196/188 regs (sm_80/90)"),
            96: (64, 32, 4, "16 rows/warp: dQ 48 + S, dP 16 regs each; dS staged; 84 KB smem; 198/204 regs (sm_80/90)"),
            128: (32, 32, 2, "16 rows/warp: dQ 64 + S, dP 16 regs each; dS staged; 70 KB smem; 204/204 regs (sm_80/90)"),
            192: (32, 16, 2, "16 rows/warp: dQ 96 + S, dP 8 regs each; dS staged; 76 KB smem; 222/239 regs (sm_80/90)"),
            256: (16, 8, 1, "dQ 128 regs; 8-key tiles, 1 warp (16 spilled 44 B on sm_90); 50 KB smem; 240/240 regs (sm_80/90)"),
        }),
        "tf32": _rows({
            32: (64, 32, 4, "16 rows/warp: dQ 16 + S, dP 16 regs each; 27 KB smem; 189/188 regs (sm_80/90)"),
            64: (64, 32, 4, "16 rows/warp: dQ 32 + S, dP 16 regs each; 51 KB smem; 195/199 regs (sm_80/90)"),
            96: (64, 32, 4, "16 rows/warp: dQ 48 + S, dP 16 regs each; 75 KB smem; 204/212 regs (sm_80/90)"),
            128: (32, 32, 2, "16 rows/warp: dQ 64 + S, dP 16 regs each; 66 KB smem; 197/195 regs (sm_80/90)"),
            192: (32, 32, 2, "16 rows/warp: dQ 96 + S, dP 16 regs each; 98 KB smem; 224/220 regs (sm_80/90)"),
            256: (32, 8, 2, "dQ 128 regs; 8-key tiles (16 spilled 24 B at 3xTF32 on sm_90); 81 KB smem; 202/202 regs (sm_80/90)"),
        }),
        "3xtf32": _rows({
            32: (64, 32, 4, "16 rows/warp: dQ 16 + S, dP 16 regs each; 27 KB smem; 138/146 regs (sm_80/90)"),
            64: (64, 32, 4, "16 rows/warp: dQ 32 + S, dP 16 regs each; 51 KB smem; 165/188 regs (sm_80/90)"),
            96: (64, 32, 4, "16 rows/warp: dQ 48 + S, dP 16 regs each; 75 KB smem; 192/197 regs (sm_80/90)"),
            128: (32, 32, 2, "16 rows/warp: dQ 64 + S, dP 16 regs each; 66 KB smem; 225/227 regs (sm_80/90)"),
            192: (32, 32, 2, "16 rows/warp: dQ 96 + S, dP 16 regs each; 98 KB smem; 230/236 regs (sm_80/90)"),
            256: (32, 8, 2, "dQ 128 regs; 8-key tiles (16 spilled 24 B at 3xTF32 on sm_90); 81 KB smem; 226/240 regs (sm_80/90)"),
        }),
        "dmma": _rows({
            32: (32, 32, 4, "8 rows/warp: dQ 8 + S, dP 8 doubles each; 36 KB smem; 150/152 regs (sm_80/90)"),
            64: (32, 32, 4, "8 rows/warp: dQ 16 + S, dP 8 doubles each; 68 KB smem; 176/174 regs (sm_80/90)"),
            96: (32, 16, 4, "8 rows/warp: dQ 24 + S, dP 4 doubles each; 75 KB smem; 154/156 regs (sm_80/90)"),
            128: (32, 16, 4, "8 rows/warp: dQ 32 + S, dP 4 doubles each; 99 KB smem; 174/172 regs (sm_80/90)"),
            192: (16, 8, 2, "8 rows/warp: dQ 48 + S, dP 2 doubles each; 8-key tiles (16 spilled 60 B on sm_90 with a modifier); 74 KB smem; 224/222 regs (sm_80/90)"),
            256: (16, 8, 2, "8 rows/warp: dQ 64 + S, dP 2 doubles each; 8-key tiles (16 spilled 120 B on sm_90; (8, 8, 1) 12 B with a modifier); 98 KB smem; 240/239 regs (sm_80/90)"),
        }),
        "dfma": _rows({
            32: (32, 32, 4, "8 rows/warp: dQ 8 + S, dP 8 doubles each; dS staged; 45 KB smem; 183 regs (sm_80)"),
            64: (32, 32, 4, "8 rows/warp: dQ 16 + S, dP 8 doubles each; dS staged; 77 KB smem; 203 regs (sm_80)"),
            96: (32, 16, 4, "8 rows/warp: dQ 24 + S, dP 4 doubles each; dS staged; 80 KB smem; 188 regs (sm_80)"),
            128: (16, 16, 2, "8 rows/warp: dQ 32 + S, dP 4 doubles each; dS staged; 68 KB smem; 218 regs (sm_80)"),
            192: (16, 8, 2, "8 rows/warp: dQ 48 + S, dP 2 doubles each; dS staged; 8-key tiles (16 spilled 60 B on sm_90 with a modifier); 75 KB smem; 232 regs (sm_80)"),
            256: (16, 8, 2, "8 rows/warp: dQ 64 + S, dP 2 doubles each; dS staged; 8-key tiles (16 spilled 120 B on sm_90; (8, 8, 1) 12 B with a modifier); 99 KB smem; 240 regs (sm_80)"),
        }),
    },
}
#: every family with a tile table
FAMILIES = tuple(TILES) + WIDE_FAMILIES


def native_head_dim(head_dim: int) -> int:
    """The native head dim a problem of ``head_dim`` runs on (the next one up)."""
    for d in NATIVE_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {NATIVE_HEAD_DIMS[-1]} on the CUDA kernels, got {head_dim}")


def _spec(family: str, dtype: str, head_dim: int, tile: Tile, math: str = "") -> KernelSpec:
    return KernelSpec(family, dtype, head_dim, tile.block_m, tile.block_n, tile.warps, math=math)


def _table(family: str, math: str = "") -> dict:
    return WIDE_TILES[family][math] if family in WIDE_FAMILIES else TILES[family]


def select(family: str, dtype: str, head_dim: int, max_smem: int = SMEM_LIMIT[80], *,
           modified: bool = False, plain: Optional[bool] = None, math: str = "", cc: int = 80) -> KernelSpec:
    """The specialization of ``family`` the dispatcher runs for ``dtype`` and a (true) ``head_dim`` on a GPU of
    compute capability ``cc`` allowing ``max_smem`` bytes of shared memory per block (``modified``: with a score
    modifier compiled in; ``plain``: no modifier code at all, default ``not modified`` (:data:`ARCH_PLAIN_ONLY`);
    ``math``: the wide families' arithmetic, :func:`wide_math`). ``dtype`` was validated by the backend."""
    d = native_head_dim(head_dim)
    if family in WIDE_FAMILIES and (math not in MATHS or MATHS[math][0] != dtype):
        raise ValueError(f"the {family} kernels need a math for {dtype} ({', '.join(MATHS)}), got {math!r}")
    rows = _table(family, math)[d]
    if modified and (family, d) in MODIFIED_TILES:
        rows = (MODIFIED_TILES[family, d],) + rows[1:]
    elif family in TILES and (family, d, cc) in ARCH_TILES and (
            (not modified if plain is None else plain) or (family, d, cc) not in ARCH_PLAIN_ONLY):
        rows = (ARCH_TILES[family, d, cc],) + rows
    for tile in rows:
        if tile is not None and _spec(family, dtype, d, tile, math).smem_bytes <= max_smem:
            return _spec(family, dtype, d, tile, math)
    need = _spec(family, dtype, d, _table(family, math)[d][0], math).smem_bytes
    raise ValueError(f"the CUDA {family} kernel for head_dim {head_dim} needs {need} bytes of shared memory per "
                     f"block; this GPU allows {max_smem} (head_dim {d} needs an A100/H100-class GPU)")


def _variants(family: str, cc=None):
    """(dtype, math) pairs of ``family`` (those a GPU of compute capability ``cc`` runs, when given)."""
    if family not in WIDE_FAMILIES:
        return [(dtype, "") for dtype in CTYPES]
    return [(dtype, m) for m, (dtype, _, _) in MATHS.items()
            if cc is None or dtype == "float32" or m == wide_math(dtype, cc=cc)]


def all_specs(families=FAMILIES) -> list[KernelSpec]:
    """Every specialization the dispatcher can select on some supported GPU, in table order."""
    out: dict[KernelSpec, None] = {}
    for family in families:
        for dtype, math in _variants(family):
            for d in NATIVE_HEAD_DIMS:
                arch_rows = tuple(t for (f, hd, _), t in ARCH_TILES.items() if (f, hd) == (family, d))
                for tile in arch_rows + _table(family, math)[d]:
                    if tile is not None:
                        out.setdefault(_spec(family, dtype, d, tile, math))
    return list(out)


def specs_by_arch() -> dict[int, dict[KernelSpec, int]]:
    """Per compile target (80, 90), each specialization some GPU of its family selects, with the smallest
    shared-memory limit among those GPUs (what the compile check holds it to)."""
    out: dict[int, dict[KernelSpec, int]] = {}
    for arch, ccs in ARCH_FAMILIES.items():
        chosen: dict[KernelSpec, int] = {}
        for cc in ccs:
            limit = SMEM_LIMIT[cc]
            for family in FAMILIES:
                for dtype, math in _variants(family, cc):
                    for d in NATIVE_HEAD_DIMS:
                        try:
                            spec = select(family, dtype, d, limit, math=math, cc=cc)
                        except ValueError:  # head_dim 256 backward on 99 KB GPUs
                            continue
                        chosen[spec] = min(chosen.get(spec, limit), limit)
        out[arch] = chosen
    return out


def helper_names(dtype: str) -> list[str]:
    """The backward's preprocess and convert kernels for ``dtype`` (tiny; compiled with the family)."""
    if dtype in WIDE_CTYPES:
        return [f"{name}<{WIDE_CTYPES[dtype]}>" for name in WIDE_HELPERS]
    return [f"{name}<{CTYPES[dtype]}>" for name in HELPERS]


#: query rows per 128-thread block of the backward's helper kernels, by family: ``kHelperRows`` of
#: kernels/flash_bwd.cu (8 lanes a row, 16-byte accesses), ``kWideHelperRows`` of kernels/flash_bwd_wide.cu (a warp a
#: row); every compilation asserts them (cuflash.cuda.source.kernel_source)
HELPER_ROWS = {"bwd": ("kHelperRows", 16), "wbwd": ("kWideHelperRows", 4)}


def helper_rows(dtype: str) -> int:
    """Query rows per thread block of :func:`helper_names`' kernels (:data:`HELPER_ROWS`)."""
    return HELPER_ROWS["wbwd" if dtype in WIDE_CTYPES else "bwd"][1]


def combine_name(dtype: str) -> str:
    """The split-KV combine kernel for ``dtype`` (workspaces in float32; float64 for float64)."""
    acc = "double" if dtype == "float64" else "float"
    return f"{COMBINE}<{WIDE_CTYPES.get(dtype) or CTYPES[dtype]}, {acc}>"


def forward_module(spec: KernelSpec, dtype: str) -> tuple:
    """The names a forward kernel's module is compiled with, the same for every call that launches it: the kernel
    and its dtype's split-KV combine. A module is one NVRTC compile of the whole kernel file; a split KV-cache call
    compiled it once more for the combine, after attention or ``warmup`` had compiled it without."""
    return (spec.name_expression, combine_name(dtype))


def source_helpers(source: str) -> list[str]:
    """The helper kernels compiled with every module of ``source`` (the backward files' preprocess/convert, the
    forward files' split-KV combine)."""
    if source == SOURCES["fwd"]:
        return [combine_name(dt) for dt in CTYPES]
    if source == SOURCES["wfwd"]:
        return [combine_name(dt) for dt in WIDE_CTYPES]
    if source == SOURCES["bwd"]:
        return [n for dt in CTYPES for n in helper_names(dt)]
    if source == SOURCES["wbwd"]:
        return [n for dt in WIDE_CTYPES for n in helper_names(dt)]
    return []
