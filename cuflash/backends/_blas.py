"""The NumPy backend's matrix products run on one BLAS thread, and the process's BLAS is left as found.

Why one thread: the backend parallelizes over tiles itself (so that the softmax's elementwise work,
which NumPy runs on one core, overlaps across cores too), and a BLAS's result may depend on its
thread count (OpenBLAS splits the inner dimension of a product differently with more threads:
a 1000 x 1000 x 64 float32 product differs in about half its elements between 1 and 2 threads).
Products pinned to one thread make every result bitwise the same whatever the user's BLAS setting.

How: the BLAS's own *global* thread count, through ``threadpoolctl``. OpenBLAS built with pthreads
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


@functools.lru_cache(maxsize=1)
def _controllers():
    """The loaded BLAS libraries (NumPy's among them: NumPy is imported before this runs)."""
    import numpy  # noqa: F401  (its BLAS must be loaded to be found)
    from threadpoolctl import ThreadpoolController

    return tuple(ThreadpoolController().select(user_api="blas").lib_controllers)


def blas_threads() -> list[int]:
    """The current thread count of every loaded BLAS library (for tests and diagnostics)."""
    return [c.get_num_threads() for c in _controllers()]


@contextmanager
def single_threaded():
    """Run BLAS on one thread for the duration; concurrent uses nest, the last restores."""
    global _active, _saved
    with _lock:
        if _active == 0:
            _saved = [(c, c.get_num_threads()) for c in _controllers()]
            for c, n in _saved:
                if n != 1:
                    c.set_num_threads(1)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                for c, n in _saved:
                    if c.get_num_threads() != n:
                        c.set_num_threads(n)
                _saved = []
