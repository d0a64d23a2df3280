"""Backend registry: names → modules, imported lazily so CuPy is loaded only when used.

A backend module exposes ``available() -> (bool, reason)``, ``forward(problem)`` and
``backward(problem, dout, out, lse)``.
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
            out[name] = importlib.import_module(f".{name}", __name__).available()
        except ImportError as exc:
            out[name] = (False, f"not built yet ({exc})")
    return out


def _available_list():
    return ", ".join(n for n, (ok, _) in status().items() if ok) or "none"


def select(problem: Problem, backend):
    """The backend module for ``problem``: named, or picked from the arrays' module."""
    if backend is None:
        backend = "cuda" if problem.xp.__name__ == "cupy" else "numpy"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string ({', '.join(NAMES)}) or None, got {type(backend).__name__}")
    module = get(backend)
    wants = "cupy" if backend == "cuda" else "numpy"
    if problem.xp.__name__ != wants:
        raise TypeError(f"backend {backend!r} takes {wants} arrays, got {problem.xp.__name__} arrays")
    return module
