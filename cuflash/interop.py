"""Arrays of any library in, the caller's array type out: the one place where cuflash converts arrays.

cuflash computes on NumPy arrays (``numpy`` backend) and CuPy arrays (``cuda`` backend). Every public function
takes, besides those, any array that implements DLPack (``__dlpack__`` and ``__dlpack_device__``: PyTorch, JAX,
array-api-strict, Dask, TensorFlow, MXNet, ...) or the CUDA Array Interface (``__cuda_array_interface__``: Numba,
PyCUDA, ...), converts it here, without a copy, and gives its results back in the caller's array type:

- a CPU array (DLPack device ``kDLCPU`` or ``kDLCUDAHost``) becomes a NumPy view (``numpy.from_dlpack``) and runs on
  the ``numpy`` backend;
- a CUDA array (``kDLCUDA``, ``kDLCUDAManaged``) becomes a CuPy view (``cupy.from_dlpack``, under
  ``cupy.cuda.Device(i)`` of the array's device) and runs on the ``cuda`` backend, on that device and on CuPy's
  current stream there. DLPack's stream handshake orders the work: importing asks the producer to make its pending
  writes visible to CuPy's stream, and the caller's library, importing the results, makes its own stream wait for
  CuPy's. (To run on, say, PyTorch's current stream instead, wrap the call in
  ``with cupy.cuda.Stream.from_external(torch.cuda.current_stream()):``);
- a CUDA Array Interface object becomes a CuPy view (``cupy.asarray``; CuPy honours the interface's ``stream``).

Results go back through the caller's own Array API namespace: ``array_namespace(q).from_dlpack(result)``, found by
``array-api-compat`` (which knows PyTorch, which has no ``__array_namespace__``, and every library that has one),
then moved to ``q``'s device object if that differs (array-api-strict's virtual devices). Arrays whose library
``array-api-compat`` does not know, and CUDA Array Interface objects (Numba has no ``from_dlpack``), get NumPy or
CuPy results; CuPy arrays are themselves ``__cuda_array_interface__`` and DLPack producers, so any CUDA library
takes them back without a copy.

Rules checked here, each a ``TypeError``/``ValueError`` naming the argument before any computation:

- the data arrays of a call (``q``, ``k``, ``v``, ``dout``, ``out``, ``lse``, the ``out=`` buffers, merge parts)
  come from one library and live on one device (the result type must be unambiguous, and a CPU tensor next to a
  CUDA tensor would otherwise surface as a NumPy/CuPy mixture);
- a buffer to write into (``out=``, ``dq=``, ...) converts without a copy to a writable array; a JAX array, which
  JAX never lets change, is refused by its type as a buffer or a KV cache to append to (on a GPU, CuPy's view of it
  is writable);
- option arrays (``seqlens_q``, ``bias``, ``mod_arrays`` values, ...) are converted the same way and otherwise left
  to the usual validation (:mod:`cuflash.problem`);
- NumPy and CuPy arrays pass through untouched, and the checks of :func:`cuflash.problem.array_module` (masked and
  object arrays, NumPy/CuPy mixtures, CuPy arrays on different GPUs) apply after conversion, to every array alike.

``array-api-compat`` is imported only when an array of another library arrives (a NumPy or CuPy call never loads
it), and CuPy only for CUDA arrays.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import sys
import types
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from .problem import _is_cupy
from .problem.core import wrong_device

__all__ = ["Edge", "device_kind", "refuse_deleted", "refuse_lazy_negation"]

#: DLPack device types (``DLDeviceType``) cuflash imports: CPU memory and CUDA memory
_CPU_TYPES = {1: "cpu", 3: "cuda_host"}
_CUDA_TYPES = {2: "cuda", 13: "cuda_managed"}


def _library(a: Any) -> str:
    """The top-level module of ``a``'s type ("torch", "jaxlib", "numpy", ...), for messages."""
    return type(a).__module__.split(".")[0] or type(a).__name__


def device_kind(a: Any) -> tuple[str, int]:
    """``("cpu", 0)`` or ``("cuda", device id)`` for a NumPy/CuPy array or a DLPack/CUDA Array Interface object."""
    if isinstance(a, np.ndarray):
        return "cpu", 0
    if _is_cupy(a):
        device = getattr(a, "device", None)
        return "cuda", int(getattr(device, "id", 0))
    if hasattr(a, "__dlpack_device__"):
        kind, index = a.__dlpack_device__()
        kind, index = int(kind), int(index)
        if kind in _CPU_TYPES:
            return "cpu", 0
        if kind in _CUDA_TYPES:
            return "cuda", index
        raise TypeError(f"DLPack device type {kind} is not supported (CPU and CUDA memory are)")
    if hasattr(a, "__cuda_array_interface__"):
        cupy = _cupy("a __cuda_array_interface__ object")
        return "cuda", int(cupy.asarray(a).device.id)
    return "cpu", 0


def _cupy(what: str) -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise TypeError(f"{what} lives in CUDA memory: that needs CuPy (pip install 'cuflash[cuda12]' or "
                        f"'cuflash[cuda13]'): {exc}") from None
    return cupy


def _compat() -> Any:
    try:
        import array_api_compat
    except ImportError as exc:  # a declared dependency; only a broken install lacks it
        raise ImportError(f"arrays of other libraries need array-api-compat (pip install array-api-compat), to give "
                          f"results back in their own type: {exc}") from None
    return array_api_compat


class Edge:
    """One call's conversions: arrays in through :meth:`data`, :meth:`buffer` and :meth:`option`, results out
    through :meth:`export`, the work inside :meth:`device`.

    The first data array fixes the call's *origin*: its library (``numpy``, ``cupy`` or a foreign one, with the
    Array API namespace results go back in) and its device; every later data array must match it.
    """

    def __init__(self) -> None:
        self.library: Optional[str] = None      # "numpy", "cupy" or the foreign library's module name
        self.namespace: Any = None               # the caller's Array API namespace (foreign arrays only)
        self.caller_device: Any = None           # the caller's device object (foreign arrays only)
        self.device_id: Optional[int] = None     # the CUDA device of foreign CUDA arrays (None: CPU, or native)
        self._first: Optional[str] = None
        self._place: Optional[tuple[str, int]] = None
        self._key: Any = None
        self._written: list[Any] = []            # the caller's arrays the call writes into (see written())
        self._began = False                      # the call's checks are done: its writes may begin (see begin())

    def __getstate__(self) -> dict[str, Any]:
        """Pickle and deepcopy (a residual keeps its call's edge): the Array API namespace, a module, travels by its
        name ("cannot pickle 'module' object" was all a residual of torch tensors said)."""
        state = dict(self.__dict__)
        for name in ("namespace", "_key"):
            if isinstance(state[name], types.ModuleType):
                state[name] = _ModuleName(state[name].__name__)
        device = state["caller_device"]
        if _library(device) == "jaxlib":  # a JAX device does not pickle: its platform and id do
            state["caller_device"] = _JaxDevice(device.platform, device.id)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in ("namespace", "_key"):
            if isinstance(state[name], _ModuleName):
                state[name] = state[name].load(state["library"])
        if isinstance(state["caller_device"], _JaxDevice):
            state["caller_device"] = state["caller_device"].load()
        self.__dict__.update(state)

    def again(self) -> "Edge":
        """This edge for another call (a residual's backward: its origin kept), with nothing written yet: a list
        shared across calls kept the tensors of a call that failed while converting its buffers, and a later call
        advanced their version counters though it never wrote them (and two threads would share it)."""
        edge = copy.copy(self)
        edge._written, edge._began = [], False
        return edge

    @property
    def foreign(self) -> bool:
        """Whether the call's arrays are of a library other than NumPy and CuPy (results are converted back)."""
        return self.library not in (None, "numpy", "cupy")

    # ----------------------------------------------------------------------------------------------- in
    def data(self, name: str, a: Any) -> Any:
        """A data array as NumPy/CuPy, zero-copy; it must come from the call's library and device."""
        if a is None:
            return None
        native, library, key, namespace = self._convert(name, a)
        if key is None:  # not an array: array_module refuses it, naming it
            return native
        foreign = library not in ("numpy", "cupy")
        place = device_kind(native)
        if self._first is None:
            self._first, self.library, self._key, self._place = name, library, key, place
            if namespace is not None:
                self.namespace = namespace
                self.caller_device = _compat().device(a)
            if foreign and place[0] == "cuda":
                self.device_id = place[1]
            return native
        if not (foreign or self.foreign):
            return native  # NumPy and CuPy: array_module checks mixtures and devices, as for every caller
        if key is not self._key:
            raise TypeError(f"{self._first} is a {self.library} array but {name} is a {library} array: pass arrays of "
                            f"one library (results come back in its type), converting with that library's "
                            f"from_dlpack")
        if place != self._place:
            raise ValueError(f"{self._first} is on {_where(self._place)} but {name} is on {_where(place)}: move "
                             f"them to one device")
        if self.caller_device is not None and namespace is not None and _compat().device(a) != self.caller_device:
            # one memory, several devices of the library (JAX's CPU devices, array-api-strict's virtual ones)
            raise ValueError(f"{self._first} is on {self.library}'s device {self.caller_device} but {name} is on "
                             f"{_compat().device(a)}: move them to one device")
        return native

    def buffer(self, name: str, a: Any) -> Any:
        """An output buffer (``out=``, ``dq=``...) as a writable NumPy/CuPy view of the caller's memory."""
        if a is None:
            return None
        native = self.data(name, a)
        self.written((name,), a)
        if isinstance(native, np.ndarray) and not native.flags.writeable:
            raise ValueError(f"{name} is read-only: a buffer for the result must be writable")
        return native

    def option(self, name: str, a: Any) -> Any:
        """An option's array (seqlens, bias, ...), converted; its checks are the usual ones after conversion."""
        if a is None or isinstance(a, np.ndarray) or _is_cupy(a) or not _is_foreign_array(a):
            return a
        return self._convert(name, a)[0]

    def _convert(self, name: str, a: Any) -> tuple[Any, str, Any, Any]:
        """``(native array, library, identity key, Array API namespace or None)``."""
        if isinstance(a, np.ndarray):
            return a, "numpy", "numpy", None
        if _is_cupy(a):
            return a, "cupy", "cupy", None
        if not _is_foreign_array(a):
            return a, _library(a), None, None  # not an array: array_module refuses it, naming it
        library = _library(a)
        refuse_lazy_negation(name, a)
        refuse_deleted(name, a)  # JAX: its DLPack device raised a TypeError naming nothing
        if hasattr(a, "__dlpack__") and hasattr(a, "__dlpack_device__"):
            try:
                kind, _ = device_kind(a)
            except (BufferError, TypeError, ValueError, RuntimeError) as exc:  # another accelerator, torch's meta
                # device, a sharded JAX array (DLPack's __dlpack_device__ raises BufferError where it cannot export)
                raise TypeError(f"{name}: {exc}") from None
            try:
                if kind == "cpu":
                    native = np.from_dlpack(a)
                else:
                    cupy = _cupy(f"{name} (a {library} array)")
                    with cupy.cuda.Device(device_kind(a)[1]):
                        native = cupy.from_dlpack(a)
            except (BufferError, RuntimeError, TypeError, ValueError) as exc:
                raise TypeError(f"{name}: {library} could not hand this array over through DLPack without a copy "
                                f"({type(exc).__name__}: {exc})") from None
        else:  # __cuda_array_interface__ only (Numba, PyCUDA): CuPy reads it in place
            cupy = _cupy(f"{name} (a {library} array)")
            native = cupy.asarray(a)
        try:
            namespace = _compat().array_namespace(a)
        except TypeError:  # a library array-api-compat does not know: results stay NumPy/CuPy
            namespace = None
        return native, library, (namespace if namespace is not None else type(a)), namespace

    # ----------------------------------------------------------------------------------------------- out
    def export(self, x: Any) -> Any:
        """A NumPy/CuPy result in the caller's array type (zero-copy where the caller's library allows)."""
        if x is None or self.namespace is None:
            return x
        if not x.flags.c_contiguous:  # a slice (v's own head dim): JAX imports compact strides only
            x = (np if isinstance(x, np.ndarray) else _cupy("the result")).ascontiguousarray(x)
        result = self.namespace.from_dlpack(x)
        compat = _compat()
        if self.caller_device is not None and compat.device(result) != self.caller_device:
            result = compat.to_device(result, self.caller_device)
        return result

    def written(self, names: Sequence[str], *arrays: Any) -> None:
        """The caller's ``arrays`` (called ``names``) are written in place by the call (a buffer, a KV cache appended
        to): where they are PyTorch tensors, their autograd version counters advance once the work is done
        (:meth:`device`). cuflash writes through a view of their memory, which PyTorch does not see: a tensor autograd
        had saved for another operation's backward was then read with the new values, silently (PyTorch's own
        in-place write raises). An inference tensor outside inference mode, which PyTorch refuses to write in place,
        is refused alike (it was written)."""
        for name, a in zip(names, arrays):
            if _is_jax(a):  # on a GPU CuPy's view of it is writable: refused by type
                raise ValueError(f"{name} is a JAX array, which JAX never lets change: cuflash cannot write into it "
                                 f"(let cuflash allocate the result; a KV cache to append to must be of another "
                                 f"library)")
        torch = [(name, a) for name, a in zip(names, arrays) if a is not None and _library(a) == "torch"]
        for name, a in torch:
            if a.is_inference() and not sys.modules["torch"].is_inference_mode_enabled():
                raise TypeError(f"{name}: this torch tensor is an inference tensor, which PyTorch does not let be "
                                f"written in place outside torch.inference_mode(): call inside it, or pass "
                                f"{name}.clone() made outside it")
        self._written += [a for _, a in torch]

    def begin(self) -> None:
        """The call's checks are done and the backend is chosen: from here its writes may begin. A call refused before
        this leaves the version counters of the tensors it would have written as they were, as PyTorch's own refused
        in-place operations do (a refused KV-cache append advanced them, and a backward that had saved the cache then
        raised "modified by an inplace operation")."""
        self._began = True

    @contextlib.contextmanager
    def device(self) -> Iterator[None]:
        """Where the work runs: under ``cupy.cuda.Device(i)`` for foreign CUDA arrays (NumPy and CuPy callers manage
        their own device, as before). On the way out (an error too: a write may have begun) of a call that reached
        :meth:`begin`, the version counters of the PyTorch tensors written (:meth:`written`) advance."""
        try:
            if self.device_id is None:
                if self.library == "cupy" and self._place is not None:
                    # before anything is done with them: padding a head dim, casting a float64 bias or checking a
                    # backend's device ran on the current GPU first, a cross-device copy or an error naming nothing
                    current = _cupy("the arrays").cuda.runtime.getDevice()
                    if self._place[1] != current:
                        raise wrong_device(str(self._first), self._place[1], current)
                yield
                return
            cupy = _cupy("the arrays")
            with cupy.cuda.Device(self.device_id):
                yield
        finally:
            if self._written and self._began:
                import torch

                torch.autograd.graph.increment_version(self._written)
            self._written, self._began = [], False


class _ModuleName(str):
    """A pickled edge's Array API namespace: imported again on loading, and only a namespace of the edge's own
    library or array-api-compat's wrapper of it (a pickle naming another module imports nothing)."""

    def load(self, library: Optional[str]) -> types.ModuleType:
        root, own = self.split(".")[0], (library or "").split(".")[0]
        if not own or root not in ("array_api_compat", own, {"jaxlib": "jax"}.get(own)):  # JAX arrays are jaxlib's
            raise ValueError(f"a pickled cuflash residual names the Array API namespace {str(self)!r}, which is not "
                             f"{library}'s: refusing to import it")
        return importlib.import_module(self)


class _JaxDevice:
    """A pickled edge's JAX device, by its platform and id, found again among this process's JAX devices."""

    def __init__(self, platform: str, id_: int) -> None:
        self.platform, self.id = str(platform), int(id_)

    def load(self) -> Any:
        import jax

        platform, id_ = self.platform, self.id
        for device in jax.devices(platform):
            if device.id == id_:
                return device
        raise ValueError(f"a pickled cuflash residual's arrays were on JAX's {platform} device {id_}, which this "
                         f"process does not have")


def _is_jax(a: Any) -> bool:
    """Whether ``a`` is a JAX array (its type from the jax or jaxlib package; NumPy and CuPy arrays never, whatever
    module a subclass of theirs comes from: "jax" in a user module's name refused a NumPy buffer)."""
    if a is None or isinstance(a, np.ndarray) or _is_cupy(a):
        return False
    return type(a).__module__.split(".")[0] in ("jax", "jaxlib")


def refuse_deleted(name: str, a: Any) -> None:
    """A deleted JAX array (donated to a jitted call, or ``delete()``d) is a ValueError naming it; a tracer (under
    jit) has no buffer to ask about (its ``is_deleted`` raises) and passes."""
    try:
        deleted = callable(getattr(a, "is_deleted", None)) and bool(a.is_deleted())
    except Exception:  # noqa: BLE001 - a tracer: ConcretizationTypeError
        deleted = False
    if deleted:
        raise ValueError(f"{name}: this {_library(a)} array has been deleted (donated to a jitted call, or "
                         f"delete()d): its buffer is gone")


def refuse_lazy_negation(name: str, a: Any) -> None:
    """A PyTorch tensor whose values are not its memory is a TypeError naming it, as DLPack hands over the memory
    alone: one negated lazily (``is_neg()``: ``z.conj().imag``) would be read as ``-a`` (and an ``out=`` so flagged
    written as ``-out``); a zero tensor (``_is_zerotensor()``, autograd's stand-in for zeros) and a fake one (the
    shape-only tensors of ``torch.compile`` and ``torch.export`` tracing) have no memory of their values at all, and
    were read as whatever lay at the address DLPack gave (results of 1e30 and NaN, no error)."""
    library = _library(a)
    if callable(getattr(a, "is_neg", None)) and a.is_neg():
        raise TypeError(f"{name}: this {library} tensor is negated lazily (is_neg()), which DLPack does not "
                        f"carry: its memory holds -{name}; pass {name}.resolve_neg()")
    if callable(getattr(a, "_is_zerotensor", None)) and a._is_zerotensor():
        raise TypeError(f"{name}: this {library} tensor is a zero tensor (_is_zerotensor()), whose values are in no "
                        f"memory DLPack can hand over; pass torch.zeros_like({name})")
    torch = sys.modules.get("torch") if library == "torch" else None
    fake = getattr(getattr(getattr(torch, "_subclasses", None), "fake_tensor", None), "is_fake", None)
    if fake is not None and fake(a):
        raise TypeError(f"{name}: this {library} tensor is a fake tensor (torch.compile / torch.export tracing, "
                        f"FakeTensorMode): it has shapes but no values; call cuflash on real tensors, outside the "
                        f"traced region (torch.compiler.disable)")


def _is_foreign_array(a: Any) -> bool:
    return (hasattr(a, "__dlpack__") and hasattr(a, "__dlpack_device__")) or hasattr(a, "__cuda_array_interface__")


def _where(place: Optional[tuple[str, int]]) -> str:
    if place is None:
        return "an unknown device"
    return "the CPU" if place[0] == "cpu" else f"GPU {place[1]}"
