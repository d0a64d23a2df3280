"""Public functions: :func:`attention`, :func:`attention_backward`, :func:`attention_vjp`, the packed forms
:func:`attention_qkvpacked` and :func:`attention_kvpacked`, and :class:`AttentionResidual`.

Every function takes NumPy and CuPy arrays and any DLPack / CUDA Array Interface array, converted at the edge by
:mod:`cuflash.interop` and given back in the caller's array type. The rooms around this one: the options' names,
defaults and shared documentation are :mod:`cuflash.options`; the residual and its fingerprint
:mod:`cuflash.residual`; what the backends do not compute natively (``layout`` transposes, packed inputs, a value
head dim of its own) ``cuflash._layout``; validation :mod:`cuflash.problem`. ``out=`` buffers are copied into here.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from types import MappingProxyType
from typing import Any, Literal, Mapping, Optional, Sequence, Union, overload

import numpy as np

from . import _layout, backends
from .blockmask import BlockMask
from .dropout import fresh_seed, needs_seed
from .interop import Edge
from .options import (DEFAULTS, LAYOUTS, OPTIONS, Array, Layout, Precision, check_keywords, fill_doc, native_options,
                      snapshot)
from .problem import check_backward, check_buffer, check_dropout, check_flags, make_problem
from .residual import AttentionResidual, fingerprint, fingerprints, watched

__all__ = ["attention", "attention_backward", "attention_vjp", "attention_qkvpacked", "attention_kvpacked",
           "AttentionResidual", "Vjp", "fingerprint", "Array", "Layout", "Precision", "LAYOUTS", "OPTIONS", "DEFAULTS"]

#: An array of any supported library: NumPy, CuPy, or anything with ``__dlpack__`` / ``__cuda_array_interface__``.


class Vjp:
    """The ``vjp`` of :func:`attention_vjp`: ``vjp(dout) -> (dq, dk, dv)``; ``vjp.seed``, ``vjp.residual``."""

    def __init__(self, residual: AttentionResidual, deterministic: bool) -> None:
        self.residual = residual
        self.deterministic = deterministic

    @property
    def seed(self) -> Optional[int]:
        """The dropout seed (drawn by the forward when none was given)."""
        return self.residual.seed

    def __call__(self, dout: Array) -> Any:
        return attention_backward(dout, self.residual, deterministic=self.deterministic)


# ==================================================================================================== forward
@overload
def attention(q: Array, k: Array, v: Array, *, causal: bool = ..., scale: Optional[float] = ...,
              window: Optional[tuple[Optional[int], Optional[int]]] = ..., block_mask: Optional[BlockMask] = ...,
              seqlens_q: Optional[Array] = ..., seqlens_k: Optional[Array] = ..., bias: Optional[Array] = ...,
              alibi_slopes: Optional[Array] = ..., softcap: Optional[float] = ..., score_mod: Optional[str] = ...,
              mask_mod: Optional[str] = ..., mod_arrays: Optional[Mapping[str, Any]] = ..., dropout_p: float = ...,
              seed: Optional[int] = ..., return_lse: Literal[False] = ..., return_residual: Literal[True],
              out: Optional[Array] = ..., layout: Layout = ..., dtype: Optional[str] = ...,
              precision: Precision = ..., backend: Optional[str] = ...) -> tuple[Array, AttentionResidual]: ...


@overload
def attention(q: Array, k: Array, v: Array, *, causal: bool = ..., scale: Optional[float] = ...,
              window: Optional[tuple[Optional[int], Optional[int]]] = ..., block_mask: Optional[BlockMask] = ...,
              seqlens_q: Optional[Array] = ..., seqlens_k: Optional[Array] = ..., bias: Optional[Array] = ...,
              alibi_slopes: Optional[Array] = ..., softcap: Optional[float] = ..., score_mod: Optional[str] = ...,
              mask_mod: Optional[str] = ..., mod_arrays: Optional[Mapping[str, Any]] = ..., dropout_p: float = ...,
              seed: Optional[int] = ..., return_lse: bool = ..., return_residual: Literal[False] = ...,
              out: Optional[Array] = ..., layout: Layout = ..., dtype: Optional[str] = ...,
              precision: Precision = ..., backend: Optional[str] = ...) -> Any: ...


def attention(q: Array, k: Array, v: Array, *, causal: bool = False, scale: Optional[float] = None,
              window: Optional[tuple[Optional[int], Optional[int]]] = None, block_mask: Optional[BlockMask] = None,
              seqlens_q: Optional[Array] = None, seqlens_k: Optional[Array] = None, bias: Optional[Array] = None,
              alibi_slopes: Optional[Array] = None, softcap: Optional[float] = None, score_mod: Optional[str] = None,
              mask_mod: Optional[str] = None, mod_arrays: Optional[Mapping[str, Any]] = None, dropout_p: float = 0.0,
              seed: Optional[int] = None, return_lse: bool = False, return_residual: bool = False,
              out: Optional[Array] = None, layout: Layout = "bshd", dtype: Optional[str] = None,
              precision: Precision = "ieee", backend: Optional[str] = None) -> Any:
    """Exact softmax attention, computed block by block without materializing the score matrix.

    Parameters
    ----------
    q : array, shape ``(..., seqlen_q, heads, head_dim)``
        float16, bfloat16, float32 or float64 (NumPy and CuPy).
        {arrays}
    k : array, shape ``(..., seqlen_k, heads_kv, head_dim)``
        Same dtype and batch dimensions as ``q``; ``heads % heads_kv == 0`` (query head ``h``
        reads kv head ``h // (heads // heads_kv)``).
    v : array, shape ``(..., seqlen_k, heads_kv, head_dim_v)``
        As ``k``; its head dim may differ from q's and k's (``out`` then has ``head_dim_v``). The backends
        compute one head dim, so the smaller of the two is zero-padded to the larger here (the scores and
        outputs are unchanged; the default scale stays ``1/sqrt(head_dim)`` of q and k): this costs a padded
        copy of ``v`` (``head_dim_v < head_dim``) or of ``q`` and ``k`` (``head_dim_v > head_dim``), and the
        arithmetic of the larger head dim. A native path is later work.
    return_lse : bool, default False
        Also return the log-sum-exp of the scaled scores (natural log).
    return_residual : bool, default False
        Return ``(out, residual)``: an :class:`AttentionResidual` for ``attention_backward(dout, residual)``,
        which carries the lse, every option and the drawn seed (so ``return_lse`` is not taken with it).
    out : array, optional
        A buffer for the result: ``q``'s shape with ``head_dim_v`` last, ``q``'s dtype, library and device,
        writable, overlapping none of the inputs. The result is written into it and the buffer itself is
        returned. The backends allocate their own result for now, so this is one extra copy (no allocation
        is saved yet, but the caller's memory is reused across a training loop).
    {options}

    Returns
    -------
    out : array, shape ``q.shape[:-1] + (head_dim_v,)``, q's dtype, the caller's array type
    lse : array, shape ``(..., heads, seqlen_q)``, float32 (float64 for float64 input)
        Only when ``return_lse``.
    seed : int
        Only when ``dropout_p > 0`` and ``seed`` was None (and no residual is returned): the drawn seed,
        last in the tuple (``(out, seed)`` or ``(out, lse, seed)``).
    residual : AttentionResidual
        Only when ``return_residual``: the result is ``(out, residual)``.
    """
    options = {name: value for name, value in locals().items() if name in OPTIONS}
    edge = Edge()
    natives = tuple(edge.data(name, a) for name, a in (("q", q), ("k", k), ("v", v)))
    return _forward(edge, natives, options, return_lse=return_lse, return_residual=return_residual, out=out,
                    backend=backend, packed=None, caller=(q, k, v))


def attention_qkvpacked(qkv: Array, *, causal: bool = False, scale: Optional[float] = None,
                        window: Optional[tuple[Optional[int], Optional[int]]] = None,
                        block_mask: Optional[BlockMask] = None, seqlens_q: Optional[Array] = None,
                        seqlens_k: Optional[Array] = None, bias: Optional[Array] = None,
                        alibi_slopes: Optional[Array] = None, softcap: Optional[float] = None,
                        score_mod: Optional[str] = None, mask_mod: Optional[str] = None,
                        mod_arrays: Optional[Mapping[str, Any]] = None, dropout_p: float = 0.0,
                        seed: Optional[int] = None, return_lse: bool = False, return_residual: bool = False,
                        out: Optional[Array] = None, layout: Layout = "bshd", dtype: Optional[str] = None,
                        precision: Precision = "ieee", backend: Optional[str] = None) -> Any:
    """:func:`attention` of packed self-attention inputs (FlashAttention-2's ``flash_attn_qkvpacked_func``).

    Parameters
    ----------
    qkv : array, shape ``(..., seqlen, 3, heads, head_dim)`` (``layout="bshd"``) or ``(..., 3, heads, seqlen,
        head_dim)`` (``"bhsd"``)
        ``q``, ``k``, ``v`` stacked, e.g. the output of one fused projection; read through views (no copy).
        {arrays}
    return_lse, return_residual, out :
        As for :func:`attention`. The backward of a packed residual, ``attention_backward(dout, residual)``,
        returns one ``dqkv`` of ``qkv``'s shape (its three gradients are copied into it).
    {options}

    Returns
    -------
    As :func:`attention`.
    """
    options = {name: value for name, value in locals().items() if name in OPTIONS}
    edge = Edge()
    packed = edge.data("qkv", qkv)
    natives = _layout.unpack(packed, "qkv", 3, layout)
    return _forward(edge, natives, options, return_lse=return_lse, return_residual=return_residual, out=out,
                    backend=backend, packed="qkv", caller=(qkv,))


def attention_kvpacked(q: Array, kv: Array, *, causal: bool = False, scale: Optional[float] = None,
                       window: Optional[tuple[Optional[int], Optional[int]]] = None,
                       block_mask: Optional[BlockMask] = None, seqlens_q: Optional[Array] = None,
                       seqlens_k: Optional[Array] = None, bias: Optional[Array] = None,
                       alibi_slopes: Optional[Array] = None, softcap: Optional[float] = None,
                       score_mod: Optional[str] = None, mask_mod: Optional[str] = None,
                       mod_arrays: Optional[Mapping[str, Any]] = None, dropout_p: float = 0.0,
                       seed: Optional[int] = None, return_lse: bool = False, return_residual: bool = False,
                       out: Optional[Array] = None, layout: Layout = "bshd", dtype: Optional[str] = None,
                       precision: Precision = "ieee", backend: Optional[str] = None) -> Any:
    """:func:`attention` with keys and values packed (FlashAttention-2's ``flash_attn_kvpacked_func``).

    Parameters
    ----------
    q : array, shape ``(..., seqlen_q, heads, head_dim)`` (``"bhsd"``: ``(..., heads, seqlen_q, head_dim)``)
        {arrays}
    kv : array, shape ``(..., seqlen_k, 2, heads_kv, head_dim)`` (``"bhsd"``: ``(..., 2, heads_kv, seqlen_k,
        head_dim)``)
        ``k`` and ``v`` stacked; read through views (no copy).
    return_lse, return_residual, out :
        As for :func:`attention`. The backward of a packed residual returns ``(dq, dkv)``.
    {options}

    Returns
    -------
    As :func:`attention`.
    """
    options = {name: value for name, value in locals().items() if name in OPTIONS}
    edge = Edge()
    q_n = edge.data("q", q)
    k_n, v_n = _layout.unpack(edge.data("kv", kv), "kv", 2, layout)
    return _forward(edge, (q_n, k_n, v_n), options, return_lse=return_lse, return_residual=return_residual, out=out,
                    backend=backend, packed="kv", caller=(q, kv))


def _one_call(a: Any) -> Any:
    """For NumPy arrays, the NumPy backend's reading of CUFLASH_BLAS and CUFLASH_NUM_THREADS for the whole public call
    (:func:`cuflash.backends._blas.one_call`): a forward and its residual's fingerprints, or a residual's check and its
    backward, read them once (a value changed meanwhile by another thread failed the call after its forward)."""
    if isinstance(a, np.ndarray):
        from .backends._blas import one_call

        return one_call()
    return contextlib.nullcontext()


def _forward(edge: Edge, natives: Sequence[Any], options: dict[str, Any], *, return_lse: bool,
             return_residual: bool, out: Optional[Array], backend: Optional[str], packed: Optional[str],
             caller: tuple[Any, ...]) -> Any:
    """The forward of every public form, on NumPy/CuPy arrays in the caller's layout."""
    with _one_call(natives[0]):
        return _forward_call(edge, natives, options, return_lse=return_lse, return_residual=return_residual, out=out,
                             backend=backend, packed=packed, caller=caller)


def _forward_call(edge: Edge, natives: Sequence[Any], options: dict[str, Any], *, return_lse: bool,
                  return_residual: bool, out: Optional[Array], backend: Optional[str], packed: Optional[str],
                  caller: tuple[Any, ...]) -> Any:
    check_flags(return_lse=return_lse, return_residual=return_residual)
    if return_lse and return_residual:
        raise TypeError("return_lse and return_residual are exclusive: the residual carries the lse "
                        "(residual.lse)")
    q, k, v = natives
    layout = _layout.check_layout(options["layout"])
    drawn = needs_seed(options["dropout_p"], options["seed"])
    if drawn:
        options["seed"] = fresh_seed()
    natives_opts = native_options(edge, options)
    out_buf = edge.buffer("out", out)
    with edge.device():
        qb, kb, vb = (_layout.to_bshd(a, layout) for a in (q, k, v))
        qp, kp, vp, kw, dv = _layout.pad_head_dims(qb, kb, vb, natives_opts)
        problem = make_problem(qp, kp, vp, layout=layout, **kw)
        want = tuple(q.shape[:-1]) + (v.shape[-1],)
        if out_buf is not None:
            inputs = dict(watched(_named((q, k, v), packed), natives_opts))  # the option arrays too (a bias, offsets)
            check_buffer("out", out_buf, want, problem.dtype, problem.xp, inputs)
        module = backends.select(problem, backend)
        edge.begin()
        result, lse = module.forward(problem)
        o = problem.unflatten(result, problem.q.shape[1:])
        if dv is not None:
            o = o[..., :dv]
        o = _layout.from_bshd(o, layout)
        lse = problem.unflatten(lse, (problem.heads_q, problem.seqlen_q))
        if out_buf is not None:
            out_buf[...] = o
            o = out_buf
        out_caller = out if out is not None else edge.export(o)
        lse_caller = edge.export(lse)
    if return_residual:
        saved = (q, k, v, o, lse)
        # by the caller's names: a change to a packed input said "v was modified", of an array never passed
        seen = watched(dict(_named((q, k, v), packed), out=o, lse=lse), natives_opts)
        residual = AttentionResidual(out_caller, lse_caller, MappingProxyType(snapshot(options)), packed, backend,
                                     saved, MappingProxyType(snapshot(natives_opts)),
                                     fingerprints(a for _, a in seen), edge, seen)
        return out_caller, residual
    results: tuple[Any, ...] = (out_caller,)
    if return_lse:
        results += (lse_caller,)
    if drawn:
        results += (options["seed"],)
    return results if len(results) > 1 else results[0]


# ==================================================================================================== backward
#: the keywords the caller of attention_backward wrote (a default value passed explicitly included): the residual
#: form refuses every forward option given, and an option equal to its default cannot be told apart otherwise
_KEYWORDS: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("cuflash_keywords", default=frozenset())


def _records_keywords(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        token = _KEYWORDS.set(frozenset(kwargs))
        try:
            return fn(*args, **kwargs)
        finally:
            _KEYWORDS.reset(token)

    return wrapper


@_records_keywords
def attention_backward(dout: Array, q: Union[Array, AttentionResidual], k: Optional[Array] = None,
                       v: Optional[Array] = None, out: Optional[Array] = None, lse: Optional[Array] = None, *,
                       causal: bool = False, scale: Optional[float] = None,
                       window: Optional[tuple[Optional[int], Optional[int]]] = None,
                       block_mask: Optional[BlockMask] = None, seqlens_q: Optional[Array] = None,
                       seqlens_k: Optional[Array] = None, bias: Optional[Array] = None,
                       alibi_slopes: Optional[Array] = None, softcap: Optional[float] = None,
                       score_mod: Optional[str] = None, mask_mod: Optional[str] = None,
                       mod_arrays: Optional[Mapping[str, Any]] = None, dropout_p: float = 0.0,
                       seed: Optional[int] = None, dtype: Optional[str] = None, layout: Layout = "bshd",
                       precision: Precision = "ieee", deterministic: bool = False, return_dbias: bool = False,
                       dq: Optional[Array] = None, dk: Optional[Array] = None, dv: Optional[Array] = None,
                       dqkv: Optional[Array] = None, dkv: Optional[Array] = None,
                       backend: Optional[str] = None) -> Any:
    """Gradients of :func:`attention` by recomputation from the saved ``lse`` (FA2 Algorithm 2).

    Two forms:

    - ``attention_backward(dout, residual)`` with the :class:`AttentionResidual` of
      ``attention(..., return_residual=True)``: the forward's arrays and options come from the residual, so they
      cannot mismatch, and an in-place change of ``q``, ``k``, ``v`` or ``out`` since the forward raises
      ``ValueError``. Passing any forward option as well is a ``TypeError``. This is the form to use.
    - ``attention_backward(dout, q, k, v, out, lse, **options)``, kept for compatibility: **the options must be
      exactly the forward's** (``causal``, ``window``, ``scale``, masks, modifiers, dropout ``seed``, ``layout``,
      ...). Nothing can check that here: the lse does not record them, and gradients for other options are
      silently wrong (e.g. ``causal=True`` passed only to the backward).

    Parameters
    ----------
    dout : array, ``out``'s shape and dtype
        Gradient of the loss with respect to ``out``. {arrays}
    q : array or AttentionResidual
        The forward's ``q`` (keyword form), or its residual (then ``k``, ``v``, ``out``, ``lse`` are not given).
    k, v : arrays as for :func:`attention`
    out, lse : the forward's results (``attention(..., return_lse=True)``) for the same options.
    deterministic : bool, default False
        On the ``cuda`` backend, dQ is accumulated with fp32 atomics by default, so its last bits
        may differ from run to run (dK and dV never do). ``True`` computes dQ in a second pass
        over query blocks without atomics: bitwise reproducible, at the cost of recomputing S, P
        and dP once more; ``dbias`` of a bias that broadcasts (summed by atomics by default) is
        then accumulated in the whole ``(B, H, Sq, Sk)`` shape (float32; float64 for float64),
        naive attention's memory, and summed in a fixed order. The ``numpy`` backend is always
        bitwise reproducible.
    return_dbias : bool, default False
        Also return the gradient of ``bias`` (in ``bias``'s own shape and dtype).
    dq, dk, dv : arrays, optional
        Buffers for the gradients (FlashAttention-2's names): the shapes and dtype of ``q``, ``k``, ``v``, the
        same library and device, writable, overlapping no input and no other buffer. The gradients are written
        into them and the buffers themselves are returned; the backends still allocate their own, so this is
        one extra copy each.
    dqkv, dkv : arrays, optional
        The buffers for a residual of :func:`attention_qkvpacked` (``dqkv``, ``qkv``'s shape) or of
        :func:`attention_kvpacked` (``dq`` and ``dkv``, ``kv``'s shape).
    {options}

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtype of q, k, v
        ``dk``/``dv`` of a kv head sum the contributions of its query heads. For a packed residual: ``dqkv``
        (qkv-packed) or ``(dq, dkv)`` (kv-packed) instead.
    dbias : array, bias's shape and dtype
        Only with ``return_dbias``: summed over the dimensions ``bias`` broadcasts; last in the tuple.
    """
    given = {name: value for name, value in locals().items() if name in OPTIONS}
    check_flags(deterministic=deterministic, return_dbias=return_dbias)
    buffers = {"dq": dq, "dk": dk, "dv": dv, "dqkv": dqkv, "dkv": dkv}
    if isinstance(q, AttentionResidual):
        return _backward_residual(dout, q, given, (k, v, out, lse), buffers, deterministic=deterministic,
                                  return_dbias=return_dbias, backend=backend)
    for name in ("dqkv", "dkv"):
        if buffers[name] is not None:
            raise TypeError(f"{name}= is the buffer of a packed residual's backward (attention_backward(dout, "
                            f"residual) after attention_qkvpacked/attention_kvpacked)")
    if check_dropout(given["dropout_p"], given["seed"])[0] and given["seed"] is None:
        raise ValueError("seed is required when dropout_p > 0: pass the seed the forward used "
                         "(returned by attention when it drew one)")
    edge = Edge()
    arrays = tuple(edge.data(name, a) for name, a in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out),
                                                      ("lse", lse)))
    natives_opts = native_options(edge, given)
    natives = {name: edge.buffer(name, buffers[name]) for name in ("dq", "dk", "dv")}
    return _backward(edge, arrays, natives_opts, natives, {n: buffers[n] for n in ("dq", "dk", "dv")},
                     deterministic=deterministic, return_dbias=return_dbias, backend=backend, packed=None)


def _backward_residual(dout: Array, residual: AttentionResidual, given: Mapping[str, Any],
                       positional: tuple[Any, ...], buffers: dict[str, Any], *, deterministic: bool,
                       return_dbias: bool, backend: Optional[str]) -> Any:
    if any(a is not None for a in positional):
        raise TypeError("attention_backward(dout, residual) takes no k, v, out, lse: the residual holds them")
    extra = sorted(name for name in given if name in _KEYWORDS.get())
    if extra:
        raise TypeError(f"attention_backward(dout, residual) takes the forward's options from the residual; "
                        f"{', '.join(extra)} given as well (the residual has {extra[0]}="
                        f"{residual.options[extra[0]]!r})")
    if residual._edge is None or len(residual._saved) != 5:
        raise TypeError("residual must come from attention(..., return_residual=True)")
    edge = residual._edge.again()
    allowed = {None: ("dq", "dk", "dv"), "qkv": ("dqkv",), "kv": ("dq", "dkv")}[residual.packed]
    wrong = sorted(name for name, b in buffers.items() if b is not None and name not in allowed)
    if wrong:
        form = {None: "attention", "qkv": "attention_qkvpacked", "kv": "attention_kvpacked"}[residual.packed]
        raise TypeError(f"{', '.join(wrong)}= is not a buffer of a residual of {form} (its buffers: "
                        f"{', '.join(allowed)})")
    q, k, v, out, lse = residual._saved
    with _one_call(q):
        residual.check_unchanged()
        dout_n = edge.data("dout", dout)
        natives = {name: edge.buffer(name, buffers[name]) for name in allowed}
        return _backward(edge, (q, k, v, dout_n, out, lse), dict(residual._native_options), natives,
                         {name: buffers[name] for name in allowed}, deterministic=deterministic,
                         return_dbias=return_dbias, backend=residual.backend if backend is None else backend,
                         packed=residual.packed)


def _backward(edge: Edge, arrays: tuple[Any, ...], options: dict[str, Any], buffers: dict[str, Any],
              caller_buffers: dict[str, Any], *, deterministic: bool, return_dbias: bool, backend: Optional[str],
              packed: Optional[str]) -> Any:
    """The backward of every form, on NumPy/CuPy arrays in the caller's layout."""
    q, k, v, dout, out, lse = arrays
    layout = _layout.check_layout(options.get("layout", "bshd"))
    with edge.device():
        qb, kb, vb, doutb, outb = (_layout.to_bshd(a, layout) for a in (q, k, v, dout, out))
        qp, kp, vp, kw, dv_width = _layout.pad_head_dims(qb, kb, vb, options)
        if dv_width is not None:  # dout and out have v's head dim: checked here, before padding hides it
            want = tuple(qb.shape[:-1]) + (dv_width,)
            for name, a in (("dout", doutb), ("out", outb)):
                if hasattr(a, "shape") and tuple(a.shape) != want:
                    raise ValueError(f"{name} must have shape {tuple(q.shape[:-1]) + (dv_width,)} (q's shape with "
                                     f"v's head_dim), got {tuple(a.shape)}")
            if vp is not vb:  # v was padded: so are dout and out, with zeros (zero gradient contributions)
                doutb, outb = (_layout.pad_last(a, qb.shape[-1], name) if hasattr(a, "shape") else a
                               for name, a in (("dout", doutb), ("out", outb)))
        problem = make_problem(qp, kp, vp, layout=layout, **kw)
        dout_f, out_f, lse_f = check_backward(problem, doutb, outb, lse, layout)
        if return_dbias and (problem.mods is None or problem.mods.bias_shape is None):
            raise ValueError("return_dbias=True needs bias=: there is no bias to differentiate")
        if return_dbias:
            _check_dbias_export(edge, options["bias"])
        _check_grad_buffers(buffers, problem, (q, k, v, dout, out, lse), options, packed, layout)
        module = backends.select(problem, backend)
        edge.begin()
        grads = module.backward(problem, dout_f, out_f, lse_f, deterministic=deterministic, dbias=return_dbias)
        shapes = (problem.q.shape[1:], problem.k.shape[1:], problem.v.shape[1:])
        gq, gk, gv = (problem.unflatten(g, s) for g, s in zip(grads[:3], shapes))
        if dv_width is not None:
            gq, gk, gv = gq[..., :qb.shape[-1]], gk[..., :kb.shape[-1]], gv[..., :dv_width]
        gq, gk, gv = (_layout.from_bshd(g, layout) for g in (gq, gk, gv))
        results = _place_grads(edge, (gq, gk, gv), buffers, caller_buffers, packed, problem.xp, layout)
        if return_dbias:  # in bias's own shape (the backend summed what it broadcasts) and dtype
            with np.errstate(all="ignore"):  # rounding to a float16 bias underflows as a rule (as in the backends)
                dbias = grads[3].reshape(problem.mods.bias_shape).astype(options["bias"].dtype, copy=False)
            results += (edge.export(dbias),)
    if packed == "qkv" and not return_dbias:
        return results[0]
    return results


def _check_dbias_export(edge: Edge, bias: Any) -> None:
    """dbias comes back in the caller's array type and in bias's dtype. Where the caller's library cannot take that
    dtype (a NumPy bias of the other byte order, or of ml_dtypes' bfloat16, beside torch tensors; a float64 one beside
    JAX arrays without x64, which came back float32), a TypeError before the backward, not a BufferError after it or
    a silent cast: an empty array of the dtype is handed over first."""
    if edge.namespace is None:
        return
    want = bias.dtype  # a NumPy dtype: bias is NumPy or CuPy here
    try:
        got = edge.export(bias.reshape(-1)[:0].copy())  # writable, as dbias is (JAX refuses a read-only one)
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"return_dbias=True: dbias comes back as a {edge.library} array of bias's dtype {want}, which "
                        f"{edge.library} cannot take ({type(exc).__name__}: {exc}); pass bias as a {edge.library} "
                        f"array or in a dtype it takes") from None
    if str(got.dtype).rpartition(".")[2] != want.name:
        raise TypeError(f"return_dbias=True: dbias in bias's dtype {want} would come back as a {edge.library} array "
                        f"of {str(got.dtype).rpartition('.')[2]}; pass bias in a dtype {edge.library} keeps (JAX: "
                        f"float64 needs jax_enable_x64)")


def _named(qkv: Sequence[Any], packed: Optional[str]) -> dict[str, Any]:
    """``q, k, v`` by the names the caller knows them by: a packed input's parts by the packed array's name (an
    overlap with ``out=`` or a gradient buffer is reported as one with ``qkv``, not with a ``q`` never passed)."""
    names = {None: ("q", "k", "v"), "qkv": ("qkv (its q part)", "qkv (its k part)", "qkv (its v part)"),
             "kv": ("q", "kv (its k part)", "kv (its v part)")}[packed]
    return dict(zip(names, qkv))


def _place_grads(edge: Edge, grads: tuple[Any, Any, Any], buffers: dict[str, Any], caller_buffers: dict[str, Any],
                 packed: Optional[str], xp: Any, layout: str) -> tuple[Any, ...]:
    """The gradients in the caller's form: written into the buffers (returned as the caller passed them), packed
    (``dqkv``, ``dkv``: one array with the gradients copied into it) and exported."""
    gq, gk, gv = grads
    axis = _layout.pack_axis(layout)

    def packed_into(name: str, parts: Sequence[Any]) -> Any:
        buf = buffers.get(name)
        shape = _layout.pack_shape(parts[0].shape, len(parts), axis)
        target = buf if buf is not None else xp.empty(shape, dtype=parts[0].dtype)
        for i, g in enumerate(parts):
            target[_layout.pack_index(i, axis, target.ndim)] = g
        return caller_buffers[name] if buf is not None else edge.export(target)

    def single(name: str, g: Any) -> Any:
        buf = buffers.get(name)
        if buf is None:
            return edge.export(g)
        buf[...] = g
        return caller_buffers[name]

    if packed == "qkv":
        return (packed_into("dqkv", (gq, gk, gv)),)
    if packed == "kv":
        return single("dq", gq), packed_into("dkv", (gk, gv))
    return single("dq", gq), single("dk", gk), single("dv", gv)


def _check_grad_buffers(buffers: dict[str, Any], problem: Any, arrays: tuple[Any, ...], options: Mapping[str, Any],
                        packed: Optional[str], layout: str) -> None:
    """The gradient buffers: of the gradients' dtype (q's, in the machine's byte order), each sharing memory with no
    input, option array (a bias, offsets, ``mod_arrays``) or other buffer."""
    q, k, v = arrays[:3]
    inputs = dict(watched({**_named(arrays[:3], packed), **dict(zip(("dout", "out", "lse"), arrays[3:]))}, options))
    axis = _layout.pack_axis(layout)
    want = {"dq": tuple(q.shape), "dk": tuple(k.shape), "dv": tuple(v.shape)}
    if packed == "qkv":
        want = {"dqkv": _layout.pack_shape(q.shape, 3, axis)}
    elif packed == "kv":
        want = {"dq": tuple(q.shape), "dkv": _layout.pack_shape(k.shape, 2, axis)}
    checked: dict[str, Any] = {}
    for name, shape in want.items():
        buf = buffers.get(name)
        if buf is None:
            continue
        check_buffer(name, buf, shape, problem.dtype, problem.xp, {**inputs, **checked})
        checked[name] = buf


def attention_vjp(q: Array, k: Array, v: Array, **options: Any) -> tuple[Array, Vjp]:
    """JAX-style ``(out, vjp)``: ``vjp(dout)`` returns ``(dq, dk, dv)``.

    Takes the options of :func:`attention` (except ``return_lse`` and ``return_residual``; ``out=`` is written as
    there, and its later change detected as ``out``'s) and
    ``deterministic`` of :func:`attention_backward`. Built on :class:`AttentionResidual` (``vjp.residual``): it
    keeps references to ``q``, ``k``, ``v``, ``out`` and the lse (nothing of size N², no copies), and like
    PyTorch's autograd it detects a later in-place change: ``vjp`` raises ``ValueError`` when ``q``, ``k``, ``v``,
    ``out``, the lse or an array option (``bias``, ``seqlens_q``, a ``mod_arrays`` value, ...) no longer hold the
    values the forward saw (a fingerprint of each is taken now and checked then; :func:`fingerprint`). With dropout
    and no seed, one is drawn and kept for the backward (read it back as ``vjp.seed``).
    """
    kept = "the lse is kept inside vjp (vjp.residual)"
    check_keywords("attention_vjp", options, attention, also=("deterministic",),
                   refused={"return_lse": kept, "return_residual": kept})
    options = dict(options)
    deterministic = options.pop("deterministic", False)
    check_flags(deterministic=deterministic)
    out, residual = attention(q, k, v, return_residual=True, **options)
    return out, Vjp(residual, bool(deterministic))


for _fn in (attention, attention_qkvpacked, attention_kvpacked, attention_backward):
    fill_doc(_fn)
del _fn
