"""Public functions: :func:`attention`, :func:`attention_backward`, :func:`attention_vjp`."""
from __future__ import annotations

from . import backends
from .problem import check_backward, make_problem

_OPTIONS_DOC = """
    causal : bool, default False
        Causal mask aligned bottom-right: query ``i`` sees key ``j`` iff ``j <= i + (Lk - Lq)``,
        with ``Lq, Lk`` the sequence's own lengths.
    scale : float, optional
        Softmax scale applied to ``q @ k.T``; default ``1 / sqrt(head_dim)``.
    window : (int or None, int or None), optional
        Local attention ``(left, right)`` around the same diagonal: keeps
        ``i + off - left <= j <= i + off + right``; ``None`` leaves a side unbounded.
    block_mask : BlockMask, optional
        Block-sparse grid ``(batch|1, heads|1, ceil(Sq/bq), ceil(Sk/bk))``; False blocks are skipped.
    seqlens_q, seqlens_k : integer array of the batch shape, optional
        Valid length of each sequence; rows past ``seqlens_q`` give ``out = 0``, ``lse = -inf``.
    backend : {None, "numpy", "cuda", "emulate"}
        ``None`` picks from the arrays: NumPy → ``"numpy"``, CuPy → ``"cuda"``.

    All masks combine by AND. A query row that sees no key gets ``out = 0``, ``lse = -inf`` and
    zero gradients."""


def _problem(q, k, v, kw):
    return make_problem(q, k, v, causal=kw["causal"], scale=kw["scale"], window=kw["window"],
                        block_mask=kw["block_mask"], seqlens_q=kw["seqlens_q"], seqlens_k=kw["seqlens_k"])


def attention(q, k, v, *, causal=False, scale=None, window=None, block_mask=None,
              seqlens_q=None, seqlens_k=None, return_lse=False, backend=None):
    """Exact softmax attention, computed block by block without materializing the score matrix.

    Parameters
    ----------
    q : array, shape ``(..., seqlen_q, heads, head_dim)``
        float16, bfloat16, float32 or float64 (NumPy); float16 or bfloat16 (CuPy).
    k, v : array, shape ``(..., seqlen_k, heads_kv, head_dim)``
        Same dtype and batch dimensions as ``q``; ``heads % heads_kv == 0`` (query head ``h``
        reads kv head ``h // (heads // heads_kv)``).
    return_lse : bool, default False
        Also return the log-sum-exp of the scaled scores (natural log).
    {options}

    Returns
    -------
    out : array, q's shape and dtype
    lse : array, shape ``(..., heads, seqlen_q)``, float32 (float64 for float64 input)
        Only when ``return_lse``.
    """
    kw = dict(causal=causal, scale=scale, window=window, block_mask=block_mask,
              seqlens_q=seqlens_q, seqlens_k=seqlens_k)
    problem = _problem(q, k, v, kw)
    out, lse = backends.select(problem, backend).forward(problem)
    out = problem.unflatten(out, problem.q.shape[1:])
    if not return_lse:
        return out
    return out, problem.unflatten(lse, (problem.heads_q, problem.seqlen_q))


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, window=None,
                       block_mask=None, seqlens_q=None, seqlens_k=None, backend=None):
    """Gradients of :func:`attention` by recomputation from the saved ``lse`` (FA2 Algorithm 2).

    Parameters
    ----------
    dout : array, q's shape and dtype
        Gradient of the loss with respect to ``out``.
    q, k, v : arrays as for :func:`attention`
    out, lse : the forward's results (``attention(..., return_lse=True)``) for the same options.
    {options}

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtype of q, k, v
        ``dk``/``dv`` of a kv head sum the contributions of its query heads.
    """
    kw = dict(causal=causal, scale=scale, window=window, block_mask=block_mask,
              seqlens_q=seqlens_q, seqlens_k=seqlens_k)
    problem = _problem(q, k, v, kw)
    dout_f, out_f, lse_f = check_backward(problem, dout, out, lse)
    dq, dk, dv = backends.select(problem, backend).backward(problem, dout_f, out_f, lse_f)
    return (problem.unflatten(dq, problem.q.shape[1:]), problem.unflatten(dk, problem.k.shape[1:]),
            problem.unflatten(dv, problem.v.shape[1:]))


def attention_vjp(q, k, v, **options):
    """JAX-style ``(out, vjp)``: ``vjp(dout)`` returns ``(dq, dk, dv)``.

    Takes the options of :func:`attention` (except ``return_lse``); keeps ``out`` and ``lse``
    alive for the backward, nothing of size N².
    """
    if "return_lse" in options:
        raise TypeError("attention_vjp does not take return_lse: the lse is kept inside vjp")
    out, lse = attention(q, k, v, return_lse=True, **options)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, **options)

    return out, vjp


attention.__doc__ = attention.__doc__.format(options=_OPTIONS_DOC)
attention_backward.__doc__ = attention_backward.__doc__.format(options=_OPTIONS_DOC)
