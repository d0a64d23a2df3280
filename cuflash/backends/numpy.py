"""Blocked NumPy backend: FlashAttention-2 Algorithm 1 (forward) and Algorithm 2 (backward).

The CPU product. Vectorized over batch and heads, one tile of ``block_q x block_k`` scores at a
time; extra memory is O(tile + N·d): S and P never exist beyond one tile. Statistics are float32
(float64 for float64 input); float16/bfloat16 inputs are upcast to float32 once, O(N·d).
Query tiles are independent in the forward and key tiles in the backward, so they are spread
over a small thread pool: NumPy's ufuncs and BLAS release the GIL on large tiles.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..dropout import keep_mask
from ..plan import Plan
from ._blas import single_threaded
from ..problem import Problem, stats_dtype

#: Default tile, measured on 2 cores (N = 4096, 4 heads, d = 64, fp32): 256 x 512 beat
#: 128..512 x 512..2048 by 5-25%. Wide key tiles amortize the per-tile Python overhead and keep
#: the matrix products efficient, while one score tile per worker (B·H·256·512 floats for few
#: heads) stays cache-sized.
BLOCK_Q, BLOCK_K = 256, 512
#: dQ accumulators of the backward: a constant, so dQ's summation order never depends on threads.
DQ_CHUNKS = 4
#: what this backend computes (checked once, by cuflash.backends.select)
DTYPES = ("float16", "bfloat16", "float32", "float64")
BF16_BITS = False
MAX_HEAD_DIM = None
ARRAYS = "numpy"


def available():
    return True, "always available"


def _threads() -> int:
    """Worker threads: ``CUFLASH_NUM_THREADS``, else the cores this process may use."""
    if "CUFLASH_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["CUFLASH_NUM_THREADS"]))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _map(fn, items):
    items = list(items)
    if len(items) < 2 or _threads() < 2:
        return [fn(x) for x in items]

    def run(x):
        with single_threaded():
            return fn(x)

    with ThreadPoolExecutor(_threads()) as pool:
        return list(pool.map(run, items))


def _work_dtype(problem):
    return stats_dtype(problem.dtype)


def _grouped(x, problem, dtype):
    """(B, S, H, D) → (B, Hkv, H/Hkv, S, D) in the working dtype.

    A view when the dtype already matches: BLAS takes each (S, D) slice with its row stride as
    the leading dimension, so no copy is needed; float16/bfloat16 are upcast once, O(N·d).
    """
    b, s, h, d = x.shape
    return x.transpose(0, 2, 1, 3).astype(dtype, copy=False).reshape(b, problem.heads_kv, h // problem.heads_kv, s, d)


def _ungroup(x):
    b, hkv, g, s, d = x.shape
    return x.reshape(b, hkv * g, s, d).transpose(0, 2, 1, 3)


def _mask_scores(s, plan, tile, problem):
    """Set invisible scores of a partial tile to -inf (mask before the max: seed 004's pitfall)."""
    if tile.full:
        return
    keep = plan.element_mask(tile)  # (B, Hq|1, bq, bk)
    b, h = keep.shape[:2]
    keep = keep.reshape(b, problem.heads_kv, problem.group, *keep.shape[2:]) if h > 1 else keep[:, :, None]
    np.copyto(s, -np.inf, where=~keep)


def _dropout_scale(problem, tile, dtype):
    """Keep-mask of a tile scaled by 1/(1-p), as (B, Hkv, G, bq, bk); None without dropout."""
    if not problem.dropout_p:
        return None
    b = np.arange(problem.batch)[:, None, None, None]
    h = np.arange(problem.heads_q)[None, :, None, None]
    i = np.arange(tile.i0, tile.i1)[None, None, :, None]
    j = np.arange(tile.k0, tile.k1)[None, None, None, :]
    keep = keep_mask(problem.seed, problem.dropout_p, b, h, i, j)
    z = keep.astype(dtype) * dtype.type(1.0 / (1.0 - problem.dropout_p))
    return z.reshape(problem.batch, problem.heads_kv, problem.group, *z.shape[2:])


def _scaled_q(problem, wt):
    """Q, and the scale still to apply to S (None when folded into Q).

    Folding the scale into Q saves a pass over every score tile, but rounds each q·scale: an
    extra rounding the naive computation does not have. A power-of-two scale (1/8 for head_dim
    64) folds exactly, so only then is it folded.
    """
    q = _grouped(problem.q, problem, wt)
    if problem.scale != 0 and math.frexp(problem.scale)[0] in (0.5, -0.5):
        return q * wt.type(problem.scale), None
    return q, wt.type(problem.scale)


def forward(problem: Problem, *, block_q=None, block_k=None, plan=None):
    """Return ``out (B, Sq, Hq, D)`` in q's dtype and ``lse (B, Hq, Sq)``."""
    wt = _work_dtype(problem)
    plan = plan or Plan(problem, block_q or BLOCK_Q, block_k or BLOCK_K)
    q, scale = _scaled_q(problem, wt)
    kt = np.swapaxes(_grouped(problem.k, problem, wt), -1, -2)
    v = _grouped(problem.v, problem, wt)
    out = np.zeros(q.shape, dtype=wt)
    lse = np.full(q.shape[:-1], -np.inf, dtype=wt)

    def row(tiles):
        i0, i1 = tiles[0].i0, tiles[0].i1
        q_i = q[..., i0:i1, :]
        m_i = np.full(q_i.shape[:-1], -np.inf, dtype=wt)
        l_i = np.zeros(q_i.shape[:-1], dtype=wt)
        acc = np.zeros(q_i.shape, dtype=wt)
        for t in tiles:
            s = q_i @ kt[..., t.k0:t.k1]
            if scale is not None:
                s *= scale
            _mask_scores(s, plan, t, problem)
            m_new = np.maximum(m_i, s.max(axis=-1))
            m_safe = np.where(m_new == -np.inf, 0, m_new)  # a row that saw nothing yet: no -inf - -inf
            s -= m_safe[..., None]
            np.exp(s, out=s)
            alpha = np.exp(m_i - m_safe)
            l_i = l_i * alpha + s.sum(axis=-1)  # l is of the undropped P: lse stays dropout-free
            z = _dropout_scale(problem, t, wt)
            if z is not None:
                s *= z
            acc *= alpha[..., None]
            acc += s @ v[..., t.k0:t.k1, :]
            m_i = m_new
        seen = l_i != 0  # a NaN sum propagates; only rows that saw no key get 0 and -inf
        out[..., i0:i1, :] = acc / np.where(seen, l_i, 1)[..., None]
        lse[..., i0:i1] = np.where(seen, m_i + np.log(np.where(seen, l_i, 1)), -np.inf)

    _map(row, plan.by_query())
    return (_ungroup(out).astype(problem.dtype, copy=False),
            lse.reshape(problem.batch, problem.heads_q, problem.seqlen_q))


def backward(problem: Problem, dout, out, lse, *, block_q=None, block_k=None, plan=None, deterministic=False,
             dbias=False):
    """FA2 Algorithm 2: ``(dq, dk, dv)`` by recomputing P from ``lse``; no N×N buffer.

    Always bitwise reproducible (``deterministic`` is accepted for the API's sake)."""
    wt = _work_dtype(problem)
    plan = plan or Plan(problem, block_q or BLOCK_Q, block_k or BLOCK_K)
    q, s_scale = _scaled_q(problem, wt)  # S recomputed exactly as the forward computed it
    k = _grouped(problem.k, problem, wt)
    kt = np.swapaxes(k, -1, -2)
    v = _grouped(problem.v, problem, wt)
    do = _grouped(dout, problem, wt)
    o = _grouped(out, problem, wt)
    lse_g = np.asarray(lse, dtype=wt).reshape(q.shape[:-1])
    lse_g = np.where(np.isneginf(lse_g), np.inf, lse_g)  # rows that saw nothing: P = exp(-inf) = 0
    big_d = np.einsum("...d,...d->...", do, o)  # D = rowsum(dO ∘ O)
    dk = np.zeros(k.shape[:2] + (1,) + k.shape[3:], dtype=wt)
    dv = np.zeros_like(dk)
    scale = wt.type(problem.scale)

    def column(tiles, dq_acc):
        k0, k1 = tiles[0].k0, tiles[0].k1
        k_j, v_j = k[..., k0:k1, :], v[..., k0:k1, :]
        dk_j = np.zeros(q.shape[:3] + (k1 - k0, q.shape[-1]), dtype=wt)
        dv_j = np.zeros_like(dk_j)
        for t in tiles:
            q_i, do_i = q[..., t.i0:t.i1, :], do[..., t.i0:t.i1, :]
            s = q_i @ kt[..., k0:k1]  # bit-identical to the forward's S, so P = exp(S - lse) is too
            if s_scale is not None:
                s *= s_scale
            _mask_scores(s, plan, t, problem)
            s -= lse_g[..., t.i0:t.i1, None]
            p = np.exp(s, out=s)
            z = _dropout_scale(problem, t, wt)
            dv_j += np.swapaxes(p if z is None else p * z, -1, -2) @ do_i
            dp = do_i @ np.swapaxes(v_j, -1, -2)
            if z is not None:
                dp *= z  # dP of the dropped P, back through the keep-mask
            dp -= big_d[..., t.i0:t.i1, None]
            ds = np.multiply(p, dp, out=dp)
            dq_acc[..., t.i0:t.i1, :] += ds @ k_j
            dk_j += np.swapaxes(ds, -1, -2) @ q_i
        dk_j = dk_j.sum(axis=2, keepdims=True)
        dk[..., k0:k1, :] = dk_j if s_scale is None else dk_j * scale  # a folded Q carries the scale
        dv[..., k0:k1, :] = dv_j.sum(axis=2, keepdims=True)

    # Key tiles are dealt round-robin to a fixed number of dQ accumulators (O(N·d) each), summed
    # in a fixed order: dQ is bitwise the same whatever the thread count or schedule.
    columns = plan.by_key()
    chunks = max(1, min(DQ_CHUNKS, len(columns)))

    def chunk(c):
        dq_acc = np.zeros(q.shape, dtype=wt)
        for tiles in columns[c::chunks]:
            column(tiles, dq_acc)
        return dq_acc

    dq = sum(_map(chunk, range(chunks)), np.zeros(q.shape, dtype=wt)) * scale
    cast = lambda x: _ungroup(x).astype(problem.dtype, copy=False)  # noqa: E731
    return cast(dq), cast(dk), cast(dv)
