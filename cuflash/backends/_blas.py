"""Keep BLAS to one thread inside the NumPy backend's worker threads.

The backend parallelizes over tiles itself so that the softmax's elementwise work (which NumPy
runs on one core) overlaps across cores too; BLAS threading on top would oversubscribe the cores.
OpenBLAS (>= 0.3.27, what NumPy wheels bundle) has a per-thread setting for exactly this; with
another BLAS this is a no-op and the backend is merely slower.
"""
from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager


@functools.lru_cache(maxsize=1)
def _set_local():
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        fn = getattr(ctypes.CDLL(path), "openblas_set_num_threads_local", None)
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
            return fn
    return None


@contextmanager
def single_threaded():
    """Within this thread, run BLAS calls on one thread; restore the previous count afterwards."""
    fn = _set_local()
    previous = fn(1) if fn else None
    try:
        yield
    finally:
        if fn:
            fn(previous)
