"""cuflash for JAX: :func:`attention` usable under ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

``cuflash.jax.attention(q, k, v, causal=True)`` takes JAX arrays (or tracers) and returns a JAX array; its
gradient is a ``jax.custom_vjp`` whose backward is cuflash's backward (FA2 Algorithm 2, recomputation from the
saved log-sum-exp), so nothing of size N² is ever stored, in the forward or in the residuals JAX keeps.
Install with ``pip install 'cuflash[jax]'`` (JAX is an optional extra).

How the call reaches cuflash
----------------------------
``jax.experimental.buffer_callback`` (recent JAX; 0.10 here): XLA calls back into Python with its own device
buffers and, on a GPU, its compute stream. On the CPU the buffers are read as NumPy arrays without a copy
(``__array__``) and cuflash's ``numpy`` backend runs; on a GPU they become CuPy arrays without a copy
(``cupy.from_dlpack``, on XLA's stream through ``cupy.cuda.Stream.from_external``, under the buffers' device) and
the ``cuda`` backend runs on that stream, so the kernels are ordered with the surrounding XLA work and nothing
crosses to the host. Results are written into XLA's output buffers (``out=``).

Why not the alternatives (measured on the 2-core CPU of CI, JAX 0.10.2, ``jax.jit``, min of repeats):

- ``jax.pure_callback`` hands the callback host arrays and copies the returned arrays into XLA's buffers: a no-op
  callback costs 0.15 ms per call at (1, 128, 2, 64) and 2.3 ms at (2, 2048, 4, 64) (the copy of the results),
  against 0.012 and 0.024 ms for ``buffer_callback``; a jitted forward at (1, 128, 2, 64) takes 0.56 ms against
  0.37 ms (0.28 ms calling cuflash on NumPy directly), forward + backward 1.49 against 0.89 ms; and on a GPU it
  would copy every operand device -> host -> device. It stays as the fallback where ``buffer_callback`` is missing
  (older JAX; meant for the CPU; selected by :data:`CALLBACK`), tested on the CPU like the default.
- JAX's FFI (``jax.ffi.ffi_call``) needs a handler compiled ahead of time and registered with XLA, in C++;
  cuflash's kernels are compiled at run time by CuPy (NVRTC) with launch parameters computed in Python, so an FFI
  handler would need a C++ port of the launch logic and a build step. ``buffer_callback`` is itself an XLA FFI
  custom call (``xla_buffer_python_{cpu,gpu}_callback``) that reaches Python with the stream: the same data path.

What the options become
-----------------------
``q``, ``k``, ``v`` are differentiated; ``bias`` too (its gradient is cuflash's ``dbias``). ``seqlens_q`` and
``seqlens_k`` may be traced (integer arrays: no gradient). Everything else is static, fixed when the function is
traced: ``causal``, ``scale``, ``window``, ``block_mask``, ``softcap``, ``score_mod``, ``mask_mod``,
``dropout_p``, ``seed``, ``layout``; and ``alibi_slopes`` and ``mod_arrays`` must be concrete arrays (NumPy, or JAX
arrays outside ``jit``), since cuflash does not differentiate them (a traced one raises ``TypeError`` rather than
giving a silently zero gradient). Dropout needs an explicit ``seed``: a seed drawn inside ``jit`` would be one
constant for every call. Under ``jax.vmap`` the mapped axis becomes a leading batch dimension
(``vmap_method="broadcast_all"``: one call for every slice): a ``block_mask`` or a ``mod_arrays`` entry indexed by
the batch then has to cover the new batch size, and a modifier's ``b`` counts over it (the flattened index of mapped
and own batch dimensions, so ``b == 0`` holds in the first mapped slice only: a modifier that reads ``b`` is not per
slice under ``vmap``). With dropout or per-batch ``alibi_slopes`` (shape ``(*batch, heads)``), both keyed by the
batch index, the slices run one by one (``vmap_method="sequential"``), so that ``vmap(f)(x)[i] == f(x[i])`` holds.
The functions and callbacks of each configuration of static options are made once and reused (up to 64
configurations): a call outside ``jit`` compiles only the first time. Shapes, dtypes, options, ``backend`` and
the values of concrete ``seqlens_q``/``seqlens_k`` (NumPy, or JAX arrays outside ``jit``) are validated when the
function is traced (the ``TypeError``, ``ValueError`` or ``RuntimeError`` that :func:`cuflash.attention` raises,
naming the argument), not inside the callback; ``backend`` in full where the callback gets NumPy arrays (JAX on the
CPU only, or ``pure_callback``), and elsewhere (a GPU) its name and availability. Only the values of traced seqlens
and what depends on the batch extent that ``vmap`` adds (a ``b``-indexed operand's shape, the int32 bounds of an
expression reading ``b``) are checked in the callback, where JAX wraps cuflash's error in its ``JaxRuntimeError``.
"""
from __future__ import annotations

import contextlib
import numbers
from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as _exc:  # pragma: no cover - exercised only without JAX
    raise ImportError(f"cuflash.jax needs JAX: pip install 'cuflash[jax]' ({_exc})") from None

_buffer_callback: Optional[Callable[..., Any]]
try:
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # JAX older than 0.7
    _buffer_callback = None

from . import _layout, api, backends
from .blockmask import BlockMask
from .dropout import needs_seed
from .interop import refuse_deleted, refuse_lazy_negation
from .problem import check_flags, make_problem

__all__ = ["attention", "CALLBACK"]

#: How calls reach cuflash: ``"buffer"`` (``jax.experimental.buffer_callback``: XLA's buffers and stream, CPU and
#: GPU, no copies) or ``"pure"`` (``jax.pure_callback``: host arrays; CPU). Read when a function is traced.
CALLBACK = "buffer" if _buffer_callback is not None else "pure"


def attention(q: Any, k: Any, v: Any, *, causal: bool = False, scale: Optional[float] = None,
              window: Optional[tuple[Optional[int], Optional[int]]] = None, block_mask: Optional[BlockMask] = None,
              seqlens_q: Any = None, seqlens_k: Any = None, bias: Any = None, alibi_slopes: Any = None,
              softcap: Optional[float] = None, score_mod: Optional[str] = None, mask_mod: Optional[str] = None,
              mod_arrays: Optional[Mapping[str, Any]] = None, dropout_p: float = 0.0, seed: Optional[int] = None,
              layout: api.Layout = "bshd", deterministic: bool = False, backend: Optional[str] = None) -> Any:
    """Exact attention of JAX arrays, differentiable and usable under ``jit``, ``grad`` and ``vmap``.

    Parameters
    ----------
    q, k, v : jax.Array
        As for :func:`cuflash.attention`: ``(..., seqlen, heads, head_dim)`` (``layout="bshd"``) or
        ``(..., heads, seqlen, head_dim)`` (``"bhsd"``); grouped heads; ``v``'s head dim may differ. On the CPU
        float16, bfloat16, float32, float64, on the CPU and on a GPU (the CUDA kernels: float32 in the default
        ``precision="ieee"``, which this adapter does not take as an option; float64 on DMMA or DFMA).
    seqlens_q, seqlens_k : integer jax.Array of the batch shape, optional
        May be traced; not differentiated.
    bias : float jax.Array, optional
        May be traced; differentiated (cuflash's ``dbias``).
    alibi_slopes : array, optional
        A concrete array (not differentiated).
    mod_arrays : dict of str to concrete array or number, optional
        The arrays ``score_mod``/``mask_mod`` read (not differentiated).
    seed : int, optional
        Required with ``dropout_p > 0``.
    deterministic : bool, default False
        The backward's ``deterministic`` (:func:`cuflash.attention_backward`).
    backend : {None, "numpy", "cuda", "emulate"}
        As for :func:`cuflash.attention`; None picks ``numpy`` on the CPU and ``cuda`` on a GPU.
    causal, scale, window, block_mask, softcap, score_mod, mask_mod, dropout_p, layout :
        Static options, as for :func:`cuflash.attention` (causal is aligned bottom-right, where
        ``jax.nn.dot_product_attention(is_causal=True)`` aligns top-left: they agree when ``seqlen_q ==
        seqlen_k``).

    Returns
    -------
    out : jax.Array
        ``q``'s shape with ``v``'s head dim, ``q``'s dtype.

    Examples
    --------
    >>> loss = lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True).sum()
    >>> dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    """
    static = dict(causal=causal, scale=scale, window=window, block_mask=block_mask, softcap=softcap,
                  score_mod=score_mod, mask_mod=mask_mod, dropout_p=dropout_p, seed=seed, layout=layout)
    _refuse_traced(dict(static, deterministic=deterministic))
    check_flags(deterministic=deterministic)
    if needs_seed(dropout_p, seed):
        raise ValueError("cuflash.jax.attention needs an explicit seed with dropout_p > 0: a seed drawn here would "
                         "be one constant for every call of a jitted function (pass seed=int, e.g. from your PRNG)")
    host = {"alibi_slopes": _concrete("alibi_slopes", alibi_slopes),
            "mod_arrays": None if mod_arrays is None else _concrete_dict(mod_arrays)}
    q, k, v = (_jax_array(name, a) for name, a in (("q", q), ("k", k), ("v", v)))
    with jax.ensure_compile_time_eval():  # NumPy seqlens stay concrete under jit: _validate checks their values
        seqlens_q, seqlens_k = (None if a is None else _jax_array(name, a)
                                for name, a in (("seqlens_q", seqlens_q), ("seqlens_k", seqlens_k)))
    if bias is not None:
        bias = _jax_array("bias", bias)
        # Full rank (batch dims first): under vmap the mapped axis is then added in front of every operand alike.
        rank = q.ndim
        if bias.ndim < rank:
            bias = jnp.reshape(bias, (1,) * (rank - bias.ndim) + tuple(bias.shape))
    _validate(q, k, v, seqlens_q, seqlens_k, bias, static, host, backend)
    call = _Call.of(static, host, bool(deterministic), backend)
    return call.function(seqlens_q is not None, seqlens_k is not None, bias is not None)(
        q, k, v, seqlens_q, seqlens_k, bias)


def _key(value: Any) -> Any:
    """A hashable stand-in for a static option or a concrete host array (by value: a host array changed in place
    between calls is another configuration); a BlockMask by identity (it is a value: read-only, :class:`_Call` keeps
    it alive)."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, Mapping):
        return ("mapping",) + tuple(sorted((k, _key(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_key(v) for v in value)
    if isinstance(value, (numbers.Number, np.generic)):  # by type and exact value: 16777217 == 16777217.0 and
        # 0.0 == -0.0 in Python, but not in the expression (an int32; a float rounded to the working precision; 1 / c):
        # one reused the other's configuration, and a call computed with an earlier call's number
        return ("number", type(value).__module__, type(value).__qualname__, repr(value))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


# ------------------------------------------------------------------------------------------------ the custom_vjp
class _Call:
    """One configuration of static options: its custom_vjp functions and the callbacks they run, made once and
    kept (:meth:`of`): JAX caches compiled callbacks by the callable's identity, so new ones at every call outside
    ``jit`` compiled again each time and kept every copy (20 ms and 1.4 MB a call)."""

    _made: "OrderedDict[Any, _Call]" = OrderedDict()
    _limit = 64  # configurations kept (least recently used dropped first)

    def __init__(self, static: dict[str, Any], host: dict[str, Any], deterministic: bool,
                 backend: Optional[str]) -> None:
        self.static, self.host, self.deterministic, self.backend = static, host, deterministic, backend
        self._functions: dict[Any, Callable[..., Any]] = {}
        self._callbacks: dict[Any, Callable[..., Any]] = {}
        # Under vmap the mapped axis joins the batch (one callback for every slice) unless something is keyed by
        # the batch index that a slice alone would number otherwise: the dropout mask, per-batch ALiBi slopes.
        slopes = host["alibi_slopes"]
        per_slice = bool(static["dropout_p"]) or (slopes is not None and np.ndim(slopes) > 1)
        self.vmap_method = "sequential" if per_slice else "broadcast_all"

    @classmethod
    def of(cls, static: dict[str, Any], host: dict[str, Any], deterministic: bool,
           backend: Optional[str]) -> "_Call":
        key = (_key(static), _key(host), deterministic, backend)
        call = cls._made.pop(key, None) or cls(static, host, deterministic, backend)
        cls._made[key] = call
        while len(cls._made) > cls._limit:
            cls._made.popitem(last=False)
        return call

    def function(self, has_sq: bool, has_sk: bool, has_bias: bool) -> Callable[..., Any]:
        key = (has_sq, has_sk, has_bias)
        if key not in self._functions:
            self._functions[key] = self._make_function()
        return self._functions[key]

    def _make_function(self) -> Callable[..., Any]:
        @jax.custom_vjp
        def f(q: Any, k: Any, v: Any, sq: Any, sk: Any, bias: Any) -> Any:
            return self.forward(q, k, v, sq, sk, bias)[0]

        # The forward and backward of a gradient are host callbacks, which JAX cannot differentiate: grad of grad
        # (jax.hessian) stopped in JAX's own "callbacks do not support JVP. Please use jax.custom_jvp", advice a user
        # of cuflash cannot act on. Each is a custom_jvp whose rule says so instead (first order never calls it).
        @jax.custom_jvp
        def forward(args: tuple[Any, ...]) -> tuple[Any, ...]:
            q, k, v, sq, sk, bias = args
            return tuple(self.forward(q, k, v, sq, sk, bias))

        @jax.custom_jvp
        def backward(res: tuple[Any, ...], dout: Any) -> tuple[Any, ...]:
            q, k, v, sq, sk, bias, out, lse = res
            return tuple(self.backward(q, k, v, sq, sk, bias, out, lse, dout))

        def second_order(primals: Any, tangents: Any) -> Any:
            raise NotImplementedError("cuflash.jax gives first derivatives only: a gradient runs cuflash's forward "
                                      "and attention_backward on the host, which JAX cannot differentiate again "
                                      "(grad of grad, jax.hessian, forward mode over a gradient)")

        forward.defjvp(second_order)
        backward.defjvp(second_order)

        def f_fwd(q: Any, k: Any, v: Any, sq: Any, sk: Any, bias: Any) -> tuple[Any, tuple[Any, ...]]:
            out, lse = forward((q, k, v, sq, sk, bias))
            return out, (q, k, v, sq, sk, bias, out, lse)

        def f_bwd(res: tuple[Any, ...], dout: Any) -> tuple[Any, ...]:
            bias = res[5]
            grads = backward(res, dout)
            return grads[0], grads[1], grads[2], None, None, (grads[3] if bias is not None else None)

        f.defvjp(f_fwd, f_bwd)
        return f

    # -------------------------------------------------------------------------------------- forward
    def forward(self, q: Any, k: Any, v: Any, sq: Any, sk: Any, bias: Any) -> Sequence[Any]:
        lse_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
        heads, seqlen = (q.shape[-2], q.shape[-3]) if self.static["layout"] == "bshd" else q.shape[-3:-1]
        shapes = (jax.ShapeDtypeStruct(tuple(q.shape[:-1]) + (v.shape[-1],), q.dtype),
                  jax.ShapeDtypeStruct(tuple(q.shape[:-3]) + (heads, seqlen), lse_dtype))
        named = ("seqlens_q", "seqlens_k", "bias")
        present = [name for name, a in zip(named, (sq, sk, bias)) if a is not None]

        def compute(q: Any, k: Any, v: Any, *extra: Any, outs: Optional[Sequence[Any]]) -> Any:
            options = dict(zip(present, extra))
            _fit_bias(options, q.shape[:-3])
            result = api.attention(q, k, v, return_lse=True, out=None if outs is None else outs[0],
                                   backend=self.backend, **self.static, **options, **self._host_for(q))
            if outs is None:
                return result
            outs[1][...] = result[1]
            return None

        return self._run(("fwd", tuple(present)), compute, shapes,
                         (q, k, v) + tuple(a for a in (sq, sk, bias) if a is not None))

    # -------------------------------------------------------------------------------------- backward
    def backward(self, q: Any, k: Any, v: Any, sq: Any, sk: Any, bias: Any, out: Any, lse: Any,
                 dout: Any) -> Sequence[Any]:
        shapes: tuple[Any, ...] = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v))
        if bias is not None:
            shapes += (jax.ShapeDtypeStruct(bias.shape, bias.dtype),)
        named = ("seqlens_q", "seqlens_k", "bias")
        present = [name for name, a in zip(named, (sq, sk, bias)) if a is not None]

        def compute(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, *extra: Any,
                    outs: Optional[Sequence[Any]]) -> Any:
            options = dict(zip(present, extra))
            reduce_axes = _fit_bias(options, q.shape[:-3])
            buffers = {} if outs is None else dict(dq=outs[0], dk=outs[1], dv=outs[2])
            grads = api.attention_backward(dout, q, k, v, out, lse, deterministic=self.deterministic,
                                           return_dbias="bias" in options, backend=self.backend, **buffers,
                                           **self.static, **options, **self._host_for(q))
            if "bias" in options:
                dbias = grads[3]
                if reduce_axes:
                    dbias = dbias.sum(axis=reduce_axes, keepdims=True)
                grads = grads[:3] + (dbias,)
            if outs is None:
                return grads
            if "bias" in options:
                outs[3][...] = grads[3]
            return None

        got = self._run(("bwd", tuple(present)), compute, shapes,
                        (q, k, v, out, lse, dout) + tuple(a for a in (sq, sk, bias) if a is not None))
        return tuple(got) + ((None,) if bias is None else ())

    def _host_for(self, q: Any) -> dict[str, Any]:
        """The concrete host arrays on q's side (CuPy copies on a GPU: they are small)."""
        if isinstance(q, np.ndarray):
            return self.host
        import cupy

        slopes = self.host["alibi_slopes"]
        arrays = self.host["mod_arrays"]
        return {"alibi_slopes": None if slopes is None else cupy.asarray(slopes),
                "mod_arrays": None if arrays is None else {
                    name: cupy.asarray(a) if isinstance(a, np.ndarray) else a for name, a in arrays.items()}}

    def _run(self, which: tuple[Any, ...], compute: Callable[..., Any], shapes: Sequence[Any],
             args: Sequence[Any]) -> Sequence[Any]:
        """Run ``compute(*arrays, outs=...)`` from XLA: with ``buffer_callback``, on XLA's buffers (``outs``: the
        output buffers, written in place); with ``pure_callback``, on host arrays (``outs=None``: it returns
        them). The callable handed to JAX is made once per (``which``, shapes) and reused: ``compute`` of a later
        trace does the same (it depends on ``which`` and this configuration only)."""
        key = (which, tuple((tuple(sh.shape), np.dtype(sh.dtype).str) for sh in shapes), CALLBACK)
        if CALLBACK == "buffer" and _buffer_callback is not None:
            if key not in self._callbacks:
                def callback(ctx: Any, outs: Sequence[Any], *ins: Any) -> None:
                    with _device_arrays(ctx, list(ins) + list(outs)) as arrays:
                        compute(*arrays[:len(ins)], outs=arrays[len(ins):])

                self._callbacks[key] = _buffer_callback(callback, tuple(shapes), vmap_method=self.vmap_method)
            return list(self._callbacks[key](*args))
        if key not in self._callbacks:
            def host(*ins: Any) -> Any:
                return tuple(compute(*(np.asarray(a) for a in ins), outs=None))

            self._callbacks[key] = host
        return list(jax.pure_callback(self._callbacks[key], tuple(shapes), *args, vmap_method=self.vmap_method))


# ------------------------------------------------------------------------------------------------ callbacks


class _StreamRef:
    """XLA's stream pointer as a CUDA-stream-protocol object (``__cuda_stream__``) for CuPy."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.ptr


@contextlib.contextmanager
def _device_arrays(ctx: Any, buffers: Sequence[Any]) -> Iterator[list[Any]]:
    """XLA's buffers as NumPy arrays (CPU) or as CuPy arrays on XLA's device and stream (GPU), without copies."""
    kind, device = buffers[0].__dlpack_device__()
    if int(kind) in (1, 3):  # kDLCPU, kDLCUDAHost
        yield [np.asarray(b) for b in buffers]
        return
    import cupy

    ptr = int(ctx.stream)
    if hasattr(cupy.cuda.Stream, "from_external"):
        stream = cupy.cuda.Stream.from_external(_StreamRef(ptr))
    else:  # CuPy < 14
        stream = cupy.cuda.ExternalStream(ptr, int(device))
    with cupy.cuda.Device(int(device)), stream:
        yield [cupy.from_dlpack(b) for b in buffers]


# ------------------------------------------------------------------------------------------------ helpers
def _jax_array(name: str, a: Any) -> Any:
    if isinstance(a, jax.Array):
        refuse_deleted(name, a)  # JAX's own RuntimeError, later, named no argument
        return a
    _refuse_masked(name, a)
    if isinstance(a, (np.ndarray, np.generic)) or (hasattr(a, "__dlpack__") and hasattr(a, "__dlpack_device__")):
        refuse_lazy_negation(name, a)
        if isinstance(a, (np.ndarray, np.generic)) and not a.dtype.isnative:  # JAX's own error named a NumPy array
            raise TypeError(f"{name} is a NumPy array of non-native byte order ({a.dtype.str}), which JAX does not "
                            f"take: pass {name}.astype({name}.dtype.newbyteorder('='))")
        try:
            out = jnp.asarray(a)
        except (TypeError, ValueError, RuntimeError) as exc:  # e.g. torch: requires grad, bfloat16 via NumPy
            raise TypeError(f"{name} cannot become a jax.Array ({type(exc).__name__}: {exc}); pass a jax.Array or "
                            f"a plain NumPy array (torch: tensor.detach(), a dtype NumPy has)") from None
        have = getattr(a, "dtype", None)
        want = have.name if isinstance(have, np.dtype) else str(have).rsplit(".", 1)[-1]  # torch.float64 -> float64
        # JAX without x64 makes int64 int32 (2**32 + 3 -> 3) and float64 float32: an integer array whose values
        # survive passes, any other change of dtype is refused
        if np.dtype(out.dtype).name != want and not (np.dtype(out.dtype).kind in "iu" and np.array_equal(
                np.asarray(out), _host(a))):
            raise _cast_error(name, want, out.dtype)
        return out
    raise TypeError(f"{name} must be a jax.Array (or an array JAX converts), got {type(a).__name__}")


def _refuse_masked(name: str, a: Any) -> None:
    if isinstance(a, np.ma.MaskedArray):
        raise TypeError(f"{name} is a numpy.ma.MaskedArray: cuflash would ignore its mask; pass a plain array")


def _host(a: Any) -> np.ndarray:
    """The values of an array JAX was given, on the host (CuPy's through ``.get()``): only to compare a cast."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def _cast_error(name: str, have: Any, got: Any) -> TypeError:
    return TypeError(f"{name} has dtype {have}, which JAX would turn into {got} (64-bit types need "
                     f"jax.config.update('jax_enable_x64', True)); pass {got} yourself, or enable x64")


def _refuse_traced(static: Mapping[str, Any]) -> None:
    """The options fixed when a function is traced, refused as traced values by name and what to do: the checks of
    :func:`cuflash.attention` said only "causal must be a bool, got DynamicJaxprTracer"."""
    for name, value in static.items():
        if any(isinstance(x, jax.core.Tracer) for x in (value if isinstance(value, (tuple, list)) else (value,))):
            raise TypeError(f"{name} must be static, a Python value fixed when the function is traced, got a traced "
                            f"value: pass it through jax.jit's static_argnames, functools.partial or a closure")


def _concrete(name: str, a: Any) -> Any:
    """A concrete host array (or None / a number) of an option cuflash does not differentiate: a read-only copy, as
    calls are kept by these values (:meth:`_Call.of`): a reference to the caller's array gave a later call with equal
    values the array as the caller had changed it since."""
    if a is None or isinstance(a, numbers.Number):
        return a
    if isinstance(a, jax.core.Tracer):
        raise TypeError(f"{name} must be a concrete array (NumPy, or a JAX array outside jit): cuflash does not "
                        f"differentiate it, and under jit/grad/vmap a traced {name} would get a silently zero "
                        f"gradient; close over a NumPy array instead")
    _refuse_masked(name, a)
    if not isinstance(a, (np.ndarray, np.generic, jax.Array)):
        raise TypeError(f"{name} must be an array (NumPy or JAX) or a number, got {type(a).__name__}")
    host = np.array(a, copy=True)
    host.flags.writeable = False
    return host


def _concrete_dict(arrays: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(arrays, Mapping):
        raise TypeError(f"mod_arrays must be a dict of name -> array or number, got {type(arrays).__name__}")
    return {name: _concrete(f"mod_arrays[{name!r}]", a) for name, a in arrays.items()}


def _fit_bias(options: dict[str, Any], batch: tuple[int, ...]) -> tuple[int, ...]:
    """A bias whose batch dimensions are neither all 1 nor the batch shape (what vmap of an unbatched bias gives:
    the mapped axis only) is broadcast to the batch shape here; returns the axes its gradient must be summed over."""
    bias = options.get("bias")
    n_batch = len(batch)
    if bias is None or n_batch == 0:
        return ()
    batch = tuple(batch)
    have = tuple(bias.shape[:n_batch])
    if have in ((1,) * n_batch, batch):
        return ()
    xp = np if isinstance(bias, np.ndarray) else __import__("cupy")
    options["bias"] = xp.broadcast_to(bias, batch + tuple(bias.shape[n_batch:]))
    return tuple(i for i in range(n_batch) if have[i] == 1 and batch[i] != 1)


def _validate(q: Any, k: Any, v: Any, sq: Any, sk: Any, bias: Any, static: dict[str, Any],
              host: dict[str, Any], backend: Any) -> None:
    """The checks of :func:`cuflash.attention`, at trace time (:func:`~cuflash.problem.make_problem`, then
    :func:`cuflash.backends.select`), on stand-ins of the shapes and dtypes (zero-stride views: no memory) and on
    the values of concrete ``seqlens_q``/``seqlens_k`` (small: the batch shape); traced ones are checked in the
    callback."""
    def stand_in(a: Any) -> Any:
        return None if a is None else np.broadcast_to(np.zeros((), np.dtype(a.dtype)), tuple(a.shape))

    def values(a: Any) -> Any:
        return stand_in(a) if a is None or isinstance(a, jax.core.Tracer) else np.asarray(a)

    layout = _layout.check_layout(static["layout"])
    qd, kd, vd = (_layout.to_bshd(stand_in(a), layout) for a in (q, k, v))
    width = _layout.padded_width(qd, kd, vd)
    if width is not None:  # as _layout.pad_head_dims at run time (the backend sees the padded head dim, its
        # MAX_HEAD_DIM), on stand-ins: no memory
        qd, kd, vd = (np.broadcast_to(np.zeros((), a.dtype), a.shape[:-1] + (width,)) for a in (qd, kd, vd))
    options = {name: value for name, value in static.items() if name != "layout"}
    problem = make_problem(qd, kd, vd, seqlens_q=values(sq), seqlens_k=values(sk), bias=stand_in(bias), **options,
                           **host)
    if _host_arrays():
        backends.select(problem, backend)
    elif backend is not None:  # a GPU: the callback gets CuPy arrays, which the stand-ins are not
        if not isinstance(backend, str):
            backends.select(problem, backend)  # its TypeError for a backend that is not a string (before the arrays)
        backends.get(backend)  # the name, and whether it is available here


def _host_arrays() -> bool:
    """Whether the callback will get NumPy arrays: always with ``pure_callback``; with ``buffer_callback`` when JAX
    has no platform but the CPU (a traced q does not say which device it will run on)."""
    if CALLBACK != "buffer" or _buffer_callback is None:
        return True
    from jax.extend import backend as jax_backend

    return set(jax_backend.backends()) <= {"cpu"}
