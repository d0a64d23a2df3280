"""Backend registry: names → modules, imported lazily so CuPy is loaded only when used.

A backend module exposes ``available() -> (bool, reason)``, ``forward(problem)``,
``backward(problem, dout, out, lse, *, deterministic)`` and what it computes: ``DTYPES`` (element
types), ``BF16_BITS`` (takes uint16 arrays declared ``dtype="bfloat16"``), ``MAX_HEAD_DIM`` (None:
any) and ``ARRAYS`` ("numpy" or "cupy"). :func:`select` checks a
problem against those once, so no backend re-checks dtypes or head dims. ``details() -> str``, optional: more
than availability for the list of backends (:func:`status`), kept out of ``available()``, which every call asks.
``call_scope()``, optional: a context manager that an operation made of several of the backend's calls (a ring's
steps) runs them in, so that they see one configuration (the NumPy backend's BLAS).

Ragged batches and KV caches: a backend with ``VARLEN = True`` takes a
:class:`~cuflash.problem.VarlenProblem` in ``forward_varlen(problem) -> (out (total_q, Hq, D), lse (Hq,
total_q))`` and ``backward_varlen(problem, dout, out, lse, *, deterministic) -> (dq, dk, dv)``; one with
``KVCACHE = True`` a :class:`~cuflash.problem.KVCacheProblem` in ``forward_kvcache(problem) -> (out (B, Sq, Hq, D),
lse (B, Hq, Sq))``, which first writes ``k_new``/``v_new`` into the caches in place. A problem's ``kind``
("varlen", "kvcache") names the constant :func:`select` checks.
"""
from __future__ import annotations

import importlib

from ..problem import Problem

NAMES = ("numpy", "cuda", "emulate")


def get(name):
    if name not in NAMES:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(map(repr, NAMES))}")
    try:
        module = importlib.import_module(f".{name}", __name__)
    except ImportError as exc:
        raise RuntimeError(f"backend {name!r} is not available: {exc}. Available: {_available_list()}") from None
    ok, why = module.available()
    if not ok:
        raise RuntimeError(f"backend {name!r} is not available: {why}. Available: {_available_list()}")
    return module


def status():
    """``{name: (available, reason)}`` for every backend."""
    out = {}
    for name in NAMES:
        try:
            module = importlib.import_module(f".{name}", __name__)
            ok, why = module.available()
            details = getattr(module, "details", None)
            out[name] = (ok, f"{why}; {details()}" if ok and details is not None else why)
        except ImportError as exc:
            out[name] = (False, f"not built yet ({exc})")
    return out


def _available_list():
    return ", ".join(n for n, (ok, _) in status().items() if ok) or "none"


def select(problem: Problem, backend):
    """The backend module for ``problem``: named, or picked from the arrays' module; checked against what it computes."""
    if backend is None:
        backend = "cuda" if problem.xp.__name__ == "cupy" else "numpy"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string ({', '.join(NAMES)}) or None, got {type(backend).__name__}")
    module = get(backend)
    if problem.xp.__name__ != module.ARRAYS:
        raise TypeError(f"backend {backend!r} takes {module.ARRAYS} arrays, got {problem.xp.__name__} arrays")
    kind = getattr(problem, "kind", None)
    if kind is not None and not getattr(module, kind.upper(), False):
        raise ValueError(f"backend {backend!r} does not support {kind} yet; use backend='numpy' (NumPy arrays)")
    if problem.element_type not in module.DTYPES:
        bits = " or uint16 bits with dtype='bfloat16'" if module.BF16_BITS else ""
        other = "; use backend='numpy' (NumPy arrays) for float32/float64" if backend != "numpy" else ""
        raise TypeError(f"backend {backend!r} computes {', '.join(module.DTYPES)} (bfloat16 as ml_dtypes.bfloat16"
                        f"{bits}), got {problem.element_type}{other}")
    if problem.bf16_bits and not module.BF16_BITS:
        raise TypeError(f"backend {backend!r} takes bfloat16 as ml_dtypes.bfloat16 arrays; dtype='bfloat16' over "
                        f"uint16 bits is the fallback for CuPy versions without bfloat16")
    if problem.mods is not None and not getattr(module, "MODIFIERS", False):
        raise NotImplementedError(f"score and mask modifiers (bias, alibi_slopes, softcap, score_mod, mask_mod) "
                                  f"are not implemented on backend {backend!r} yet")
    if module.MAX_HEAD_DIM is not None and problem.head_dim > module.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {module.MAX_HEAD_DIM} on backend {backend!r}, got "
                         f"{problem.head_dim}")
    return module
