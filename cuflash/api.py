"""Public functions: :func:`attention`, :func:`attention_backward`, :func:`attention_vjp`."""
from __future__ import annotations

import zlib

import numpy as np

from . import backends
from .dropout import fresh_seed
from .problem import array_module, check_backward, make_problem

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
    bias : float array broadcastable to ``(..., heads, seqlen_q, seqlen_k)``, optional
        Added to the scores (after the scale and softcap, before the softmax); the batch dimensions
        broadcast all or none. The backward returns its gradient with ``return_dbias=True``.
    alibi_slopes : float array ``(heads,)`` or ``(..., heads)``, optional
        ALiBi (FlashAttention-2's convention): adds ``-slope[h] * |i + Lk - Lq - j|``.
    softcap : float > 0, optional
        Soft-capping (FlashAttention-2's convention): a score ``s`` becomes ``softcap * tanh(s / softcap)``
        (first of the modifiers, right after the scale).
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
    dropout_p : float in [0, 1), default 0
        Attention dropout: after normalization, P is multiplied by a keep-mask and by
        ``1/(1 - dropout_p)``; ``lse`` is of the undropped scores. The mask is a pure function of
        (seed, batch, head, row, column) (:func:`cuflash.dropout_mask`), identical on every backend.
    seed : int, optional
        Dropout seed in ``[0, 2**64)``. With ``dropout_p > 0`` and ``seed=None`` the forward draws a
        fresh seed and returns it as an extra last result; the backward requires it.
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
        ``None`` picks from the arrays: NumPy → ``"numpy"``, CuPy → ``"cuda"``.

    All masks combine by AND. A query row that sees no key gets ``out = 0``, ``lse = -inf`` and
    zero gradients."""

#: the options attention and attention_backward share (the forward's must be the backward's)
OPTIONS = ("causal", "scale", "window", "block_mask", "seqlens_q", "seqlens_k", "bias", "alibi_slopes", "softcap",
           "score_mod", "mask_mod", "mod_arrays", "dropout_p", "seed", "dtype", "precision")


def attention(q, k, v, *, causal=False, scale=None, window=None, block_mask=None, seqlens_q=None, seqlens_k=None,
              bias=None, alibi_slopes=None, softcap=None, score_mod=None, mask_mod=None, mod_arrays=None,
              dropout_p=0.0, seed=None, return_lse=False, dtype=None, precision="ieee", backend=None):
    """Exact softmax attention, computed block by block without materializing the score matrix.

    Parameters
    ----------
    q : array, shape ``(..., seqlen_q, heads, head_dim)``
        float16, bfloat16, float32 or float64 (NumPy and CuPy).
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
    seed : int
        Only when ``dropout_p > 0`` and ``seed`` was None: the drawn seed, last in the tuple
        (``(out, seed)`` or ``(out, lse, seed)``).
    """
    drawn = seed is None and dropout_p
    kw = {name: value for name, value in locals().items() if name in OPTIONS}
    kw["seed"] = fresh_seed() if drawn else seed
    problem = make_problem(q, k, v, **kw)
    out, lse = backends.select(problem, backend).forward(problem)
    result = (problem.unflatten(out, problem.q.shape[1:]),)
    if return_lse:
        result += (problem.unflatten(lse, (problem.heads_q, problem.seqlen_q)),)
    if drawn:
        result += (problem.seed,)
    return result if len(result) > 1 else result[0]


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, window=None, block_mask=None,
                       seqlens_q=None, seqlens_k=None, bias=None, alibi_slopes=None, softcap=None, score_mod=None,
                       mask_mod=None, mod_arrays=None, dropout_p=0.0, seed=None, dtype=None, precision="ieee",
                       deterministic=False, return_dbias=False, backend=None):
    """Gradients of :func:`attention` by recomputation from the saved ``lse`` (FA2 Algorithm 2).

    Parameters
    ----------
    dout : array, q's shape and dtype
        Gradient of the loss with respect to ``out``.
    q, k, v : arrays as for :func:`attention`
    out, lse : the forward's results (``attention(..., return_lse=True)``) for the same options.
    deterministic : bool, default False
        On the ``cuda`` backend, dQ is accumulated with fp32 atomics by default, so its last bits
        may differ from run to run (dK and dV never do). ``True`` computes dQ in a second pass
        over query blocks without atomics: bitwise reproducible, at the cost of recomputing S, P
        and dP once more. The ``numpy`` backend is always bitwise reproducible.
    return_dbias : bool, default False
        Also return the gradient of ``bias`` (in ``bias``'s own shape and dtype).
    {options}

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtype of q, k, v
        ``dk``/``dv`` of a kv head sum the contributions of its query heads.
    dbias : array, bias's shape and dtype
        Only with ``return_dbias``: summed over the dimensions ``bias`` broadcasts.
    """
    if dropout_p and seed is None:
        raise ValueError("seed is required when dropout_p > 0: pass the seed the forward used "
                         "(returned by attention when it drew one)")
    problem = make_problem(q, k, v, **{name: value for name, value in locals().items() if name in OPTIONS})
    dout_f, out_f, lse_f = check_backward(problem, dout, out, lse)
    for name, flag in (("deterministic", deterministic), ("return_dbias", return_dbias)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if return_dbias and (problem.mods is None or problem.mods.bias_shape is None):
        raise ValueError("return_dbias=True needs bias=: there is no bias to differentiate")
    module = backends.select(problem, backend)
    grads = module.backward(problem, dout_f, out_f, lse_f, deterministic=deterministic, dbias=return_dbias)
    dq, dk, dv = grads[:3]
    result = (problem.unflatten(dq, problem.q.shape[1:]), problem.unflatten(dk, problem.k.shape[1:]),
              problem.unflatten(dv, problem.v.shape[1:]))
    if return_dbias:  # in bias's own shape (the backend summed what it broadcasts) and dtype
        result += (grads[3].reshape(problem.mods.bias_shape).astype(bias.dtype, copy=False),)
    return result


def attention_vjp(q, k, v, **options):
    """JAX-style ``(out, vjp)``: ``vjp(dout)`` returns ``(dq, dk, dv)``.

    Takes the options of :func:`attention` (except ``return_lse``) and ``deterministic`` of
    :func:`attention_backward`; keeps references to ``q``, ``k``, ``v``, ``out`` and the lse
    (nothing of size N², no copies). Like PyTorch's autograd it detects a later in-place change:
    ``vjp`` raises ``ValueError`` when ``q``, ``k``, ``v`` or ``out`` no longer hold the values the
    forward saw (a fingerprint of each is taken now and checked then; :func:`fingerprint`). With
    dropout and no seed, one is drawn and kept for the backward (read it back as ``vjp.seed``).
    """
    if "return_lse" in options:
        raise TypeError("attention_vjp does not take return_lse: the lse is kept inside vjp")
    options = dict(options)
    deterministic = options.pop("deterministic", False)
    if options.get("dropout_p") and options.get("seed") is None:
        options["seed"] = fresh_seed()  # the backward must regenerate the same mask
    out, lse = attention(q, k, v, return_lse=True, **options)
    saved = {"q": q, "k": k, "v": v, "out": out}
    prints = {name: fingerprint(a) for name, a in saved.items()}

    def vjp(dout):
        for name, a in saved.items():
            if fingerprint(a) != prints[name]:
                raise ValueError(f"{name} was modified in place after attention_vjp: the gradients would be those "
                                 f"of other values; pass a copy to the in-place operation, or call attention_vjp again")
        return attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)

    vjp.seed = options.get("seed")
    return out, vjp


_CHUNK = 1 << 20
_WEIGHTS: dict = {}  # device id -> the weights of fingerprint(), on that device


def fingerprint(a) -> tuple:
    """Shape, strides, dtype and a position-sensitive checksum of an array's bits: CRC-32 of a NumPy array's
    bytes (1.6 GB/s here); for a CuPy array, on its device, ``sum_i bits16[i] * w[i]`` in float64 over fixed
    pseudo-random weights ``w`` (1 Mi-element chunks). Any change of values (an edit, a permutation)
    changes it, short of a deliberate collision."""
    xp = array_module(a, names=("array",))
    flat = xp.ascontiguousarray(a).reshape(-1).view(xp.uint8 if xp is np else xp.uint16)
    if xp is np:
        total = zlib.crc32(memoryview(flat))
    else:
        key = a.device.id
        if key not in _WEIGHTS:
            _WEIGHTS[key] = xp.asarray(np.random.default_rng(0).random(_CHUNK))
        total = 0.0
        for start in range(0, flat.size, _CHUNK):
            part = flat[start:start + _CHUNK].astype(xp.float64)
            total += float(part @ _WEIGHTS[key][:part.size])
    return tuple(a.shape), tuple(a.strides), str(a.dtype), total
