"""What is measured: :class:`Case` (one configuration) and :func:`suite` (every case of a run)."""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Optional

import numpy as np

OPS = ("fwd", "bwd", "fwd_bwd")
DEVICES = ("cpu", "cuda")
MODES = ("smoke", "quick", "full")
OP_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
FIGURES = ("product", "throughput", "memory", "blocksparse", "tiles", "decode", "wide")
FIGURE_FILES = {"product": "product", "throughput": "fig1_throughput", "memory": "fig2_memory",
                "blocksparse": "fig3_blocksparse", "tiles": "fig4_tiles", "decode": "fig5_decode",
                "wide": "fig6_wide"}
FIGURE_TITLES = {
    "product": "NumPy backend target: fp32, N=4096, 4 heads, head_dim 64, forward",
    "throughput": "Attention throughput vs sequence length (FA benchmark configuration)",
    "memory": "Speedup and peak memory vs standard attention",
    "blocksparse": "Block-sparse attention: runtime vs BlockMask density",
    "tiles": "Forward runtime vs key-block (tile) size",
    "decode": "Decode-shaped attention: bandwidth vs seqlen_q",
    "wide": "float32 (precision ieee / 3xtf32 / tf32) and float64 attention vs naive attention in the same arithmetic",
}
GPU_IMPLS = ("cuflash", "torch-flash", "torch-cudnn", "torch-efficient", "torch-math", "cupy-standard",
             "jax-cudnn", "jax-xla")
CPU_IMPLS = ("cuflash", "numpy", "numpy-inplace", "torch-flash", "torch-math")
PRODUCT_IMPLS = ("cuflash", "numpy", "numpy-inplace", "torch-flash")  # torch-flash: SDPA's CPU pick for fp32
#: the float32/float64 figure: cuflash against naive attention in the same arithmetic class (CuPy's cuBLAS, PyTorch's
#: SDPA math backend), each dtype x precision below
WIDE_IMPLS = ("cuflash", "cupy-naive", "torch-math")
WIDE_MODES = (("float32", "ieee"), ("float32", "3xtf32"), ("float32", "tf32"), ("float64", "ieee"))
#: float64 tensor-core peak of an H100 SXM (DMMA, dense), TFLOP/s: the float64 target is half of it at long seqlens
H100_FP64_TENSOR_PEAK = 67.0


@dataclass(frozen=True)
class Case:
    """One measured configuration. Arrays are ``(batch, seqlen, heads, head_dim)``.

    Parameters
    ----------
    figure : str
        The figure the case belongs to (:data:`FIGURES`, or a pytest-benchmark group of its own).
    device : {"cpu", "cuda"}
    op : {"fwd", "bwd", "fwd_bwd"}
    dtype : str
        NumPy dtype name, or ``"bfloat16"``.
    batch, heads, seqlen_q, seqlen_k, head_dim : int
    causal : bool, keyword-only
    density : float or None, keyword-only
        Realized BlockMask density; None: no mask.
    mask_block : tuple of int or None, keyword-only
        BlockMask block ``(rows, cols)`` when ``density`` is set.
    block_k : int or None, keyword-only
        Key-tile size (the tile sweep only).
    tile : tuple of int or None, keyword-only
        ``(block_m, block_n, warps)`` of the forward kernel, or with ``op="bwd"`` of the backward's main kernel
        (the CUDA tile sweep only; ``block_k`` is its ``block_n``): a candidate row for the tile table, measured
        against the table's own.
    impls : tuple of str, keyword-only
        The implementations a suite runs on this case.
    precision : str, keyword-only
        cuflash's ``precision=`` for float32 (the float32/float64 figure); the baselines run in the same accuracy
        class ("tf32": TF32 matmuls, otherwise full float32).
    """

    figure: str
    device: str
    op: str
    dtype: str
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    _: KW_ONLY
    causal: bool = False
    density: Optional[float] = None
    mask_block: Optional[tuple] = None
    block_k: Optional[int] = None
    tile: Optional[tuple] = None
    impls: tuple = ()
    precision: str = "ieee"

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.density is not None and self.mask_block is None:
            raise ValueError("mask_block must be given with density")
        if self.tile is not None and (len(self.tile) != 3 or self.block_k != self.tile[1]):
            raise ValueError(f"tile must be (block_m, block_n, warps) with block_n == block_k, got {self.tile!r} "
                             f"and block_k {self.block_k!r}")

    @property
    def inputs_key(self) -> tuple:
        """What the input arrays depend on: cases sharing it share their inputs."""
        return (self.device, self.dtype, self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim,
                self.density, self.mask_block)

    @property
    def flops(self) -> float:
        """FLOPs of one call (FA convention, see :mod:`benchmarks`)."""
        f = 4.0 * self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim
        if self.causal and self.seqlen_q == self.seqlen_k:
            f /= 2
        if self.density is not None:
            f *= self.density
        return f * OP_FLOP_FACTOR[self.op]

    @property
    def bytes(self) -> int:
        """Compulsory bytes: inputs read once and outputs written once (lse float32)."""
        item = 2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize
        bh, d = self.batch * self.heads, self.head_dim
        fwd = bh * d * (2 * self.seqlen_q + 2 * self.seqlen_k) * item          # Q, K, V in; O out
        bwd = (bh * d * (3 * self.seqlen_q + 2 * self.seqlen_k) * item          # Q, O, dO, K, V in
               + bh * self.seqlen_q * 4                                         # lse in
               + bh * d * (self.seqlen_q + 2 * self.seqlen_k) * item)           # dQ, dK, dV out
        return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[self.op]

    def label(self) -> str:
        """One line naming the case (progress bar, logs)."""
        extra = "" if self.density is None else f" density={self.density:g}"
        extra += "" if self.block_k is None else f" block_k={self.block_k}"
        extra += "" if self.tile is None else f" tile={'x'.join(map(str, self.tile))}"
        extra += "" if self.precision == "ieee" else f" precision={self.precision}"
        return (f"{self.figure} {self.op} {self.dtype} B={self.batch} H={self.heads} Sq={self.seqlen_q} "
                f"Sk={self.seqlen_k} d={self.head_dim}{' causal' if self.causal else ''}{extra}")


def fa_config(seqlen: int, head_dim: int, *, tokens: int, hidden: int) -> tuple[int, int]:
    """FA benchmark shape: ``batch = tokens / seqlen`` (at least 1), ``heads = hidden / head_dim``."""
    return max(1, tokens // seqlen), max(1, hidden // head_dim)


def realized_density(density: float, n_key_blocks: int) -> float:
    """The density a mask keeping ``round(density · nk)`` (at least 1) key blocks per row has."""
    return max(1, round(density * n_key_blocks)) / n_key_blocks


def product_case(*, impls=PRODUCT_IMPLS) -> Case:
    """The NumPy backend's target: fp32, N = 4096, 4 heads, head_dim 64, forward, 1 batch: at least
    4x faster than naive NumPy (``numpy``) and within 3x of PyTorch's CPU SDPA (``torch-flash``)."""
    return Case("product", "cpu", "fwd", "float32", 1, 4, 4096, 4096, 64, impls=tuple(impls))


# ------------------------------------------------------------------------------------------------
# Suites: (device, mode) → case list. Sizes are what one run can afford: a GPU "full" run must fit
# one 10-minute device call; a CPU "quick" run must finish in under a minute on 2 cores; "smoke" is
# the quick code paths at toy sizes (tests; on "cuda" small enough for the CPU emulator).
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SuiteSpec:
    tokens: int                 # FA configuration: batch * seqlen
    hidden: int                 # FA configuration: heads * head_dim
    dtype: str
    seqlens: tuple
    head_dims: tuple
    causals: tuple
    ops: tuple
    memory_seqlens: tuple
    memory_head_dim: int
    sparse_seqlen: int
    densities: tuple
    mask_block: tuple
    tile_seqlen: int
    tile_head_dims: tuple
    block_ks: tuple
    decode_seqlen_k: tuple
    decode_seqlen_q: tuple
    decode_batch: int
    decode_heads: int
    decode_head_dim: int
    sparse_ops: tuple = ("fwd",)
    wide_seqlens: tuple = ()        # the float32/float64 figure (GPU only): seqlens, ops, head_dim
    wide_ops: tuple = ("fwd",)
    wide_head_dim: int = 64
    # the CUDA tile sweep: per (op, head_dim), the tiles (block_m, block_n, warps) to time, the A100 table's row
    # first (each passes the compile check: no spill, register headroom; on an H100 the row it runs, ARCH_TILES',
    # is among them); empty: sweep block_ks over the row this GPU runs
    tile_candidates: tuple = ()


#: float16 tiles to time beside the A100 table's row (first), per op and head_dim 64 and 128: the first H100 run
#: measured the table's rows at 0.58-0.81 (forward d64), 0.36-0.71 (forward d128) and 0.38-0.62 (backward) of
#: FlashAttention-2's speed. Each passes the compile check on sm_80 and sm_90 (registers of 255 on sm_80/sm_90, no
#: spill, headroom): forward d64 (128, 128, 8) 178/183, (64, 128, 4) 178/177, (64, 64, 4) 156/154; forward d128
#: (128, 32, 4) 242/243 (32 rows per warp, as FA2: each K/V fragment feeds two m-tiles), (128, 128, 8) 219/222,
#: (64, 128, 4) 222/225, (64, 64, 4) 168/172 ((128, 64, 4) spilled 348/32 bytes); backward (the main kernel; dQ by
#: atomics) d64 (128, 64, 8) 174/176, (64, 64, 4) 216/222; d128 (128, 64, 8) 224/218, 137 KB of shared memory
#: ((64, 128, 8), FA2's, spilled 24/16 bytes; (32, 128, 8) and (32, 64, 4) left under 8 spare registers). The second
#: H100 run (2026-11-27, N = 4096) timed forward d128 (64, 128, 4) at 2.15 ms and (128, 32, 4) at 2.16 against the
#: row's 2.74: cuflash.cuda.specs.ARCH_TILES now gives sm_90 (64, 128, 4); the other rows were within 1% of the best.
#: The H200 run of the same day timed backward d128 (128, 64, 8) at 8.51 ms against the row's (64, 64, 8) 9.20 (the
#: H100: 11.47 and 11.57): sm_90 runs (128, 64, 8) there, without a modifier.
TILE_CANDIDATES = (("fwd", 64, ((128, 64, 4), (128, 128, 8), (64, 128, 4), (64, 64, 4))),
                   ("fwd", 128, ((128, 64, 8), (128, 32, 4), (128, 128, 8), (64, 128, 4), (64, 64, 4))),
                   ("bwd", 64, ((64, 128, 8), (128, 64, 8), (64, 64, 4))),
                   ("bwd", 128, ((64, 64, 8), (128, 64, 8))))


def _cuda_spec(mode: str) -> SuiteSpec:
    if mode == "full":
        return SuiteSpec(16384, 2048, "float16", (512, 1024, 2048, 4096, 8192, 16384), (64, 128),
                         (False, True), OPS, (1024, 2048, 4096, 8192, 16384, 32768, 65536), 64,
                         4096, (1.0, 0.5, 0.25, 0.125, 0.0625), (128, 128), 4096, (64, 128),
                         (32, 64, 128), (16384, 65536), (1, 2, 4, 8, 16), 4, 32, 128,
                         sparse_ops=("fwd", "bwd"), wide_seqlens=(1024, 2048, 4096, 8192, 16384),
                         wide_ops=("fwd", "bwd"), tile_candidates=TILE_CANDIDATES)
    if mode == "smoke":
        return SuiteSpec(256, 64, "float16", (128,), (32,), (False, True), OPS, (128, 256), 32,
                         256, (1.0, 0.5), (64, 64), 256, (32,), (32, 64), (512,), (1, 4), 1, 2, 32,
                         wide_seqlens=(128,), wide_ops=("fwd", "bwd"), wide_head_dim=32,
                         tile_candidates=(("fwd", 32, ((128, 64, 4), (64, 32, 4))),))
    return SuiteSpec(16384, 2048, "float16", (1024, 4096), (128,), (False, True), ("fwd", "fwd_bwd"),
                     (1024, 4096, 16384), 64, 4096, (1.0, 0.5, 0.25), (128, 128), 4096, (128,),
                     (32, 64, 128), (16384,), (1, 16), 4, 32, 128, wide_seqlens=(1024, 4096))


def _cpu_spec(mode: str) -> SuiteSpec:
    from cuflash.backends.numpy import BLOCK_K, BLOCK_Q

    if mode == "smoke":
        return SuiteSpec(256, 64, "float32", (128,), (32,), (False, True), OPS, (128, 256), 32,
                         256, (1.0, 0.5), (64, 64), 256, (32,), (64, 128), (512,), (1, 4), 1, 2, 32)
    if mode == "full":
        return SuiteSpec(4096, 256, "float32", (512, 1024, 2048, 4096), (64, 128), (False, True), OPS,
                         (1024, 2048, 4096, 8192), 64, 4096, (1.0, 0.5, 0.25, 0.125), (BLOCK_Q, BLOCK_K),
                         4096, (64,), (128, 256, 512, 1024, 2048), (32768,), (1, 4, 16), 1, 8, 64)
    # quick: the product case (N = 4096) dominates; the figures get two or three small points each
    return SuiteSpec(1024, 256, "float32", (512, 1024), (64,), (False,), OPS, (512, 1024, 2048), 64,
                     2048, (1.0, 0.5, 0.25), (BLOCK_Q, BLOCK_K), 2048, (64,), (128, 512, 2048), (16384,),
                     (1, 16), 1, 8, 64)


def suite(device: str, mode: str) -> list[Case]:
    """Every case of a run.

    Parameters
    ----------
    device : {"cpu", "cuda"}
    mode : {"smoke", "quick", "full"}

    Returns
    -------
    list of Case
        The product case first (CPU quick and full runs only: it measures the NumPy backend, which a
        GPU session should not spend its device time on), then the figures in :data:`FIGURES` order.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    s = _cuda_spec(mode) if device == "cuda" else _cpu_spec(mode)
    impls = GPU_IMPLS if device == "cuda" else CPU_IMPLS
    # A short CPU run keeps the slow extras (torch's math backend, in-place NumPy) to the figures
    # they are for: the product case and the memory figure.
    lean = impls if device == "cuda" or mode == "full" else tuple(
        i for i in impls if i not in ("torch-math", "numpy-inplace"))
    cases = [product_case()] if device == "cpu" and mode != "smoke" else []
    cases += _throughput_cases(s, device, lean)
    cases += _memory_cases(s, device, impls)
    cases += _sparse_cases(s, device)
    cases += _tile_cases(s, device)
    cases += _decode_cases(s, device, lean + ("cuflash-kvcache",))  # the split-KV decode path beside attention
    cases += _wide_cases(s, device)
    return cases


def _throughput_cases(s: SuiteSpec, device: str, impls: tuple) -> list[Case]:
    out = []
    for d in s.head_dims:
        for causal in s.causals:
            for n in s.seqlens:
                b, h = fa_config(n, d, tokens=s.tokens, hidden=s.hidden)
                out += [Case("throughput", device, op, s.dtype, b, h, n, n, d, causal=causal, impls=impls)
                        for op in s.ops]
    return out


def _memory_cases(s: SuiteSpec, device: str, impls: tuple) -> list[Case]:
    d = s.memory_head_dim
    # cuflash against the materializing impls (and torch-flash on a GPU, where its memory is observable)
    wanted = ("cuflash", "cupy-standard", "numpy", "numpy-inplace", "torch-math") + (
        ("torch-flash",) if device == "cuda" else ())
    keep = tuple(i for i in impls if i in wanted)
    out = []
    for n in s.memory_seqlens:
        b, h = fa_config(n, d, tokens=s.tokens, hidden=s.hidden)
        out.append(Case("memory", device, "fwd", s.dtype, b, h, n, n, d, impls=keep))
    return out


def _sparse_cases(s: SuiteSpec, device: str) -> list[Case]:
    n, d = s.sparse_seqlen, s.memory_head_dim
    b, h = fa_config(n, d, tokens=s.tokens, hidden=s.hidden)
    nk = -(-n // s.mask_block[1])
    densities = sorted({realized_density(x, nk) for x in s.densities}, reverse=True)
    return [Case("blocksparse", device, op, s.dtype, b, h, n, n, d, density=x, mask_block=s.mask_block,
                 impls=("cuflash",)) for op in s.sparse_ops for x in densities]


def _tile_cases(s: SuiteSpec, device: str) -> list[Case]:
    out = []
    if device == "cuda" and s.tile_candidates:
        for op, d, tiles in s.tile_candidates:
            b, h = fa_config(s.tile_seqlen, d, tokens=s.tokens, hidden=s.hidden)
            out += [Case("tiles", device, op, s.dtype, b, h, s.tile_seqlen, s.tile_seqlen, d, block_k=t[1],
                         tile=tuple(t), impls=("cuflash",)) for t in tiles]
        return out
    for d in s.tile_head_dims:
        b, h = fa_config(s.tile_seqlen, d, tokens=s.tokens, hidden=s.hidden)
        out += [Case("tiles", device, "fwd", s.dtype, b, h, s.tile_seqlen, s.tile_seqlen, d, block_k=bk,
                     impls=("cuflash",)) for bk in s.block_ks]
    return out


def _decode_cases(s: SuiteSpec, device: str, impls: tuple) -> list[Case]:
    # Non-causal: torch's is_causal is top-left aligned, cuflash's bottom-right; with Sq << Sk a
    # decode step sees the whole cache anyway.
    return [Case("decode", device, "fwd", s.dtype, s.decode_batch, s.decode_heads, sq, sk, s.decode_head_dim,
                 impls=impls) for sk in s.decode_seqlen_k for sq in s.decode_seqlen_q]


def _wide_cases(s: SuiteSpec, device: str) -> list[Case]:
    """float32 in each precision and float64, FA configuration (16k tokens, hidden 2048 on a GPU), non-causal: the
    targets (README, Precision) are float64 >= 50% of the DMMA peak at long seqlens and every float32 mode faster than
    the naive cuBLAS attention of its accuracy class at every seqlen >= 1k, with O(N) memory where naive is O(N^2)."""
    out = []
    d = s.wide_head_dim
    for dtype, precision in WIDE_MODES:
        for n in s.wide_seqlens:
            b, h = fa_config(n, d, tokens=s.tokens, hidden=s.hidden)
            out += [Case("wide", device, op, dtype, b, h, n, n, d, precision=precision, impls=WIDE_IMPLS)
                    for op in s.wide_ops]
    return out
