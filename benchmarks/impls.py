"""The implementations measured: cuflash and what users would pick instead.

Each :class:`Impl`'s ``build(case, inputs)`` returns ``(run, sync)``: ``run()`` launches one call
(possibly asynchronously) and returns its result; ``sync(result)`` waits until the device is done.
PyTorch and JAX are imported only when their adapter is used: neither is a dependency.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from .cases import OPS, Case
from .inputs import Inputs

NA = "n/a: "  # prefix of the reasons an impl does not apply to a case (by design, not a failure)


class Skip(Exception):
    """An impl cannot run a case (unsupported, out of memory, not installed): recorded, not fatal."""


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


def device_sync(device: str) -> Callable:
    """``sync(result=None)`` that waits for the current CuPy stream ("cuda"), a no-op on the CPU."""
    if device == "cuda":
        import cupy

        return lambda result=None: cupy.cuda.get_current_stream().synchronize()
    return lambda result=None: None


# ---------------------------------------------------------------------------------- cuflash
def _check_cuflash(device: str):
    from .environment import cuflash_backend_status

    ok, why = cuflash_backend_status(device)
    if not ok:
        raise Skip(f"cuflash {device} backend unavailable: {why}")


def _build_cuflash(case: Case, x: Inputs):
    import cuflash

    opts = dict(causal=case.causal, block_mask=x.block_mask)
    if case.precision != "ieee":
        opts["precision"] = case.precision
    if case.block_k is not None:
        run = _tile_run(case, x)
    elif case.op == "fwd":
        run = lambda: cuflash.attention(x.q, x.k, x.v, **opts)  # noqa: E731
    elif case.op == "bwd":
        out, lse = cuflash.attention(x.q, x.k, x.v, return_lse=True, **opts)
        run = lambda: cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, **opts)  # noqa: E731
    else:
        def run():
            out, lse = cuflash.attention(x.q, x.k, x.v, return_lse=True, **opts)
            return cuflash.attention_backward(x.dout, x.q, x.k, x.v, out, lse, **opts)
    return run, device_sync(case.device)


def _build_cuflash_kvcache(case: Case, x: Inputs):
    """The decode path: ``attention_with_kvcache`` over K, V as a full cache (split-KV chosen by num_splits=None)."""
    import cuflash

    xp = _module_of(x.q)
    lengths = xp.full((case.batch,), case.seqlen_k, dtype=np.int32)
    run = lambda: cuflash.attention_with_kvcache(x.q, x.k, x.v, cache_seqlens=lengths, causal=case.causal)  # noqa
    return run, device_sync(case.device)


def _dispatched(op: str, dtype: str, head_dim: int, precision: str = "ieee"):
    """The specialization the dispatcher runs for ``op`` on the current GPU: its compute capability and shared-memory
    opt-in pick the tile table's row (an H100 has rows of its own, ``specs.ARCH_TILES``; the float32/float64
    families, ``w*``, by the arithmetic ``precision`` and the GPU select)."""
    from cuflash.backends.cuda import _device
    from cuflash.cuda import specs

    _, cc, max_smem = _device()
    math = specs.wide_math(dtype, precision, cc) if op in specs.WIDE_FAMILIES else ""
    return specs.select(op, dtype, head_dim, max_smem, cc=cc, math=math)


def _tile_run(case: Case, x: Inputs) -> Callable:
    """Forward with an explicit key-tile size: the NumPy backend's ``block_k``; on CUDA the tile
    table's specialization with ``block_n = block_k`` (or the whole ``case.tile``), through the backend's
    own ``forward(spec=)``; with ``op="bwd"`` (CUDA, ``case.tile``) the backward's main kernel so, through
    ``backward(spec=)``, after an untimed forward."""
    from cuflash.problem import make_problem

    problem = make_problem(x.q, x.k, x.v, causal=case.causal)
    if case.device == "cpu":
        from cuflash.backends import numpy as numpy_backend

        return lambda: numpy_backend.forward(problem, block_k=case.block_k)
    from cuflash.backends import cuda as backend

    table = _dispatched(case.op, case.dtype, case.head_dim)
    if case.tile is not None:
        spec = replace(table, block_m=case.tile[0], block_n=case.tile[1], warps=case.tile[2])  # KernelSpec validates
    else:
        spec = replace(table, block_n=case.block_k)
    if case.op == "bwd":
        out, lse = backend.forward(problem)
        return lambda: backend.backward(problem, x.dout, out, lse, spec=spec)
    return lambda: backend.forward(problem, spec=spec)


# ---------------------------------------------------------------------------------- standard attention
def standard_attention(q, k, v, *, bias=None, inplace=True):
    """Algorithm 0 (standard attention) on NumPy or CuPy arrays, in their own dtype.

    ``S = QKᵀ/√d`` and ``P = softmax(S)`` are materialized (``B·H·Sq·Sk`` each). A baseline only:
    cuflash's oracle is :mod:`cuflash.reference`.

    Parameters
    ----------
    q : array, shape (B, Sq, H, d)
    k, v : array, shape (B, Sk, H, d)
    bias : array of shape (Sq, Sk) or None, keyword-only
        Additive mask (0 / -inf).
    inplace : bool, keyword-only
        False: the formula as written, every step allocating its result (naive NumPy). True: one
        buffer for S and P, Q scaled instead of S (what a careful user writes).

    Returns
    -------
    array, shape (B, Sq, H, d)
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
        return (lambda: standard_attention(x.q, x.k, x.v, bias=bias, inplace=inplace)), device_sync(case.device)
    return build


# ---------------------------------------------------------------------------------- naive attention on cuBLAS
def standard_attention_backward(q, k, v, dout, p, out):
    """Standard attention's backward (FA1 Algorithm 3) from the saved P ``(B, H, Sq, Sk)`` and O: dV = PᵀdO,
    dP = dO Vᵀ, dS = P∘(dP − rowsum(dO∘O)), dQ = dS K/√d, dK = dSᵀQ/√d; O(N²) memory like the forward."""
    xp = _module_of(q)
    scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    qh, kh, vh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    doh, oh = dout.transpose(0, 2, 1, 3), out.transpose(0, 2, 1, 3)
    dv = xp.matmul(p.swapaxes(-1, -2), doh)
    ds = xp.matmul(doh, vh.swapaxes(-1, -2))
    ds -= (doh * oh).sum(axis=-1, keepdims=True)
    ds *= p
    dq = xp.matmul(ds, kh) * scale
    dk = xp.matmul(ds.swapaxes(-1, -2), qh) * scale
    return tuple(a.transpose(0, 2, 1, 3) for a in (dq, dk, dv))


def cublas_compute_type(dtype: str, precision: str):
    """CuPy's matmul compute type of the accuracy class: TF32 tensor cores for precision "tf32", else strict float32
    / float64 (CuPy's default for float32 follows the CUPY_TF32 environment variable: set explicitly here)."""
    from cupy._core import _routines_linalg as linalg

    if dtype == "float32":
        return linalg.COMPUTE_TYPE_TF32 if precision == "tf32" else linalg.COMPUTE_TYPE_FP32
    return linalg.COMPUTE_TYPE_DEFAULT


def _build_cupy_naive(case: Case, x: Inputs):
    """Standard attention forward / backward on CuPy (cuBLAS), in the case's dtype and accuracy class."""
    from cupy._core import _routines_linalg as linalg

    dt = x.q.dtype
    kind = cublas_compute_type(case.dtype, case.precision)
    bias = causal_bias(x.xp, case.seqlen_q, case.seqlen_k, dt) if case.causal else None

    def in_class(fn):
        def run():
            before = linalg.get_compute_type(dt)
            linalg.set_compute_type(dt, kind)
            try:
                return fn()
            finally:
                linalg.set_compute_type(dt, before)
        return run

    if case.op == "fwd":
        return in_class(lambda: standard_attention(x.q, x.k, x.v, bias=bias)), device_sync(case.device)
    xp = x.xp

    def forward_saving_p():
        scale = dt.type(1.0 / math.sqrt(case.head_dim))
        s = xp.matmul(x.q.transpose(0, 2, 1, 3) * scale, x.k.transpose(0, 2, 3, 1))
        if bias is not None:
            s += bias
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        return s, xp.matmul(s, x.v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    if case.op == "bwd":
        p, out = in_class(forward_saving_p)()  # the forward's saved P and O (not timed)
        return in_class(lambda: standard_attention_backward(x.q, x.k, x.v, x.dout, p, out)), device_sync(case.device)

    def fwd_bwd():
        p2, out2 = forward_saving_p()
        return standard_attention_backward(x.q, x.k, x.v, x.dout, p2, out2)
    return in_class(fwd_bwd), device_sync(case.device)


# ---------------------------------------------------------------------------------- PyTorch SDPA
TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                  "torch-efficient": "EFFICIENT_ATTENTION", "torch-math": "MATH"}


def _check_torch(device: str):
    try:
        import torch
        from torch.nn.attention import sdpa_kernel  # torch >= 2.3
        del sdpa_kernel  # imported to check that it exists
    except Exception as exc:  # noqa: BLE001 -- ImportError, or a broken install's OSError (a missing libtorch_cuda)
        raise Skip(f"torch not importable ({type(exc).__name__}: {exc})") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise Skip("torch has no CUDA support here")


def _torch_tensors(x: Inputs, *, grad: bool):
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


def _skip_misaligned_causal(case: Case, library: str):
    if case.causal and case.seqlen_q != case.seqlen_k:
        raise Skip(f"{library}'s is_causal is top-left aligned; cuflash's bottom-right")


def _build_torch(name: str):
    def build(case: Case, x: Inputs):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        _skip_misaligned_causal(case, "torch")
        backend = getattr(SDPBackend, TORCH_BACKENDS[name])
        q, k, v, do = _torch_tensors(x, grad=case.op != "fwd")
        tr = lambda t: t.transpose(1, 2)  # noqa: E731  (B, S, H, d) -> (B, H, S, d), a view

        def attend():
            with sdpa_kernel(backend):
                if case.dtype == "float32":  # the accuracy class: TF32 matmuls for precision "tf32" only
                    tf32 = torch.backends.cuda.matmul.allow_tf32
                    torch.backends.cuda.matmul.allow_tf32 = case.precision == "tf32"
                    try:
                        return sdpa(tr(q), tr(k), tr(v), is_causal=case.causal)
                    finally:
                        torch.backends.cuda.matmul.allow_tf32 = tf32
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
    except Exception as exc:  # noqa: BLE001 -- ImportError, or a broken install's own error
        raise Skip(f"jax not importable ({type(exc).__name__}: {exc})") from None
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        raise Skip(f"jax has no GPU here ({str(exc).splitlines()[0]})") from None


def _jax_array(a):
    import jax

    try:
        return jax.dlpack.from_dlpack(a)  # zero-copy from CuPy
    except Exception:  # noqa: BLE001 -- older jax takes only capsules: copy (outside the timing)
        return jax.device_put(a.get() if hasattr(a, "get") else np.asarray(a))


def _build_jax(name: str):
    def build(case: Case, x: Inputs):
        import functools

        import jax

        _skip_misaligned_causal(case, "jax")
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


def _standard(name: str, device: str, *, inplace: bool) -> Impl:
    return Impl(name, (device,), ("fwd",), _build_standard(inplace=inplace), _check_standard, "pool", "standard")


IMPLS = {
    "cuflash": Impl("cuflash", ("cpu", "cuda"), OPS, _build_cuflash, _check_cuflash, "pool", "tiled",
                    block_mask=True, tile_choice=True),
    "cuflash-kvcache": Impl("cuflash-kvcache", ("cpu", "cuda"), ("fwd",), _build_cuflash_kvcache, _check_cuflash,
                            "pool", "tiled"),
    "numpy": _standard("numpy", "cpu", inplace=False),
    "numpy-inplace": _standard("numpy-inplace", "cpu", inplace=True),
    "cupy-standard": _standard("cupy-standard", "cuda", inplace=True),
    "cupy-naive": Impl("cupy-naive", ("cuda",), OPS, _build_cupy_naive, _check_standard, "pool", "standard"),
    **{n: Impl(n, ("cpu", "cuda") if n in ("torch-flash", "torch-math") else ("cuda",), OPS, _build_torch(n),
               _check_torch, "torch", "standard" if n == "torch-math" else None) for n in TORCH_BACKENDS},
    **{n: Impl(n, ("cuda",), OPS, _build_jax(n), _check_jax, None) for n in JAX_IMPLS},
}


def applicable(impl: Impl, case: Case) -> Optional[str]:
    """Why ``impl`` does not apply to ``case`` (None if it does); the reason starts with :data:`NA`."""
    if case.device not in impl.devices:
        return f"{NA}{impl.name} does not run on {case.device}"
    if case.op not in impl.ops:
        return f"{NA}{impl.name} has no {case.op}"
    if case.density is not None and not impl.block_mask:
        return f"{NA}{impl.name} takes no BlockMask"
    if case.block_k is not None and not impl.tile_choice:
        return f"{NA}{impl.name} takes no tile choice"
    return None


def model_io_bytes(case: Case, impl: Impl) -> Optional[int]:
    """:func:`cuflash.io_cost` for the impl's algorithm: GPU only (a CPU has no HBM/SRAM split the
    ledger describes); Algorithm 0's ledger for standard attention, the tiled ledger with the CUDA
    kernels' tile tables (or the swept key tile) for cuflash."""
    if case.device != "cuda" or impl.io_model is None:
        return None
    from cuflash.io_cost import io_cost

    wide = case.dtype in ("float32", "float64")
    if wide and case.op != "fwd":
        return None  # the ledger's backward is the float16 kernel's (dQ by atomics); the wide one has a dQ pass
    try:  # the tiles this GPU runs (the float16 rows, or the float32/float64 forward's), or the swept one
        tiles = {}
        for op, prefix in (("fwd", ""), ("bwd", "bwd_")):
            if case.op in (op, "fwd_bwd"):
                spec = (_dispatched("wfwd", case.dtype, case.head_dim, case.precision) if wide
                        else _dispatched(op, "float16", case.head_dim))
                tiles[prefix + "block_q"], tiles[prefix + "block_k"] = spec.block_m, spec.block_n
        prefix = "bwd_" if case.op == "bwd" else ""
        if case.tile:
            tiles[prefix + "block_q"], tiles[prefix + "block_k"] = case.tile[:2]
        elif case.block_k:
            tiles["block_k"] = case.block_k
        cost = io_cost(seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k, head_dim=case.head_dim, batch=case.batch,
                       heads=case.heads, dtype=case.dtype, op=case.op, causal=case.causal, density=case.density,
                       **tiles)
    except (ImportError, ValueError, TypeError):
        return None
    return cost.tiled if impl.io_model == "tiled" else cost.standard
