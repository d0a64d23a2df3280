"""What the backends do not compute natively, arranged the same way for every backend: the ``layout`` transposes
(views), packed QKV/KV inputs (views) and a value head dim that differs from the query/key head dim (zero padding).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

from .options import LAYOUTS
from .problem import array_module, dtype_name


def check_layout(layout: Any) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be 'bshd' (..., seqlen, heads, head_dim) or 'bhsd' (..., heads, seqlen, "
                         f"head_dim), got {layout!r}")
    return layout


def swap(a: Any) -> Any:
    """Swap the seqlen and heads axes (a view)."""
    if not hasattr(a, "ndim") or a.ndim < 3:
        return a
    n = a.ndim
    return a.transpose(tuple(range(n - 3)) + (n - 2, n - 3, n - 1))


def to_bshd(a: Any, layout: str) -> Any:
    """An input in the ``"bshd"`` form the backends take: a view."""
    return a if layout == "bshd" else swap(a)


def from_bshd(a: Any, layout: str) -> Any:
    """A result in the caller's ``layout``, C-contiguous: a view where the backend laid its memory out in that order
    (the NumPy backend and the reference follow ``Problem.layout``), else a copy (the CUDA kernels write ``"bshd"``:
    a ``"bhsd"`` result, or one cut to a value head dim of its own, is copied, O(N d) against their O(N^2 d)).
    A result that is a transposed view surprised callers who reshape it or hand its buffer on."""
    r = to_bshd(a, layout)
    if not hasattr(r, "flags") or r.flags.c_contiguous:
        return r
    return array_module(r, names=("result",)).ascontiguousarray(r)


def pack_axis(layout: str) -> int:
    """The axis of the 3 (qkv) or 2 (kv) in a packed array: ``(..., S, 3, H, D)`` or ``(..., 3, H, S, D)``."""
    return -3 if layout == "bshd" else -4


def pack_index(i: int, axis: int, ndim: int) -> tuple[Any, ...]:
    return (slice(None),) * (ndim + axis) + (i,)


def pack_shape(shape: Sequence[int], n: int, axis: int) -> tuple[int, ...]:
    shape = tuple(shape)
    cut = len(shape) + axis + 1
    return shape[:cut] + (n,) + shape[cut:]


def unpack(packed: Any, name: str, n: int, layout: Any) -> tuple[Any, ...]:
    """Views ``packed[..., i, :, :]`` (or ``[..., i, :, :, :]`` for ``"bhsd"``) of a packed array."""
    layout = check_layout(layout)
    axis = pack_axis(layout)
    form = "(..., seqlen, {n}, heads, head_dim)" if layout == "bshd" else "(..., {n}, heads, seqlen, head_dim)"
    if not hasattr(packed, "shape") or not hasattr(packed, "ndim"):
        array_module(packed, names=(name,))  # refuses it, naming it
    if packed.ndim < 4 or packed.shape[axis] != n:
        raise ValueError(f"{name} must have shape {form.format(n=n)} for layout={layout!r}, got "
                         f"{tuple(packed.shape)}")
    return tuple(packed[pack_index(i, axis, packed.ndim)] for i in range(n))


def pad_last(a: Any, width: int, name: str) -> Any:
    """``a`` (the argument ``name``) with its last axis zero-padded to ``width`` (a copy)."""
    xp = array_module(a, names=(name,))
    padded = xp.zeros(tuple(a.shape[:-1]) + (width,), dtype=a.dtype)
    padded[..., :a.shape[-1]] = a
    return padded


def padded_width(q: Any, k: Any, v: Any) -> Optional[int]:
    """The head dim that :func:`pad_head_dims` pads q, k and v to (the larger of v's and q's and k's) where v's
    differs, else None: also for callers that pad stand-ins of the arrays instead (``cuflash.jax``'s trace-time
    checks, which must allocate nothing)."""
    arrays = (q, k, v)
    if not all(hasattr(a, "shape") and hasattr(a, "ndim") and hasattr(a, "dtype") for a in arrays):
        return None
    if (q.ndim < 3 or not q.ndim == k.ndim == v.ndim or tuple(k.shape[:-1]) != tuple(v.shape[:-1])
            or q.shape[-1] != k.shape[-1] or v.shape[-1] == k.shape[-1] or min(k.shape[-1], v.shape[-1]) < 1
            or len({dtype_name(a.dtype) for a in arrays}) > 1):  # the name: a big-endian q is q's dtype too
        return None
    return max(int(k.shape[-1]), int(v.shape[-1]))


def pad_head_dims(q: Any, k: Any, v: Any, options: Mapping[str, Any]
                   ) -> tuple[Any, Any, Any, dict[str, Any], Optional[int]]:
    """``(q, k, v, make_problem keywords, head_dim_v or None)``: when v's head dim differs from q's and k's, the
    smaller is zero-padded to the larger (zero columns add nothing to a score and give zero output columns) and
    the default scale is fixed to ``1/sqrt(head_dim)`` of q and k. Anything that is not such a case is passed on
    unchanged for :func:`~cuflash.problem.make_problem` to judge."""
    kw = {name: value for name, value in options.items() if name != "layout"}
    if padded_width(q, k, v) is None:
        return q, k, v, kw, None
    d, dv = int(k.shape[-1]), int(v.shape[-1])
    if kw.get("scale") is None:
        kw["scale"] = 1.0 / math.sqrt(d)
    if dv < d:
        v = pad_last(v, d, "v")
    else:
        q, k = pad_last(q, dv, "q"), pad_last(k, dv, "k")
    return q, k, v, kw, dv

