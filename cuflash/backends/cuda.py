"""The "cuda" backend: the fused kernels of ``kernels/`` on CuPy arrays.

Each kernel family is compiled once per device by ``cupy.RawModule`` (NVRTC, then CuPy's disk
cache) from the source with every local include inlined, and memoized with
``cupy.memoize(for_each_device=True)``. Launches go to the current CuPy stream. CuPy is imported
only when this backend is first used.

bfloat16: CuPy has no bfloat16 dtype of its own. Arrays whose dtype is ``ml_dtypes.bfloat16`` are
taken where the installed CuPy supports them; otherwise pass the bits as a ``uint16`` array and
ask for ``dtype="bfloat16"`` (the output is ``uint16`` bits as well).
"""
from __future__ import annotations

import concurrent.futures
import functools
import sys

import numpy as np

from ..cuda import launch as launches
from ..cuda import params
from ..cuda import specs
from ..cuda.compile import KERNEL_OPTIONS
from ..cuda.source import kernel_source
from ..problem import Problem, check_current_device, check_flags, check_precision_name

MIN_CC = 80
#: what this backend computes (checked once, by cuflash.backends.select)
DTYPES = tuple(specs.CTYPES) + tuple(specs.WIDE_CTYPES)  # float32/float64: kernels/flash_*_wide.cu
MAX_HEAD_DIM = specs.NATIVE_HEAD_DIMS[-1]
BF16_BITS = True
MODIFIERS = True  # score and mask modifiers compiled into the kernels (cuflash/cuda/modcode.py)
ARRAYS = "cupy"
#: ragged batches (cuflash.attention_varlen): the kernels read cu_seqlens themselves (forward_varlen,
#: backward_varlen). KV caches (cuflash.attention_with_kvcache, forward_kvcache): contiguous or paged (the K/V loads
#: go through the block table), split-KV with a combine kernel; the append of k_new/v_new is an array copy.
VARLEN = True
KVCACHE = True

#: compiled by available(): both element types' headers, a template instantiation and a load on the device, the
#: steps every kernel needs (a machine without the CUDA headers, or with an NVRTC newer than its driver, fails here).
PROBE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
template <typename T> __global__ void cuflash_probe(T* x) { x[threadIdx.x] = T(1.0f); }
"""
PROBE_NAMES = ("cuflash_probe<__half>", "cuflash_probe<__nv_bfloat16>")
INSTALL_HINT = ("install the CuPy extra matching the driver's CUDA version (`nvidia-smi`, top right): "
                "pip install 'cuflash[cuda12]' for 12.x, 'cuflash[cuda13]' for 13.x")


def _cupy():
    import cupy

    return cupy


@functools.lru_cache(maxsize=None)
def _memoized():
    """The per-device memoized compile and query functions (built on first use: CuPy is imported lazily)."""
    cupy = _cupy()

    @cupy.memoize(for_each_device=True)
    def device():
        dev = cupy.cuda.Device()
        cc = int(dev.compute_capability)
        attributes = dev.attributes  # one query of the driver builds them all: once per device
        smem = attributes.get("MaxSharedMemoryPerBlockOptin") or specs.SMEM_LIMIT.get(cc, 48 * 1024)
        try:
            sms = int(attributes.get("MultiProcessorCount") or 108)
        except (TypeError, ValueError):  # a value the split-KV heuristic cannot take: an A100's count
            sms = 108
        return dev.id, cc, int(smem), sms

    @cupy.memoize(for_each_device=True)
    def module(source: str, names: tuple):
        return cupy.RawModule(code=source, options=KERNEL_OPTIONS, name_expressions=names)

    @cupy.memoize(for_each_device=True)
    def function(source: str, names: tuple, name: str, shared_bytes: int):
        fn = module(source, names).get_function(name)
        if shared_bytes > 48 * 1024:  # above 48 KB a block must opt in (per device: this is memoized per device)
            fn.max_dynamic_shared_size_bytes = shared_bytes
        return fn

    @cupy.memoize(for_each_device=True)
    def probe():
        try:
            module = cupy.RawModule(code=PROBE, options=KERNEL_OPTIONS, name_expressions=PROBE_NAMES)
            for name in PROBE_NAMES:
                module.get_function(name)
        except Exception as exc:  # CompileException, CUDADriverError (NVRTC newer than the driver), ...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"CuPy cannot compile and load a kernel ({type(exc).__name__}: {first}); {INSTALL_HINT}"
        return None

    return device, function, probe


def _device():
    """(device id, compute capability as int, opt-in shared memory per block) of the current device."""
    return _memoized()[0]()[:3]


def available():
    try:
        cupy = _cupy()
    except ImportError as exc:
        return False, f"CuPy is not installed ({exc}); {INSTALL_HINT}"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False, "no CUDA device"
        _, cc, _ = _device()
    except Exception as exc:  # no driver, no device
        return False, f"no usable CUDA device ({exc})"
    if cc < MIN_CC:
        return False, (f"compute capability {cc // 10}.{cc % 10} is not supported: the kernels need 8.0 or newer "
                       f"(A100, A10/A30/A40, RTX 30xx/40xx, L4/L40, H100/H200)")
    broken = _memoized()[2]()
    if broken:
        return False, broken
    return True, f"CuPy {cupy.__version__}, NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}, sm_{cc}"


def _check_devices(problem: Problem, **more):
    """Every array (q, k, v and ``more``) on the current device (:func:`cuflash.problem.check_current_device`)."""
    check_current_device(_device()[0], q=problem.q, k=problem.k, v=problem.v, **more)


def run(launch: launches.LaunchSpec):
    """Launch one :class:`~cuflash.cuda.launch.LaunchSpec` on the current stream (compiling on first use)."""
    _, _, max_smem = _device()
    if launch.shared_bytes > max_smem:
        raise ValueError(f"{launch.name_expression} needs {launch.shared_bytes} bytes of shared memory; this GPU "
                         f"allows {max_smem} per block")
    fn = _memoized()[1](launch.source, launch.module_names, launch.name_expression, launch.shared_bytes)
    args = tuple(params.as_bytes(a) if getattr(a, "dtype", None) is params.PARAMS else a for a in launch.args)
    fn(launch.grid, launch.block, args, shared_mem=launch.shared_bytes)


def forward(problem: Problem, *, spec=None):
    """``(out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) float32)`` on the current CuPy stream.

    ``spec`` forces a :class:`~cuflash.cuda.specs.KernelSpec` (benchmarks compare tile choices with it)."""
    _check_devices(problem)
    _, cc, max_smem = _device()
    fl = launches.forward_launch(problem, max_smem=max_smem, spec=spec, cc=cc)
    if fl.launch is not None:
        run(fl.launch)
    return fl.result()


def backward(problem: Problem, dout, out, lse, *, deterministic=False, dbias=False, spec=None):
    """``(dq, dk, dv)`` on the current CuPy stream (:func:`cuflash.cuda.launch.backward_launch`).

    ``spec`` forces the main kernel's :class:`~cuflash.cuda.specs.KernelSpec` (benchmarks compare tile choices)."""
    _check_devices(problem, dout=dout, out=out, lse=lse)
    _, cc, max_smem = _device()
    bl = launches.backward_launch(problem, dout, out, lse, deterministic=deterministic, max_smem=max_smem,
                                  dbias=dbias, cc=cc, spec=spec)
    for launch in bl.launches:
        run(launch)
    return bl.result()


def forward_varlen(problem, *, spec=None):
    """``(out (total_q, Hq, D), lse (Hq, total_q))`` of a :class:`~cuflash.problem.VarlenProblem` on the current
    stream: the forward kernel over the packed arrays (:func:`cuflash.cuda.launch.forward_varlen_launch`)."""
    _check_devices(problem, cu_seqlens_q=problem.cu_seqlens_q, cu_seqlens_k=problem.cu_seqlens_k)
    _, cc, max_smem = _device()
    fl = launches.forward_varlen_launch(problem, max_smem=max_smem, spec=spec, cc=cc)
    if fl.launch is not None:
        run(fl.launch)
    return fl.result()


def backward_varlen(problem, dout, out, lse, *, deterministic=False):
    """``(dq, dk, dv)`` packed like ``q``, ``k``, ``v`` on the current stream
    (:func:`cuflash.cuda.launch.backward_varlen_launch`)."""
    _check_devices(problem, dout=dout, out=out, lse=lse)
    _, cc, max_smem = _device()
    bl = launches.backward_varlen_launch(problem, dout, out, lse, deterministic=deterministic, max_smem=max_smem,
                                         cc=cc)
    for launch in bl.launches:
        run(launch)
    return bl.result()


def forward_kvcache(problem, *, spec=None):
    """Append ``k_new``/``v_new`` into the caches (an array copy on the current stream), then ``(out (B, Sq, Hq, D),
    lse (B, Hq, Sq))`` from the KV-cache forward kernel (and the split-KV combine):
    :func:`cuflash.cuda.launch.forward_kvcache_launch`, ``num_splits=None`` sized by this GPU's SM count."""
    from .numpy_ragged import append_kvcache

    more = {n: getattr(problem, n) for n in ("cache_seqlens", "k_new", "v_new", "block_table")
            if getattr(problem, n) is not None}
    _check_kvcache_devices(problem, more)
    _, cc, max_smem = _device()
    sizes = dict(max_smem=max_smem, sm_count=_sm_count(), spec=spec, cc=cc)
    launches.check_kvcache_launch(problem, **sizes)  # a refused call leaves the caches as they were
    with append_kvcache(problem):  # undone if the kernels fail to compile or launch
        kl = launches.forward_kvcache_launch(problem, **sizes)
        for launch in kl.launches:
            run(launch)
    return kl.result()


def _check_kvcache_devices(problem, more):
    dev = _device()[0]
    for name, a in dict(q=problem.q, k_cache=problem.k_cache, v_cache=problem.v_cache, **more).items():
        if a.device.id != dev:
            raise ValueError(f"{name} is on GPU {a.device.id} but the current device is GPU {dev}: call cuflash "
                             f"inside `with cupy.cuda.Device({a.device.id}):`")


def _sm_count() -> int:
    """Streaming multiprocessors of the current device (the split-KV heuristic's input; 108 if unknown), queried
    once per device with the rest of :func:`_device`'s: every KV-cache call asked the driver for all the device's
    attributes again."""
    return _memoized()[0]()[3]


_WARMUP_DTYPES = (*specs.CTYPES, *specs.WIDE_CTYPES)


def _warmup_dtypes(dtypes) -> list:
    """``warmup``'s ``dtypes`` as kernel dtype names. A single name is one dtype: iterating ``"float16"`` would
    read it letter by letter ("f" is NumPy's float32)."""
    want = f"one of {', '.join(_WARMUP_DTYPES)} (a name or a NumPy dtype)"
    if isinstance(dtypes, (str, np.dtype, type)):
        dtypes = (dtypes,)
    try:
        items = list(dtypes)
    except TypeError:
        raise TypeError(f"dtypes must be a dtype or a sequence of dtypes, each {want}; got {dtypes!r}") from None
    names = []
    for dt in items:
        name = dt if isinstance(dt, str) and dt in _WARMUP_DTYPES else None
        if name is None and isinstance(dt, (str, np.dtype, type)):
            try:  # other spellings NumPy knows ("f2", "half", np.float32, ml_dtypes.bfloat16)
                name = np.dtype(dt).name
            except (TypeError, ValueError):
                pass
        if name not in _WARMUP_DTYPES:
            raise ValueError(f"dtypes must each be {want}; got {dt!r}")
        names.append(name)
    return names


def _warmup_head_dims(head_dims) -> list:
    """``warmup``'s ``head_dims`` as a list of ints in [1, the largest native head dim]; one int is one head dim."""
    top = specs.NATIVE_HEAD_DIMS[-1]
    want = f"an int or a sequence of ints in [1, {top}]"
    if isinstance(head_dims, (int, np.integer)) and not isinstance(head_dims, bool):
        head_dims = (head_dims,)
    if isinstance(head_dims, (str, bytes)):
        raise TypeError(f"head_dims must be {want}, got {head_dims!r}")
    try:
        items = list(head_dims)
    except TypeError:
        raise TypeError(f"head_dims must be {want}, got {head_dims!r}") from None
    for d in items:
        # 64.0 or True would otherwise pass the tile table's comparisons and name a kernel that does not exist
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"head_dims must be {want}, got {d!r} in {head_dims!r}")
        if not 1 <= d <= top:
            raise ValueError(f"head_dims must be {want}, got {d!r} in {head_dims!r}")
    return [int(d) for d in items]


def warmup(dtypes=tuple(specs.CTYPES), head_dims=specs.NATIVE_HEAD_DIMS, *, backward=False, precision="ieee",
           progress=True, file=None, workers=1):
    """Compile the kernels for ``dtypes`` x ``head_dims`` on the current device now (NVRTC, then CuPy's
    disk cache), so the first real call does not pay for it.

    ``dtypes`` defaults to the 16-bit ones; float32 and float64 compile the kernels of kernels/flash_*_wide.cu, in
    the arithmetic that ``precision`` (float32) and the device (float64) select.
    Returns the specs compiled: the forward ones, then with ``backward=True`` the ``(bwd, dq)`` pairs (a
    head_dim whose backward this GPU cannot run, 256 on 99 KB-shared-memory GPUs, is left out).
    ``progress`` prints a one-line progress bar to ``file`` (default stderr). ``workers`` > 1 compiles that many
    modules at once, on threads (NVRTC releases the GIL), e.g. on a 16-core GPU machine before a test suite whose
    workers would otherwise each compile what they meet first, some the same module at once.

    ``dtypes`` is one dtype or a sequence of them, each a name (``"float16"``, ``"bfloat16"``, ``"float32"``,
    ``"float64"`` or any NumPy spelling of them, e.g. ``"f4"``) or a NumPy dtype/scalar type (``np.float16``,
    ``ml_dtypes.bfloat16``): ``warmup("float16")`` warms float16 up, as NumPy reads ``dtype="float16"``.
    ``head_dims`` is one int or a sequence of ints in ``[1, 256]`` (a head dim runs on the next native one up, as
    in a call). ``precision`` is one of ``"ieee"``, ``"3xtf32"``, ``"tf32"``. Bad arguments raise before any
    device query or compile.
    """
    # checked before the device so that a typo is reported as such, on any machine, before minutes of compiling
    names = _warmup_dtypes(dtypes)
    dims = _warmup_head_dims(head_dims)
    check_precision_name(precision)
    if not isinstance(workers, int) or isinstance(workers, bool):
        raise TypeError(f"workers must be a positive int, got {type(workers).__name__} {workers!r}")
    if workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    check_flags(backward=backward, progress=progress)  # "yes" compiled the backward kernels, a truth test
    if file is not None and not callable(getattr(file, "write", None)):  # it failed at the first progress line
        raise TypeError(f"file must be a writable text stream (with a write method) or None, got "
                        f"{type(file).__name__}")
    ok, why = available()
    if not ok:
        raise RuntimeError(f"cannot warm up the CUDA kernels: {why}")
    _, cc, max_smem = _device()
    jobs: dict = {}  # spec(s) -> the module to compile; a dict keeps order and drops repeats
    for dt in names:
        wide = dt in specs.WIDE_CTYPES
        math = specs.wide_math(dt, precision, cc) if wide else ""
        f, b, q = ("wfwd", "wbwd", "wdq") if wide else ("fwd", "bwd", "dq")
        for d in dims:
            fwd = specs.select(f, dt, d, max_smem, math=math, cc=cc)
            jobs.setdefault(fwd, (specs.forward_module(fwd, dt), fwd))
            if backward:
                try:
                    pair = (specs.select(b, dt, d, max_smem, math=math, cc=cc),
                            specs.select(q, dt, d, max_smem, math=math, cc=cc))
                except ValueError:
                    continue
                module = (*specs.helper_names(dt), pair[0].name_expression, pair[1].name_expression)
                jobs.setdefault(pair, (module, pair[0]))
    out = file or sys.stderr
    function = _memoized()[1]
    device_id = _device()[0]

    def compile_one(job):
        module, spec = job
        with _cupy().cuda.Device(device_id):  # a pool thread starts on device 0
            function(kernel_source(spec.source), module, spec.name_expression, spec.smem_bytes)
        return spec

    pool = concurrent.futures.ThreadPoolExecutor(workers)
    try:
        for i, spec in enumerate(pool.map(compile_one, jobs.values())):
            if progress:
                print(f"\rcuflash warmup [{'#' * (20 * (i + 1) // len(jobs)):<20}] {i + 1}/{len(jobs)} "
                      f"{spec.name_expression}", end="", file=out, flush=True)
    except BaseException:  # Ctrl-C or a failed compile: the queued modules are dropped, not compiled first
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    if progress:
        print(f"\rcuflash warmup [{'#' * 20}] {len(jobs)}/{len(jobs)} done{' ' * 50}", file=out, flush=True)
    return list(jobs)
