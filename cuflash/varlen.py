"""Ragged batches without padding: :func:`attention_varlen`, :func:`attention_varlen_backward`,
:func:`attention_varlen_vjp` (FlashAttention-2's ``flash_attn_varlen_func``).

Sequences of different lengths are packed one after another along the token axis, ``q`` ``(total_q, heads,
head_dim)`` and ``k``, ``v`` ``(total_k, heads_kv, head_dim)``, and located by int32 cumulative offsets
``cu_seqlens_q = [0, len_0, len_0 + len_1, ..., total_q]`` (likewise ``cu_seqlens_k``). Sequence ``i`` attends
only within itself, exactly as batch entry ``i`` of :func:`cuflash.attention` on the padded batch with
``seqlens_q``/``seqlens_k`` would, but memory and time follow the real tokens, never ``batch × max length``: the
NumPy backend runs each sequence as its own problem over views of the packed arrays, all on one thread pool; the
CUDA kernels (``cuda``, and ``emulate`` on the CPU) read the offsets on the device, one launch per kernel over
(tiles of the longest sequence, heads, sequences).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from . import backends
from .dropout import fresh_seed, needs_seed
from .interop import Edge
from .options import Precision, check_keywords, native_options, snapshot
from .problem import check_dropout, check_flags, check_varlen_backward, make_varlen_problem
from .residual import fingerprints, watched

Array = Any

_VARLEN_DOC = """
    cu_seqlens_q : int32 array, shape ``(batch + 1,)``
        Cumulative query offsets ``[0, len_0, len_0 + len_1, ..., total_q]``: non-decreasing (a sequence may be
        empty), starting at 0 and ending at ``q.shape[0]``. On ``q``'s device; an array of another library is read
        through DLPack (exactly: int32 values).
    cu_seqlens_k : int32 array, shape ``(batch + 1,)``
        The same for ``k`` and ``v`` (ending at ``k.shape[0]``); one entry per sequence as ``cu_seqlens_q``.
    max_seqlen_q, max_seqlen_k : int, optional
        Upper bounds of the sequence lengths (FlashAttention-2's arguments: what a CUDA grid is sized by without
        reading the offsets back). ``None`` computes them from the offsets; a given value is checked to be at least
        the longest sequence. They are also the extents of ``q_idx``/``kv_idx`` for ``bias`` and ``mod_arrays``.
    causal : bool, default False
        Causal mask aligned bottom-right within each sequence: query ``i`` of sequence ``b`` sees key ``j`` of it
        iff ``j <= i + (Lk_b - Lq_b)``.
    scale : float, optional
        Softmax scale applied to ``q @ k.T``; default ``1 / sqrt(head_dim)``.
    window : (int or None, int or None), optional
        Local attention ``(left, right)`` around the same per-sequence diagonal.
    bias : float array broadcastable to ``(batch, heads, max_seqlen_q, max_seqlen_k)``, optional
        Added to the scores of sequence ``b`` at ``[b, h, i, j]``, ``i``, ``j`` positions within the sequence (the
        padded batch's bias); differentiated for dq, dk, dv but ``return_dbias`` is not supported here yet.
    alibi_slopes : float array ``(heads,)`` or ``(batch, heads)``, optional
        ALiBi: adds ``-slope[h] * |i + Lk_b - Lq_b - j|`` (FlashAttention-2's convention, per sequence).
    softcap : float > 0, optional
        ``score -> softcap * tanh(score / softcap)``, first of the modifiers.
    score_mod, mask_mod : str, optional
        Modifiers in :mod:`cuflash.mods`' language, with ``b`` the sequence index, ``q_idx``/``kv_idx`` positions
        within the sequence and ``q_len``/``kv_len`` its lengths.
    mod_arrays : dict of str to array or number, optional
        Their operands; an array dimension read at ``b``, ``h``, ``q_idx``, ``kv_idx`` has the extent ``batch``,
        ``heads``, ``max_seqlen_q``, ``max_seqlen_k``.
    dropout_p : 0 or a float in [2**-32, 1 - 2**-32], default 0
        Attention dropout. The keep-mask of sequence ``b`` is the one :func:`cuflash.attention` draws for batch
        entry ``b`` of the padded batch: Philox with counter (column, row, head, ``b``), row and column positions
        within the sequence (:func:`cuflash.dropout_mask`).
    seed : int, optional
        Dropout seed in ``[0, 2**64)``; drawn and returned last when ``dropout_p > 0`` and ``seed`` is None.
    block_mask : None
        Refused (``ValueError``): a BlockMask's grid has fixed lengths. Use ``mask_mod``, ``window`` or ``causal``.
    dtype : {None, "bfloat16"}
        ``"bfloat16"`` declares ``uint16`` arrays of bfloat16 bits (CuPy without ``ml_dtypes``).
    precision : {"ieee", "3xtf32", "tf32"}, default "ieee"
        The arithmetic of float32 inputs on the CUDA kernels, as for :func:`cuflash.attention` (the NumPy backend
        computes float32 in float32 whatever the mode; other dtypes take only ``"ieee"``).
    backend : {None, "numpy", "cuda", "emulate"}
        ``None`` picks from the arrays. Every backend computes ragged batches (``"cuda"``: CuPy arrays, with
        ``cu_seqlens_*`` on the device)."""

_OPTIONS = ("max_seqlen_q", "max_seqlen_k", "causal", "scale", "window", "bias", "alibi_slopes", "softcap",
            "score_mod", "mask_mod", "mod_arrays", "dropout_p", "seed", "block_mask", "dtype", "precision")
_ARRAY_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "block_table", "bias", "alibi_slopes")


def attention_varlen(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array, *,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, causal: bool = False,
                     scale: Optional[float] = None, window: Optional[tuple[Optional[int], Optional[int]]] = None,
                     bias: Optional[Array] = None, alibi_slopes: Optional[Array] = None,
                     softcap: Optional[float] = None, score_mod: Optional[str] = None, mask_mod: Optional[str] = None,
                     mod_arrays: Optional[Mapping[str, Any]] = None, dropout_p: float = 0.0,
                     seed: Optional[int] = None, block_mask: Any = None, return_lse: bool = False,
                     dtype: Optional[str] = None, precision: Precision = "ieee", backend: Optional[str] = None) -> Any:
    """Exact attention over a ragged batch of packed sequences, each attending only within itself.

    Parameters
    ----------
    q : array, shape ``(total_q, heads, head_dim)``
        The queries of every sequence, one after another (``cu_seqlens_q`` says where each starts).
        float16, bfloat16, float32 or float64 (NumPy). Any DLPack / CUDA Array Interface array is taken, and
        results come back in its type (:mod:`cuflash.interop`).
    k : array, shape ``(total_k, heads_kv, head_dim)``
        Keys packed the same way; q's dtype; ``heads % heads_kv == 0`` (grouped-query heads).
    v : array, shape ``(total_k, heads_kv, head_dim)``
        Values, as ``k``.
    return_lse : bool, default False
        Also return the log-sum-exp of the scaled scores.
    {varlen}

    Returns
    -------
    out : array, shape ``(total_q, heads, head_dim)``, q's dtype
        Rows of a sequence without keys are 0.
    lse : array, shape ``(heads, total_q)``, float32 (float64 for float64 input)
        Only with ``return_lse`` (FlashAttention-2's varlen layout); ``-inf`` for rows that see no key.
    seed : int
        Only when ``dropout_p > 0`` and ``seed`` was None: the drawn seed, last.

    Examples
    --------
    >>> lens = np.array([5, 0, 17], np.int32)
    >>> cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    >>> q = np.random.default_rng(0).standard_normal((22, 4, 64), dtype=np.float32)
    >>> out = cuflash.attention_varlen(q, q[:, :2], q[:, :2], cu, cu, causal=True)
    """
    check_flags(return_lse=return_lse)
    options = {name: value for name, value in locals().items() if name in _OPTIONS}
    drawn = needs_seed(dropout_p, seed)
    if drawn:
        options["seed"] = fresh_seed()
    edge = Edge()
    arrays = tuple(edge.data(name, a) for name, a in (("q", q), ("k", k), ("v", v)))
    offsets = native_options(edge, {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}, _ARRAY_OPTIONS)
    with edge.device():
        problem = make_varlen_problem(*arrays, **offsets, **native_options(edge, options, _ARRAY_OPTIONS))
        out, lse = backends.select(problem, backend).forward_varlen(problem)
        results: tuple[Any, ...] = (edge.export(out),) + ((edge.export(lse),) if return_lse else ())
    if drawn:
        results += (options["seed"],)
    return results if len(results) > 1 else results[0]


def attention_varlen_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array,
                              cu_seqlens_q: Array, cu_seqlens_k: Array, *, max_seqlen_q: Optional[int] = None,
                              max_seqlen_k: Optional[int] = None, causal: bool = False,
                              scale: Optional[float] = None,
                              window: Optional[tuple[Optional[int], Optional[int]]] = None,
                              bias: Optional[Array] = None, alibi_slopes: Optional[Array] = None,
                              softcap: Optional[float] = None, score_mod: Optional[str] = None,
                              mask_mod: Optional[str] = None, mod_arrays: Optional[Mapping[str, Any]] = None,
                              dropout_p: float = 0.0, seed: Optional[int] = None, block_mask: Any = None,
                              dtype: Optional[str] = None, precision: Precision = "ieee", deterministic: bool = False,
                              return_dbias: bool = False, backend: Optional[str] = None) -> tuple[Array, Array, Array]:
    """Gradients of :func:`attention_varlen` by recomputation from the saved ``lse`` (FA2 Algorithm 2, per sequence).

    The options must be exactly the forward's (a drawn dropout seed included); :func:`attention_varlen_vjp` keeps
    them for you and checks that the arrays did not change in between.

    Parameters
    ----------
    dout : array, shape ``(total_q, heads, head_dim)``, q's dtype
        Gradient of the loss with respect to ``out``.
    q, k, v : arrays as for :func:`attention_varlen`
    out : array, shape ``(total_q, heads, head_dim)``
        The forward's result.
    lse : array, shape ``(heads, total_q)``
        The forward's log-sum-exp (``return_lse=True``), float32 (float64 for float64 input).
    deterministic : bool, default False
        Accepted for the CUDA backend's sake; the NumPy backend is always bitwise reproducible.
    return_dbias : bool, default False
        Not supported for ragged batches yet: ``True`` raises ``ValueError``.
    {varlen}

    Returns
    -------
    dq : array, shape ``(total_q, heads, head_dim)``, q's dtype
    dk, dv : arrays, shape ``(total_k, heads_kv, head_dim)``, q's dtype
        A kv head's gradients sum those of its query heads.
    """
    check_flags(deterministic=deterministic, return_dbias=return_dbias)
    if return_dbias:
        raise ValueError("return_dbias is not supported by attention_varlen_backward yet: each sequence reads its own "
                         "corner of the bias, and their gradients are not gathered into bias's shape; use "
                         "cuflash.attention_backward on the padded batch for dbias")
    if check_dropout(dropout_p, seed)[0] and seed is None:
        raise ValueError("seed is required when dropout_p > 0: pass the seed the forward used (returned by "
                         "attention_varlen when it drew one)")
    options = {name: value for name, value in locals().items() if name in _OPTIONS}
    edge = Edge()
    arrays = tuple(edge.data(name, a) for name, a in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out),
                                                      ("lse", lse)))
    offsets = native_options(edge, {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}, _ARRAY_OPTIONS)
    with edge.device():
        problem = make_varlen_problem(*arrays[:3], **offsets, **native_options(edge, options, _ARRAY_OPTIONS))
        saved = check_varlen_backward(problem, *arrays[3:])
        grads = backends.select(problem, backend).backward_varlen(problem, *saved, deterministic=deterministic)
        return edge.export(grads[0]), edge.export(grads[1]), edge.export(grads[2])


class VarlenVjp:
    """``vjp(dout) -> (dq, dk, dv)`` of :func:`attention_varlen_vjp`; ``vjp.seed`` is the dropout seed used."""

    def __init__(self, arrays: tuple[Any, ...], options: dict[str, Any], deterministic: bool,
                 backend: Optional[str]) -> None:
        self._arrays, self._options = arrays, options
        self._deterministic, self._backend = deterministic, backend
        self._prints = self._fingerprints()

    @property
    def seed(self) -> Optional[int]:
        seed = self._options.get("seed")
        return None if seed is None else int(seed)

    def _fingerprints(self) -> tuple[tuple[str, Any], ...]:
        edge = Edge()
        arrays = {n: edge.data(n, a) for n, a in zip(("q", "k", "v", "out"), self._arrays)}
        cu_q, cu_k = self._arrays[5:7]
        options = native_options(edge, dict(self._options, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), _ARRAY_OPTIONS)
        seen = watched(arrays, options)
        return tuple(zip((name for name, _ in seen), fingerprints(a for _, a in seen)))

    def __call__(self, dout: Array) -> tuple[Array, Array, Array]:
        for (name, now), (_, before) in zip(self._fingerprints(), self._prints):
            if now != before:
                raise ValueError(f"{name} was modified in place after attention_varlen_vjp: the gradients would be "
                                 f"those of other values; pass a copy to the in-place operation")
        q, k, v, out, lse, cu_q, cu_k = self._arrays
        return attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **self._options,
                                         deterministic=self._deterministic, backend=self._backend)


def attention_varlen_vjp(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                         **options: Any) -> tuple[Array, VarlenVjp]:
    """JAX-style ``(out, vjp)`` of :func:`attention_varlen`: ``vjp(dout)`` returns ``(dq, dk, dv)``.

    Takes the options of :func:`attention_varlen` (not ``return_lse``) and ``deterministic`` of the backward.
    ``vjp`` keeps references to the arrays (no copies) and the lse, and raises ``ValueError`` when ``q``, ``k``,
    ``v``, ``out``, the offsets or an array option (``bias``, ...) were changed in place before it is called.
    With dropout and no seed, one is drawn and kept (``vjp.seed``).
    """
    check_keywords("attention_varlen_vjp", options, attention_varlen, also=("deterministic",),
                   refused={"return_lse": "the lse is kept inside vjp"})
    options = snapshot(options)  # the caller's window list or mod_arrays dict may change before the backward
    deterministic = options.pop("deterministic", False)
    backend = options.pop("backend", None)
    check_flags(deterministic=deterministic)
    if needs_seed(options.get("dropout_p", 0.0), options.get("seed")):
        options["seed"] = fresh_seed()
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, return_lse=True, backend=backend, **options)
    return out, VarlenVjp((q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), options, bool(deterministic), backend)


for _fn in (attention_varlen, attention_varlen_backward):
    if _fn.__doc__:
        _fn.__doc__ = _fn.__doc__.replace("{varlen}", _VARLEN_DOC.strip("\n").lstrip())
del _fn
