"""The "cuda" backend: the fused kernels of ``kernels/`` on CuPy arrays.

Each specialization (:class:`cuflash.kernels.KernelSpec`) is compiled once per device by
``cupy.RawModule`` (NVRTC) from the source with every local include inlined — CuPy's disk cache
hashes the source string, so a header change is a new cache entry — and memoized here. Launches
go to the current CuPy stream. CuPy is imported only when this backend is first used.

bfloat16: CuPy has no bfloat16 dtype of its own. Arrays whose dtype is ``ml_dtypes.bfloat16`` are
taken where the installed CuPy supports them; otherwise pass the bits as a ``uint16`` array and
ask for ``dtype="bfloat16"`` (a ``uint16`` problem is read as bfloat16 bits here; the output is
``uint16`` bits as well).
"""
from __future__ import annotations

import sys
import threading

import numpy as np

from .. import kernels
from ..problem import Problem

MIN_CC = 80
_modules: dict = {}  # (device id, KernelSpec) -> cupy.RawKernel
_lock = threading.Lock()
_NVRTC_OPTIONS = ("-std=c++17",)


def _cupy():
    import cupy

    return cupy


_devices: dict = {}  # device id -> (compute capability, opt-in shared memory per block)


def _device():
    """(device id, compute capability as int, opt-in shared memory per block) of the current device."""
    cupy = _cupy()
    dev = cupy.cuda.Device()
    info = _devices.get(dev.id)
    if info is None:
        cc = int(dev.compute_capability)
        smem = dev.attributes.get("MaxSharedMemoryPerBlockOptin") or kernels.SMEM_LIMIT.get(cc, 48 * 1024)
        info = _devices[dev.id] = (cc, int(smem))
    return (dev.id,) + info


#: the kernels apply dropout forward (kernels/dropout.cuh) and backward (the same keep bits, regenerated)
supports_dropout = True
supports_dropout_backward = True


def available():
    try:
        cupy = _cupy()
    except ImportError as exc:
        return False, f"CuPy is not installed ({exc}); install cuflash[cuda12] or cuflash[cuda13]"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False, "no CUDA device"
        _, cc, _ = _device()
    except Exception as exc:  # no driver, no device
        return False, f"no usable CUDA device ({exc})"
    if cc < MIN_CC:
        return False, (f"compute capability {cc // 10}.{cc % 10} is not supported: the kernels need 8.0 or newer "
                       f"(A100, A10/A30/A40, RTX 30xx/40xx, L4/L40, H100/H200)")
    return True, f"CuPy {cupy.__version__}, sm_{cc}"


def _check(problem: Problem, **more):
    """Usable GPU, supported dtype, and every array (q, k, v and ``more``) on the current device: the kernels
    launch there, and CuPy checks (and enables) peer access for its own kernels but not for raw ones, so
    another GPU's buffer would be an illegal address, a sticky error that ends the process's CUDA context."""
    ok, why = available()
    if not ok:
        raise RuntimeError(f"backend 'cuda' is not available: {why}")
    dtype = kernels.dtype_of(problem.q)
    if dtype not in kernels.SUPPORTED_DTYPES:
        raise TypeError(f"the CUDA kernels take float16 or bfloat16 inputs (bfloat16 as ml_dtypes.bfloat16 or "
                        f"uint16 bits), got {problem.q.dtype}; use backend='numpy' for float32/float64")
    dev = _device()[0]
    for name, a in dict(q=problem.q, k=problem.k, v=problem.v, **more).items():
        where = a.device.id
        if where != dev:
            raise ValueError(f"{name} is on GPU {where} but the current device is GPU {dev}: call cuflash inside "
                             f"`with cupy.cuda.Device({where}):`")


def kernel(spec: kernels.KernelSpec):
    """The compiled ``cupy.RawKernel`` of ``spec`` on the current device (compiled once, memoized)."""
    cupy = _cupy()
    dev, _, max_smem = _device()
    key = (dev, spec)
    fn = _modules.get(key)
    if fn is None:
        with _lock:
            fn = _modules.get(key)
            if fn is None:
                if spec.smem_bytes > max_smem:
                    raise ValueError(f"{spec.name_expression} needs {spec.smem_bytes} bytes of shared memory; "
                                     f"this GPU allows {max_smem} per block")
                module = cupy.RawModule(code=kernels.fwd_source(), options=_NVRTC_OPTIONS,
                                        name_expressions=(spec.name_expression,))
                fn = module.get_function(spec.name_expression)
                if spec.smem_bytes > 48 * 1024:  # above 48 KB a block must opt in
                    fn.max_dynamic_shared_size_bytes = spec.smem_bytes
                _modules[key] = fn
    return fn


def _device_args(args):
    # A null pointer (no seqlens, no BlockMask) goes to the kernel as a 64-bit zero.
    return tuple(np.uint64(0) if a is None else a for a in args)


def forward(problem: Problem, *, spec=None):
    """``(out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) float32)`` on the current CuPy stream.

    ``spec`` forces a :class:`~cuflash.kernels.KernelSpec` (benchmarks compare tile choices with it)."""
    _check(problem)
    _, _, max_smem = _device()
    fl = kernels.forward_launch(problem, max_smem=max_smem, spec=spec)
    if fl.spec is not None:
        fn = kernel(fl.kernel)
        fn(fl.spec.grid, fl.spec.block, _device_args(fl.spec.args), shared_mem=fl.spec.shared_bytes)
    return fl.result()


_bwd_modules: dict = {}  # (device id, BwdSpec, DqSpec) -> {name expression: cupy.RawKernel}


def backward_kernels(spec, dq_spec):
    """The compiled backward family for ``spec``/``dq_spec`` on the current device: one RawModule holding
    the preprocess, main, convert and dq kernels (compiled once, memoized); name expression → RawKernel."""
    from .. import kernels_bwd

    cupy = _cupy()
    dev, _, max_smem = _device()
    key = (dev, spec, dq_spec)
    fns = _bwd_modules.get(key)
    if fns is None:
        with _lock:
            fns = _bwd_modules.get(key)
            if fns is None:
                for s in (spec, dq_spec):  # before compiling: get_function runs NVRTC over the whole family
                    if s.smem_bytes > max_smem:
                        raise ValueError(f"{s.name_expression} needs {s.smem_bytes} bytes of shared memory; "
                                         f"this GPU allows {max_smem} per block")
                ctype = kernels.CTYPES[spec.dtype]
                names = [f"cuflash::flash_bwd_preprocess_kernel<{ctype}>",
                         f"cuflash::flash_bwd_convert_dq_kernel<{ctype}>", spec.name_expression,
                         dq_spec.name_expression]
                module = cupy.RawModule(code=kernels_bwd.bwd_source(), options=_NVRTC_OPTIONS,
                                        name_expressions=tuple(names))
                fns = {n: module.get_function(n) for n in names}
                for s in (spec, dq_spec):
                    if s.smem_bytes > 48 * 1024:
                        fns[s.name_expression].max_dynamic_shared_size_bytes = s.smem_bytes
                _bwd_modules[key] = fns
    return fns


def backward(problem: Problem, dout, out, lse, *, deterministic=False):
    """``(dq, dk, dv)`` on the current CuPy stream (:func:`cuflash.kernels_bwd.backward_launch`).

    ``deterministic=False``: dQ is accumulated with fp32 atomics, so its last bits may vary from run to
    run (dK, dV never do). ``deterministic=True``: a second pass over query tiles computes dQ without
    atomics; bitwise reproducible.
    """
    from .. import kernels_bwd

    _check(problem, dout=dout, out=out, lse=lse)
    _, _, max_smem = _device()
    bl = kernels_bwd.backward_launch(problem, dout, out, lse, deterministic=deterministic, max_smem=max_smem)
    if bl.launches:
        main = bl.kernels[0]
        dq_spec = bl.kernels[1] if len(bl.kernels) > 1 else kernels_bwd.select_specs(main.dtype, main.head_dim,
                                                                                    max_smem)[1]
        fns = backward_kernels(main, dq_spec)
        for launch in bl.launches:
            fns[launch.name_expression](launch.grid, launch.block, _device_args(launch.args),
                                        shared_mem=launch.shared_bytes)
    return bl.result()


def warmup(dtypes=kernels.SUPPORTED_DTYPES, head_dims=kernels.NATIVE_HEAD_DIMS, *, backward=False, progress=True,
           file=None):
    """Compile the kernels for ``dtypes`` x ``head_dims`` on the current device now (NVRTC, then CuPy's
    disk cache), so the first real call does not pay for it.

    Returns the forward specs, then, with ``backward=True``, the ``(main, dq)`` backward pairs (a
    head_dim whose backward this GPU cannot run, 256 on 99 KB-shared-memory GPUs, is left out).
    ``progress`` prints a one-line progress bar to ``file`` (default stderr).
    """
    ok, why = available()
    if not ok:
        raise RuntimeError(f"cannot warm up the CUDA kernels: {why}")
    _, _, max_smem = _device()
    names = [np.dtype(dt).name if not isinstance(dt, str) else dt for dt in dtypes]
    jobs = {}  # what to compile -> how; dict keeps order and drops repeats (odd head dims share a spec)
    for dt in names:
        for d in head_dims:
            s = kernels.select_spec(dt, d, max_smem)
            jobs.setdefault(s, lambda s=s: kernel(s))
    if backward:
        from .. import kernels_bwd

        for dt in names:
            for d in head_dims:
                try:
                    pair = kernels_bwd.select_specs(dt, d, max_smem)
                except ValueError:
                    continue
                jobs.setdefault(pair, lambda pair=pair: backward_kernels(*pair))
    out = file or sys.stderr
    for i, (what, compile_it) in enumerate(jobs.items()):
        if progress:
            name = what.name_expression if isinstance(what, kernels.KernelSpec) else what[0].name_expression
            bar = "#" * (20 * i // len(jobs))
            print(f"\rcuflash warmup [{bar:<20}] {i}/{len(jobs)} {name}", end="", file=out, flush=True)
        compile_it()
    if progress:
        print(f"\rcuflash warmup [{'#' * 20}] {len(jobs)}/{len(jobs)} done{' ' * 50}", file=out, flush=True)
    return list(jobs)
