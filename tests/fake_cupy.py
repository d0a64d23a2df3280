"""A fake ``cupy`` that runs the ``cuda`` backend on the CPU: kernels go through :mod:`cuflash.emulate`.

:func:`make` builds a module named ``cupy`` (a test fixture puts it in ``sys.modules["cupy"]`` and takes it out
again) with just what cuflash and its tests use, and with the rules of real CuPy/CUDA that the backend must obey
enforced, so that a mistake which would fail (or silently misbehave) on a GPU fails here too:

- arrays (:class:`ndarray`, ``type(x).__module__ == "cupy"``, ``__cuda_array_interface__``) live in "device
  memory": 256-byte aligned NumPy buffers tagged with a device id. Like CuPy, implicit conversion to NumPy
  (``np.asarray(x)``) raises TypeError; ``.get()`` / ``cupy.asnumpy`` copy to the host.
- ``RawModule(code=, options=, name_expressions=)``: ``options`` must be a tuple (a Cython ``tuple`` argument in
  CuPy), ``get_function`` finds the module's name expressions and its ``extern "C"`` kernels (names NVRTC does not
  mangle), nothing else. Compilation happens at launch, by the emulator,
  from the module's own source (a kernel fetched from the wrong source fails to build).
- ``RawKernel.__call__(grid, block, args, shared_mem=, stream=)``: grid and block are tuples within CUDA's
  limits (grid x < 2**31, y, z < 65536, every dimension >= 1; block <= 1024 threads); dynamic shared memory above
  48 KiB needs ``max_dynamic_shared_size_bytes`` set first, on the device that launches (CUDA keeps the attribute
  per device), and at most the device's opt-in limit; arguments are device arrays of the current device, NumPy
  scalars or Python scalars (``int`` -> int64, ``float`` -> float64, as CuPy does), or a size-1 NumPy array,
  passed *by value* as CuPy does (cuflash's params struct); every 64-bit unsigned field of such a struct is a
  device pointer and must be null or point into memory of the launching device (else the illegal address a GPU
  would fault on). A larger NumPy array is refused, and so is ``None`` (a null pointer on some CuPy versions
  only: pass ``np.uint64(0)``, which the fake hands to the emulator as nullptr where the kernel takes a
  pointer). Every launch is recorded with its stream: the current stream unless one is given.
- ``memoize(for_each_device=True)`` caches per current device, as CuPy's does.
- ``compile_error``: ``RawModule.get_function`` raises ``cupy.cuda.compiler.CompileException`` with this
  message (a machine whose NVRTC cannot find the CUDA headers).

``bf16=False`` makes a CuPy without ``ml_dtypes.bfloat16`` support: arrays of that dtype are refused, as they
are by CuPy versions that predate it, so the ``uint16``-bits path is the only way in.
"""
from __future__ import annotations

import numbers
import re
import threading
import types
from dataclasses import dataclass, field

import numpy as np

from cuflash import emulate
from cuflash.emulate._runner import POINTER
from cuflash.cuda.launch import LaunchSpec
from cuflash.cuda.params import PARAMS

__version__ = "13.99.0+fake"
ALIGNMENT = 256                         # CuPy's memory pool hands out 256-byte aligned blocks (and larger)
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS = 1024
DEFAULT_DYNAMIC_SMEM = 48 * 1024        # what a kernel may use without the opt-in attribute


class CUDAError(RuntimeError):
    """What real CUDA would answer with an error code (invalid configuration, invalid value, ...)."""


@dataclass(frozen=True)
class Gpu:
    compute_capability: str              # CuPy spells it "90", "86", ...
    smem_optin: int | None = None        # MaxSharedMemoryPerBlockOptin; None: the attribute is absent
    name: str = "Fake GPU"


H100 = Gpu("90", 227 * 1024, "fake H100")
A100 = Gpu("80", 163 * 1024, "fake A100")
RTX_4090 = Gpu("89", 99 * 1024, "fake RTX 4090")
T4 = Gpu("75", 64 * 1024, "fake T4")


@dataclass
class Launch:
    """One recorded kernel launch."""

    name: str
    grid: tuple
    block: tuple
    shared_mem: int
    stream: object
    device: int
    args: tuple = field(repr=False)


def _extern_c(code: str, name: str) -> bool:
    """Whether ``code`` defines ``name`` as an ``extern "C"`` kernel, which a module finds by its plain name."""
    kernel = r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+'
    return re.search(kernel + re.escape(name) + r"\s*\(", code) is not None


def make(gpus=(H100,), *, bf16: bool = True, device_count_error: str | None = None,
         compile_error: str | None = None) -> types.ModuleType:
    """A fresh fake ``cupy`` module (its own devices, streams and records).

    ``gpus``: one :class:`Gpu` per device (empty: no device). ``device_count_error``: ``getDeviceCount`` raises
    ``cupy.cuda.runtime.CUDARuntimeError`` with this message (no driver). Records, on the module:
    ``_modules`` (every RawModule built), ``_launches`` (:class:`Launch`), ``_attribute_reads`` (device
    attribute dict reads), ``_syncs`` (device synchronizations).
    """
    gpus = tuple(gpus)
    cupy = types.ModuleType("cupy")
    cupy.__version__ = __version__
    cupy.__file__ = __file__
    cupy._modules, cupy._launches = [], []
    cupy._attribute_reads = cupy._syncs = 0
    state = threading.local()  # current device and stream stack, per thread as in CuPy

    def current_device() -> int:
        if not gpus:
            raise runtime.CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
        return getattr(state, "device", 0)

    # ------------------------------------------------------------------ dtypes
    def check_dtype(dtype) -> np.dtype:
        dt = np.dtype(dtype)
        if dt.name == "bfloat16" and not bf16:
            raise ValueError("Unsupported dtype bfloat16 (this fake CuPy has no ml_dtypes support)")
        if dt.kind in "OUSMm" or (dt.kind == "V" and dt.name != "bfloat16"):
            raise ValueError(f"Unsupported dtype {dt}")
        return dt

    # ------------------------------------------------------------------ device memory
    allocations = []  # (start address, end address, device, buffer): what device pointers may point into
    cupy._allocations = allocations  # tests count them (nothing allocated before a refusal)

    def alloc(shape, dtype) -> np.ndarray:
        dt = check_dtype(dtype)
        shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
        start = -raw.ctypes.data % ALIGNMENT
        buf = raw[start:start + nbytes]
        addr = buf.ctypes.data
        allocations.append((addr, addr + max(nbytes, 1), current_device() if gpus else 0, raw))
        return buf.view(dt).reshape(shape)

    def to_device(host: np.ndarray, dtype=None) -> "ndarray":
        host = np.asarray(host)
        dt = check_dtype(host.dtype if dtype is None else dtype)
        buf = alloc(host.shape, dt)
        buf[...] = host.astype(dt, copy=False)
        return ndarray._wrap(buf, current_device())

    class _MemoryPointer:
        __module__ = "cupy.cuda.memory"

        def __init__(self, ptr, device_id):
            self.ptr, self.device_id = ptr, device_id

    class ndarray:
        """A device array: a NumPy view into fake device memory plus the device it lives on."""

        __module__ = "cupy"
        __array_priority__ = 100

        def __init__(self, *args, **kwargs):
            raise NotImplementedError("the fake creates arrays through cupy.asarray/empty/zeros/full")

        @classmethod
        def _wrap(cls, a: np.ndarray, dev: int) -> "ndarray":
            obj = object.__new__(cls)
            obj._a, obj._dev = a, dev
            return obj

        # -------- what the emulator and CUDA see
        @property
        def __cuda_array_interface__(self):
            a = self._a
            return {"shape": a.shape, "typestr": a.dtype.str, "descr": a.dtype.descr, "version": 3,
                    "strides": None if a.flags.c_contiguous else a.strides,
                    "data": (a.__array_interface__["data"][0], False), "stream": 1}

        @property
        def data(self):
            return _MemoryPointer(self._a.__array_interface__["data"][0], self._dev)

        @property
        def device(self):
            return cuda.Device(self._dev)

        # -------- NumPy-like metadata
        shape = property(lambda self: self._a.shape)
        dtype = property(lambda self: self._a.dtype)
        ndim = property(lambda self: self._a.ndim)
        size = property(lambda self: self._a.size)
        strides = property(lambda self: self._a.strides)
        itemsize = property(lambda self: self._a.itemsize)
        nbytes = property(lambda self: self._a.nbytes)
        flags = property(lambda self: self._a.flags)
        T = property(lambda self: self.transpose())

        def __repr__(self):
            return f"array({self._a!r}, device={self._dev})".replace("array(array(", "array(")

        # -------- no implicit host conversion, like CuPy
        def __array__(self, *args, **kwargs):
            raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                            "Please use `.get()` to construct a NumPy array explicitly.")

        __array_ufunc__ = None  # NumPy operations on a device array raise TypeError, as with CuPy

        def __matmul__(self, other):  # a device reduction in CuPy; here on the fake device memory
            return self._same(np.asarray(self._a @ _operand(other, self._dev)))

        def __add__(self, other):  # element-wise, on the device (one device, as CuPy checks)
            return self._same(np.asarray(self._a + _operand(other, self._dev)))

        __radd__ = __add__

        def __mul__(self, other):  # element-wise, on the device (integers wrap, as in CUDA)
            return self._same(np.asarray(self._a * _operand(other, self._dev)))

        __rmul__ = __mul__

        def sum(self, axis=None, dtype=None, out=None, keepdims=False):  # a device reduction (0-d for axis=None)
            result = np.asarray(self._a.sum(axis=axis, dtype=dtype, keepdims=keepdims))
            if out is None:
                return self._same(result)
            if out.shape != result.shape or out._dev != self._dev:
                raise ValueError(f"out {out.shape} on device {out._dev}: the sum gives {result.shape}")
            out._a[...] = result
            return out

        def __float__(self):  # CuPy synchronizes and copies a 0-d result to the host
            return float(self._a)

        def item(self):  # likewise: the one element as a Python scalar
            return self._a.item()

        def __int__(self):
            return int(self._a)

        def __bool__(self):  # likewise for one element (CuPy refuses more, as NumPy does)
            if self.size != 1:
                raise ValueError("The truth value of an array with more than one element is ambiguous.")
            return bool(self._a)

        def min(self, axis=None, keepdims=False):  # device reductions (a 0-d device array for axis=None)
            return self._same(np.asarray(self._a.min(axis=axis, keepdims=keepdims)))

        def max(self, axis=None, keepdims=False):
            return self._same(np.asarray(self._a.max(axis=axis, keepdims=keepdims)))

        def get(self, stream=None, order="C", out=None):
            host = np.array(self._a, order=order, copy=True)
            if out is not None:
                out[...] = host
                return out
            return host

        # -------- views and copies
        def _same(self, a: np.ndarray) -> "ndarray":
            """Wrap ``a``: a view when it shares this array's memory, else a copy into new device memory."""
            if isinstance(a, np.ndarray) and np.may_share_memory(a, self._a):
                return ndarray._wrap(a, self._dev)
            buf = alloc(np.shape(a), np.asarray(a).dtype)
            buf[...] = a
            return ndarray._wrap(buf, self._dev)

        def copy(self, order="C"):
            buf = alloc(self.shape, self.dtype)
            buf[...] = self._a
            return ndarray._wrap(buf, self._dev)

        def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
            dt = check_dtype(dtype)
            if dt == self.dtype and not copy:
                return self
            buf = alloc(self.shape, dt)
            buf[...] = self._a.astype(dt)
            return ndarray._wrap(buf, self._dev)

        def view(self, dtype=None):
            return ndarray._wrap(self._a.view() if dtype is None else self._a.view(check_dtype(dtype)), self._dev)

        def reshape(self, *shape, order="C"):
            return self._same(self._a.reshape(*shape, order=order))

        def transpose(self, *axes):
            return ndarray._wrap(self._a.transpose(*axes), self._dev)

        def __getitem__(self, key):
            r = self._a[_unwrap_key(key, self._dev)]
            if not isinstance(r, np.ndarray):
                r = np.asarray(r)
                buf = alloc((), r.dtype)
                buf[...] = r
                return ndarray._wrap(buf, self._dev)
            return self._same(r)

        def __setitem__(self, key, value):
            self._a[_unwrap_key(key, self._dev)] = _operand(value, self._dev)

    def _operand(x, dev):
        """A device operand: another device array of the same device, a scalar, or (as CuPy's setitem accepts)
        a host array for ``x[...] = host``."""
        if isinstance(x, ndarray):
            if x._dev != dev:
                raise ValueError(f"array on device {x._dev} used with an array on device {dev}")
            return x._a
        if isinstance(x, np.ndarray):
            return x
        if isinstance(x, (numbers.Number, np.generic)):
            return x
        raise TypeError(f"Unsupported type {type(x)}")

    def _unwrap_key(key, dev):
        if isinstance(key, tuple):
            return tuple(_unwrap_key(k, dev) for k in key)
        return key._a if isinstance(key, ndarray) else key

    # ------------------------------------------------------------------ array creation
    def asarray(a, dtype=None, order=None, *, blocking=False):
        if isinstance(a, ndarray):  # stays on its device, as in CuPy
            return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
        if hasattr(a, "__cuda_array_interface__"):
            raise TypeError("only fake device arrays are supported")
        return to_device(np.asarray(a), dtype)

    def empty(shape, dtype=float, order="C"):
        return ndarray._wrap(alloc(shape, dtype), current_device())

    def zeros(shape, dtype=float, order="C"):
        buf = alloc(shape, dtype)
        buf[...] = 0
        return ndarray._wrap(buf, current_device())

    def full(shape, fill_value, dtype=None, order="C"):
        dtype = np.asarray(fill_value).dtype if dtype is None else dtype
        buf = alloc(shape, dtype)
        buf[...] = fill_value
        return ndarray._wrap(buf, current_device())

    def ascontiguousarray(a, dtype=None):
        a = asarray(a)
        if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        buf = alloc(a.shape, a.dtype if dtype is None else dtype)
        buf[...] = a._a
        return ndarray._wrap(buf, a._dev)

    def broadcast_to(a, shape):  # a view with zero strides, as CuPy's
        a = asarray(a)
        return ndarray._wrap(np.broadcast_to(a._a, shape), a._dev)

    def array_equal(a1, a2, equal_nan=False):  # a 0-d bool device array, as CuPy's
        a1, a2 = asarray(a1), asarray(a2)
        return a1._same(np.asarray(np.array_equal(a1._a, _operand(a2, a1._dev), equal_nan=equal_nan)))

    def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
        return a.get(order=order, out=out) if isinstance(a, ndarray) else np.asarray(a, order=order)

    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                 "uint32", "uint64", "bool_", "dtype", "nan", "inf"):
        setattr(cupy, name, getattr(np, name))
    for fn in (asarray, empty, zeros, full, ascontiguousarray, asnumpy, broadcast_to, array_equal):
        setattr(cupy, fn.__name__, fn)
    cupy.ndarray = ndarray

    _C_TYPES = {"unsigned long long": np.uint64, "long long": np.int64, "unsigned int": np.uint32, "int": np.int32,
                "float": np.float32, "double": np.float64}

    class ReductionKernel:
        """CuPy's ``ReductionKernel`` for the expressions cuflash writes, on the fake device memory: a ``map_expr``
        that NumPy evaluates alike on the broadcast inputs (``w * x``: integer products that wrap, as in C++),
        ``reduce_expr`` ``a + b`` in ``reduce_type`` (wrapping too), ``post_map_expr`` ``<out> = a``; anything
        else raises NotImplementedError rather than be emulated wrongly."""

        __module__ = "cupy"

        def __init__(self, in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                     name="reduce_kernel", reduce_type=None, reduce_dims=True, preamble="", options=()):
            self.names = [p.split()[-1] for p in in_params.split(",")]
            out_type, self.out = out_params.split()
            if reduce_expr.replace(" ", "") != "a+b" or post_map_expr.replace(" ", "") != f"{self.out}=a" \
                    or identity != "0" or not re.fullmatch(r"[\w\s*+()]+", map_expr):
                raise NotImplementedError(f"the fake ReductionKernel sums a NumPy-compatible map_expr only: "
                                          f"{map_expr!r}, {reduce_expr!r}, {post_map_expr!r}, {identity!r}")
            self.map_expr, self.out_dtype = map_expr, np.dtype(out_type)
            if reduce_type is not None and reduce_type not in _C_TYPES:  # CuPy typedefs it: C++ must know it
                raise compiler.CompileException(f'error: identifier "{reduce_type}" is undefined (reduce_type is a '
                                                f'C++ type name)', "", name, options)
            self.reduce_dtype = np.dtype(_C_TYPES[reduce_type] if reduce_type else out_type)

        def __call__(self, *args, axis=None, out=None, keepdims=False):
            if len(args) != len(self.names):
                raise TypeError(f"{len(self.names)} inputs expected, got {len(args)}")
            dev = current_device()
            values = np.broadcast_arrays(*(_operand(a, dev) for a in args))
            mapped = eval(self.map_expr, {"__builtins__": {}}, dict(zip(self.names, values)))  # noqa: S307
            result = np.add.reduce(mapped.astype(self.reduce_dtype), axis=axis, keepdims=keepdims)
            result = np.asarray(result, dtype=self.out_dtype)
            if out is None:
                return ndarray._wrap(np.ascontiguousarray(result), dev)
            if out.shape != result.shape or out.dtype != self.out_dtype:
                raise ValueError(f"out {out.shape} {out.dtype}: the reduction gives {result.shape} {self.out_dtype}")
            out._a[...] = result
            return out

    cupy.ReductionKernel = ReductionKernel

    # ------------------------------------------------------------------ cupy.cuda
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.ModuleType("cupy.cuda.runtime")
    cupy.cuda, cuda.runtime = cuda, runtime

    class CUDARuntimeError(RuntimeError):
        __module__ = "cupy_backends.cuda.api.runtime"

    runtime.CUDARuntimeError = CUDARuntimeError

    def getDeviceCount():  # noqa: N802 - CuPy's name
        if device_count_error is not None:
            raise CUDARuntimeError(device_count_error)
        return len(gpus)

    def getDevice():  # noqa: N802
        return current_device()

    runtime.getDeviceCount, runtime.getDevice = getDeviceCount, getDevice

    class Device:
        __module__ = "cupy.cuda.device"

        def __init__(self, device=None):
            self.id = current_device() if device is None else int(device)
            if not 0 <= self.id < len(gpus):
                raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")
            self._prev = []

        @property
        def compute_capability(self) -> str:
            return gpus[self.id].compute_capability

        @property
        def attributes(self) -> dict:
            cupy._attribute_reads += 1
            gpu = gpus[self.id]
            attrs = {"MaxSharedMemoryPerBlock": 48 * 1024, "MultiProcessorCount": 132, "WarpSize": 32,
                     "MaxThreadsPerBlock": MAX_THREADS, "MaxGridDimX": MAX_GRID[0], "MaxGridDimY": MAX_GRID[1],
                     "MaxGridDimZ": MAX_GRID[2]}
            if gpu.smem_optin is not None:
                attrs["MaxSharedMemoryPerBlockOptin"] = gpu.smem_optin
            return attrs

        def use(self):
            state.device = self.id

        def synchronize(self):
            cupy._syncs += 1

        def __enter__(self):
            self._prev.append(getattr(state, "device", 0))
            self.use()
            return self

        def __exit__(self, *exc):
            state.device = self._prev.pop()

        def __repr__(self):
            return f"<CUDA Device {self.id}>"

    class Stream:
        __module__ = "cupy.cuda.stream"
        _count = 0

        def __init__(self, null=False, non_blocking=False, ptds=False):
            Stream._count += 1
            self.ptr = 0 if null else Stream._count
            self.non_blocking = non_blocking

        def __enter__(self):
            _stack().append(self)
            return self

        def __exit__(self, *exc):
            _stack().pop()

        def synchronize(self):
            cupy._syncs += 1

        def __repr__(self):
            return f"<Stream {self.ptr}>"

    Stream.null = Stream(null=True)

    def _stack():
        if not hasattr(state, "streams"):
            state.streams = []
        return state.streams

    def get_current_stream(device_id=None):
        s = _stack()
        return s[-1] if s else Stream.null

    cuda.Device, cuda.Stream, cuda.get_current_stream = Device, Stream, get_current_stream

    def set_allocator(allocator=None):  # the fake allocates with NumPy: no pool to switch off
        cupy._allocator = allocator

    cuda.set_allocator = cuda.set_pinned_memory_allocator = set_allocator
    cuda.get_device_id = current_device

    # ------------------------------------------------------------------ RawModule / RawKernel
    class RawModule:
        __module__ = "cupy"

        def __init__(self, *, code=None, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                     enable_cooperative_groups=False, name_expressions=None, jitify=None):
            if (code is None) == (path is None):
                raise TypeError("Exactly one of `code` and `path` keyword arguments must be given.")
            if not isinstance(options, tuple) or not all(isinstance(o, str) for o in options):
                raise TypeError(f"options must be a tuple of str (a Cython tuple argument), got {options!r}")
            if path is not None or not isinstance(code, str):
                raise TypeError("the fake RawModule takes CUDA C++ source as `code`")
            if name_expressions is not None and backend != "nvrtc":
                raise ValueError("only nvrtc supports retrieving the mangled names for the given name expressions")
            self.code, self.options, self.backend = code, options, backend
            self.name_expressions = None if name_expressions is None else tuple(name_expressions)
            self.device = current_device()
            cupy._modules.append(self)

        def get_function(self, name):
            if compile_error is not None:
                raise compiler.CompileException(compile_error, self.code, "kern.cu", self.options, "nvrtc")
            if not isinstance(name, str):
                raise TypeError(f"name must be a str, got {type(name).__name__}")
            if name not in (self.name_expressions or ()) and not _extern_c(self.code, name):
                raise CUDAError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name!r} is neither one of this "
                                f"module's name expressions {self.name_expressions} nor an extern \"C\" kernel")
            return RawKernel(self, name)

    class RawKernel:
        __module__ = "cupy"

        def __init__(self, module, name):
            self.module, self.name, self.code, self.options = module, name, module.code, module.options
            self._max_dynamic = {}  # device -> bytes: CUDA keeps function attributes per device (context)

        @property
        def max_dynamic_shared_size_bytes(self) -> int:
            return self._max_dynamic.get(current_device(), DEFAULT_DYNAMIC_SMEM)

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, value):
            dev = current_device()
            limit = gpus[dev].smem_optin or DEFAULT_DYNAMIC_SMEM
            if not isinstance(value, numbers.Integral) or not 0 <= value <= limit:
                raise CUDAError(f"cudaErrorInvalidValue: max_dynamic_shared_size_bytes={value!r} on device {dev} "
                                f"(opt-in limit {limit})")
            self._max_dynamic[dev] = int(value)

        def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
            launch(self, grid, block, args, shared_mem, stream)

    def dims(what, value, limits):
        if not isinstance(value, tuple):
            raise TypeError(f"Argument '{what}' has incorrect type (expected tuple, got {type(value).__name__})")
        if not 1 <= len(value) <= 3 or not all(isinstance(v, numbers.Integral) for v in value):
            raise TypeError(f"{what} must be 1 to 3 integers, got {value!r}")
        value = tuple(int(v) for v in value) + (1,) * (3 - len(value))
        if any(v < 1 for v in value):  # CuPy would quietly launch max(1, v): never what the caller meant
            raise CUDAError(f"{what} {value} has an empty dimension (CuPy would launch 1 there)")
        if any(v > m for v, m in zip(value, limits)):
            raise CUDAError(f"cudaErrorInvalidConfiguration: {what} {value} exceeds CUDA's limits {limits}")
        return value

    def convert(i, a, dev):
        if isinstance(a, ndarray):
            if a._dev != dev:
                raise CUDAError(f"argument {i}: an array on device {a._dev} passed to a kernel on device {dev}")
            return a._a
        if a is None:
            raise TypeError(f"argument {i} is None: pass np.uint64(0) for a null pointer (CuPy versions differ "
                            f"on None)")
        if isinstance(a, np.ndarray):
            if a.size != 1:
                raise TypeError(f"argument {i}: a numpy.ndarray of shape {a.shape} is a host array; CuPy passes a "
                                f"size-1 one by value and refuses others. Pass a cupy.ndarray.")
            if a.dtype.kind == "V" and a.dtype.names is None:
                # plain bytes (cuflash.cuda.params.as_bytes): CuPy copies them as they are, and the kernel's
                # signature types them; the one struct cuflash passes is Params, read back as such for the pointer
                # check and the emulator
                if a.dtype.itemsize != PARAMS.itemsize:
                    raise TypeError(f"argument {i}: {a.dtype.itemsize} bytes by value, but Params has "
                                    f"{PARAMS.itemsize}")
                a = a.view(PARAMS)
            check_pointers(i, a, dev)
            return a
        if isinstance(a, np.generic):
            return a
        if isinstance(a, bool):
            return np.bool_(a)
        if isinstance(a, int):
            return np.int64(a) if a < 2**63 else np.uint64(a)
        if isinstance(a, float):
            return np.float64(a)
        raise TypeError(f"argument {i}: Unsupported type {type(a)}")

    def check_pointers(i, a, dev):
        """Every uint64 leaf of a struct passed by value is a device pointer: null, or into this device's memory."""
        def leaves(dt, prefix=""):
            for name in dt.names or ():
                sub = dt.fields[name][0]
                yield from leaves(sub, f"{prefix}{name}.") if sub.names else [(prefix + name, sub)]

        for path, dt in leaves(a.dtype):
            if dt != np.uint64:
                continue
            value = int(_field(a, path))
            if value == 0:
                continue
            owner = [d for lo, hi, d, _ in allocations if lo <= value < hi]
            if not owner:
                raise CUDAError(f"argument {i}: field {path} = {value:#x} is not device memory (a kernel would hit "
                                f"an illegal address)")
            if owner[-1] != dev:
                raise CUDAError(f"argument {i}: field {path} points into device {owner[-1]}'s memory, but the "
                                f"kernel runs on device {dev}")

    def launch(kernel, grid, block, args, shared_mem, stream):
        grid, block = dims("grid", grid, MAX_GRID), dims("block", block, MAX_BLOCK)
        if block[0] * block[1] * block[2] > MAX_THREADS:
            raise CUDAError(f"cudaErrorInvalidConfiguration: block {block} has more than {MAX_THREADS} threads")
        dev = current_device()
        if not isinstance(shared_mem, numbers.Integral) or shared_mem < 0:
            raise TypeError(f"shared_mem must be a non-negative int, got {shared_mem!r}")
        if shared_mem > kernel.max_dynamic_shared_size_bytes:
            raise CUDAError(f"cudaErrorInvalidValue: {kernel.name} launched with {shared_mem} bytes of dynamic shared "
                            f"memory on device {dev}, but max_dynamic_shared_size_bytes there is "
                            f"{kernel.max_dynamic_shared_size_bytes} (set it first above 48 KiB)")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        converted = tuple(convert(i, a, dev) for i, a in enumerate(args))
        spec = LaunchSpec(source=kernel.code, name_expression=kernel.name, grid=grid, block=block,
                          shared_bytes=int(shared_mem), args=converted,
                          options=tuple(o for o in kernel.options if o.startswith("-D")))
        params = emulate.compile(spec).params
        if len(params) == len(converted):  # otherwise the emulator reports the count
            converted = tuple(_null(i, p, a) for i, (p, a) in enumerate(zip(params, converted)))
        stream = get_current_stream() if stream is None else stream
        cupy._launches.append(Launch(kernel.name, grid, block, int(shared_mem), stream, dev, converted))
        emulate.launch(LaunchSpec(spec.source, spec.name_expression, grid, block, spec.shared_bytes, converted,
                                  spec.options))

    def _null(i, p, a):
        if p.kind == POINTER and isinstance(a, np.uint64):
            if a != 0:
                raise TypeError(f"argument {i}: a raw device address {int(a):#x} cannot be emulated")
            return None
        return a

    cupy.RawModule, cupy.RawKernel = RawModule, RawKernel

    # ------------------------------------------------------------------ cupy.memoize, NVRTC, the compiler
    def memoize(for_each_device=False):
        def decorator(fn):
            cache = {}

            def wrapper(*args):
                key = ((current_device(),) if for_each_device else ()) + args
                if key not in cache:
                    cache[key] = fn(*args)
                return cache[key]
            return wrapper
        return decorator

    class CompileException(Exception):
        __module__ = "cupy.cuda.compiler"

        def __init__(self, msg, source, name, options, backend="nvrtc"):
            super().__init__(msg)

    nvrtc = types.ModuleType("cupy.cuda.nvrtc")
    nvrtc.getVersion = lambda: (12, 9)
    compiler = types.ModuleType("cupy.cuda.compiler")
    compiler.CompileException = CompileException
    cupy.memoize, cuda.nvrtc, cuda.compiler = memoize, nvrtc, compiler
    return cupy


def _field(a: np.ndarray, path: str):
    """``a[0]`` of a structured array, then field by field along ``path`` ("mask.cells")."""
    value = a[0]
    for name in path.split("."):
        value = value[name]
    return value


def install(monkeypatch, fake: types.ModuleType) -> types.ModuleType:
    """Put ``fake`` in ``sys.modules`` as ``cupy`` (and its ``cupy.cuda`` submodules) through pytest's
    ``monkeypatch``, so that it is removed again (and any previous entry restored) after the test."""
    import sys

    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.runtime", fake.cuda.runtime)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nvrtc", fake.cuda.nvrtc)
    monkeypatch.setitem(sys.modules, "cupy.cuda.compiler", fake.cuda.compiler)
    # cuflash's per-device arrays belong to the CuPy that made them: the fingerprint's weights start afresh
    monkeypatch.setattr("cuflash.residual._WEIGHTS", {})
    return fake
