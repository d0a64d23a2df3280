"""Exact merge of partial attention results over disjoint key sets (log-sum-exp combination).

Attention over a key set ``K = K_1 ∪ ... ∪ K_n`` (disjoint) is a weighted mean of the attention over each part:
with ``lse_i`` the log-sum-exp of a row's scaled scores over ``K_i`` and ``out_i`` its softmax-weighted values,

    lse = log sum_i exp(lse_i),        out = sum_i exp(lse_i - lse) · out_i.

This is the rescaling step of FlashAttention's online softmax (FA2 Algorithm 1, lines 8-10) applied to whole
partial results, the combine of split-KV decoding ("flash-decoding"), of chunked prefill and of ring attention
(Liu et al. 2023), and FlashInfer's ``merge_state``. :mod:`cuflash.distributed` merges with the same code.
"""
from __future__ import annotations

import collections.abc
import contextlib
from typing import Any, Sequence

import numpy as np

from . import _layout
from ._fp import ignore_fp_errors
from .interop import Edge
from .options import Layout
from .problem import array_module, dtype_name, native

_OUT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_LSE_DTYPES = ("float32", "float64")


@ignore_fp_errors  # its final rounding too (a float16 result underflows as a rule), as merge_parts' arithmetic
def merge_attention_states(outs: Sequence[Any], lses: Sequence[Any], *, layout: Layout = "bshd") -> tuple[Any, Any]:
    """Merge attention results computed over disjoint key sets into the result over their union.

    Parameters
    ----------
    outs : sequence of arrays, each of shape ``(..., seqlen_q, heads, head_dim)`` (``(..., heads, seqlen_q,
    head_dim)`` with ``layout="bhsd"``)
        Partial outputs, as :func:`cuflash.attention` returns them: float16, bfloat16, float32 or
        float64, all of one dtype and shape. At least one.
    lses : sequence of arrays, each of shape ``(..., heads, seqlen_q)``
        Their log-sum-exps (natural log of the sum of exp of the scaled scores), float32 or float64,
        all of one dtype; ``-inf`` for a row that saw no key of that part. One per ``outs`` entry.
    layout : {"bshd", "bhsd"}, default "bshd", keyword-only
        The layout of ``outs`` (and of ``out``), as the :func:`cuflash.attention` calls that made them were given
        it. Without it, ``"bhsd"`` parts were read as ``"bshd"`` ones: an error naming the lse's shape, or, where
        heads equal seqlen_q, a silently wrong merge.

    Returns
    -------
    out : array, the shape and dtype of ``outs[i]`` (C-contiguous)
        ``sum_i exp(lses[i] - lse) * outs[i]``; 0 for a row that is ``-inf`` in every part.
    lse : array, the shape and dtype of ``lses[i]``
        ``logsumexp_i lses[i]``; ``-inf`` for a row that is ``-inf`` in every part.

    Notes
    -----
    The weights are computed after subtracting the row's largest ``lse_i`` (each is at most 1, at least one is 1,
    so nothing overflows), in float32 (float64 when ``outs`` or ``lses`` are float64), and rounded once at the end.
    A NaN in a part's ``lse`` makes the row NaN (its ``out`` and ``lse``); a NaN in an element of a part's ``out``
    makes that element of the row NaN, whatever the part's weight (an ``out`` of a ``-inf`` part is weighted by
    exactly 0, and ``0 * NaN`` is NaN): corruption is never hidden.
    NumPy arrays give NumPy results, CuPy arrays CuPy results (computed on the arrays' device and current stream);
    arrays of other libraries (anything with ``__dlpack__`` or ``__cuda_array_interface__``: PyTorch, JAX, ...)
    are read without a copy and give results of their own type (:mod:`cuflash.interop`).

    Examples
    --------
    >>> out1, lse1 = cuflash.attention(q, k[:, :100], v[:, :100], return_lse=True)
    >>> out2, lse2 = cuflash.attention(q, k[:, 100:], v[:, 100:], return_lse=True)
    >>> out, lse = cuflash.merge_attention_states([out1, out2], [lse1, lse2])   # attention over all of k, v
    """
    form = _layout.check_layout(layout)
    edge = Edge()
    outs, lses = _sequence("outs", outs), _sequence("lses", lses)
    outs = [edge.data(f"outs[{i}]", a) for i, a in enumerate(outs)]
    lses = [edge.data(f"lses[{i}]", a) for i, a in enumerate(lses)]
    outs, lses, xp = _check(outs, lses, form)
    work = np.dtype(np.float64) if "float64" in (dtype_name(outs[0].dtype), dtype_name(lses[0].dtype)) \
        else np.dtype(np.float32)
    # CuPy allocates on the current device: run on the parts' (one device, checked above), as attention does
    on_device = xp.cuda.Device(outs[0].device.id) if xp is not np else contextlib.nullcontext()
    with on_device, edge.device():
        out, lse = merge_parts(xp, outs, lses, work)
        out = _layout.from_bshd(out.astype(outs[0].dtype, copy=False), form)
        return edge.export(out), edge.export(lse.astype(lses[0].dtype, copy=False))


@ignore_fp_errors
def merge_parts(xp: Any, outs: Sequence[Any], lses: Sequence[Any], work: np.dtype[Any], *,
                unseen: bool = False) -> tuple[Any, Any]:
    """The merge on validated arrays: ``(out, lse)`` in the working dtype ``work`` (no checks, no final rounding).

    :mod:`cuflash.distributed` calls this directly to keep its running accumulator in ``work`` across steps. NumPy's
    floating-point errors are ignored whatever the caller set (a part's weight underflows as a rule; NaN and
    infinities are handled below).

    ``unseen``: a part whose weight is exactly 0 contributes nothing, even an infinity or NaN of its ``out`` (no ``0 *
    inf = NaN``). Attention split over its keys (split-KV, the ring) takes this, as the whole call does: there a key
    whose probability underflows to 0 contributes nothing, and its split's weight underflows with it. The public
    merge keeps ``0 * NaN = NaN`` (its Notes: corruption is never hidden).
    """
    lse_all = xp.stack([xp.asarray(x).astype(work, copy=False) for x in lses])  # (n, ..., H, Sq)
    top = lse_all.max(axis=0)
    # A row that is -inf everywhere would compute (-inf) - (-inf) = NaN: shift it by 0 instead, so that every
    # weight is exp(-inf) = 0 and the row gets out 0, lse -inf. A +inf lse (a part saw an infinite score) makes
    # the row's lse +inf, as logsumexp over the union does (its weights inf - inf = NaN: handled below); out's NaN
    # there and every NaN propagate.
    top = xp.where(top == -np.inf, work.type(0), top)
    weights = xp.exp(lse_all - top)
    total = weights.sum(axis=0)
    seen = total != 0  # a NaN total stays NaN (NaN != 0), never passes for "sees no key"
    safe_total = xp.where(seen, total, work.type(1))
    lse = xp.where(seen, top + xp.log(safe_total), work.type(-np.inf))
    lse = xp.where(top == np.inf, top, lse)  # exp(inf - inf) is NaN
    # Normalized weights, moved from (..., H, Sq) to out's (..., Sq, H, 1).
    scaled = xp.swapaxes(weights / safe_total, -1, -2)[..., None]
    out = _weighted(xp, scaled[0], outs[0], work, unseen)
    for i in range(1, len(outs)):
        out += _weighted(xp, scaled[i], outs[i], work, unseen)
    return out, lse


def _weighted(xp: Any, weight: Any, out: Any, work: np.dtype[Any], unseen: bool) -> Any:
    term = weight * out.astype(work, copy=False)
    return xp.where(weight != 0, term, work.type(0)) if unseen else term


def _sequence(name: str, seq: Any) -> list[Any]:
    # a Sequence, not any sized iterable: a dict or set iterated as its keys (or in no set order) reads as parts
    if isinstance(seq, (str, bytes)) or not isinstance(seq, collections.abc.Sequence) or hasattr(seq, "shape"):
        raise TypeError(f"{name} must be a list or tuple of arrays (one per part), got {type(seq).__name__}")
    return list(seq)


def _check(outs: list[Any], lses: list[Any], layout: str) -> tuple[list[Any], list[Any], Any]:
    """Validated ``(outs as "bshd" views, lses, xp)``: equal counts, shapes, dtypes and array module; TypeError/
    ValueError naming the argument otherwise."""
    if not outs:
        raise ValueError("outs must hold at least one partial result, got an empty sequence")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have one entry per part, got {len(outs)} outs and {len(lses)} lses")
    names = [f"outs[{i}]" for i in range(len(outs))] + [f"lses[{i}]" for i in range(len(lses))]
    xp = array_module(*outs, *lses, names=names)
    outs, lses = [native(a) for a in outs], [native(a) for a in lses]
    for what, arrays, allowed in (("outs", outs, _OUT_DTYPES), ("lses", lses, _LSE_DTYPES)):
        first = arrays[0]
        if dtype_name(first.dtype) not in allowed:
            raise TypeError(f"{what}[0] must be {', '.join(allowed)}, got {first.dtype}")
        for i, a in enumerate(arrays[1:], 1):
            if a.dtype != first.dtype:
                raise TypeError(f"{what}[{i}] has dtype {a.dtype}, but {what}[0] has {first.dtype}: all parts must "
                                f"share one dtype")
            if a.shape != first.shape:
                raise ValueError(f"{what}[{i}] has shape {tuple(a.shape)}, but {what}[0] has {tuple(first.shape)}: "
                                 f"all parts must have one shape")
    out0, lse0 = outs[0], lses[0]
    form = "(..., seqlen_q, heads, head_dim)" if layout == "bshd" else "(..., heads, seqlen_q, head_dim)"
    if out0.ndim < 3:
        raise ValueError(f"outs[0] must have shape {form} (layout={layout!r}), got {tuple(out0.shape)}")
    bshd = _layout.to_bshd(out0, layout).shape
    want = bshd[:-3] + (bshd[-2], bshd[-3])
    if tuple(lse0.shape) != tuple(want):
        raise ValueError(f"lses[0] must have shape (..., heads, seqlen_q) = {tuple(want)} to match outs[0] "
                         f"{tuple(out0.shape)} {form} (layout={layout!r}), got {tuple(lse0.shape)}")
    return [_layout.to_bshd(a, layout) for a in outs], lses, xp
