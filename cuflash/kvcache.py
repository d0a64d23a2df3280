"""Inference with a KV cache: :func:`attention_with_kvcache` (FlashAttention-2's ``flash_attn_with_kvcache``).

One call appends the new tokens' keys and values into the cache in place and attends the queries to everything
the cache then holds: decoding (one query per sequence), speculative decoding and chunked prefill (several), over a
contiguous cache ``(batch, capacity, heads_kv, head_dim)`` or a paged one (``block_table`` into pages ``(num_pages,
page_size, heads_kv, head_dim)``, vLLM's PagedAttention layout). ``num_splits`` cuts each sequence's key range into
parts computed independently and merged by log-sum-exp (split-KV, "flash-decoding").
"""
from __future__ import annotations

from typing import Any, Optional

from . import backends
from .interop import Edge
from .problem import check_flags, make_kvcache_problem
from .options import Precision, native_options
from .varlen import _ARRAY_OPTIONS

Array = Any


def attention_with_kvcache(q: Array, k_cache: Array, v_cache: Array, *, cache_seqlens: Array,
                           k_new: Optional[Array] = None, v_new: Optional[Array] = None,
                           block_table: Optional[Array] = None, num_splits: Optional[int] = None,
                           causal: bool = False, window: Optional[tuple[Optional[int], Optional[int]]] = None,
                           alibi_slopes: Optional[Array] = None, softcap: Optional[float] = None,
                           scale: Optional[float] = None, return_lse: bool = False, dtype: Optional[str] = None,
                           precision: Precision = "ieee", backend: Optional[str] = None) -> Any:
    """Append ``k_new``/``v_new`` to the KV cache in place, then attend ``q`` to each sequence's cached keys.

    Parameters
    ----------
    q : array, shape ``(batch, seqlen_q, heads, head_dim)``
        float16, bfloat16, float32 or float64 (NumPy). ``seqlen_q`` may exceed 1 (speculative decoding, chunked
        prefill). Any DLPack array is taken, results come back in its type (:mod:`cuflash.interop`).
    k_cache, v_cache : arrays, shape ``(batch, capacity, heads_kv, head_dim)``, or ``(num_pages, page_size,
        heads_kv, head_dim)`` with ``block_table``
        The caches, q's dtype, ``heads % heads_kv == 0``. Written in place when ``k_new`` is given (so they must be
        writable, in native byte order, and share no memory with each other or with ``q``, ``k_new``, ``v_new``);
        only positions ``cache_seqlens[b] + [0, seqlen_new)`` of each sequence change.
    cache_seqlens : int32 array, shape ``(batch,)``
        Tokens already in each sequence's cache. **Not updated**: as with FlashAttention-2, the caller advances it
        (``cache_seqlens += seqlen_new``) after the call. ``cache_seqlens + seqlen_new`` must fit the capacity.
    k_new, v_new : arrays, shape ``(batch, seqlen_new, heads_kv, head_dim)``, optional
        Keys and values of the new tokens (both or neither), q's dtype; not modified.
    block_table : int32 array, shape ``(batch, max_blocks)``, optional
        Paged cache: position ``p`` of sequence ``b`` lives at page ``block_table[b, p // page_size]``, slot
        ``p % page_size``; ``capacity = max_blocks * page_size``. The first ``ceil((cache_seqlens[b] + seqlen_new) /
        page_size)`` entries of a row must be pages of the cache; later ones are never read (e.g. -1). Pages may be
        shared between sequences for reading (a common prefix), but a page that receives new tokens must appear once
        in all the entries used (``ValueError`` otherwise).
    num_splits : int >= 1, optional
        Cut each sequence's key range into this many parts of whole key tiles, computed independently and merged
        by log-sum-exp (:func:`cuflash.merge_attention_states`' formula, in float32/float64, rounded once): the
        CUDA split-KV kernel's semantics. ``None`` chooses: 1 on the NumPy backend (its parallelism is over
        sequences and tiles; a split that depended on the thread count would change the bits with it); on the CUDA
        kernels :func:`cuflash.tiling.kv_splits` from the GPU's SM count and the shape (decode-shaped calls split).
    causal : bool, default False
        Bottom-right aligned over each sequence's ``L = cache_seqlens[b] + seqlen_new`` keys: query ``i`` sees key
        ``j`` iff ``j <= i + L - seqlen_q`` (the new queries are the last ``seqlen_q`` positions).
    window : (int or None, int or None), optional
        Local attention ``(left, right)`` around the same diagonal.
    alibi_slopes : float array ``(heads,)`` or ``(batch, heads)``, optional
        ALiBi: adds ``-slope[h] * |i + L - seqlen_q - j|``.
    softcap : float > 0, optional
        ``score -> softcap * tanh(score / softcap)``.
    scale : float, optional
        Softmax scale; default ``1 / sqrt(head_dim)``.
    return_lse : bool, default False
        Also return the log-sum-exp.
    dtype : {None, "bfloat16"}
        ``"bfloat16"`` declares ``uint16`` arrays (``q``, the caches, ``k_new``, ``v_new``) of bfloat16 bits (CuPy
        without ``ml_dtypes``; the kernels' backends), as for :func:`cuflash.attention`; ``out`` is bfloat16 bits too.
    precision : {"ieee", "3xtf32", "tf32"}, default "ieee"
        The arithmetic of float32 inputs on the CUDA kernels, as for :func:`cuflash.attention` (the NumPy backend
        computes float32 in float32 whatever the mode; other dtypes take only ``"ieee"``).
    backend : {None, "numpy", "cuda", "emulate"}
        ``None`` picks from the arrays. Every backend computes KV-cache calls; on ``"cuda"``/``"emulate"`` the
        forward kernel reads a paged cache through ``block_table`` and the split-KV partials are merged by a
        combine kernel (the append stays an array copy).

    Returns
    -------
    out : array, shape ``(batch, seqlen_q, heads, head_dim)``, q's dtype
        Rows of a sequence with no key (``L = 0``) are 0.
    lse : array, shape ``(batch, heads, seqlen_q)``, float32 (float64 for float64 input)
        Only with ``return_lse``.

    Notes
    -----
    Every argument is checked before the cache is touched: offsets, lengths, page indices and aliasing (of the
    caches with each other and with every array the call reads: q, the new tokens, ``cache_seqlens``,
    ``block_table``, ``alibi_slopes``) give a ``ValueError``/``TypeError`` naming the argument, and so do the
    backend's own limits (the CUDA grid, ``CUFLASH_NUM_THREADS``): a refused call leaves the cache as it was.

    Examples
    --------
    >>> out = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_new=k1, v_new=v1,
    ...                                      causal=True)
    >>> lens += 1                                       # the caller advances the lengths
    """
    check_flags(return_lse=return_lse)
    edge = Edge()
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k_new": k_new, "v_new": v_new}
    natives = {name: edge.data(name, a) for name, a in arrays.items()}  # writability: make_kvcache_problem
    if k_new is not None or v_new is not None:  # the new keys and values are written into the caches
        edge.written(("k_cache", "v_cache"), k_cache, v_cache)
    given = dict(cache_seqlens=cache_seqlens, block_table=block_table, alibi_slopes=alibi_slopes)
    options = native_options(edge, given, _ARRAY_OPTIONS)
    with edge.device():
        problem = make_kvcache_problem(natives["q"], natives["k_cache"], natives["v_cache"], k_new=natives["k_new"],
                                       v_new=natives["v_new"], num_splits=num_splits, causal=causal, window=window,
                                       softcap=softcap, scale=scale, dtype=dtype, precision=precision,
                                       **options)
        module = backends.select(problem, backend)
        edge.begin()
        out, lse = module.forward_kvcache(problem)
        return (edge.export(out), edge.export(lse)) if return_lse else edge.export(out)
