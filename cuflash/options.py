"""The options of :func:`cuflash.attention` and :func:`cuflash.attention_backward`: their names, defaults and
documentation (one copy, filled into every public docstring), and their arrays converted at the edge.

Validation is not here: :func:`cuflash.problem.make_problem` judges every value.
"""
from __future__ import annotations

import functools
import inspect
import numbers
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np

from .interop import Edge

Array = Any
#: ``"bshd"``: ``(..., seqlen, heads, head_dim)`` (FlashAttention's layout, the default); ``"bhsd"``:
#: ``(..., heads, seqlen, head_dim)`` (PyTorch SDPA's).
Layout = Literal["bshd", "bhsd"]
Precision = Literal["ieee", "3xtf32", "tf32"]
LAYOUTS = ("bshd", "bhsd")

_OPTIONS_DOC = """
    causal : bool, default False
        Causal mask aligned bottom-right: query ``i`` sees key ``j`` iff ``j <= i + (Lk - Lq)``,
        with ``Lq, Lk`` the sequence's own lengths.
    scale : float, optional
        Softmax scale applied to ``q @ k.T``; default ``1 / sqrt(head_dim)`` of q and k.
    window : (int or None, int or None), optional
        Local attention ``(left, right)`` around the same diagonal: keeps
        ``i + off - left <= j <= i + off + right``; ``None`` leaves a side unbounded.
    block_mask : BlockMask, optional
        An element-exact mask with a block structure ``(batch|1, heads|1, ceil(Sq/bq), ceil(Sk/bk))``
        (:class:`cuflash.BlockMask`): skipped blocks are never computed, partial ones are tested element by
        element.
    seqlens_q, seqlens_k : integer array of the batch shape, optional
        Valid length of each sequence; rows past ``seqlens_q`` give ``out = 0``, ``lse = -inf``.
    bias : float array broadcastable to ``(..., heads, seqlen_q, seqlen_k)``, optional
        Added to the scores (after the scale and softcap, before the softmax); the batch dimensions
        broadcast all or none. The backward returns its gradient with ``return_dbias=True``.
    alibi_slopes : float array ``(heads,)`` or ``(..., heads)``, optional
        ALiBi (FlashAttention-2's convention): adds ``-slope[h] * |i + Lk - Lq - j|``.
    softcap : float > 0, optional
        Soft-capping (FlashAttention-2's convention): a score ``s`` becomes ``softcap * tanh(s / softcap)``
        (first of the modifiers, right after the scale). At least the smallest normal number of the working
        precision (float32's 1.2e-38; float64's for float64 inputs): a smaller cap is 0 there, or flushed to 0.
    score_mod : str, optional
        A score modifier written once as a Python expression over ``score, b, h, q_idx, kv_idx, q_len,
        kv_len`` and the names of ``mod_arrays`` (:mod:`cuflash.mods` gives the grammar), e.g.
        ``"score + slope[h] * (kv_idx - q_idx)"``; applied last, after bias and ALiBi. Differentiated
        symbolically for the backward.
    mask_mod : str, optional
        A mask as an expression of the same variables (no ``score``) evaluating to a bool, e.g.
        ``"doc[q_idx] == doc[kv_idx]"``; False removes the score. Evaluated on every visited tile: for
        skipping whole tiles use ``BlockMask.from_mask_mod``.
    mod_arrays : dict of str to array or number, optional
        The arrays and scalars ``score_mod``/``mask_mod`` read. An array is indexed by the variables
        ``b, h, q_idx, kv_idx`` only, and its shape must be their extents exactly (``b`` runs over the
        flattened batch).
    dropout_p : 0 or a float in [2**-32, 1 - 2**-32], default 0
        Attention dropout: after normalization, P is multiplied by a keep-mask and by
        ``1/(1 - dropout_p)``; ``lse`` is of the undropped scores. The mask is a pure function of
        (seed, batch, head, row, column) (:func:`cuflash.dropout_mask`), identical on every backend.
    seed : int, optional
        Dropout seed in ``[0, 2**64)``. With ``dropout_p > 0`` and ``seed=None`` the forward draws a
        fresh seed and returns it as an extra last result (or keeps it in the residual); the backward
        requires it.
    layout : {"bshd", "bhsd"}, default "bshd"
        ``"bshd"``: ``q`` is ``(..., seqlen_q, heads, head_dim)`` (FlashAttention's layout); ``"bhsd"``:
        ``(..., heads, seqlen_q, head_dim)`` (PyTorch SDPA's), and ``k``, ``v``, ``out`` and the gradients
        likewise. The inputs are read through transposed views (no copy: the kernels need only the last axis
        contiguous); ``out`` and the gradients come back C-contiguous in the layout asked for (the NumPy backend
        lays them out so; a ``"bhsd"`` result of the CUDA kernels, which write ``"bshd"``, is copied once).
        ``lse`` is ``(..., heads, seqlen_q)`` in both.
    precision : {"ieee", "3xtf32", "tf32"}, default "ieee"
        The arithmetic of float32 inputs on the CUDA kernels. ``"ieee"`` (the default, chosen for
        accuracy): float32 FMA, the accuracy of a naive float32 computation. ``"3xtf32"``: TF32 tensor
        cores, each product split into three (CUTLASS's 3xTF32), near-float32 accuracy, faster where
        tensor cores outrun the FMA pipes. ``"tf32"``: one TF32 product, the fastest and the least
        accurate (10-bit mantissas: about 1e-3 relative, like PyTorch's allow_tf32). float64 always
        computes in float64 (DMMA on A100/H100) and 16-bit inputs on their own tensor cores: they take
        only ``"ieee"``. The NumPy backend computes float32 in float32 whatever the mode. The README's
        "Precision" table gives each mode's measured accuracy.
    dtype : {None, "bfloat16"}
        ``"bfloat16"`` declares ``uint16`` arrays as bfloat16 bit patterns, for CuPy versions without
        ``ml_dtypes.bfloat16`` support (results are then bfloat16 bits too); otherwise leave None.
    backend : {None, "numpy", "cuda", "emulate"}
        ``None`` picks from the arrays: NumPy (or CPU arrays of another library) → ``"numpy"``, CuPy (or CUDA
        arrays of another library) → ``"cuda"``.

    All masks combine by AND. A query row that sees no key gets ``out = 0``, ``lse = -inf`` and
    zero gradients."""

_ARRAYS_DOC = """Arrays of other libraries (PyTorch, JAX, array-api-strict, Numba, ... : anything with
    ``__dlpack__`` or ``__cuda_array_interface__``) are taken without a copy, CPU arrays on the ``numpy``
    backend and CUDA arrays on the ``cuda`` one, and results come back in the caller's array type
    (:mod:`cuflash.interop`)."""

#: the options attention and attention_backward share (the forward's must be the backward's)
OPTIONS = ("causal", "scale", "window", "block_mask", "seqlens_q", "seqlens_k", "bias", "alibi_slopes", "softcap",
           "score_mod", "mask_mod", "mod_arrays", "dropout_p", "seed", "dtype", "layout",
           "precision")
#: each option's default (an option of the keyword form left at its default is "not given")
DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"causal": False, "scale": None, "window": None, "block_mask": None, "seqlens_q": None, "seqlens_k": None,
     "bias": None, "alibi_slopes": None, "softcap": None, "score_mod": None, "mask_mod": None, "mod_arrays": None,
     "dropout_p": 0.0, "seed": None, "dtype": None, "layout": "bshd",
     "precision": "ieee"})
_OPTION_ARRAYS = ("seqlens_q", "seqlens_k", "bias", "alibi_slopes")


def is_given(name: str, value: Any) -> bool:
    """Whether a keyword-form option differs from its default (was given)."""
    default = DEFAULTS[name]
    if default is None:
        return value is not None
    if isinstance(value, (bool, np.bool_, numbers.Real, str)):
        return bool(value != default)
    return True


def native_options(edge: Edge, options: Mapping[str, Any], arrays: Sequence[str] = _OPTION_ARRAYS) -> dict[str, Any]:
    """The options with their arrays (``arrays``, and ``mod_arrays``' values) converted to NumPy/CuPy
    (:meth:`Edge.option`)."""
    native = dict(options)
    for name in arrays:
        if name in options:
            native[name] = edge.option(name, options[name])
    mod_arrays = options.get("mod_arrays")
    if isinstance(mod_arrays, Mapping):  # any mapping, as a dict
        native["mod_arrays"] = {key: edge.option(f"mod_arrays[{key!r}]", value) for key, value in mod_arrays.items()}
    return native


def snapshot(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options as a call saw them, for a residual that replays them later: a list (``window=[l, r]``) as a
    tuple and a dict (``mod_arrays``) copied, so that the caller reusing or changing its own list or dict cannot
    change the options of a backward that the saved lse belongs to (the arrays inside are fingerprinted)."""
    return {name: tuple(x) if isinstance(x, list) else dict(x) if isinstance(x, Mapping) else x
            for name, x in options.items()}


def check_keywords(caller: str, options: Mapping[str, Any], target: Callable[..., Any], *, also: Sequence[str] = (),
                   refused: Mapping[str, str] = MappingProxyType({})) -> None:
    """The keywords that ``caller``, a function of ``**options``, passes on to ``target``: each a keyword-only
    parameter of ``target`` or one of ``also`` (the caller's own), else the TypeError Python raises for an unknown
    keyword, naming ``caller`` (``target`` named itself: a function the caller never called). ``refused``: keywords
    of ``target`` that ``caller`` does not take, each with the reason."""
    taken = tuple(n for n in _keyword_only(target) if n not in refused) + tuple(also)
    for name in options:
        if name in refused:
            raise TypeError(f"{caller} does not take {name}: {refused[name]}")
        if name not in taken:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r} (it takes {', '.join(taken)})")


@functools.lru_cache(maxsize=None)
def _keyword_only(fn: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY)


def fill_doc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with ``{options}`` and ``{arrays}`` in its docstring replaced by the shared text."""
    if fn.__doc__:
        fn.__doc__ = fn.__doc__.replace("{options}", _OPTIONS_DOC.strip("\n").lstrip()).replace("{arrays}", _ARRAYS_DOC)
    return fn
