"""Launch descriptions: a :class:`~cuflash.problem.Problem` → the kernels to run, each with its params struct.

:func:`forward_launch` and :func:`backward_launch` are the one place that turns a problem into
:class:`LaunchSpec` values (grid, block, shared memory, the packed :data:`~cuflash.cuda.params.PARAMS`);
the CUDA backend hands them to CuPy and the emulate backend to :mod:`cuflash.emulate`, unchanged.

The backward (FA2 Algorithm 2 by recomputation) is three launches: ``preprocess`` (D = rowsum(dO∘O),
L = lse·log2 e, zeroed dQ workspace), the ``bwd`` kernel over key tiles (dK, dV; dQ by fp32
atomics), then ``convert`` (dQ = scale·workspace in the input dtype) or, with
``deterministic=True``, the ``dq`` kernel over query tiles that recomputes dQ without atomics (dQ,
dK and dV then bitwise reproducible; by default dQ's last bits follow the atomics' order).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np

from .. import dropout, tiling
from . import modcode, params, specs
from .source import kernel_source

#: ``kUnbounded`` in kernels/mask.cuh: "no window bound"; lengths must stay below it.
UNBOUNDED = 1 << 30
#: sequence-length limit of the int32 index arithmetic in the kernels (see mask.cuh).
MAX_SEQLEN = UNBOUNDED - 1
#: rows of the split-KV combine kernel's blocks (one warp per row; the backward's helpers: specs.helper_rows).
ROWS_PER_BLOCK = 4


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to run one kernel, for CuPy and for the emulator alike.

    Attributes
    ----------
    source : str
        Complete CUDA C++ source (local includes inlined, :func:`~cuflash.cuda.source.kernel_source`).
    name_expression : str
        Kernel name or template instantiation, e.g. ``"cuflash::flash_fwd_kernel<__half, 64, 128, 64, 4>"``.
    grid, block : tuple of 3 ints
    shared_bytes : int
        Dynamic shared memory in bytes.
    args : tuple
        Kernel arguments in signature order: device buffers (CuPy arrays, or NumPy arrays for the emulator),
        NumPy scalars, or size-1 NumPy arrays of a structured dtype passed by value (the params struct).
    options : tuple of str
        Compiler options (``-D`` macros and the like) shared by NVRTC and the emulator's g++.
    module : tuple of str
        The name expressions compiled together with this one (one CuPy ``RawModule``); default just this one.
    keep : tuple
        Arrays the params struct points to: held until the launch has been issued.
    """

    source: str
    name_expression: str
    grid: tuple
    block: tuple
    shared_bytes: int
    args: tuple
    options: tuple = ()
    module: tuple = ()
    keep: tuple = field(default=(), repr=False)

    @property
    def module_names(self) -> tuple:
        return self.module or (self.name_expression,)


# ------------------------------------------------------------------------------------------------
# Inputs as the kernels read them
# ------------------------------------------------------------------------------------------------
def _scale_log2(problem) -> np.float32:
    """``scale * log2(e)`` rounded once to float32 (every kernel multiplies its scores by it); past float32's range
    (a scale above 2.36e38) inf, without NumPy's overflow warning (README's first range limit); below float32's
    smallest, 0 or a subnormal, without the underflow one."""
    with np.errstate(over="ignore", under="ignore"):
        return np.float32(problem.scale * np.log2(np.e))


def _aligned(a) -> bool:
    """cp.async copies 16-byte chunks: base address and every stride must be multiples of 16 bytes."""
    return (params.address(a) % 16 == 0 and a.strides[-1] == a.dtype.itemsize
            and all(s % 16 == 0 for s, n in zip(a.strides[:-1], a.shape[:-1]) if n > 1))


def _prepare(xp, a, d8: int):
    """``a`` itself when the kernel can read it in place, else a contiguous copy with the head dim
    zero-padded to ``d8`` (a multiple of 8: whole 16-byte chunks)."""
    if a.shape[-1] == d8 and _aligned(a):
        return a
    padded = xp.zeros(a.shape[:-1] + (d8,), dtype=a.dtype)
    padded[..., :a.shape[-1]] = a
    return padded


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels read and write: a multiple of 8 (whole 16-byte chunks)."""
    return -(-head_dim // 8) * 8


def check_launch_limits(problem, what: str):
    """The grid is (tiles, heads, batch) and indices are int32: reject what the kernels cannot address."""
    b, sq, hq, _ = problem.q.shape
    sk = problem.k.shape[1]
    if max(sq, sk) > MAX_SEQLEN:
        raise ValueError(f"sequence lengths must be below 2**30 on the CUDA kernels, got {sq}, {sk}")
    if hq > 65535 or b > 65535:
        raise ValueError(f"the CUDA {what} launches one block per (tile, head, batch): heads ({hq}) and "
                         f"flattened batch ({b}) must each be at most 65535; split the batch")


# ------------------------------------------------------------------------------------------------
# Block-mask lists at the kernel's tile granularity
# ------------------------------------------------------------------------------------------------
def tile_lists(kept: np.ndarray, full: np.ndarray):
    """The BlockMask schedule as a kernel reads it: per (batch|1, head|1, tile) of the outer loop, the sorted tiles
    of the inner loop that are kept, ``n`` for a full one and ``~n`` for one that needs the element test.
    ``kept``/``full`` are :func:`cuflash.tiling.mask_tiles`, oriented (outer, inner).

    Returns ``(counts int32 (Bm, Hm, n_outer), lists int32 (Bm, Hm, n_outer, n_inner))``, C-ordered (the kernels
    index them flat).
    """
    order = np.argsort(~kept, axis=-1, kind="stable").astype(np.int32)  # kept tiles first, ascending
    lists = np.where(np.take_along_axis(full, order, axis=-1), order, ~order).astype(np.int32)
    counts = kept.sum(axis=-1).astype(np.int32)
    return np.ascontiguousarray(counts), np.ascontiguousarray(lists)


def _mask_arg(xp, bm, block_q: int, block_k: int, transposed: bool):
    """``(BlockMaskArg value, arrays it points to)``: the tile lists per query tile (per key tile when
    ``transposed``: the backward's main kernel)."""
    if bm is None:
        return (0, 0, 0, 0, 0), ()

    def make():
        kept, full = tiling.mask_tiles(bm, block_q, block_k)
        if transposed:
            kept, full = kept.transpose(0, 1, 3, 2), full.transpose(0, 1, 3, 2)
        return tuple(xp.asarray(a) for a in tile_lists(kept, full))

    counts, lists = bm.derived(("tile lists", modcode.device_key(xp), block_q, block_k, transposed), make)
    gb, gh, n_tiles = counts.shape
    value = (params.address(counts), params.address(lists), gh * n_tiles if gb > 1 else 0,
             n_tiles if gh > 1 else 0, lists.shape[-1])
    return value, (counts, lists)


def _dropout_arg(problem) -> tuple:
    """``(seed_lo, seed_hi, threshold, rescale)``: :mod:`cuflash.dropout`'s keep-mask. Without dropout
    ``(0, 0, 0, 1)``: threshold 0 keeps every element and the kernels skip the generator."""
    p = problem.dropout_p
    if not p:
        return (0, 0, 0, 1.0)
    seed = int(problem.seed)
    return (seed & 0xFFFFFFFF, seed >> 32, dropout.threshold(p), 1.0 / (1.0 - p))


def _window(w) -> int:
    return UNBOUNDED if w is None else min(w, UNBOUNDED)


def _common(problem, d8: int) -> dict:
    """The params fields every kernel of a problem shares."""
    b, sq, hq, _ = problem.q.shape
    drop = _dropout_arg(problem)
    rescale64 = 1.0 / (1.0 - problem.dropout_p) if problem.dropout_p else 1.0
    return dict(seqlens_q=problem.seqlens_q, seqlens_k=problem.seqlens_k, seqlen_q=sq, seqlen_k=problem.seqlen_k,
                head_dim=d8, heads_per_kv=problem.group, scale=problem.scale,
                scale_log2=_scale_log2(problem),  # rounded once: every kernel multiplies by it
                window_left=_window(problem.window_left), window_right=_window(problem.window_right),
                stats_batch_stride=hq * sq, stats_head_stride=sq, dropout=drop,
                # the float64 kernels' scalars, rounded once to float64 (kernels/params.cuh, WideArg)
                wide=(problem.scale, rescale64))


def is_wide(problem) -> bool:
    """float32/float64 inputs: the kernels of kernels/flash_*_wide.cu."""
    return problem.element_type in specs.WIDE_CTYPES


def math_of(problem, cc: int = 80) -> str:
    """The wide kernels' arithmetic for ``problem`` on a GPU of compute capability ``cc`` ("" for 16-bit inputs)."""
    return specs.wide_math(problem.element_type, problem.precision, cc) if is_wide(problem) else ""


def _stats_dtype(problem):
    """lse, L, D and the dQ workspace: float32, float64 for float64 inputs."""
    return np.float64 if problem.element_type == "float64" else np.float32


def _launch(spec: specs.KernelSpec, source: str, grid, values: dict, keep: tuple, module=()) -> LaunchSpec:
    return LaunchSpec(source=source, name_expression=spec.name_expression, grid=grid, block=(spec.threads, 1, 1),
                      shared_bytes=spec.smem_bytes, args=(params.pack(**values),), module=module, keep=keep)


def _with_mods(problem, specs_, dbias=False, deterministic=False):
    """The specializations with the call's modifier compiled in, their source, the ModArgs value and the arrays it
    points to (and the dbias accumulator, when asked for: in the problem's whole (B, H, Sq, Sk) shape where the
    backward is ``deterministic``, :func:`modcode.dbias_buffer`). The float64 kernels take it in float64."""
    source = kernel_source(specs_[0].source)
    if problem.mods is None and problem.block_mask is None:
        return specs_, source, None, (), None
    real = "double" if problem.element_type == "float64" else "float"
    mods, bm, xp = problem.mods, problem.block_mask, problem.xp

    def render():
        return modcode.render(mods, bm, dbias=dbias, real=real)

    def operands():
        return modcode.operands(mods, bm, xp, dbias=dbias, real=real)

    if mods is None:  # a BlockMask alone: its code and operands are the mask's (kept on it, as its tile lists)
        (name, code), (value, keep) = (bm.derived(("kernel code", dbias, real), render),
                                       bm.derived(("operands", modcode.device_key(xp), dbias, real), operands))
    else:  # mod_arrays are the caller's, and may change between calls
        (name, code), (value, keep) = render(), operands()
    acc = None
    if dbias:
        extents = (problem.batch, problem.heads_q, problem.seqlen_q, problem.seqlen_k) if deterministic else None
        acc, strides = modcode.dbias_buffer(problem.mods, problem.xp, dtype=_stats_dtype(problem), extents=extents)
        value = value[:3] + (params.address(acc), strides)
    return tuple(replace(s, mods=name) for s in specs_), _with_code(source, code), value, keep + (acc,), acc


@functools.lru_cache(maxsize=64)
def _with_code(source: str, code: str) -> str:
    """A family's source with a modifier's code appended: the same string object for the same code, so that the
    compiled-module caches (cupy.memoize) hash its 110 kB once, not on every call (70 us a call here)."""
    return source + code


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------------
# The forward
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardLaunch:
    """A forward launch and the arrays it writes; :meth:`result` gives ``(out, lse)``."""

    launch: Optional[LaunchSpec]  # None when there is nothing to compute (an empty problem)
    out: Any                      # (B, Sq, Hq, d8) in the input dtype
    lse: Any                      # (B, Hq, Sq) float32 (float64 for float64 inputs)
    head_dim: int

    def result(self):
        out = self.out if self.out.shape[-1] == self.head_dim else self.out[..., :self.head_dim].copy()
        return out, self.lse


def _forward_spec(problem, spec, max_smem: int, cc: int):
    """The forward's specialization (padded, varlen, KV cache): the given one, or the table's for this GPU; it must
    run the problem's dtype and head dim."""
    d = problem.q.shape[-1]
    spec = spec or specs.select("wfwd" if is_wide(problem) else "fwd", problem.element_type, d, max_smem,
                                math=math_of(problem, cc), cc=cc)
    if spec.dtype != problem.element_type or spec.head_dim < d:
        raise ValueError(f"kernel {spec} cannot run a {problem.element_type} problem of head_dim {d}")
    return spec


def forward_launch(problem, *, max_smem: int = specs.SMEM_LIMIT[80],
                   spec: Optional[specs.KernelSpec] = None, cc: int = 80) -> ForwardLaunch:
    """The forward kernel's launch for ``problem`` (CuPy or NumPy arrays alike); allocates ``out``/``lse``.
    ``cc``: the GPU's compute capability (picks the float64 arithmetic, :func:`cuflash.cuda.specs.wide_math`, and
    with ``max_smem`` the tile table row)."""
    xp = problem.xp
    b, sq, hq, d = problem.q.shape
    spec = _forward_spec(problem, spec, max_smem, cc)
    check_launch_limits(problem, "forward")
    d8 = padded_head_dim(d)
    out = xp.empty((b, sq, hq, d8), dtype=problem.q.dtype)
    lse = xp.empty((b, hq, sq), dtype=_stats_dtype(problem))
    if b == 0 or sq == 0:
        return ForwardLaunch(None, out, lse, d)
    q, k, v = (_prepare(xp, a, d8) for a in (problem.q, problem.k, problem.v))
    mask, mask_keep = _mask_arg(xp, problem.block_mask, spec.block_m, spec.block_n, False)
    (spec,), source, mods, mods_keep, _ = _with_mods(problem, (spec,))
    values = dict(_common(problem, d8), q=q, k=k, v=v, o=out, lse=lse, mask=mask)
    if mods is not None:
        values["mods"] = mods
    launch = _launch(spec, source, (_cdiv(sq, spec.block_m), hq, b), values, (q, k, v, out, lse, *mask_keep,
                                                                              *mods_keep),
                     specs.forward_module(spec, problem.element_type))
    return ForwardLaunch(launch, out, lse, d)


# ------------------------------------------------------------------------------------------------
# The backward
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackwardLaunch:
    """The launches of one backward, in order, and the arrays they write; :meth:`result` gives
    ``(dq, dk, dv)`` with the problem's head_dim."""

    launches: tuple  # LaunchSpec, ... (empty for an empty problem)
    dq: Any          # (B, Sq, Hq, d8) in the input dtype
    dk: Any          # (B, Sk, Hkv, d8)
    dv: Any
    head_dim: int
    dbias: Any = None  # fp32 (B|1, H|1, Sq|1, Sk|1), or (B, H, Sq, Sk) when deterministic: the bias's gradient
    compact: Optional[tuple] = None  # the bias's (B|1, H|1, Sq|1, Sk|1): what a whole dbias is summed to
    xp: Any = None  # the arrays' module (NumPy for the emulator)

    def result(self):
        d = self.head_dim
        grads = (self.dq, self.dk, self.dv)
        if self.dq.shape[-1] != d:
            grads = tuple(a[..., :d].copy() for a in grads)
        if self.dbias is None:
            return grads
        return grads + (modcode.dbias_sum(self.xp, self.dbias, self.compact),)


def backward_specs(problem, max_smem: int, cc: int = 80) -> tuple[specs.KernelSpec, specs.KernelSpec]:
    """The (bwd, dq) specializations for ``problem`` on a GPU allowing ``max_smem`` bytes per block."""
    d, t = problem.head_dim, problem.element_type
    modified = problem.mods is not None and problem.mods.score is not None
    plain = problem.mods is None and problem.block_mask is None  # no modifier code compiled in (_with_mods)
    bwd, dq = ("wbwd", "wdq") if is_wide(problem) else ("bwd", "dq")
    math = math_of(problem, cc)
    return (specs.select(bwd, t, d, max_smem, modified=modified, plain=plain, math=math, cc=cc),
            specs.select(dq, t, d, max_smem, modified=modified, plain=plain, math=math, cc=cc))


def backward_launch(problem, dout, out, lse, *, deterministic: bool = False, max_smem: int = specs.SMEM_LIMIT[80],
                    spec: Optional[specs.KernelSpec] = None, dq_spec: Optional[specs.KernelSpec] = None,
                    dbias: bool = False, cc: int = 80) -> BackwardLaunch:
    """The backward's launches for ``problem`` (CuPy or NumPy arrays alike).

    ``dout``, ``out`` are ``(B, Sq, Hq, D)`` in the input dtype and ``lse`` ``(B, Hq, Sq)`` (the
    flattened arrays of :func:`cuflash.problem.check_backward`). Allocates dq, dk, dv and the fp32
    workspaces (L, D: O(B·H·Sq); the dQ accumulator: O(B·Sq·H·D), default mode only) on
    ``problem.xp``; nothing of size N². With ``problem.dropout_p > 0`` the kernels regenerate the
    forward's keep-mask from ``problem.seed``.
    """
    xp = problem.xp
    b, sq, hq, d = problem.q.shape
    sk, hkv = problem.seqlen_k, problem.heads_kv
    spec, dq_spec = _backward_pair(problem, spec, dq_spec, max_smem, cc)
    check_launch_limits(problem, "backward")
    d8 = padded_head_dim(d)
    dt = problem.q.dtype
    nothing = b == 0 or sq == 0 or sk == 0  # no key or no query: zero gradients, no launch
    alloc = xp.zeros if nothing else xp.empty  # otherwise the kernels write every element
    dq, dk, dv = alloc((b, sq, hq, d8), dtype=dt), alloc((b, sk, hkv, d8), dtype=dt), alloc((b, sk, hkv, d8), dtype=dt)
    # no launch: the compact zeros are dbias already (nothing to sum in a fixed order)
    (spec, dq_spec), source, mods, mods_keep, dbias_acc = _with_mods(problem, (spec, dq_spec), dbias,
                                                                     deterministic and not nothing)
    compact = problem.mods.bias_compact if dbias else None
    if nothing:
        return BackwardLaunch((), dq, dk, dv, d, dbias_acc, compact, xp)

    q, k, v, do, o = (_prepare(xp, a, d8) for a in (problem.q, problem.k, problem.v, dout, out))
    st = _stats_dtype(problem)
    lse = xp.ascontiguousarray(lse, dtype=st)
    lse_log2, dsum = xp.empty((b, hq, sq), dtype=st), xp.empty((b, hq, sq), dtype=st)
    acc = None if deterministic else xp.empty((b, sq, hq, d8), dtype=st)
    common = dict(_common(problem, d8), q=q, k=k, v=v, o=o, dout=do, dq=dq, dk=dk, dv=dv, dq_accum=acc, lse=lse,
                  lse_log2=lse_log2, dsum=dsum)
    if mods is not None:
        common["mods"] = mods
    keep = (q, k, v, o, do, dq, dk, dv, acc, lse, lse_log2, dsum, *mods_keep)
    launches = _backward_launches(problem, spec, dq_spec, source, common, keep, sq, sk, b, deterministic)
    return BackwardLaunch(launches, dq, dk, dv, d, dbias_acc, compact, xp)


def _backward_launches(problem, spec, dq_spec, source, common, keep, rows_q: int, rows_k: int, batch: int,
                       deterministic: bool) -> tuple:
    """FA2 Algorithm 2 as launches, for the padded and the packed (varlen) batch alike: the preprocess (D), the main
    kernel over key tiles, then the convert of the fp32 dQ accumulator or the deterministic dQ pass. ``rows_q/k``:
    the (longest) sequence's rows the grids cover."""
    hq, hkv = problem.heads_q, problem.heads_kv
    # One RawModule per (bwd, dq) pair holds every backward kernel, so both modes share one compilation.
    module = (*specs.helper_names(problem.element_type), spec.name_expression, dq_spec.name_expression)
    preprocess, convert = specs.helper_names(problem.element_type)

    helper_args = (params.pack(**common),)  # both helpers read the same fields: packed once (40-70 us on the H200)

    def helper(name):  # 128 threads, specs.helper_rows rows each block
        return LaunchSpec(source=source, name_expression=name,
                          grid=(_cdiv(rows_q, specs.helper_rows(problem.element_type)), hq, batch),
                          block=(128, 1, 1), shared_bytes=0, args=helper_args, module=module, keep=keep)

    mask, mask_keep = _mask_arg(problem.xp, problem.block_mask, spec.block_m, spec.block_n, transposed=True)
    launches = [helper(preprocess),
                _launch(spec, source, (_cdiv(rows_k, spec.block_n), hkv, batch), dict(common, mask=mask),
                        keep + mask_keep, module)]
    if deterministic:
        mask, mask_keep = _mask_arg(problem.xp, problem.block_mask, dq_spec.block_m, dq_spec.block_n, False)
        launches.append(_launch(dq_spec, source, (_cdiv(rows_q, dq_spec.block_m), hq, batch), dict(common, mask=mask),
                                keep + mask_keep, module))
    else:
        launches.append(helper(convert))
    return tuple(launches)


# ------------------------------------------------------------------------------------------------
# Ragged batches (varlen): the same kernels over packed arrays
# ------------------------------------------------------------------------------------------------
# FA2's varlen layout: q (total_q, Hq, D), k/v (total_k, Hkv, D) packed along the token axis, lse (Hq, total_q).
# The kernels read the int32 offsets cu_seqlens_q/k themselves (SeqSpan in kernels/block_info.cuh): sequence b is
# grid z = b, its rows start at cu_seqlens[b] (tensor batch stride 0, params.tensor), and grid x covers the longest
# sequence (max_seqlen_q/k, known on the host from cuflash.problem: no read-back of the offsets here); blocks past a
# sequence's length write nothing. Masks, modifiers and dropout see (b, position within the sequence), so each
# sequence computes what batch entry b of the padded problem computes.
def check_varlen_limits(problem, what: str):
    if max(problem.max_seqlen_q, problem.max_seqlen_k) > MAX_SEQLEN:
        raise ValueError(f"sequence lengths must be below 2**30 on the CUDA kernels, got {problem.max_seqlen_q}, "
                         f"{problem.max_seqlen_k}")
    if max(problem.total_q, problem.total_k) >= 2 ** 31:
        raise ValueError(f"the CUDA kernels index packed tokens with int32 offsets: at most 2**31 - 1 tokens, got "
                         f"{problem.total_q}, {problem.total_k}")
    if problem.heads_q > 65535 or problem.batch > 65535:
        raise ValueError(f"the CUDA {what} launches one block per (tile, head, sequence): heads ({problem.heads_q}) "
                         f"and sequences ({problem.batch}) must each be at most 65535; split the batch")


def _varlen_common(problem, d8: int) -> tuple[dict, tuple]:
    """The params fields every kernel of a varlen problem shares, and the offset arrays they point to."""
    xp = problem.xp
    cu_q, cu_k = (xp.ascontiguousarray(c, dtype=np.int32) for c in (problem.cu_seqlens_q, problem.cu_seqlens_k))
    rescale64 = 1.0 / (1.0 - problem.dropout_p) if problem.dropout_p else 1.0
    values = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqlen_q=problem.max_seqlen_q,
                  seqlen_k=problem.max_seqlen_k, head_dim=d8, heads_per_kv=problem.group, scale=problem.scale,
                  scale_log2=_scale_log2(problem),
                  window_left=_window(problem.window_left), window_right=_window(problem.window_right),
                  stats_batch_stride=0, stats_head_stride=problem.total_q, dropout=_dropout_arg(problem),
                  wide=(problem.scale, rescale64))
    return values, (cu_q, cu_k)


def forward_varlen_launch(problem, *, max_smem: int = specs.SMEM_LIMIT[80], spec: Optional[specs.KernelSpec] = None,
                          cc: int = 80) -> ForwardLaunch:
    """The forward kernel's launch for a :class:`~cuflash.problem.VarlenProblem`: ``out (total_q, Hq, d8)``,
    ``lse (Hq, total_q)``."""
    xp = problem.xp
    total_q, hq, d = problem.q.shape
    spec = _forward_spec(problem, spec, max_smem, cc)
    check_varlen_limits(problem, "forward")
    d8 = padded_head_dim(d)
    if problem.batch == 0 or problem.max_seqlen_q == 0:
        out = xp.zeros((total_q, hq, d8), dtype=problem.q.dtype)
        return ForwardLaunch(None, out, xp.full((hq, total_q), -np.inf, dtype=_stats_dtype(problem)), d)
    out = xp.empty((total_q, hq, d8), dtype=problem.q.dtype)  # every row belongs to a sequence: all written
    lse = xp.empty((hq, total_q), dtype=_stats_dtype(problem))
    q, k, v = (_prepare(xp, a, d8) for a in (problem.q, problem.k, problem.v))
    (spec,), source, mods, mods_keep, _ = _with_mods(problem, (spec,))
    common, cu = _varlen_common(problem, d8)
    values = dict(common, q=q, k=k, v=v, o=out, lse=lse)
    if mods is not None:
        values["mods"] = mods
    grid = (_cdiv(problem.max_seqlen_q, spec.block_m), hq, problem.batch)
    return ForwardLaunch(_launch(spec, source, grid, values, (q, k, v, out, lse, *cu, *mods_keep),
                                 specs.forward_module(spec, problem.element_type)), out, lse, d)


def _backward_pair(problem, spec, dq_spec, max_smem: int, cc: int):
    """The backward's (main, dq) specializations: the given ones, or the table's for this GPU; each must run the
    problem's dtype and head dim."""
    if spec is None or dq_spec is None:
        chosen = backward_specs(problem, max_smem, cc)
        spec, dq_spec = spec or chosen[0], dq_spec or chosen[1]
    d = problem.q.shape[-1]
    for s in (spec, dq_spec):
        if s.dtype != problem.element_type or s.head_dim < d:
            raise ValueError(f"kernel {s} cannot run a {problem.element_type} problem of head_dim {d}")
    return spec, dq_spec


def backward_varlen_launch(problem, dout, out, lse, *, deterministic: bool = False,
                           max_smem: int = specs.SMEM_LIMIT[80], spec: Optional[specs.KernelSpec] = None,
                           dq_spec: Optional[specs.KernelSpec] = None, cc: int = 80) -> BackwardLaunch:
    """The backward's launches for a :class:`~cuflash.problem.VarlenProblem` (``dout``, ``out`` packed like ``q``,
    ``lse (Hq, total_q)``): the padded backward's kernels and modes, over packed arrays."""
    xp = problem.xp
    total_q, hq, d = problem.q.shape
    total_k, hkv = problem.total_k, problem.heads_kv
    spec, dq_spec = _backward_pair(problem, spec, dq_spec, max_smem, cc)
    check_varlen_limits(problem, "backward")
    d8 = padded_head_dim(d)
    dt = problem.q.dtype
    max_q, max_k, batch = problem.max_seqlen_q, problem.max_seqlen_k, problem.batch
    nothing = batch == 0 or max_q == 0 or max_k == 0  # zero gradients, no launch
    alloc = xp.zeros if nothing else xp.empty  # otherwise the kernels write every row of every sequence
    dq, dk, dv = (alloc((total_q, hq, d8), dtype=dt), alloc((total_k, hkv, d8), dtype=dt),
                  alloc((total_k, hkv, d8), dtype=dt))
    (spec, dq_spec), source, mods, mods_keep, _ = _with_mods(problem, (spec, dq_spec))
    if nothing:
        return BackwardLaunch((), dq, dk, dv, d)

    q, k, v, do, o = (_prepare(xp, a, d8) for a in (problem.q, problem.k, problem.v, dout, out))
    st = _stats_dtype(problem)
    lse = xp.ascontiguousarray(lse, dtype=st)
    lse_log2, dsum = xp.empty((hq, total_q), dtype=st), xp.empty((hq, total_q), dtype=st)
    acc = None if deterministic else xp.empty((total_q, hq, d8), dtype=st)
    common, cu = _varlen_common(problem, d8)
    common.update(q=q, k=k, v=v, o=o, dout=do, dq=dq, dk=dk, dv=dv, dq_accum=acc, lse=lse, lse_log2=lse_log2,
                  dsum=dsum)
    if mods is not None:
        common["mods"] = mods
    keep = (q, k, v, o, do, dq, dk, dv, acc, lse, lse_log2, dsum, *cu, *mods_keep)
    launches = _backward_launches(problem, spec, dq_spec, source, common, keep, max_q, max_k, batch, deterministic)
    return BackwardLaunch(launches, dq, dk, dv, d)


# ------------------------------------------------------------------------------------------------
# KV cache (attention_with_kvcache): the forward over a contiguous or paged cache, split-KV and its combine
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVCacheLaunch:
    """The launches of one KV-cache forward (the forward kernel; with split-KV the combine after it) and the arrays
    they write; :meth:`result` gives ``(out (B, Sq, Hq, D), lse (B, Hq, Sq))``."""

    launches: tuple
    out: Any
    lse: Any
    head_dim: int
    num_splits: int

    def result(self):
        return ForwardLaunch(None, self.out, self.lse, self.head_dim).result()


def check_kvcache_launch(problem, *, max_smem: int = specs.SMEM_LIMIT[80], sm_count: int = 108,
                         spec: Optional[specs.KernelSpec] = None, cc: int = 80):
    """``(spec, query tiles, splits)`` of the KV-cache forward, or the error that refuses it: the backends call this
    before the new tokens are appended, so that a refused call leaves the caches as they were (it depends on shapes
    and host lengths only, never on the cache's contents)."""
    b, sq, hq, _ = problem.q.shape
    spec = _forward_spec(problem, spec, max_smem, cc)
    if b == 0 or sq == 0:
        return spec, 0, 1
    capacity = problem.capacity
    if max(sq, capacity) > MAX_SEQLEN or hq > 65535:
        raise ValueError(f"the CUDA kernels take sequence lengths below 2**30 and at most 65535 heads, got seqlen_q "
                         f"{sq}, cache capacity {capacity}, {hq} heads")
    m_tiles = _cdiv(sq, spec.block_m)
    key_tiles = _cdiv(int(np.max(problem.lengths_k, initial=0)), spec.block_n)
    # More splits than key tiles leave shares empty (the kernel's per = ceil(tiles / splits) is then 1, so each split
    # up to the tiles' count takes one tile either way): capped, the same partials and bits, as the NumPy backend
    # caps them; num_splits=40000 was refused by the grid limit, and 3000 launched 6000 blocks and workspaces for
    # mostly nothing.
    splits = max(1, min(problem.num_splits or tiling.kv_splits(sm_count, m_tiles * hq * b, key_tiles), key_tiles))
    if b * splits > 65535:
        raise ValueError(f"the CUDA KV-cache forward launches one block per (tile, head, batch x split): batch ({b}) "
                         f"x num_splits ({splits}) must be at most 65535")
    return spec, m_tiles, splits


def forward_kvcache_launch(problem, *, max_smem: int = specs.SMEM_LIMIT[80], sm_count: int = 108,
                           spec: Optional[specs.KernelSpec] = None, cc: int = 80) -> KVCacheLaunch:
    """The KV-cache forward for a :class:`~cuflash.problem.KVCacheProblem` whose new tokens are already appended.

    Sequence b's queries attend to its first ``cache_seqlens[b] + S_new`` cache positions: the padded forward with
    those as seqlens_k over the cache (``seqlen_k`` = the capacity bounds them); a paged cache is read through
    ``block_table`` by the kernel's K/V loads (kernels/kv_tile.cuh), with the page stride as k/v's batch stride
    (float64: the pages are gathered into a contiguous copy first; that kernel has no registers for paged loads).
    ``problem.num_splits`` (None: :func:`cuflash.tiling.kv_splits` from ``sm_count`` and the shape) > 1 splits each
    sequence's key tiles over that many blocks (grid z = batch * splits) writing partial (out, lse) to workspaces in
    the accumulator type, then the combine kernel merges them (kernels/combine.cuh)."""
    xp = problem.xp
    b, sq, hq, d = problem.q.shape
    spec, m_tiles, splits = check_kvcache_launch(problem, max_smem=max_smem, sm_count=sm_count, spec=spec, cc=cc)
    d8 = padded_head_dim(d)
    st = _stats_dtype(problem)
    out = xp.empty((b, sq, hq, d8), dtype=problem.q.dtype)
    lse = xp.empty((b, hq, sq), dtype=st)
    if b == 0 or sq == 0:
        return KVCacheLaunch((), out, lse, d, 1)
    lengths = np.asarray(problem.lengths_k, dtype=np.int64)
    capacity = problem.capacity
    k_cache, v_cache = problem.k_cache, problem.v_cache
    gather = problem.paged and problem.element_type == "float64"
    if gather:  # the float64 kernel has no paged K/V loads (kernels/flash_fwd_wide.cu): its pages gathered first
        # from the checked host table, entries past a sequence's used pages set to page 0: they may hold anything
        # (-1, 99) and are never read, as the kernel's own paged loads never read them
        used = -(-np.asarray(problem.lengths_k, dtype=np.int64) // problem.page_size)
        host = problem.table_host
        table = xp.asarray(np.where(np.arange(host.shape[1]) < used[:, None], host, 0).astype(np.int32))
        if k_cache.shape[0] == 0:  # no page 0 either: every sequence is empty, nothing is read
            k_cache, v_cache = (xp.zeros((b, capacity) + a.shape[2:], a.dtype) for a in (k_cache, v_cache))
        else:
            k_cache, v_cache = (a[table].reshape((b, capacity) + a.shape[2:]) for a in (k_cache, v_cache))
    q, k, v = (_prepare(xp, a, d8) for a in (problem.q, k_cache, v_cache))
    seqlens_k = xp.asarray(lengths.astype(np.int32))  # host lengths (cuflash.problem read them): no device sync here
    keep = [q, k, v, out, lse, seqlens_k]
    paged = (0, 0, 0)
    if problem.paged and not gather:
        table = xp.ascontiguousarray(problem.block_table, dtype=np.int32)
        paged = (params.address(table), table.shape[1], problem.page_size)
        keep.append(table)
    (spec,), source, mods, mods_keep, _ = _with_mods(problem, (spec,))
    values = dict(seqlens_k=seqlens_k, seqlen_q=sq, seqlen_k=capacity, head_dim=d8, heads_per_kv=problem.group,
                  scale=problem.scale, scale_log2=_scale_log2(problem),
                  window_left=_window(problem.window_left), window_right=_window(problem.window_right),
                  stats_batch_stride=hq * sq, stats_head_stride=sq, dropout=(0, 0, 0, 1.0), wide=(problem.scale, 1.0),
                  q=q, k=k, v=v, o=out, lse=lse, paged=paged)
    if mods is not None:
        values["mods"] = mods
    keep = tuple(keep) + tuple(mods_keep)
    module = specs.forward_module(spec, problem.element_type)
    if splits == 1:
        return KVCacheLaunch((_launch(spec, source, (m_tiles, hq, b), values, keep, module),), out, lse, d, 1)
    # Split-KV: partials in the accumulator type (float32; float64 for float64), one slab per split laid out like
    # out / lse, then the combine over (rows / 4, heads, batch) writes out and lse.
    o_acc, lse_acc = xp.empty((splits, b, sq, hq, d8), dtype=st), xp.empty((splits, b, hq, sq), dtype=st)
    values["split"] = (params.address(o_acc), params.address(lse_acc), b * sq * hq * d8, b * hq * sq, splits)
    keep += (o_acc, lse_acc)
    combine = module[1]
    main = _launch(spec, source, (m_tiles, hq, b * splits), values, keep, module)
    merge = LaunchSpec(source=source, name_expression=combine, grid=(_cdiv(sq, ROWS_PER_BLOCK), hq, b),
                       block=(32 * ROWS_PER_BLOCK, 1, 1), shared_bytes=0, args=(params.pack(**values),),
                       module=module, keep=keep)
    return KVCacheLaunch((main, merge), out, lse, d, splits)
