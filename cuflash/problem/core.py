"""Validation of one attention call into a :class:`Problem`, and the visibility rule.

Every public entry point funnels its arguments through :func:`make_problem` once, before any
backend runs: a bad argument raises ``TypeError``/``ValueError`` naming it and the expected form,
and nothing is silently broadcast, truncated or cast.

The visibility rule (:func:`visible`) is the single Python definition of which (query, key) pairs
attend; ``kernels/mask.cuh`` is its only other copy, and a test holds the two together. The ragged calls
(varlen, KV cache) are validated in :mod:`cuflash.problem.ragged` on top of this.
"""
from __future__ import annotations

import collections.abc
import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: ``precision=``: the arithmetic of float32 inputs on the CUDA kernels (cuflash.api documents them); "ieee" is the
#: only one for the other dtypes, and the NumPy backend computes float32 in float32 whatever it says.
PRECISIONS = ("ieee", "3xtf32", "tf32")


# --------------------------------------------------------------------------------------------
# The visibility rule
# --------------------------------------------------------------------------------------------
def visible(i, j, len_q, len_k, left: Optional[int], right: Optional[int]):
    """Whether query row ``i`` sees key column ``j`` (NumPy broadcasting over all arguments).

    ``len_q``/``len_k`` are the sequence's own valid lengths. The diagonal is aligned
    bottom-right (``off = len_k - len_q``), so causal is ``right = 0`` and a window keeps
    ``i + off - left <= j <= i + off + right``; ``None`` leaves a side unbounded.
    """
    i, j = np.asarray(i), np.asarray(j)
    len_q, len_k = np.asarray(len_q), np.asarray(len_k)
    diag = i + (len_k - len_q)
    keep = (i < len_q) & (j < len_k)
    if left is not None:
        keep = keep & (j >= diag - left)
    if right is not None:
        keep = keep & (j <= diag + right)
    return keep


def key_range(q_lo: int, q_hi: int, len_q, len_k, left, right) -> tuple[int, int]:
    """Half-open range of key columns that some row in ``[q_lo, q_hi)`` sees, in any sequence.

    ``len_q``/``len_k`` are scalars or one length per sequence; the range is the union over
    sequences, so a tile outside it can be skipped for the whole batch at once.
    """
    len_q, len_k = np.atleast_1d(len_q), np.atleast_1d(len_k)
    rows_hi = np.minimum(q_hi, len_q)  # rows past a sequence's length see nothing
    off = len_k - len_q
    lo = np.zeros_like(len_k) if left is None else np.maximum(q_lo + off - left, 0)
    hi = len_k if right is None else np.minimum(rows_hi - 1 + off + right + 1, len_k)
    live = (rows_hi > q_lo) & (hi > lo)
    if not live.any():
        return 0, 0
    return int(lo[live].min()), int(hi[live].max())


# --------------------------------------------------------------------------------------------
# Array modules and dtypes
# --------------------------------------------------------------------------------------------
def _is_cupy(x) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


def array_module(*arrays, names, foreign=True):
    """Return ``numpy`` or ``cupy`` for the arrays; reject non-arrays, masked and object arrays, mixtures of
    NumPy and CuPy, and CuPy arrays on different devices.

    This is the single check of the NumPy/CuPy arrays every entry point works on; arrays of other libraries are
    converted to those before it, at the edge (:mod:`cuflash.interop`). ``foreign=False``: the caller takes NumPy
    and CuPy only (cuflash.distributed), and the error says so."""
    kinds = {}
    devices = {}
    for a, name in zip(arrays, names):
        if isinstance(a, np.ma.MaskedArray):
            raise TypeError(f"{name} is a numpy.ma.MaskedArray: its mask would be ignored; pass a plain array and "
                            f"express the mask with causal/window/seqlens/block_mask/mask_mod")
        if isinstance(a, np.ndarray):
            kinds[name] = "numpy"
        elif _is_cupy(a) and hasattr(a, "__cuda_array_interface__"):
            kinds[name] = "cupy"
            device = getattr(a, "device", None)
            if device is not None and hasattr(device, "id"):
                devices[name] = device.id
        elif foreign:
            traced = "; under jax.jit, jax.grad or jax.vmap use cuflash.jax.attention" if \
                type(a).__module__.split(".")[0] == "jax" and "Tracer" in type(a).__name__ else ""
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray (or an array of another library that "
                            f"implements __dlpack__ or __cuda_array_interface__: torch, JAX, array-api-strict, "
                            f"Numba, ...), got {type(a).__name__}{traced}")
        else:
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray (cuflash.distributed takes NumPy and "
                            f"CuPy arrays only; np.from_dlpack / cupy.from_dlpack convert others without a copy), "
                            f"got {type(a).__name__}")
        if getattr(a, "dtype", None) is not None and np.dtype(a.dtype).kind == "O":
            # no dtype suggested: this check serves the float arrays and the integer ones (offsets, lengths) alike
            raise TypeError(f"{name} is an array of Python objects (dtype object): convert it to an array of the "
                            f"numeric dtype {name} takes first (its documentation says which)")
    if len(set(kinds.values())) > 1:
        desc = ", ".join(f"{n} is {m}" for n, m in kinds.items())
        raise TypeError(f"q, k, v (and dout/out/lse) must all be NumPy or all CuPy arrays ({desc})")
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"{n} on GPU {d}" for n, d in devices.items())
        raise ValueError(f"the arrays must all live on one GPU ({desc}): copy them to one device first, "
                         f"e.g. with cupy.asarray under `with cupy.cuda.Device(i):`")
    if "cupy" in kinds.values():
        import cupy

        return cupy
    return np


def check_buffer(name: str, buf: Any, shape: tuple, dtype: Any, xp: Any, inputs: dict) -> None:
    """An output buffer (``out=``, ``dq=``, ...): an ``xp`` array of exactly ``shape`` and ``dtype``, writable, and
    sharing no memory with any of ``inputs`` (name -> array) or with the other buffers passed in ``inputs``.

    Results are written into the buffer after the computation, so no layout (contiguity) is required of it; an
    overlap is refused all the same, so that a native path writing as it goes can come later without changing
    what is accepted."""
    if array_module(buf, names=(name,)) is not xp:
        raise TypeError(f"{name} must be a {xp.__name__} array like q, k, v (the same library and device)")
    on_gpu = {n: a for n, a in inputs.items() if _is_cupy(a)}
    if _is_cupy(buf) and on_gpu:  # on the inputs' GPU (array_module's check, which names them)
        array_module(buf, *on_gpu.values(), names=(name, *on_gpu))
    if tuple(buf.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(buf.shape)}")
    if buf.dtype != dtype:
        swapped = not buf.dtype.isnative and buf.dtype.newbyteorder("=") == dtype  # results are in native order
        raise TypeError(f"{name} must have dtype {dtype} (q's){' in this machine byte order' if swapped else ''}, got "
                        f"{buf.dtype.str if swapped else buf.dtype}")
    if isinstance(buf, np.ndarray) and not buf.flags.writeable:
        raise ValueError(f"{name} is read-only: a buffer for the result must be writable")
    check_one_place_per_element(name, buf, "a result buffer")
    for other, a in inputs.items():
        if a is not None and hasattr(a, "shape") and _overlap(buf, a):
            raise ValueError(f"{name} shares memory with {other}: a result buffer must not overlap the inputs "
                             f"(or another result buffer)")


def check_one_place_per_element(name: str, a: Any, what: str) -> None:
    """Refuse an array written into whose elements may share memory (a broadcast view, ``expand``, a stride-tricks
    window): one element's result would land on another's."""
    if _self_overlap(a):
        raise ValueError(f"{name} has elements that share memory (strides {tuple(a.strides)} for shape "
                         f"{tuple(a.shape)}: a broadcast or stride-tricks view): {what} needs one place per element; "
                         f"pass a contiguous array")


def _self_overlap(a) -> bool:
    """Whether two elements of ``a`` may share memory: its axes of more than one element, by stride, must each step
    past all that the smaller ones span (a sufficient test: a layout it cannot prove counts as overlapping)."""
    if a.size == 0:  # no elements (NumPy gives an empty array zero strides)
        return False
    span = a.itemsize
    for stride, n in sorted((abs(st), n) for n, st in zip(a.shape, a.strides) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False


_TOO_HARD = getattr(np, "exceptions", np).TooHardError  # numpy.exceptions from NumPy 1.25 on


def _overlap(a, b) -> bool:
    """Whether two arrays may share memory: exactly (bounded work; too hard counts as overlapping), NumPy's arrays
    and CuPy's alike. A CuPy array's addresses go to NumPy's solver as a byte view of the same layout
    (:func:`_device_layout`): its byte ranges alone refused the two halves of an interleaved KV cache (k and v of one
    ``(B, C, 2, H, D)`` buffer), which share no element."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        pass
    elif isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        return False  # host and device memory (a NumPy scalar beside a CuPy cache has no device pointer to compare)
    else:
        if a.size == 0 or b.size == 0:
            return False
        lo = min(int(a.data.ptr), int(b.data.ptr)) - _reach(a) - _reach(b)
        a, b = _device_layout(a, lo), _device_layout(b, lo)
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except _TOO_HARD:
        return True


def _reach(x) -> int:
    """How many bytes below its data pointer an array's negative strides reach."""
    return sum((n - 1) * -s for n, s in zip(x.shape, x.strides) if s < 0)


def _device_layout(x, lo: int):
    """A NumPy uint8 array with ``x``'s layout in bytes (its shape, strides and a last axis of its item's bytes) at
    the address ``x.data.ptr - lo`` of a one-byte dummy: only the addresses, for ``np.shares_memory``, which computes
    with them and reads none (``as_strided`` checks no bounds; nothing ever reads these views)."""
    from numpy.lib.stride_tricks import as_strided

    offset = int(x.data.ptr) - lo
    start = as_strided(_DUMMY, shape=(offset + 1,), strides=(1,))[offset:]
    return as_strided(start, shape=tuple(x.shape) + (x.itemsize,), strides=tuple(x.strides) + (1,))


_DUMMY = np.zeros(1, np.uint8)


def check_current_device(device: int, **arrays: Any) -> None:
    """Every CuPy array of ``arrays`` on GPU ``device``, the current one: kernels launch and transfers run there,
    and CuPy checks (and enables) peer access for its own kernels but not for raw ones or NCCL, so another GPU's
    buffer would be an illegal address (a sticky error that ends the process's CUDA context) or a failed transfer
    that leaves the other ranks waiting."""
    for name, a in arrays.items():
        if a is not None and _is_cupy(a) and a.device.id != device:
            raise wrong_device(name, a.device.id, device)


def wrong_device(name: str, on: int, current: int) -> ValueError:
    """The error of a CuPy array ``name`` on GPU ``on`` while GPU ``current`` is the current one."""
    return ValueError(f"{name} is on GPU {on} but the current device is GPU {current}: call cuflash inside "
                      f"`with cupy.cuda.Device({on}):`")


def check_flags(**flags: Any) -> None:
    """Each keyword a bool (NumPy's too): TypeError naming the first that is not."""
    for name, flag in flags.items():
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def dtype_name(dtype) -> str:
    """Canonical name of an array dtype (``ml_dtypes.bfloat16`` → ``"bfloat16"``)."""
    return np.dtype(dtype).name


def bf16_bits_to_float32(x):
    """``uint16`` bfloat16 bit patterns → float32 (exact: bfloat16 is float32's top half)."""
    return (x.astype(np.uint32) << 16).view(np.float32)


def stats_dtype(dtype) -> np.dtype:
    """Softmax statistics and ``lse`` are float32, float64 for float64 inputs."""
    return np.dtype(np.float64) if dtype_name(dtype) == "float64" else np.dtype(np.float32)


# --------------------------------------------------------------------------------------------
# Problem
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One validated attention call, batch dimensions flattened.

    ``q``: ``(B, Sq, Hq, D)``, ``k``/``v``: ``(B, Sk, Hkv, D)`` (views of the caller's arrays
    whenever the batch dimensions can be merged without a copy; only the last axis is assumed
    contiguous by kernels). ``window_left``/``window_right`` already include ``causal``
    (``right = min(right, 0)``); ``None`` is unbounded.
    """

    xp: Any
    q: Any
    k: Any
    v: Any
    batch_shape: tuple
    scale: float
    causal: bool
    window_left: Optional[int]
    window_right: Optional[int]
    seqlens_q: Any  # int32 (B,) on xp, or None
    seqlens_k: Any
    block_mask: Any  # BlockMask or None
    dropout_p: float = 0.0
    seed: Optional[int] = None
    #: "bfloat16" when uint16 arrays carry bfloat16 bits (``dtype="bfloat16"``), else the dtype's name.
    element_type: str = ""
    #: score and mask modifiers (:class:`cuflash.mods.Modifiers`), or None
    mods: Any = None
    #: the float32 arithmetic of the CUDA kernels (:data:`PRECISIONS`)
    precision: str = "ieee"
    #: the index, in a larger batch, of this problem's sequence 0: the ``b`` that modifiers and the dropout
    #: counter see. Nonzero only for one sequence of a ragged batch (:meth:`VarlenProblem.sequence`,
    #: :meth:`KVCacheProblem.sequence`), whose modifier operands keep the whole batch's extents.
    batch_offset: int = 0
    #: the caller's axis order, ``"bshd"`` or ``"bhsd"`` (the arrays here are ``"bshd"`` views either way): a backend
    #: that lays its results out in memory itself lays them out in this order, so that they reach the caller
    #: C-contiguous without a copy
    layout: str = "bshd"

    batch = property(lambda self: self.q.shape[0])
    seqlen_q = property(lambda self: self.q.shape[1])
    seqlen_k = property(lambda self: self.k.shape[1])
    heads_q = property(lambda self: self.q.shape[2])
    heads_kv = property(lambda self: self.k.shape[2])
    head_dim = property(lambda self: self.q.shape[3])
    dtype = property(lambda self: self.q.dtype)  # the arrays' dtype (uint16 for declared bfloat16 bits)
    group = property(lambda self: self.q.shape[2] // self.k.shape[2])
    #: uint16 arrays carrying bfloat16 bits (``dtype="bfloat16"``), not ml_dtypes.bfloat16 arrays
    bf16_bits = property(lambda self: self.element_type == "bfloat16" and dtype_name(self.q.dtype) == "uint16")

    def host_float(self, x, dtype):
        """A q/k/v-like array as a host array of ``dtype`` (decoding declared bfloat16 bits)."""
        x = np.asarray(x.get() if _is_cupy(x) else x)
        if dtype_name(x.dtype) == "uint16" and self.element_type == "bfloat16":
            x = bf16_bits_to_float32(x)
        return x.astype(dtype)

    @property
    def lengths(self):
        """Per-sequence valid lengths ``(len_q, len_k)`` as host int arrays of shape ``(B,)``."""
        def host(x, full):
            if x is None:
                return np.full(self.batch, full, dtype=np.int64)
            return np.asarray(x.get() if _is_cupy(x) else x, dtype=np.int64)

        return host(self.seqlens_q, self.seqlen_q), host(self.seqlens_k, self.seqlen_k)

    def visible_mask(self):
        """Dense ``(B, Hq|1, Sq, Sk)`` boolean visibility (element rule and BlockMask): O(N²), for references."""
        len_q, len_k = self.lengths
        i = np.arange(self.seqlen_q)[None, None, :, None]
        j = np.arange(self.seqlen_k)[None, None, None, :]
        keep = visible(i, j, len_q[:, None, None, None], len_k[:, None, None, None],
                       self.window_left, self.window_right)
        if self.block_mask is not None:
            keep = keep & self.block_mask.to_dense(self.seqlen_q, self.seqlen_k, dtype=stats_dtype(self.dtype))
        return keep

    def unflatten(self, x, tail):
        """Reshape a ``(B, *tail)`` result back to ``batch_shape + tail``."""
        return x.reshape(self.batch_shape + tuple(tail))


def _flatten(x, n_batch: int):
    """Merge the leading batch dimensions into one (a view whenever the strides allow)."""
    return x.reshape((math.prod(x.shape[:n_batch]),) + x.shape[n_batch:])


def native(a):
    """``a`` as a plain array in native byte order: a NumPy subclass is viewed as its ndarray (a masked array
    was refused earlier), non-native byte order converted (a copy). Kernels and BLAS read raw native bytes, so
    a big-endian array would otherwise be reinterpreted."""
    if isinstance(a, np.ndarray):
        a = a.view(np.ndarray) if type(a) is not np.ndarray else a
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
    return a


def _check_element_type(q, dtype):
    """The element type of q, k, v: their dtype, or bfloat16 declared over uint16 bits."""
    if dtype is None:
        return dtype_name(q.dtype)
    if dtype != "bfloat16":
        raise ValueError(f"dtype must be None or 'bfloat16' (for uint16 arrays holding bfloat16 bits), got {dtype!r}")
    if dtype_name(q.dtype) not in ("uint16", "bfloat16"):
        raise TypeError(f"dtype='bfloat16' declares uint16 arrays of bfloat16 bits, but q is {q.dtype}")
    return "bfloat16"


def _shown(shape, layout: str) -> tuple:
    """A shape of the (..., seqlen, heads, head_dim) arrays that validation sees, as the caller passed it: a
    ``layout="bhsd"`` array is read through a view with its seqlen and heads axes swapped."""
    shape = tuple(shape)
    return shape if layout == "bshd" or len(shape) < 3 else shape[:-3] + (shape[-2], shape[-3], shape[-1])


def _check_qkv(q, k, v, element_type, layout="bshd"):
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim < 3:
            raise ValueError(f"{name} must have shape (..., seqlen, heads, head_dim), got ndim={a.ndim}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k, v must have the same number of dimensions, got {q.ndim}, {k.ndim}, {v.ndim}")
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-3] != v.shape[:-3]:
        raise ValueError(
            f"batch dimensions of q, k, v must be identical (no broadcasting), "
            f"got {q.shape[:-3]}, {k.shape[:-3]}, {v.shape[:-3]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same seqlen_k and heads_kv, got k {_shown(k.shape, layout)} and "
                         f"v {_shown(v.shape, layout)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head_dim of q ({q.shape[-1]}) and k ({k.shape[-1]}) must match")
    dts = {dtype_name(a.dtype) for a in (q, k, v)}
    if len(dts) > 1:
        raise TypeError(f"q, k, v must share one dtype, got {dtype_name(q.dtype)}, "
                        f"{dtype_name(k.dtype)}, {dtype_name(v.dtype)}")
    if min(q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2]) < 1:
        raise ValueError(f"heads and head_dim must be >= 1, got q {_shown(q.shape, layout)}, k "
                         f"{_shown(k.shape, layout)}, v {_shown(v.shape, layout)}")
    if k.shape != v.shape:  # a head_dim_v of its own is taken by cuflash.attention (padded), not here
        raise ValueError(f"k and v must have the same shape (..., seqlen_k, heads_kv, head_dim) here, got k "
                         f"{_shown(k.shape, layout)} and v {_shown(v.shape, layout)}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"heads of q ({q.shape[-2]}) must be a multiple of heads of k/v ({k.shape[-2]})")
    if element_type not in FLOAT_DTYPES:
        raise TypeError(f"q, k, v must be floating point ({', '.join(FLOAT_DTYPES)}; uint16 bfloat16 bits "
                        f"with dtype='bfloat16'), got {q.dtype}")


def as_float(value) -> float:
    """``float(value)``, with an int or Fraction past float64 as inf (Python raises OverflowError): a real option is
    checked as the float64 every backend computes with."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _brief(value) -> str:
    """``repr(value)`` for an error message, cut at 40 characters (a Fraction of 10**400 runs to 800)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _working_real(value, name: str, dtype, form: str) -> float:
    """A real option (scale, softcap) as the float the computation uses: finite in float64 and in the working
    precision of ``dtype`` (float32 but for float64 inputs), where it would otherwise turn into inf."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {form}, got {type(value).__name__}")
    x = as_float(value)
    work = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    if not math.isfinite(x) or abs(x) > float(np.finfo(work).max):  # compared as Python floats: no cast, no warning
        shown = _brief(value)
        inputs = "bfloat16" if np.dtype(dtype) == np.uint16 else np.dtype(dtype).name  # bits of dtype="bfloat16"
        raise ValueError(f"{name} must be {form} and finite in {np.dtype(work).name} (the working precision of "
                         f"{inputs} inputs), got {shown}")
    return x


def _check_scale(scale, head_dim, dtype):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _working_real(scale, "scale", dtype, "a real number or None")


def _check_window(window, causal, span: int):
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    left = right = None
    if window is not None:
        if not isinstance(window, (tuple, list)):  # a wrong type, as a float inside it (below)
            raise TypeError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
        if len(window) != 2:
            raise ValueError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
        for side, w in zip(("left", "right"), window):
            if w is None:
                continue
            if isinstance(w, bool) or not isinstance(w, numbers.Integral):
                raise TypeError(f"window {side} must be an int >= 0 or None, got {w!r}")
            if w < 0:
                raise ValueError(f"window {side} must be >= 0 or None, got {w}")
        # Any bound beyond seqlen_q + seqlen_k keeps every key of every row: it means "unbounded" exactly, and
        # clamping keeps the index arithmetic of every backend far from integer overflow.
        left, right = (None if w is None else min(int(w), span) for w in window)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _check_seqlens(x, name, batch_shape, full, xp):
    if x is None:
        return None
    if not (isinstance(x, np.ndarray) or _is_cupy(x)):
        raise TypeError(f"{name} must be an integer array of shape {batch_shape}, got {type(x).__name__}")
    array_module(x, names=(name,))  # a masked array is refused (its mask would be dropped), as for q, k, v
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array of shape {batch_shape}, got dtype {x.dtype}")
    if tuple(x.shape) != tuple(batch_shape):
        raise ValueError(f"{name} must have the batch shape {batch_shape}, got {tuple(x.shape)}")
    host = np.asarray(x.get() if _is_cupy(x) else x).reshape(-1)
    top = min(full, 2**31 - 1)  # kept as int32 (the kernels' lengths): a larger length wrapped (2**32 + 1 -> 1)
    if host.size and (host.min() < 0 or host.max() > top):
        raise ValueError(f"{name} values must lie in [0, {top}]{' (int32)' if top < full else ''}, got range "
                         f"[{host.min()}, {host.max()}]")
    return xp.asarray(host.astype(np.int32))


def check_dropout(dropout_p, seed, what="dropout_p"):
    """``(p, seed)`` validated: ``p`` 0 or a real in [2**-32, 1 - 2**-32] (:data:`cuflash.dropout.MIN_P`,
    :data:`~cuflash.dropout.MAX_P`), ``seed`` None or an int in [0, 2**64)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{what} must be a float in [0, 1), got {type(dropout_p).__name__}")
    from ..dropout import MAX_P, MIN_P

    p = as_float(dropout_p)  # 1 - 2**-60 (a Fraction, a longdouble) is 1.0 there
    if not 0.0 <= p <= MAX_P:  # NaN fails this too
        why = "" if not 0 <= dropout_p < 1 else (" (it is 1.0 as a float64)" if p == 1.0 else
                                                 ": the keep-mask draws 32-bit random numbers, which keep an element "
                                                 "no less often than 2**-32; a larger p would bias the output")
        raise ValueError(f"{what} must lie in [0, 1 - 2**-32], got {_brief(dropout_p)}{why}")
    if 0.0 < p < MIN_P:  # the keep-mask drops nothing, yet kept elements would be scaled by 1 / (1 - p)
        raise ValueError(f"{what} must be 0 or lie in [2**-32, 1 - 2**-32], got {_brief(dropout_p)}: the keep-mask "
                         f"draws 32-bit random numbers and drops an element with probability floor(p * 2**32) / "
                         f"2**32, which is 0 below 2**-32 (pass 0 for no dropout)")
    if seed is not None and (isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed must be an int in [0, 2**64) or None, got {type(seed).__name__}")  # as dropout_p's
    if seed is not None and not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64) or None, got {_brief(seed)}")
    return p, (None if seed is None else int(seed))


#: the largest size (length, tile, block, count) :func:`check_int` takes, in magnitude: NumPy's int64 index
#: arithmetic on the schedule's tiles and a BlockMask's blocks overflowed past it (OverflowError naming nothing)
MAX_SIZE = 2**62


def check_int(x, name: str, low: Optional[int] = 0) -> int:
    """``x`` as an int in ``[low, MAX_SIZE]`` (``[-MAX_SIZE, MAX_SIZE]`` for ``low`` None): the one check of an int
    argument (tile sizes, lengths, a BlockMask's counts). Floats are refused, not truncated (a 4.5-row tile would
    silently become 4), and so are bools (True is not a length)."""
    form = "an int" if low is None else f"an int >= {low}"
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be {form}, got {x!r}")
    if low is not None and x < low:
        raise ValueError(f"{name} must be {form}, got {x!r}")
    if not -MAX_SIZE <= x <= MAX_SIZE:
        raise ValueError(f"{name} must be an int in [{'-2**62' if low is None else low}, 2**62], got {x!r}")
    return int(x)


def check_precision_name(precision) -> str:
    """One of :data:`PRECISIONS` (TypeError for a non-str, ValueError for another name), whatever the dtype: the
    options' check, and ``warmup``'s."""
    form = f"one of {', '.join(map(repr, PRECISIONS))}"
    if not isinstance(precision, str):
        raise TypeError(f"precision must be {form}, got {type(precision).__name__} {_brief(precision)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be {form}, got {_brief(precision)}")
    return str(precision)  # a np.str_ as the str it equals (it has another repr: ranks compare reprs)


def _check_precision(precision, element_type: str) -> str:
    precision = check_precision_name(precision)
    if precision != "ieee" and element_type != "float32":
        raise ValueError(f"precision={precision!r} selects float32 tensor-core arithmetic; {element_type} inputs "
                         f"take only precision='ieee' (their arithmetic is fixed by the dtype)")
    return precision


def make_problem(q, k, v, *, causal=False, scale=None, window=None, block_mask=None,
                 seqlens_q=None, seqlens_k=None, dropout_p=0.0, seed=None, dtype=None, bias=None,
                 alibi_slopes=None, softcap=None, score_mod=None, mask_mod=None, mod_arrays=None,
                 precision="ieee", layout="bshd") -> Problem:
    """Validate the forward arguments and return the normalized :class:`Problem`. ``q``, ``k``, ``v`` are in the
    (..., seqlen, heads, head_dim) form; ``layout`` is the caller's, for the shapes that errors show."""
    xp = array_module(q, k, v, names=("q", "k", "v"))
    q, k, v = native(q), native(k), native(v)
    element_type = _check_element_type(q, dtype)
    _check_qkv(q, k, v, element_type, layout)
    precision = _check_precision(precision, element_type)
    n_batch = q.ndim - 3
    batch_shape = tuple(q.shape[:n_batch])
    scale = _check_scale(scale, q.shape[-1], q.dtype)
    left, right = _check_window(window, causal, q.shape[-3] + k.shape[-3])
    dropout_p, seed = check_dropout(dropout_p, seed)
    sq = _check_seqlens(seqlens_q, "seqlens_q", batch_shape, q.shape[-3], xp)
    sk = _check_seqlens(seqlens_k, "seqlens_k", batch_shape, k.shape[-3], xp)
    qf, kf, vf = (_flatten(a, n_batch) for a in (q, k, v))
    if block_mask is not None:
        from ..blockmask import BlockMask

        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a cuflash.BlockMask, got {type(block_mask).__name__}")
        block_mask.check_fits(qf.shape[0], qf.shape[2], qf.shape[1], kf.shape[1])
        block_mask.check_operands(q.dtype)
    extents = {"b": qf.shape[0], "h": qf.shape[2], "q_idx": qf.shape[1], "kv_idx": kf.shape[1]}
    mods = _check_modifiers(xp, batch_shape, extents, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap,
                            score_mod=score_mod, mask_mod=mask_mod, mod_arrays=mod_arrays, like=q)
    return Problem(xp, qf, kf, vf, batch_shape, scale, bool(causal), left, right, sq, sk,
                   block_mask, dropout_p, seed, element_type, mods, precision, layout=layout)


# --------------------------------------------------------------------------------------------
# Score and mask modifiers
# --------------------------------------------------------------------------------------------
def _float_array(x, name, xp, form):
    if not (isinstance(x, np.ndarray) or _is_cupy(x)) or array_module(x, names=(name,)) is not xp:
        raise TypeError(f"{name} must be a {xp.__name__} array {form}, got {type(x).__name__}")
    x = native(x)
    if x.dtype.kind != "f" and dtype_name(x.dtype) != "bfloat16":
        raise TypeError(f"{name} must be a floating-point array {form}, got dtype {x.dtype}")
    return x


def compact(a):
    """``a`` without its broadcast: one element along every zero-stride axis (a view), the values the caller stored."""
    return a[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for st, n in zip(a.strides, a.shape))]


def _check_fits_working(x, name: str, dtype) -> None:
    """Refuse a float operand (an array, or a number of ``mod_arrays``) with finite values past the largest of the
    working precision of ``dtype`` (float32 but for float64 inputs), where the modifiers compute: they would turn
    into inf there (a float64 bias of 1e300 gave NaN outputs with float32 inputs), as ``scale`` and ``softcap``
    would. Only a wider dtype can hold them; one element per broadcast axis is read."""
    work = stats_dtype(dtype)
    if isinstance(x, numbers.Number):  # an int, bool or float of mod_arrays (ints are held to int32 elsewhere)
        with np.errstate(over="ignore", under="ignore"):  # a longdouble 1e-300 is 0 in float32, and fits
            # np.floating too: a np.longdouble is no float (1e300 passed, and made every key masked in float32); any
            # other real (a Fraction, a Decimal: typed float, and cast as one) likewise
            past_float64 = False
            if isinstance(x, numbers.Real) and not isinstance(x, (numbers.Integral, np.bool_, np.floating)):
                try:
                    x = float(x)
                except OverflowError:  # finite, and beyond float64 too: past any working precision
                    past_float64 = True
            bad = past_float64 or (isinstance(x, (float, np.floating)) and bool(np.isfinite(x))
                                   and not np.isfinite(work.type(x)))
    elif x is None or x.dtype.kind != "f" or x.dtype.itemsize <= work.itemsize:
        return
    else:
        xp = array_module(x, names=(name,))
        small = compact(x)
        with np.errstate(over="ignore", under="ignore"):  # 1e-300 in float32 is 0, and fits
            bad = bool((xp.isinf(small.astype(work)) & xp.isfinite(small)).any())  # the cast the backends make
    if bad:
        largest = float(np.finfo(work).max)
        raise ValueError(f"{name} holds finite values beyond the largest {work.name} ({largest:.4g}), the working "
                         f"precision of {dtype_name(dtype)} inputs, where they would become inf: scale them, or "
                         f"pass inf or -inf itself")


def _check_bias(bias, xp, batch_shape, extents):
    """``bias`` as a (B, H, Sq, Sk) view, the caller's shape, and the (B|1, H|1, Sq|1, Sk|1) shape that dbias is
    summed to: taken from the caller's shape, not from the view's zero strides, as an array that the caller made by
    broadcasting (``np.broadcast_to``) has zero strides along axes that its shape declares full.

    Broadcasting over batch dimensions is all or nothing (every batch dim 1, or exactly the batch shape):
    flattening a partly broadcast batch would need a copy of the size of the full score matrix."""
    tail = (extents["h"], extents["q_idx"], extents["kv_idx"])
    form = f"broadcastable to (*batch, heads, seqlen_q, seqlen_k) = {batch_shape + tail}"
    bias = _float_array(bias, "bias", xp, form)
    nb = len(batch_shape)
    if bias.ndim > nb + 3:
        raise ValueError(f"bias must be {form}, got shape {tuple(bias.shape)}")
    full = (1,) * (nb + 3 - bias.ndim) + tuple(bias.shape)
    if any(s not in (1, t) for s, t in zip(full, batch_shape + tail)):
        raise ValueError(f"bias must be {form}, got shape {tuple(bias.shape)}")
    if full[:nb] not in ((1,) * nb, batch_shape):
        raise ValueError(f"bias batch dimensions must be all 1 or exactly {batch_shape} (a partly broadcast batch "
                         f"cannot be flattened without copying), got {full[:nb]}")
    b = 1 if full[:nb] == (1,) * nb else extents["b"]
    view = bias.reshape((b,) + full[nb:])
    if math.prod((extents["b"],) + tail) > np.iinfo(np.intp).max:  # a broadcast view indexes every element
        raise ValueError(f"bias: the problem's (batch, heads, seqlen_q, seqlen_k) = {(extents['b'],) + tail} has "
                         f"more elements than an array can index; give smaller max_seqlen_q/max_seqlen_k")
    return xp.broadcast_to(view, (extents["b"],) + tail), tuple(bias.shape), (b,) + full[nb:]


def _check_alibi(slopes, xp, batch_shape, extents):
    form = f"of shape (heads,) = ({extents['h']},) or (*batch, heads) = {batch_shape + (extents['h'],)}"
    slopes = _float_array(slopes, "alibi_slopes", xp, form)
    if tuple(slopes.shape) == (extents["h"],):
        return xp.broadcast_to(slopes[None], (extents["b"], extents["h"]))
    if tuple(slopes.shape) == batch_shape + (extents["h"],):
        return slopes.reshape(extents["b"], extents["h"])
    raise ValueError(f"alibi_slopes must be {form}, got shape {tuple(slopes.shape)}")


def _check_mod_arrays(mod_arrays, xp):
    if mod_arrays is None:
        return {}
    if not isinstance(mod_arrays, collections.abc.Mapping):  # a dict, a MappingProxyType, ...
        raise TypeError(f"mod_arrays must be a dict (a mapping) of name -> array or number, got "
                        f"{type(mod_arrays).__name__}")
    out = {}
    for name, value in mod_arrays.items():
        if isinstance(value, (np.bool_, np.number)) and not isinstance(value, np.complexfloating):
            value = value.item()  # a NumPy scalar (np.True_, np.float32(2)) as the Python number it holds
        if isinstance(value, numbers.Number) and not isinstance(value, complex):
            out[name] = value
            continue
        if not (isinstance(value, np.ndarray) or _is_cupy(value)):
            raise TypeError(f"mod_arrays[{name!r}] must be an array or a number, got {type(value).__name__}")
        module = array_module(value, names=(f"mod_arrays[{name!r}]",))  # refuses a masked array, 0-d ones too
        if value.ndim and module is not xp:  # a 0-d array is a number, on the host or on the device
            raise TypeError(f"mod_arrays[{name!r}] must be a {xp.__name__} array like q, k, v")
        out[name] = native(value)
    return out


def _check_literals(expr, what: str, dtype) -> None:
    """The float literals of the caller's expression held to the working precision, as a number of ``mod_arrays``
    is (``score + 1e39`` became inf in float32)."""
    for c in expr.float_constants:
        _check_fits_working(c, f"{what}'s constant {c!r}", dtype)


def _check_modifiers(xp, batch_shape, extents, *, bias, alibi_slopes, softcap, score_mod, mask_mod, mod_arrays,
                     like):
    """The :class:`cuflash.mods.Modifiers` of a call (None without any): built-ins composed in the order
    softcap → bias → ALiBi → score_mod, every operand checked against the problem's extents, and its arrays on the
    device of ``like`` (q: the kernels read them through raw pointers)."""
    from .. import mods

    if all(x is None for x in (bias, alibi_slopes, softcap, score_mod, mask_mod)):
        if mod_arrays:
            raise ValueError("mod_arrays given without score_mod or mask_mod to read them")
        return None
    values = _check_mod_arrays(mod_arrays, xp)
    internal = {}
    score = None
    if softcap is not None:
        cap = _working_real(softcap, "softcap", like.dtype, "a real > 0 or None")
        tiny = float(np.finfo(np.float64 if np.dtype(like.dtype) == np.float64 else np.float32).tiny)
        if not cap >= tiny:  # below the working precision's smallest normal: 0 there, or 0 where the GPU flushes
            raise ValueError(f"softcap must be a real > 0 or None, at least {tiny:.3g} (the smallest normal number "
                             f"of the working precision), got {softcap!r}")
        internal["cuflash_softcap"] = cap
        score = mods.parse(mods.SOFTCAP, kind="score", arrays=internal, internal=True)
    bias_shape = bias_compact = None
    if bias is not None:
        internal["cuflash_bias"], bias_shape, bias_compact = _check_bias(bias, xp, batch_shape, extents)
        step = mods.parse(mods.BIAS, kind="score", arrays=internal, internal=True)
        score = step if score is None else step.compose(score)
    if alibi_slopes is not None:
        internal["cuflash_alibi"] = _check_alibi(alibi_slopes, xp, batch_shape, extents)
        step = mods.parse(mods.ALIBI, kind="score", arrays=internal, internal=True)
        score = step if score is None else step.compose(score)
    if score_mod is not None:
        step = mods.parse(score_mod, kind="score", arrays=values, what="score_mod")
        step.check_against(values, extents, "score_mod")
        _check_literals(step, "score_mod", like.dtype)
        score = step if score is None else step.compose(score)
    mask = None
    if mask_mod is not None:
        mask = mods.parse(mask_mod, kind="mask", arrays=values, what="mask_mod")
        mask.check_against(values, extents, "mask_mod")
        _check_literals(mask, "mask_mod", like.dtype)
    used = {o.name for e in (score, mask) if e is not None for o in e.operands}
    unused = sorted(set(values) - used)
    if unused:
        raise ValueError(f"mod_arrays {unused} are read by neither score_mod nor mask_mod")
    given = {**{f"mod_arrays[{n!r}]": a for n, a in values.items()},
             **{n: internal.get(f"cuflash_{k}") for n, k in (("bias", "bias"), ("alibi_slopes", "alibi"))}}
    on_gpu = {n: a for n, a in given.items() if _is_cupy(a)}
    if on_gpu:  # one device with q (array_module's check, which names them)
        array_module(like, *on_gpu.values(), names=("q", *on_gpu))
    for name, a in given.items():
        _check_fits_working(a, name, like.dtype)
    modifiers = mods.Modifiers(score, mask, {**values, **internal}, bias_shape, bias_compact)
    if score_mod is not None:
        modifiers.dscore  # noqa: B018 - a derivative too large to compute is refused before anything; kept for the rest
    return modifiers


def check_backward(problem: Problem, dout, out, lse, layout="bshd"):
    """Validate the backward's extra arrays against the forward problem; return them flattened. ``layout``: the
    caller's, for the shapes that errors show."""
    xp = array_module(dout, out, lse, names=("dout", "out", "lse"))
    dout, out, lse = native(dout), native(out), native(lse)
    if xp is not problem.xp:
        raise TypeError("dout, out, lse must live on the same array module as q, k, v")
    want = problem.batch_shape + problem.q.shape[1:]
    for name, a in (("dout", dout), ("out", out)):
        if tuple(a.shape) != want:
            raise ValueError(f"{name} must have q's shape {_shown(want, layout)}, got {_shown(a.shape, layout)}")
        if a.dtype != problem.dtype:
            raise TypeError(f"{name} must have q's dtype {problem.dtype}, got {a.dtype}")
    want_lse = problem.batch_shape + (problem.heads_q, problem.seqlen_q)
    if tuple(lse.shape) != want_lse:
        raise ValueError(f"lse must have shape (..., heads, seqlen_q) = {want_lse}, got {tuple(lse.shape)}")
    want_dtype = stats_dtype(problem.dtype)
    if lse.dtype != want_dtype:
        raise TypeError(f"lse must be {want_dtype} for {problem.element_type} inputs (what the forward returns), "
                        f"got {lse.dtype}")
    flat = lambda a, tail: a.reshape((problem.batch,) + tail)  # noqa: E731
    return (flat(dout, problem.q.shape[1:]), flat(out, problem.q.shape[1:]),
            flat(lse, (problem.heads_q, problem.seqlen_q)))
