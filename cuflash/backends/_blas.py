"""The NumPy backend's matrix products run on one BLAS thread, and the process's BLAS is left as found.

Why one thread: the backend parallelizes over tiles itself (so that the softmax's elementwise work,
which NumPy runs on one core, overlaps across cores too), and a BLAS's result may depend on its
thread count (OpenBLAS splits the inner dimension of a product differently with more threads:
a 1000 x 1000 x 64 float32 product differs in about half its elements between 1 and 2 threads).
Products pinned to one thread make every result bitwise the same whatever the user's BLAS setting.

How: the BLAS's own *global* thread count (``threadpoolctl`` finds the libraries; OpenBLAS is set
through its own symbols, see :func:`_openblas`). OpenBLAS built with pthreads
(what NumPy wheels bundle) has no per-thread count (``openblas_set_num_threads_local`` sets the
global one too), so per-thread toggling from worker threads races: two workers that save and
restore around each other leave the process at one thread. Here the count is saved and set to 1
by the first of any number of concurrent backend calls and restored by the last one, under a lock:
after every call the BLAS configuration is exactly what it was before (tested). While a call runs,
other threads' BLAS calls (the user's) also run on one thread.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

_lock = threading.Lock()
_active = 0
_saved: list = []


class _Count:
    """Get/set one BLAS library's thread count."""

    def __init__(self, get, set_, per_thread):
        self.get, self.set, self.per_thread = get, set_, per_thread


def _openblas(lib) -> _Count:
    """OpenBLAS through its own symbols: threadpoolctl (>= 3.6) lets only the first thread that
    ever set a limit change a pthreads OpenBLAS, silently ignoring every other thread, which would
    leave the products of a call from another thread multithreaded."""
    import ctypes
    import itertools

    dll = ctypes.CDLL(lib.filepath)
    for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
        get = getattr(dll, f"{prefix}openblas_get_num_threads{suffix}", None)
        set_ = getattr(dll, f"{prefix}openblas_set_num_threads{suffix}", None)
        if get is not None and set_ is not None:
            get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
            return _Count(get, set_, False)
    return _Count(lib.get_num_threads, lib.set_num_threads, False)


@functools.lru_cache(maxsize=1)
def _controllers():
    """The loaded BLAS libraries (NumPy's among them: NumPy is imported before this runs)."""
    import numpy  # noqa: F401  (its BLAS must be loaded to be found)
    from threadpoolctl import ThreadpoolController

    counts = []
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        layer = getattr(lib, "threading_layer", None)
        if lib.internal_api == "openblas" and layer != "openmp":
            counts.append(_openblas(lib))
        else:  # MKL, BLIS, ...: threadpoolctl's setter; an OpenMP layer's count is per thread
            counts.append(_Count(lib.get_num_threads, lib.set_num_threads, layer == "openmp"))
    return tuple(counts)


def blas_threads() -> list[int]:
    """The current thread count of every loaded BLAS library, as this thread sees it."""
    return [c.get() for c in _controllers()]


def _pin(counts):
    saved = [(c, c.get()) for c in counts]
    for c, n in saved:
        if n != 1:
            c.set(1)
    return saved


def _unpin(saved):
    for c, n in saved:
        if n is not None and c.get() != n:
            c.set(n)


@contextmanager
def single_threaded():
    """Run BLAS on one thread for the duration; concurrent uses nest, the last restores.

    Libraries with a process-wide count are pinned once for all concurrent uses; a per-thread
    count (OpenMP) is pinned in the calling thread here and by :func:`worker_single_threaded`
    in each worker thread.
    """
    global _active, _saved
    counts = _controllers()
    with _lock:
        if _active == 0:
            _saved = _pin([c for c in counts if not c.per_thread])
        _active += 1
    local = _pin([c for c in counts if c.per_thread])
    try:
        yield
    finally:
        _unpin(local)
        with _lock:
            _active -= 1
            if _active == 0:
                _unpin(_saved)
                _saved = []


@contextmanager
def worker_single_threaded():
    """In a worker thread inside :func:`single_threaded`: pin the per-thread counts too."""
    local = _pin([c for c in _controllers() if c.per_thread])
    try:
        yield
    finally:
        _unpin(local)
