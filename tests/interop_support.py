"""Helpers of the interop tests: fixed cases and the tolerance rule applied through a conversion.

``check_through(to_lib, from_lib, case)`` runs :func:`cuflash.attention` and :func:`cuflash.attention_backward`
(the residual form) on ``case``'s arrays converted by ``to_lib`` (option arrays too), asserts that every result
is of the library's type (``is_lib``), converts the results back with ``from_lib`` and holds them to the float64
reference by :func:`cuflash.testing.check_forward` / :func:`check_backward` (2x/3x the naive same-dtype error).
"""
from __future__ import annotations

import numpy as np

import cuflash
from cuflash.testing import Case, check_backward, check_forward

ARRAY_OPTIONS = ("seqlens_q", "seqlens_k")


def cases():
    """A handful of cases covering causal, windows, GQA, Sq != Sk, seqlens and batch dims (float32)."""
    rng = np.random.default_rng(7)

    def make(shape_q, shape_k, **options):
        q = rng.standard_normal(shape_q).astype(np.float32)
        k = rng.standard_normal(shape_k).astype(np.float32)
        v = rng.standard_normal(shape_k).astype(np.float32)
        dout = rng.standard_normal(shape_q).astype(np.float32)
        return Case(q, k, v, dout, options)

    return {
        "plain": make((2, 17, 2, 8), (2, 17, 2, 8)),
        "causal-gqa": make((2, 33, 4, 16), (2, 21, 2, 16), causal=True),
        "window-seqlens": make((3, 19, 2, 8), (3, 40, 1, 8), window=(5, 2),
                               seqlens_q=np.array([19, 4, 0], np.int32), seqlens_k=np.array([40, 11, 7], np.int32)),
        "no-batch": make((29, 1, 8), (13, 1, 8), causal=True, scale=0.3),
        "two-batch-dims": make((2, 2, 9, 2, 8), (2, 2, 12, 2, 8), window=(None, 3)),
    }


def check_through(case: Case, to_lib, from_lib, is_lib, *, convert_options=True):
    """Forward and backward of ``case`` on the library's arrays, held to the float64 reference."""
    def opts(options):
        if not convert_options:
            return dict(options)
        return {k: (to_lib(v) if k in ARRAY_OPTIONS and v is not None else v) for k, v in options.items()}

    residuals = []

    def forward(q, k, v, **options):
        out, residual = cuflash.attention(to_lib(q), to_lib(k), to_lib(v), return_residual=True, **opts(options))
        assert is_lib(out) and is_lib(residual.lse), (type(out), type(residual.lse))
        residuals.append(residual)
        return from_lib(out), from_lib(residual.lse)

    out, lse = check_forward(forward, case)

    def backward(dout, q, k, v, out, lse, **options):
        grads = cuflash.attention_backward(to_lib(dout), residuals[-1])
        assert len(grads) == 3 and all(is_lib(g) for g in grads), [type(g) for g in grads]
        # the keyword form gives the same gradients (bitwise: the same backend on the same values)
        again = cuflash.attention_backward(to_lib(dout), to_lib(q), to_lib(k), to_lib(v), residuals[-1].out,
                                           residuals[-1].lse, **opts(options))
        for g, h in zip(grads, again):
            assert is_lib(h) and np.array_equal(from_lib(g), from_lib(h))
        return tuple(from_lib(g) for g in grads)

    check_backward(backward, case, out, lse)
