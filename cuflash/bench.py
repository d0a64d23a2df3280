"""``python -m cuflash bench``: cuflash's speed beside what users would pick instead, in one process.

Figures (the FlashAttention papers' headline plots), each written to ``--out`` as its own JSON and,
when matplotlib is importable (extra ``plot``), a PNG:

1. ``throughput``   forward, backward, forward+backward TFLOP/s vs seqlen, FA configuration
                    (batch = tokens/seqlen, heads = hidden/head_dim; 16384 and 2048 on a GPU)
2. ``memory``       speedup and peak memory vs standard attention as N grows, until it runs out
3. ``blocksparse``  runtime vs BlockMask density (FA Figure 2, right)
4. ``tiles``        forward runtime vs key-block size (FA Figure 2, middle)
5. ``decode``       seqlen_q 1..16 against a long KV: GB/s
plus ``product``: the NumPy backend's target case (fp32, N = 4096, 4 heads, head_dim 64, forward)
against naive NumPy and PyTorch's CPU SDPA.

Timing: on a GPU, CUDA events around a timed function that ends by synchronizing the device
(each library its own way), after warm-up; on the CPU ``time.perf_counter``. Each sample runs
``calls`` back-to-back calls (enough for about a millisecond, so one synchronization does not
dominate a small case); a record's ``ms`` is the median over samples, per call.

FLOPs (FA convention): ``4·B·H·Sq·Sk·d``, halved for causal when ``Sq == Sk``, times the
BlockMask density, ×2.5 for ``bwd`` and ×3.5 for ``fwd_bwd``. ``gbps`` divides the compulsory
bytes (every input read once, every output written once) by the time; in a decode case that is
almost all K/V. ``io_bytes`` is :func:`cuflash.io_cost`'s model of the bytes the impl's algorithm
moves (the tiled ledger for cuflash's CUDA kernel, Algorithm 0's for standard attention), null
where no model applies. ``peak_bytes``: extra memory one call allocates beyond its inputs — the
CuPy memory pool's high-water mark (``torch.cuda.max_memory_allocated`` for PyTorch) on a GPU,
``tracemalloc``'s peak on the CPU; null where it cannot be observed (JAX, PyTorch on the CPU).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np

OPS = ("fwd", "bwd", "fwd_bwd")
OP_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
FIGURES = ("product", "throughput", "memory", "blocksparse", "tiles", "decode")
FIGURE_FILES = {"product": "product", "throughput": "fig1_throughput", "memory": "fig2_memory",
                "blocksparse": "fig3_blocksparse", "tiles": "fig4_tiles", "decode": "fig5_decode"}
FIGURE_TITLES = {
    "product": "NumPy backend target: fp32, N=4096, 4 heads, head_dim 64, forward",
    "throughput": "Attention throughput vs sequence length (FA benchmark configuration)",
    "memory": "Speedup and peak memory vs standard attention",
    "blocksparse": "Block-sparse attention: runtime vs BlockMask density",
    "tiles": "Forward runtime vs key-block (tile) size",
    "decode": "Decode-shaped attention: bandwidth vs seqlen_q",
}
GPU_IMPLS = ("cuflash", "torch-flash", "torch-cudnn", "torch-efficient", "torch-math", "cupy-standard",
             "jax-cudnn", "jax-xla")
CPU_IMPLS = ("cuflash", "numpy", "numpy-inplace", "torch-flash", "torch-math")


class Skip(Exception):
    """An impl cannot run a case (unsupported, out of memory, not installed): recorded, not fatal."""


# ================================================================================================
# Cases
# ================================================================================================
@dataclass(frozen=True)
class Case:
    """One measured configuration. Arrays are ``(batch, seqlen, heads, head_dim)``."""

    figure: str
    device: str                 # "cpu" | "cuda"
    op: str                     # "fwd" | "bwd" | "fwd_bwd"
    dtype: str
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    density: Optional[float] = None            # BlockMask density (realized), None: no mask
    mask_block: Optional[tuple] = None         # BlockMask block (rows, cols) when density is set
    block_k: Optional[int] = None              # key-tile size, tile sweep only
    impls: tuple = ()

    @property
    def inputs_key(self) -> tuple:
        """What the input arrays depend on: cases sharing it share their inputs."""
        return (self.device, self.dtype, self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim,
                self.density, self.mask_block)

    @property
    def flops(self) -> float:
        """FLOPs of one call (FA convention, see the module docstring)."""
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
        extra = "" if self.density is None else f" density={self.density:g}"
        extra += "" if self.block_k is None else f" block_k={self.block_k}"
        return (f"{self.figure} {self.op} {self.dtype} B={self.batch} H={self.heads} Sq={self.seqlen_q} "
                f"Sk={self.seqlen_k} d={self.head_dim}{' causal' if self.causal else ''}{extra}")


def fa_config(seqlen: int, head_dim: int, *, tokens: int, hidden: int) -> tuple[int, int]:
    """FA benchmark shape: ``batch = tokens / seqlen`` (at least 1), ``heads = hidden / head_dim``."""
    return max(1, tokens // seqlen), max(1, hidden // head_dim)


def realized_density(density: float, n_key_blocks: int) -> float:
    """The density a mask keeping ``round(density · nk)`` (at least 1) key blocks per row has."""
    return max(1, round(density * n_key_blocks)) / n_key_blocks


PRODUCT_CASE = dict(figure="product", device="cpu", op="fwd", dtype="float32", batch=1, heads=4,
                    seqlen_q=4096, seqlen_k=4096, head_dim=64, causal=False)


PRODUCT_IMPLS = ("cuflash", "numpy", "numpy-inplace", "torch-flash")  # torch-flash: SDPA's CPU pick for fp32


def product_case(*, impls=PRODUCT_IMPLS) -> Case:
    """The NumPy backend's target: fp32, N = 4096, 4 heads, head_dim 64, forward, 1 batch: at least
    4x faster than naive NumPy (``numpy``) and within 3x of PyTorch's CPU SDPA (``torch-flash``)."""
    return Case(**PRODUCT_CASE, impls=tuple(impls))


# ------------------------------------------------------------------------------------------------
# Suites: (device kind, mode) → case list. Sizes are what one run can afford: a GPU "full" run must
# fit one 10-minute device call; a CPU "quick" run must finish in under a minute on 2 cores.
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


def _suite_spec(device: str, mode: str) -> SuiteSpec:
    if device == "cuda":
        if mode == "full":
            return SuiteSpec(16384, 2048, "float16", (512, 1024, 2048, 4096, 8192, 16384), (64, 128),
                             (False, True), OPS, (1024, 2048, 4096, 8192, 16384, 32768, 65536), 64,
                             4096, (1.0, 0.5, 0.25, 0.125, 0.0625), (128, 128), 4096, (64, 128),
                             (32, 64, 128), (16384, 65536), (1, 2, 4, 8, 16), 4, 32, 128,
                             sparse_ops=("fwd", "bwd"))
        return SuiteSpec(16384, 2048, "float16", (1024, 4096), (128,), (False, True), ("fwd", "fwd_bwd"),
                         (1024, 4096, 16384), 64, 4096, (1.0, 0.5, 0.25), (128, 128), 4096, (128,),
                         (32, 64, 128), (16384,), (1, 16), 4, 32, 128)
    from .backends.numpy import BLOCK_K, BLOCK_Q

    if mode == "smoke":  # the quick code paths at toy sizes, for tests
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
    """Every case of a run on ``device`` ("cpu" | "cuda") in ``mode`` ("quick" | "full" | "smoke")."""
    s = _suite_spec(device, mode)
    impls = GPU_IMPLS if device == "cuda" else CPU_IMPLS
    # A short CPU run keeps the slow extras (torch's math backend, in-place NumPy) to the figures
    # they are for: the product case and the memory figure.
    lean = impls if device == "cuda" or mode == "full" else tuple(
        i for i in impls if i not in ("torch-math", "numpy-inplace"))
    cases = [] if mode == "smoke" else [product_case()]
    cases += _throughput_cases(s, device, lean)
    cases += _memory_cases(s, device, impls)
    cases += _sparse_cases(s, device)
    cases += _tile_cases(s, device)
    cases += _decode_cases(s, device, lean)
    return cases


def _throughput_cases(s: SuiteSpec, device, impls) -> list[Case]:
    out = []
    for d in s.head_dims:
        for causal in s.causals:
            for n in s.seqlens:
                b, h = fa_config(n, d, tokens=s.tokens, hidden=s.hidden)
                for op in s.ops:
                    out.append(Case("throughput", device, op, s.dtype, b, h, n, n, d, causal, impls=impls))
    return out


def _memory_cases(s: SuiteSpec, device, impls) -> list[Case]:
    d = s.memory_head_dim
    # cuflash against the materializing impls (and torch-flash on a GPU, where its memory is observable)
    wanted = ("cuflash", "cupy-standard", "numpy", "numpy-inplace", "torch-math") + (
        ("torch-flash",) if device == "cuda" else ())
    keep = [i for i in impls if i in wanted]
    out = []
    for n in s.memory_seqlens:
        b, h = fa_config(n, d, tokens=s.tokens, hidden=s.hidden)
        out.append(Case("memory", device, "fwd", s.dtype, b, h, n, n, d, impls=tuple(keep)))
    return out


def _sparse_cases(s: SuiteSpec, device) -> list[Case]:
    n, d = s.sparse_seqlen, s.memory_head_dim
    b, h = fa_config(n, d, tokens=s.tokens, hidden=s.hidden)
    nk = -(-n // s.mask_block[1])
    densities = sorted({realized_density(x, nk) for x in s.densities}, reverse=True)
    return [Case("blocksparse", device, op, s.dtype, b, h, n, n, d, density=x, mask_block=s.mask_block,
                 impls=("cuflash",)) for op in s.sparse_ops for x in densities]


def _tile_cases(s: SuiteSpec, device) -> list[Case]:
    out = []
    for d in s.tile_head_dims:
        b, h = fa_config(s.tile_seqlen, d, tokens=s.tokens, hidden=s.hidden)
        out += [Case("tiles", device, "fwd", s.dtype, b, h, s.tile_seqlen, s.tile_seqlen, d, block_k=bk,
                     impls=("cuflash",)) for bk in s.block_ks]
    return out


def _decode_cases(s: SuiteSpec, device, impls) -> list[Case]:
    # Non-causal: torch's is_causal is top-left aligned, cuflash's bottom-right; with Sq << Sk a
    # decode step sees the whole cache anyway.
    return [Case("decode", device, "fwd", s.dtype, s.decode_batch, s.decode_heads, sq, sk, s.decode_head_dim,
                 impls=impls) for sk in s.decode_seqlen_k for sq in s.decode_seqlen_q]


# ================================================================================================
# Device, versions, commit
# ================================================================================================
def gpu_available() -> bool:
    """CuPy importable and at least one CUDA device visible."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError (no driver), ...
        return False


def best_device() -> str:
    """"cuda" when CuPy and a GPU are there, else "cpu" (the NumPy backend)."""
    return "cuda" if gpu_available() else "cpu"


def cpu_info() -> dict:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"kind": "cpu", "name": name, "cores": cores}


def gpu_info() -> dict:
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    info = {"kind": "cuda", "name": name, "compute_capability": dev.compute_capability,
            "memory_bytes": int(props.get("totalGlobalMem", 0)) or None, "sms": props.get("multiProcessorCount")}
    # Peak DRAM bandwidth = 2 (DDR) x memory clock x bus width; CUDA 13 dropped these fields.
    clock_khz, bus_bits = props.get("memoryClockRate", 0), props.get("memoryBusWidth", 0)
    info["bandwidth_gbps"] = round(2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, 1) if clock_khz and bus_bits else None
    return info


def device_slug(info: dict) -> str:
    """File-system name of a device: ``nvidia-h100-80gb-hbm3``, ``cpu-<model>-<n>c``."""
    base = info["name"] if info["kind"] == "cuda" else f"cpu-{info['name']}-{info.get('cores')}c"
    slug = re.sub(r"\((r|tm)\)", "", base.lower())
    return re.sub(r"[^a-z0-9]+", "-", slug).strip("-") or "unknown"


def versions(device: str) -> dict:
    """Versions of everything that can change a number; absent packages are left out."""
    from . import __version__

    out = {"python": platform.python_version(), "numpy": np.__version__, "cuflash": __version__,
           "platform": platform.platform()}
    for mod in ("cupy", "torch", "jax", "jaxlib"):  # the baselines this run imported
        if mod in sys.modules:
            out[mod] = getattr(sys.modules[mod], "__version__", "unknown")
    try:
        out["matplotlib"] = importlib.metadata.version("matplotlib")
    except importlib.metadata.PackageNotFoundError:
        pass
    if device == "cuda":
        import cupy

        rt = cupy.cuda.runtime
        out["cuda_runtime"] = rt.runtimeGetVersion()
        out["cuda_driver"] = rt.driverGetVersion()
    return out


def git_commit() -> tuple[str, Optional[bool]]:
    """``(sha, dirty)`` of the checkout cuflash is imported from; ``("unknown", None)`` elsewhere."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10, check=True).stdout
        return sha or "unknown", bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


# ================================================================================================
# Inputs
# ================================================================================================
@dataclass
class Inputs:
    """Arrays of one case on its device: q ``(B, Sq, H, d)``, k, v ``(B, Sk, H, d)``, dout like q."""

    xp: object
    q: object
    k: object
    v: object
    dout: object
    block_mask: object = None


def _xp(device: str):
    if device == "cuda":
        import cupy

        return cupy
    return np


def make_inputs(case: Case, *, seed: int = 0) -> Inputs:
    """Standard-normal inputs in the case's dtype (drawn in float32, then cast)."""
    xp = _xp(case.device)
    rng = xp.random.default_rng(seed)  # NumPy and CuPy Generators both draw float32 directly
    dtype = _np_dtype(case.dtype)

    def draw(seqlen):
        return rng.standard_normal((case.batch, seqlen, case.heads, case.head_dim), dtype=np.float32).astype(dtype)

    q, k, v, dout = draw(case.seqlen_q), draw(case.seqlen_k), draw(case.seqlen_k), draw(case.seqlen_q)
    return Inputs(xp, q, k, v, dout, _density_mask(case, seed) if case.density is not None else None)


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _density_mask(case: Case, seed: int):
    """A BlockMask keeping the same number of random key blocks in every query-block row, so that
    every row (and every thread block) does the same work."""
    from .blockmask import BlockMask

    bq, bk = case.mask_block
    nq, nk = -(-case.seqlen_q // bq), -(-case.seqlen_k // bk)
    per_row = max(1, round(case.density * nk))
    rng = np.random.default_rng(seed)
    grid = np.zeros((nq, nk), dtype=bool)
    for i in range(nq):
        grid[i, rng.choice(nk, per_row, replace=False)] = True
    return BlockMask.from_grid(grid, block=(bq, bk), seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k)


# ================================================================================================
# Implementations. Each builder returns ``(run, sync)``: ``run()`` launches one call (possibly
# asynchronously) and returns its result; ``sync(result)`` waits until the device is done.
# ================================================================================================
@dataclass(frozen=True)
class Impl:
    name: str
    devices: tuple                       # where it runs: ("cpu",), ("cuda",) or both
    ops: tuple                           # ops it implements
    build: Callable                      # (case, inputs) -> (run, sync)
    check: Callable                      # (device) -> None, or raise Skip(reason)
    memory: Optional[str]                # how peak memory is observed: "pool" | "torch" | None
    io_model: Optional[str] = None       # "tiled" | "standard" | None: which io_cost ledger applies
    block_mask: bool = False             # takes a BlockMask
    tile_choice: bool = False            # takes a key-tile size


def _device_sync(device: str) -> Callable:
    if device == "cuda":
        import cupy

        return lambda result=None: cupy.cuda.get_current_stream().synchronize()
    return lambda result=None: None


# ---------------------------------------------------------------------------------- cuflash
def _check_cuflash(device: str):
    from . import backends

    ok, why = backends.status()["cuda" if device == "cuda" else "numpy"]
    if not ok:
        raise Skip(f"cuflash {device} backend unavailable: {why}")


def _build_cuflash(case: Case, x: Inputs):
    import cuflash

    opts = dict(causal=case.causal, block_mask=x.block_mask)
    if case.block_k is not None:
        run = _tile_forward(case, x)
    elif case.op == "fwd":
        run = lambda: cuflash.attention(x.q, x.k, x.v, **opts)  # noqa: E731
    elif case.op == "bwd":
        out, lse = cuflash.attention(x.q, x.k, x.v, return_lse=True, **opts)
        run = lambda: cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, **opts)  # noqa: E731
    else:
        def run():
            out, lse = cuflash.attention(x.q, x.k, x.v, return_lse=True, **opts)
            return cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, **opts)
    return run, _device_sync(case.device)


def _tile_forward(case: Case, x: Inputs):
    """Forward with an explicit key-tile size: the NumPy backend's ``block_k``; on CUDA a kernel
    specialization with ``block_n = block_k`` where the backend accepts one."""
    import inspect

    from .problem import make_problem

    problem = make_problem(x.q, x.k, x.v, causal=case.causal)
    if case.device == "cpu":
        from .backends import numpy as backend

        return lambda: backend.forward(problem, block_k=case.block_k)
    from .backends import cuda as backend
    from .cuda import specs

    table = specs.select("fwd", case.dtype, case.head_dim)
    spec = replace(table, block_n=case.block_k)  # KernelSpec validates the combination
    if "spec" in inspect.signature(backend.forward).parameters:
        return lambda: backend.forward(problem, spec=spec)
    return _cuda_forward_with(problem, spec)


def _cuda_forward_with(problem, spec):
    """The cuda backend's forward with another kernel specialization: the same launch description
    (``kernels.forward_launch(..., spec=...)``) and compiled kernel (``cuda.kernel``), while the
    backend itself always takes the tile table's choice."""
    import cupy

    from . import kernels
    from .backends import cuda as backend

    max_smem = int(cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])

    def run():
        fl = kernels.forward_launch(problem, max_smem=max_smem, spec=spec)
        if fl.spec is not None:
            args = tuple(np.uint64(0) if a is None else a for a in fl.spec.args)  # None: a null pointer
            backend.kernel(fl.kernel)(fl.spec.grid, fl.spec.block, args, shared_mem=fl.spec.shared_bytes)
        return fl.result()
    return run


# ---------------------------------------------------------------------------------- standard attention
def standard_attention(q, k, v, *, bias=None, inplace=True):
    """Algorithm 0 (standard attention) on NumPy or CuPy arrays, in their own dtype.

    ``q`` ``(B, Sq, H, d)``, ``k``/``v`` ``(B, Sk, H, d)``, ``bias`` an additive ``(Sq, Sk)`` mask
    (0 / -inf) or None; returns ``out`` ``(B, Sq, H, d)``. ``S = QKᵀ/√d`` and ``P = softmax(S)``
    are materialized (``B·H·Sq·Sk`` each). ``inplace=False`` is the formula as written, every
    step allocating its result (naive NumPy); ``inplace=True`` reuses one buffer for S and P and
    scales Q instead of S (what a careful user writes). A baseline only: cuflash's oracle is
    :mod:`cuflash.reference`.
    """
    xp = _module_of(q)
    scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))  # a NumPy scalar of q's dtype: no upcast
    qh, kt, vh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    if not inplace:
        s = xp.matmul(qh, kt) * scale
        if bias is not None:
            s = s + bias
        p = xp.exp(s - s.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True)
        return xp.matmul(p, vh).transpose(0, 2, 1, 3)
    s = xp.matmul(qh * scale, kt)  # (B, H, Sq, Sk); scaling Q costs O(N·d), scaling S O(N²)
    if bias is not None:
        s += bias
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return xp.matmul(s, vh).transpose(0, 2, 1, 3)


def _module_of(a):
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def causal_bias(xp, seqlen_q: int, seqlen_k: int, dtype):
    """``(Sq, Sk)`` additive mask, 0 where bottom-right causal attention sees a key, -inf elsewhere."""
    i = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = np.arange(seqlen_k)[None, :]
    return xp.asarray(np.where(j <= i, 0, -np.inf).astype(dtype))  # built on the host, then moved once


def _check_standard(device: str):
    return None


def _build_standard(*, inplace: bool):
    def build(case: Case, x: Inputs):
        bias = causal_bias(x.xp, case.seqlen_q, case.seqlen_k, x.q.dtype) if case.causal else None
        return (lambda: standard_attention(x.q, x.k, x.v, bias=bias, inplace=inplace)), _device_sync(case.device)
    return build


# ---------------------------------------------------------------------------------- PyTorch SDPA
TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                  "torch-efficient": "EFFICIENT_ATTENTION", "torch-math": "MATH"}


def _check_torch(device: str):
    try:
        import torch
        from torch.nn.attention import sdpa_kernel  # noqa: F401  (torch >= 2.3)
    except ImportError as exc:
        raise Skip(f"torch not importable ({exc})") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise Skip("torch has no CUDA support here")


def _torch_tensors(case: Case, x: Inputs, grad: bool):
    """Zero-copy DLPack views of q, k, v, dout, ``(B, S, H, d)`` like the arrays; q, k, v are the
    leaves gradients are taken for."""
    import torch

    def view(a, leaf):
        t = torch.from_dlpack(a)
        if leaf and grad:
            t.requires_grad_(True)
        return t

    q, k, v = (view(a, True) for a in (x.q, x.k, x.v))
    return q, k, v, view(x.dout, False)


def _build_torch(name: str):
    def build(case: Case, x: Inputs):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        if case.causal and case.seqlen_q != case.seqlen_k:
            raise Skip("torch's is_causal is top-left aligned; cuflash's bottom-right")
        backend = getattr(SDPBackend, TORCH_BACKENDS[name])
        grad = case.op != "fwd"
        q, k, v, do = _torch_tensors(case, x, grad)
        tr = lambda t: t.transpose(1, 2)  # noqa: E731  (B, S, H, d) -> (B, H, S, d), a view

        def attend():
            with sdpa_kernel(backend):
                return sdpa(tr(q), tr(k), tr(v), is_causal=case.causal)

        if case.op == "fwd":
            def run():
                with torch.no_grad():
                    return attend()
        elif case.op == "bwd":
            out = attend()
            run = lambda: torch.autograd.grad(out, (q, k, v), tr(do), retain_graph=True)  # noqa: E731
        else:
            run = lambda: torch.autograd.grad(attend(), (q, k, v), tr(do))  # noqa: E731
        sync = (lambda r=None: torch.cuda.synchronize()) if case.device == "cuda" else (lambda r=None: None)
        return run, sync
    return build


# ---------------------------------------------------------------------------------- JAX
JAX_IMPLS = {"jax-cudnn": "cudnn", "jax-xla": "xla"}


def _check_jax(device: str):
    # JAX would otherwise grab 75% of the GPU at import, starving CuPy and PyTorch in this process.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
    except ImportError as exc:
        raise Skip(f"jax not importable ({exc})") from None
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        raise Skip(f"jax has no GPU here ({str(exc).splitlines()[0]})") from None


def _jax_array(a):
    import jax

    try:
        return jax.dlpack.from_dlpack(a)  # zero-copy from CuPy
    except Exception:  # noqa: BLE001 -- older jax takes only capsules: copy (outside the timing)
        return jax.device_put(_host(a))


def _build_jax(name: str):
    def build(case: Case, x: Inputs):
        import functools

        import jax

        if case.causal and case.seqlen_q != case.seqlen_k:
            raise Skip("jax's is_causal is top-left aligned; cuflash's bottom-right")
        attn = functools.partial(jax.nn.dot_product_attention, is_causal=case.causal,
                                 implementation=JAX_IMPLS[name])
        q, k, v, do = (_jax_array(a) for a in (x.q, x.k, x.v, x.dout))
        if case.op == "fwd":
            f = jax.jit(attn)
            run = lambda: f(q, k, v)  # noqa: E731
        elif case.op == "bwd":
            _, vjp = jax.vjp(attn, q, k, v)
            f = jax.jit(lambda fn, g: fn(g))
            run = lambda: f(vjp, do)  # noqa: E731
        else:
            f = jax.jit(lambda a, b, c, g: jax.vjp(attn, a, b, c)[1](g))
            run = lambda: f(q, k, v, do)  # noqa: E731
        return run, jax.block_until_ready
    return build


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


IMPLS = {
    "cuflash": Impl("cuflash", ("cpu", "cuda"), OPS, _build_cuflash, _check_cuflash, "pool", "tiled",
                    block_mask=True, tile_choice=True),
    "numpy": Impl("numpy", ("cpu",), ("fwd",), _build_standard(inplace=False), _check_standard, "pool",
                  "standard"),
    "numpy-inplace": Impl("numpy-inplace", ("cpu",), ("fwd",), _build_standard(inplace=True), _check_standard,
                          "pool", "standard"),
    "cupy-standard": Impl("cupy-standard", ("cuda",), ("fwd",), _build_standard(inplace=True), _check_standard,
                          "pool", "standard"),
    **{n: Impl(n, ("cpu", "cuda") if n in ("torch-flash", "torch-math") else ("cuda",), OPS, _build_torch(n),
               _check_torch, "torch", "standard" if n == "torch-math" else None) for n in TORCH_BACKENDS},
    **{n: Impl(n, ("cuda",), OPS, _build_jax(n), _check_jax, None) for n in JAX_IMPLS},
}


def applicable(impl: Impl, case: Case) -> Optional[str]:
    """Why ``impl`` does not apply to ``case`` (None if it does); the reason starts with ``NA``."""
    if case.device not in impl.devices:
        return f"{NA}{impl.name} does not run on {case.device}"
    if case.op not in impl.ops:
        return f"{NA}{impl.name} has no {case.op}"
    if case.density is not None and not impl.block_mask:
        return f"{NA}{impl.name} takes no BlockMask"
    if case.block_k is not None and not impl.tile_choice:
        return f"{NA}{impl.name} takes no tile choice"
    return None


NA = "n/a: "  # prefix of the reasons an impl does not apply to a case (by design, not a failure)


# ================================================================================================
# Timing and memory
# ================================================================================================
@dataclass(frozen=True)
class Timing:
    """How long to measure: ``warmup`` calls after the first one (which also observes peak memory and
    pays for compilation), then samples until ``budget_s`` of timed time has passed (at least
    ``min_repeats``, at most ``max_repeats``)."""

    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 25
    budget_s: float = 0.25
    min_sample_ms: float = 1.0     # GPU: back-to-back calls per sample, so a sync does not dominate


TIMINGS = {"smoke": Timing(warmup=0, min_repeats=1, max_repeats=2, budget_s=0.0),
           "quick": Timing(warmup=0, min_repeats=3, max_repeats=9, budget_s=0.15),
           "full": Timing(warmup=1, min_repeats=3, max_repeats=15, budget_s=0.15)}


class Timer:
    """Timed samples of ``run`` (each sample: ``calls`` calls, then ``sync``), in ms per call.

    On CUDA the clock is a pair of CUDA events on the current CuPy stream around the timed
    function; the function ends with a device synchronization, so the end event also covers work
    that another library queued on its own streams.
    """

    def __init__(self, run: Callable, sync: Callable, *, device: str, calls: int = 1):
        self.run, self.sync, self.device, self.calls = run, sync, device, calls
        self.samples: list[float] = []
        if device == "cuda":
            import cupy

            self._events = (cupy.cuda.Event(), cupy.cuda.Event())

    def timed(self):
        """The timed function: ``calls`` calls, then a synchronization."""
        result = None
        for _ in range(self.calls):
            result = self.run()
        self.sync(result)

    def sample(self) -> float:
        """Run the timed function once; record and return its ms per call."""
        if self.device == "cuda":
            import cupy

            start, end = self._events
            start.record()
            self.timed()
            end.record()
            end.synchronize()
            ms = cupy.cuda.get_elapsed_time(start, end)
        else:
            t0 = time.perf_counter()
            self.timed()
            ms = (time.perf_counter() - t0) * 1e3
        self.samples.append(ms / self.calls)
        return ms / self.calls

    @property
    def median_ms(self) -> float:
        return float(np.median(self.samples))


def time_it(run: Callable, sync: Callable, *, device: str, timing: Timing) -> Timer:
    """Warm up, then sample until the budget is spent; returns the Timer (``median_ms``).

    On CUDA a first probe sample sets ``calls`` so that one sample lasts ``min_sample_ms``; the
    probe is not kept.
    """
    for _ in range(timing.warmup):
        sync(run())
    timer = Timer(run, sync, device=device)
    if device == "cuda":
        probe = timer.sample()
        timer.samples.clear()
        timer.calls = max(1, min(50, math.ceil(timing.min_sample_ms / max(probe, 1e-3))))
    spent = 0.0
    while len(timer.samples) < timing.min_repeats or (
            spent < timing.budget_s * 1e3 and len(timer.samples) < timing.max_repeats):
        spent += timer.sample() * timer.calls
    return timer


def first_call_peak(run: Callable, sync: Callable, *, device: str, memory: Optional[str]) -> Optional[int]:
    """Run one (warm-up) call; return the extra bytes it allocated at its peak beyond what was live
    before it, or None where that cannot be observed (see the module docstring)."""
    if device == "cpu":
        if memory == "torch":  # torch's CPU allocator is invisible to tracemalloc
            sync(run())
            return None
        return _tracemalloc_peak(run)
    if memory is None:
        sync(run())
        return None
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    base = pool.total_bytes()
    torch_base = _torch_reset_peak() if memory == "torch" else 0
    sync(run())
    extra = pool.total_bytes() - base  # the pool only grows when no cached block fits: its high-water mark
    if memory == "torch":
        import torch

        extra += torch.cuda.max_memory_allocated() - torch_base
    return int(extra)


def _tracemalloc_peak(run: Callable) -> int:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = run()
        peak = tracemalloc.get_traced_memory()[1]
        del result
    finally:
        tracemalloc.stop()
    return int(peak - base)


def _torch_reset_peak() -> int:
    import torch

    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def release_memory(device: str, *, collect: bool = True):
    """Hand cached device memory back, so one library's cache cannot starve another. ``collect``
    also runs the garbage collector first (between cases; it costs tens of ms with torch loaded).
    On the CPU reference counting already frees a case's arrays."""
    if device != "cuda":
        return
    if collect:
        gc.collect()  # autograd graphs and JAX buffers can sit in reference cycles
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        import torch

        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return any(s in text for s in ("outofmemory", "out of memory", "resource_exhausted", "memoryerror"))


# ================================================================================================
# Records
# ================================================================================================
@dataclass
class Record:
    """One measurement; fields as in the benchmarks issue's schema, null where not applicable."""

    impl: str
    op: str
    dtype: str
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    batch: int
    heads: int
    causal: bool
    density: Optional[float]
    ms: Optional[float]
    tflops: Optional[float]
    peak_bytes: Optional[int]
    gbps: Optional[float] = None
    io_bytes: Optional[int] = None
    block_k: Optional[int] = None
    device: str = "cpu"
    repeats: int = 0
    calls_per_sample: int = 1

    @classmethod
    def of(cls, case: Case, impl: str, timer: Timer, peak: Optional[int], io_bytes: Optional[int]):
        ms = timer.median_ms
        return cls(impl=impl, op=case.op, dtype=case.dtype, head_dim=case.head_dim, seqlen_q=case.seqlen_q,
                   seqlen_k=case.seqlen_k, batch=case.batch, heads=case.heads, causal=case.causal,
                   density=case.density, ms=round(ms, 6), tflops=round(case.flops / (ms * 1e-3) / 1e12, 4),
                   peak_bytes=peak, gbps=round(case.bytes / (ms * 1e-3) / 1e9, 3), io_bytes=io_bytes,
                   block_k=case.block_k, device=case.device, repeats=len(timer.samples),
                   calls_per_sample=timer.calls)


def model_io_bytes(case: Case, impl: Impl) -> Optional[int]:
    """:func:`cuflash.io_cost` for the impl's algorithm: GPU only (a CPU has no HBM/SRAM split the
    ledger describes); Algorithm 0's ledger for standard attention, the tiled ledger with the CUDA
    kernels' tile tables (or the swept key tile) for cuflash."""
    if case.device != "cuda" or impl.io_model is None:
        return None
    from .io_cost import io_cost

    try:
        cost = io_cost(seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k, head_dim=case.head_dim, batch=case.batch,
                       heads=case.heads, dtype=case.dtype, op=case.op, causal=case.causal, density=case.density,
                       block_k=case.block_k if case.block_k else None)
    except (ImportError, ValueError, TypeError):
        return None
    return cost.tiled if impl.io_model == "tiled" else cost.standard


# ================================================================================================
# The runner
# ================================================================================================
class Progress:
    """A progress bar on stderr without dependencies (one line per 10% when stderr is no terminal)."""

    def __init__(self, total: int, *, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled = max(1, total), 0, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._last_decile = -1

    def step(self, label: str):
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        bar = "#" * int(frac * 24)
        line = f"[{bar:<24}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.0f}s {label}"
        if self.tty:
            self.stream.write("\r" + line[:119].ljust(119))
            self.stream.flush()
        elif int(frac * 10) != self._last_decile or self.done == self.total:
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class RunResult:
    records: list = field(default_factory=list)   # (figure, Record)
    skipped: list = field(default_factory=list)   # (figure, dict)


def plan_work(cases: list[Case], *, impl_filter: Optional[set] = None) -> list[tuple[Case, str]]:
    """(case, impl) pairs in run order: JAX last, so its allocator cannot starve the others."""
    work = [(c, name) for c in cases for name in c.impls if impl_filter is None or name in impl_filter]
    return sorted(work, key=lambda w: w[1].startswith("jax"))  # stable: keeps the suite order otherwise


def run_cases(cases: list[Case], *, timing: Timing, deadline: Optional[float] = None,
              impl_filter: Optional[set] = None, progress: bool = True,
              checkpoint: Optional[Callable] = None, checkpoint_s: float = 60.0) -> RunResult:
    """Measure every applicable (case, impl) pair; failures become ``skipped`` entries with the reason.

    ``deadline`` (``time.monotonic()`` value): pairs not started by then are skipped. Once an impl
    runs out of memory on a figure, its larger cases on that figure are skipped. ``checkpoint(result)``
    is called every ``checkpoint_s`` seconds, so a run killed from outside still leaves its results.
    """
    result = RunResult()
    last_checkpoint = time.monotonic()
    work = plan_work(cases, impl_filter=impl_filter)
    bar = Progress(len(work), enabled=progress)
    unusable: dict[str, str] = {}      # impl -> why (not installed, no GPU support)
    oom_at: dict[tuple, int] = {}      # (figure, impl) -> smallest seqlen that ran out of memory
    inputs_key, inputs = None, None
    for case, name in work:
        bar.step(f"{name} {case.label()}")
        why = _why_not(case, name, unusable, oom_at, deadline)
        if why is not None:
            result.skipped.append((case.figure, _skip_entry(case, name, why)))
            continue
        if inputs_key != case.inputs_key:
            inputs = None
            release_memory(case.device)
            inputs, inputs_key = make_inputs(case), case.inputs_key
        failed = False
        try:
            result.records.append((case.figure, measure(case, IMPLS[name], inputs, timing=timing)))
        except Exception as exc:  # noqa: BLE001 -- a baseline failing must not end the run
            failed = True
            if is_oom(exc):
                oom_at[(case.figure, name)] = min(oom_at.get((case.figure, name), 1 << 62), case.seqlen_k)
            result.skipped.append((case.figure, _skip_entry(case, name, _reason(exc))))
        # after a failure the traceback's frames (holding the big temporaries) sit in a cycle
        release_memory(case.device, collect=failed)
        if checkpoint is not None and time.monotonic() - last_checkpoint > checkpoint_s:
            checkpoint(result)
            last_checkpoint = time.monotonic()
    bar.close()
    return result


def _why_not(case, name, unusable, oom_at, deadline) -> Optional[str]:
    impl = IMPLS[name]
    why = applicable(impl, case)
    if why:
        return why
    if deadline is not None and time.monotonic() > deadline:
        return "time limit of the run reached"
    if (case.figure, name) in oom_at and case.seqlen_k >= oom_at[(case.figure, name)]:
        return f"out of memory (ran out at seqlen {oom_at[(case.figure, name)]})"
    key = f"{name}@{case.device}"
    if key not in unusable:
        try:
            impl.check(case.device)
            unusable[key] = ""
        except Skip as exc:
            unusable[key] = str(exc)
    return unusable[key] or None


def measure(case: Case, impl: Impl, inputs: Inputs, *, timing: Timing) -> Record:
    """Time one impl on one case and observe its peak memory; returns the Record."""
    run, sync = impl.build(case, inputs)
    peak = first_call_peak(run, sync, device=case.device, memory=impl.memory)
    timer = time_it(run, sync, device=case.device, timing=timing)
    return Record.of(case, impl.name, timer, peak, model_io_bytes(case, impl))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, Skip):
        return str(exc)
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}"


def _skip_entry(case: Case, impl: str, reason: str) -> dict:
    return {"impl": impl, "op": case.op, "dtype": case.dtype, "head_dim": case.head_dim,
            "seqlen_q": case.seqlen_q, "seqlen_k": case.seqlen_k, "batch": case.batch, "heads": case.heads,
            "causal": case.causal, "density": case.density, "block_k": case.block_k, "device": case.device,
            "reason": reason}


# ================================================================================================
# Output: table, JSON, plots
# ================================================================================================
_COLUMNS = (("impl", 15, "{}"), ("op", 7, "{}"), ("dtype", 7, "{}"), ("B", 3, "{}"), ("H", 3, "{}"),
            ("Sq", 6, "{}"), ("Sk", 6, "{}"), ("d", 4, "{}"), ("causal", 6, "{}"), ("mask/bk", 7, "{}"),
            ("ms", 10, "{:.3f}"), ("TFLOP/s", 8, "{:.3g}"), ("GB/s", 8, "{:.3g}"), ("peak MB", 9, "{:.1f}"),
            ("x cuflash", 9, "{:.2f}"))


def table(result: RunResult) -> str:
    """The run as text: one block per figure; ``x cuflash`` is ms / cuflash's ms on the same case."""
    ref = {_rkey(fig, r): r.ms for fig, r in result.records if r.impl == "cuflash"}
    head = " ".join(f"{name:>{w}}" for name, w, _ in _COLUMNS)
    out = []
    for fig in FIGURES:
        rows = [r for f, r in result.records if f == fig]
        if not rows:
            continue
        out += ["", f"== {fig}: {FIGURE_TITLES[fig]}", head]
        for r in rows:
            cuf = ref.get(_rkey(fig, r))
            mask = r.density if r.density is not None else r.block_k
            vals = (r.impl, r.op, r.dtype, r.batch, r.heads, r.seqlen_q, r.seqlen_k, r.head_dim,
                    "yes" if r.causal else "no", "-" if mask is None else f"{mask:g}", r.ms, r.tflops, r.gbps,
                    None if r.peak_bytes is None else r.peak_bytes / 2**20, r.ms / cuf if cuf else None)
            out.append(" ".join(f"{'-' if v is None else fmt.format(v):>{w}}"
                                for (_, w, fmt), v in zip(_COLUMNS, vals)))
    out += product_targets(result)
    reasons = sorted({e["reason"] for _, e in result.skipped if not _inapplicable(e["reason"])})
    if reasons:
        out += ["", f"{len(result.skipped)} (case, impl) pairs not measured (see 'skipped' in the JSON); "
                    f"reasons besides an impl lacking the op, device, mask or tile option:"]
        out += [f"  - {r}" for r in reasons[:20]]
    return "\n".join(out)


def _inapplicable(reason: str) -> bool:
    return reason.startswith(NA)


def product_targets(result: RunResult) -> list[str]:
    """The NumPy backend's targets, as measured in this run: naive NumPy / cuflash (>= 4) and
    cuflash / PyTorch CPU SDPA (<= 3)."""
    ms = {r.impl: r.ms for f, r in result.records if f == "product"}
    if "cuflash" not in ms or not {"numpy", "torch-flash"} & set(ms):
        return []
    lines = ["", "product targets (this run):"]
    if "numpy" in ms:
        x = ms["numpy"] / ms["cuflash"]
        lines.append(f"  naive numpy / cuflash = {x:.2f}x (target >= 4x: {'met' if x >= 4 else 'not met'})")
    if "torch-flash" in ms:
        x = ms["cuflash"] / ms["torch-flash"]
        lines.append(f"  cuflash / torch SDPA  = {x:.2f}x (target <= 3x: {'met' if x <= 3 else 'not met'})")
    return lines


def _rkey(fig, r: Record) -> tuple:
    return (fig, r.device, r.op, r.dtype, r.batch, r.heads, r.seqlen_q, r.seqlen_k, r.head_dim, r.causal,
            r.density, r.block_k)


def payloads(result: RunResult, *, meta: dict) -> dict:
    """``{figure: JSON object}``: every figure that has a record, in the issue's schema."""
    out = {}
    for fig in FIGURES:
        recs = [asdict(r) for f, r in result.records if f == fig]
        if not recs:
            continue
        skipped = [e for f, e in result.skipped if f == fig]
        out[fig] = {"figure": fig, "title": FIGURE_TITLES[fig], **meta, "records": recs, "skipped": skipped}
    return out


def write_results(payload_by_fig: dict, out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Write ``<figure>.json`` (and ``.png`` when matplotlib is importable) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fig, payload in payload_by_fig.items():
        path = out_dir / f"{FIGURE_FILES[fig]}.json"
        path.write_text(json.dumps(payload, indent=1) + "\n")
        written.append(path)
    if plots:
        written += write_plots(payload_by_fig, out_dir)
    return written


def write_plots(payload_by_fig: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'cuflash[plot]')", file=sys.stderr)
        return []
    written = []
    for fig, payload in payload_by_fig.items():
        figure = PLOTTERS[fig](plt, payload)
        path = out_dir / f"{FIGURE_FILES[fig]}.png"
        figure.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    return written


def _caption(payload: dict) -> str:
    dev = payload["device"]
    return f"{dev['name']} · {payload['date'][:10]} · commit {payload['commit'][:10]}"


_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf")


def _color(impl: str) -> str:
    """One color per impl across every panel and figure."""
    names = list(IMPLS)
    return _PALETTE[names.index(impl) % len(_PALETTE)] if impl in names else "#000000"


def _lines(ax, records, *, x, y, label=lambda r: r["impl"], logx=True):
    """One line per label; the color follows the record's impl, the style its other attributes."""
    series: dict = {}
    for r in records:
        if r.get(y) is not None:
            series.setdefault(label(r), (r["impl"], []))[1].append((r[x], r[y]))
    styles: dict = {}
    for name, (impl, pts) in series.items():
        pts.sort()
        style = styles.setdefault(impl, ["-", "--", ":", "-."])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, color=_color(impl),
                ls=style.pop(0) if len(style) > 1 else style[0], label=name)
    if logx:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_k_formatter())
    ax.grid(alpha=0.3)


def _k_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024 else f"{v:g}")


def _finish(fig, payload, fontsize=10):
    fig.suptitle(f"{payload['title']}\n{_caption(payload)}", fontsize=fontsize)
    fig.tight_layout()
    return fig


def _plot_throughput(plt, payload):
    recs = payload["records"]
    combos = sorted({(r["head_dim"], r["causal"]) for r in recs})
    ops = [op for op in OPS if any(r["op"] == op for r in recs)]
    fig, axes = plt.subplots(len(ops), len(combos), figsize=(4.2 * len(combos), 3.2 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        for j, (d, causal) in enumerate(combos):
            ax = axes[i][j]
            _lines(ax, [r for r in recs if r["op"] == op and r["head_dim"] == d and r["causal"] == causal],
                   x="seqlen_q", y="tflops")
            ax.set_title(f"{op}, head_dim {d}, {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
    for ax in axes.flat:
        ax.legend(fontsize=6)
    return _finish(fig, payload, 10)


def _plot_memory(plt, payload):
    recs = payload["records"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    cuf = {r["seqlen_q"]: r["ms"] for r in recs if r["impl"] == "cuflash"}
    speed = [dict(r, speedup=r["ms"] / cuf[r["seqlen_q"]]) for r in recs
             if r["impl"] != "cuflash" and r["seqlen_q"] in cuf]
    _lines(ax1, speed, x="seqlen_q", y="speedup", label=lambda r: f"cuflash vs {r['impl']}")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_xlabel("seqlen")
    ax1.set_ylabel("speedup of cuflash (x)")
    ax1.legend(fontsize=7)
    _lines(ax2, [dict(r, peak_mb=r["peak_bytes"] / 2**20) for r in recs if r["peak_bytes"] is not None],
           x="seqlen_q", y="peak_mb")
    for e in payload.get("skipped", []):
        if "memory" in e["reason"].lower():
            ax2.annotate(f"{e['impl']}: OOM", (e["seqlen_q"], 1), fontsize=7, rotation=90)
    ax2.set_yscale("log")
    ax2.set_xlabel("seqlen")
    ax2.set_ylabel("peak extra memory (MiB)")
    ax2.legend(fontsize=7)
    return _finish(fig, payload, 10)


def _plot_blocksparse(plt, payload):
    recs = payload["records"]
    fig, ax = plt.subplots(figsize=(5, 3.8))
    for op in OPS:
        rows = sorted((r["density"], r["ms"]) for r in recs if r["op"] == op)
        if not rows:
            continue
        ax.plot(*zip(*rows), marker="o", label=f"cuflash {op}")
        dense = rows[-1]
        ax.plot([0, dense[0]], [0, dense[1]], ls="--", color="gray", lw=0.8)
    ax.set_xlabel("BlockMask density")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, title="dashed: runtime proportional to density", title_fontsize=7)
    return _finish(fig, payload, 9)


def _plot_tiles(plt, payload):
    fig, ax = plt.subplots(figsize=(5, 3.8))
    _lines(ax, payload["records"], x="block_k", y="ms", label=lambda r: f"cuflash d={r['head_dim']}")
    ax.set_xlabel("key-block size (block_k)")
    ax.set_ylabel("forward ms")
    ax.legend(fontsize=7)
    return _finish(fig, payload, 9)


def _plot_decode(plt, payload):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    _lines(ax, payload["records"], x="seqlen_q", y="gbps", label=lambda r: f"{r['impl']} Sk={r['seqlen_k']}")
    bw = payload["device"].get("bandwidth_gbps")
    if bw:
        ax.axhline(bw, color="gray", ls="--", lw=0.8, label=f"device peak {bw:g} GB/s")
    ax.set_xlabel("seqlen_q")
    ax.set_ylabel("GB/s (inputs read + output written; ~ K/V)")
    ax.legend(fontsize=6)
    return _finish(fig, payload, 9)


def _plot_product(plt, payload):
    recs = payload["records"]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.barh([r["impl"] for r in recs], [r["ms"] for r in recs])
    ax.set_xlabel("ms (lower is better)")
    return _finish(fig, payload, 8)


PLOTTERS = {"product": _plot_product, "throughput": _plot_throughput, "memory": _plot_memory,
            "blocksparse": _plot_blocksparse, "tiles": _plot_tiles, "decode": _plot_decode}


# ================================================================================================
# Command line
# ================================================================================================
#: Seconds of measuring after which the remaining pairs are skipped: a quick CPU run must end within a
#: minute, a full GPU run within one 10-minute device call (imports, compilation and plots included).
DEFAULT_TIME_LIMIT = {"smoke": None, "quick": 50.0, "full": 500.0}


def replot(folder: Path) -> int:
    """Redraw the PNG of every figure JSON in ``folder``."""
    by_fig = {}
    for fig, stem in FIGURE_FILES.items():
        path = folder / f"{stem}.json"
        if path.exists():
            by_fig[fig] = json.loads(path.read_text())
    if not by_fig:
        print(f"no result JSON in {folder}", file=sys.stderr)
        return 1
    written = write_plots(by_fig, folder)
    print(f"wrote {len(written)} plots to {folder}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuflash bench",
                                description="Benchmark cuflash against the baselines importable here; "
                                            "prints a table, writes JSON (+ PNG with matplotlib).")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="a small case list (default; under a minute on the NumPy backend)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="every figure at full size (on a GPU: fits one 10-minute call)")
    mode.add_argument("--smoke", dest="mode", action="store_const", const="smoke",
                      help="the quick code paths at toy sizes (tests, CI)")
    p.add_argument("--out", type=Path, default=None,
                   help="result folder (default benchmarks/results/<device>/)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: CuPy + GPU; cpu: the NumPy backend (default: cuda when available)")
    p.add_argument("--only", default=None, help=f"comma-separated figures from {', '.join(FIGURES)}")
    p.add_argument("--impl", default=None, help="comma-separated impls to run (default: all importable)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which remaining cases are skipped (quick 50, full 500)")
    p.add_argument("--no-plot", action="store_true", help="write JSON only")
    p.add_argument("--replot", type=Path, default=None, metavar="DIR",
                   help="only redraw the PNGs of the result JSON files in DIR, measuring nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(mode="quick")
    return p


def _select(cases: list[Case], only: Optional[str]) -> list[Case]:
    if not only:
        return cases
    figs = {f.strip() for f in only.split(",") if f.strip()}
    unknown = figs - set(FIGURES)
    if unknown:
        raise SystemExit(f"unknown figure(s) {sorted(unknown)}; choose from {', '.join(FIGURES)}")
    return [c for c in cases if c.figure in figs]


def main(argv=None) -> int:
    """Entry point of ``python -m cuflash bench``; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.replot is not None:
        return replot(args.replot)
    device = best_device() if args.device == "auto" else args.device
    if device == "cuda" and not gpu_available():
        raise SystemExit("--device cuda needs CuPy and a visible GPU")
    info = gpu_info() if device == "cuda" else cpu_info()
    cases = _select(suite(device, args.mode), args.only)
    impls = None if args.impl is None else {s.strip() for s in args.impl.split(",") if s.strip()}
    if impls and impls - set(IMPLS):
        raise SystemExit(f"unknown impl(s) {sorted(impls - set(IMPLS))}; choose from {', '.join(IMPLS)}")
    limit = DEFAULT_TIME_LIMIT[args.mode] if args.time_limit is None else args.time_limit
    print(f"cuflash bench --{args.mode} on {info['name']} ({device}); {len(cases)} cases", file=sys.stderr)
    out_dir = args.out or Path("benchmarks") / "results" / device_slug(info)
    commit, dirty = git_commit()
    t0 = time.monotonic()

    def meta():
        return {"mode": args.mode, "device": info, "host": cpu_info(), "commit": commit, "dirty": dirty,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "versions": versions(device), "seconds": round(time.monotonic() - t0, 1)}

    result = run_cases(cases, timing=TIMINGS[args.mode], impl_filter=impls, progress=not args.no_progress,
                       deadline=None if limit is None else t0 + limit,
                       checkpoint=lambda r: write_results(payloads(r, meta=dict(meta(), partial=True)), out_dir,
                                                          plots=False))
    final = meta()
    print(table(result))
    written = write_results(payloads(result, meta=final), out_dir, plots=not args.no_plot)
    print(f"\n{len(result.records)} records in {final['seconds']} s; wrote {len(written)} files to {out_dir}")
    return 0
