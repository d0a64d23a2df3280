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

Which BLAS: :func:`products` gives the backend its tile products, NumPy's ``matmul`` or Intel MKL's
``gemm`` (``CUFLASH_BLAS``; ``auto`` takes MKL where the ``mkl`` package is installed and the CPU is Intel's,
see :func:`_mkl`). Why MKL: on an Intel Xeon with AVX-512 (this project's machines on some days since
2026-11-24) OpenBLAS's single-threaded ``sgemm`` runs the tiles' products (inner dimension head_dim or 512,
512 rows) at 140-170 GFLOP/s where MKL's runs at 180-210, and ``dgemm`` at 66-80 against 87-101
(``benchmarks/numpy_backend.py``). No package on PyPI hands NumPy arrays to MKL's BLAS (NumPy and SciPy wheels
bundle OpenBLAS), so :class:`_Mkl` calls ``cblas_?gemm_batch_strided_64`` through ``ctypes`` (which releases the
GIL for the call): a few lines, no build step. MKL runs on one thread inside every product (its per-thread count,
set and restored around each backend call in every thread that computes). Its single-threaded ``gemm`` gave the
same bits for every alignment of its operands tried (64-byte offsets of A, B and C), so results stay reproducible
for any thread count; they may differ in the last bits between ``CUFLASH_BLAS=numpy`` and ``mkl``. One choice per
call (:func:`one_choice`): ``CUFLASH_BLAS`` changed by another thread while a call runs takes effect from the next call.
"""
from __future__ import annotations

import contextvars
import ctypes
import functools
import itertools
import os
import threading
from contextlib import contextmanager

import numpy as np

from .. import _env

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


def _controllers():
    """The loaded BLAS libraries (NumPy's among them), and MKL's per-thread count when cuflash uses MKL."""
    return _controllers_of(_mkl())


@functools.lru_cache(maxsize=2)
def _controllers_of(mkl):
    from threadpoolctl import ThreadpoolController

    counts = [mkl.local] if mkl is not None else []
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        layer = getattr(lib, "threading_layer", None)
        if lib.internal_api == "openblas" and layer != "openmp":
            counts.append(_openblas(lib))
        elif lib.internal_api == "mkl":
            counts.append(_mkl_local(lib.dynlib))
        else:  # BLIS, ...: threadpoolctl's setter; an OpenMP layer's count is per thread
            counts.append(_Count(lib.get_num_threads, lib.set_num_threads, layer == "openmp"))
    return tuple(counts)


def _mkl_local(dynlib) -> _Count:
    """MKL's own count of the calling thread, 0 where it follows the process-wide one, read and set alike through
    ``MKL_Set_Num_Threads_Local`` (which returns the previous value). threadpoolctl reads MKL_Get_Max_Threads (the
    count in effect, the process-wide one where the thread has none) but sets the thread's own: a call restored a
    thread that followed the process-wide count to an explicit one, and a later change of that count by the user
    no longer reached it."""
    import ctypes

    local = dynlib.MKL_Set_Num_Threads_Local
    local.argtypes, local.restype = [ctypes.c_int], ctypes.c_int

    def get():
        n = local(0)
        local(n)
        return n

    return _Count(get, local, True)


def blas_threads(per_thread=True) -> list[int]:
    """The current thread count of every loaded BLAS library, as this thread sees it (with ``per_thread=False``
    only the process-wide counts; MKL's per-thread count is 0 where it follows the process-wide one)."""
    return [c.get() for c in _controllers() if per_thread or not c.per_thread]


def _pin(counts, saved):
    """Set each count to 1, recording ``(count, what it was)`` in ``saved`` before changing it: an interrupt
    half-way leaves in ``saved`` exactly what needs restoring."""
    for c in counts:
        n = c.get()
        saved.append((c, n))
        if n != 1:
            c.set(1)
    return saved


def _unpin(saved):
    """Restore the counts ``saved`` (:func:`_pin`'s record), the last first (MKL's two views of one count, see
    :func:`_controllers_of`, unwind in turn), each entry removed only once its count is back: an interrupt anywhere
    in here leaves in ``saved`` exactly what is still to restore. Only a count still at the 1 it was pinned to is set
    back: one the user set meanwhile (from another thread, during a call) is theirs now, and was overwritten with
    the value from before the call. A count that cannot be set back keeps its entry and its error is raised after
    the others are restored (one failing count, pinned last, kept every count before it at 1)."""
    failed = None
    for i in reversed(range(len(saved))):
        c, n = saved[i]
        try:
            if n is not None and n != 1 and c.get() == 1:
                c.set(n)
        except Exception as exc:  # noqa: BLE001 - raised once the others are back
            failed = failed or exc
            continue
        del saved[i]
    if failed is not None:
        raise failed


def _restore(saved):
    """:func:`_unpin` until ``saved`` is empty, then the first interrupt met on the way raised again. A Ctrl-C lands
    where Python calls something, _unpin's own first line included, before any ``try`` inside it: a restore that
    dropped its record there left OpenBLAS at one thread for the rest of the process. A few tries at most (a count
    that cannot be set fails every time); what is left stays in ``saved``."""
    pending = None
    for _ in range(8):
        try:
            _unpin(saved)
            break
        except BaseException as exc:  # noqa: BLE001 - a Ctrl-C while restoring: restore the rest, then raise it
            pending = pending or exc
    if pending is not None:
        raise pending


@contextmanager
def single_threaded():
    """Run BLAS on one thread for the duration; concurrent uses nest, the last restores.

    Libraries with a process-wide count are pinned once for all concurrent uses; a per-thread
    count (OpenMP) is pinned in the calling thread here and by :func:`worker_single_threaded`
    in each worker thread.
    """
    global _active
    counts = _controllers()
    entered, local = False, []
    try:  # every pin inside: a Ctrl-C in one (a call: where CPython raises it) left OpenBLAS pinned for good
        with _lock:
            if _active == 0:
                _restore(_saved)  # what an interrupted restore left (its counts' true settings) goes back first
                _pin([c for c in counts if not c.per_thread], _saved)
            _active += 1
            entered = True  # no call between the two
        _pin([c for c in counts if c.per_thread], local)
        yield
    finally:
        # Restored in one loop whose every step may be taken again, the interrupts met on the way raised after: a
        # Ctrl-C lands wherever Python calls something or waits, at a function's first line (before any try in it)
        # or in the wait for the lock, which another thread's call holds. Raised there, the last use's restore was
        # skipped, or _active never came back to 0 and no later call restored the counts either.
        pending = None
        for _ in range(8):  # a count that cannot be set fails every time: a few tries, then its error
            try:
                try:
                    _unpin(local)  # the per-thread counts (each entry removed once restored)
                finally:  # counted out even where a per-thread count cannot be set
                    with _lock:
                        _active -= entered
                        entered = False  # with the decrement: no call between them, so no interrupt either
                        if _active == 0:  # the last use (or the first, interrupted while pinning) restores
                            _unpin(_saved)
                break
            except BaseException as exc:  # noqa: BLE001 - raised once everything is restored
                pending = pending or exc
        if pending is not None:
            raise pending


def _after_fork_in_child():
    """A fork while another thread was inside a call: the child has a copy of the lock as that thread held it (its
    first call waited on it for ever) and of the pinned counts, which no thread of its own will restore. The child
    starts with a free lock, no use, and the counts as they were before the parent's calls."""
    global _lock, _active, _saved
    _lock, _active = threading.Lock(), 0
    saved, _saved = _saved, []
    try:
        _restore(saved)
    except Exception:  # noqa: BLE001 - a library that cannot be set in the child keeps its count: not worth failing
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def worker_single_threaded():
    """In a worker thread inside :func:`single_threaded`: pin the per-thread counts too."""
    local = []
    try:
        _pin([c for c in _controllers() if c.per_thread], local)
        yield
    finally:
        _restore(local)


# --------------------------------------------------------------------------------------------
# The tile products: NumPy's matmul or MKL's gemm
# --------------------------------------------------------------------------------------------
#: Products of fewer multiply-adds (per matrix) go to NumPy: there the call's ~7 us of Python, which holds the GIL
#: that the workers share, and MKL's small-product speed do not pay (two threads of 2 x 128 x 64 x 256 products:
#: MKL 225 GFLOP/s, OpenBLAS 272; of 2 x 128 x 64 x 512: 353 against 280).
MKL_MIN_MACS = 1 << 22
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def _mkl_library():
    """The path of ``libmkl_rt`` from the installed ``mkl`` distribution, or None."""
    import importlib.metadata

    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    paths = sorted(str(f.locate()) for f in files if f.name.startswith("libmkl_rt.so"))
    return paths[-1] if paths else None


class _Mkl:
    """``cblas_sgemm_batch_strided_64``/``cblas_dgemm_batch_strided_64`` of ``libmkl_rt`` (the ILP64 names: right
    whatever ``MKL_INTERFACE_LAYER`` says; one call for a tile's heads) and MKL's per-thread thread count."""

    def __init__(self, path):
        lib = ctypes.CDLL(path)
        i, p = ctypes.c_int64, ctypes.c_void_p
        self.gemm = {}
        for dtype, name, real in ((np.float32, "cblas_sgemm_batch_strided_64", ctypes.c_float),
                                  (np.float64, "cblas_dgemm_batch_strided_64", ctypes.c_double)):
            fn = getattr(lib, name)
            # layout, trans a, trans b, m, n, k, alpha, a, lda, stride a, b, ldb, stride b, beta, c, ldc, stride c, count
            fn.argtypes = [i, i, i, i, i, i, real, p, i, i, p, i, i, real, p, i, i, i]
            fn.restype = None
            self.gemm[np.dtype(dtype)] = fn
        # VML's exp2 (float32, the base-2 softmax) and exp (float64), ILP64 names: (n, a, r, mode)
        self.vml = {}
        for key, name in (((np.dtype(np.float32), 2), "vmsExp2_64"), ((np.dtype(np.float64), 0), "vmdExp_64")):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = [i, p, p, i], None
                self.vml[key] = fn
        local = lib.MKL_Set_Num_Threads_Local  # returns the previous value; 0: follow the global count
        local.argtypes, local.restype = [ctypes.c_int], ctypes.c_int

        def get():
            n = local(0)
            local(n)
            return n

        self.local = _Count(get, local, True)


@functools.lru_cache(maxsize=1)
def _load_mkl():
    path = _mkl_library()
    if path is None:
        return None, "the mkl package is not installed (pip install 'cuflash[mkl]')"
    try:
        return _Mkl(path), None
    except (OSError, AttributeError) as exc:
        return None, f"{path} does not load or lacks cblas_?gemm_batch_strided_64 ({exc})"


@functools.lru_cache(maxsize=4)
def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor string as Linux reports it (``GenuineIntel``, ``AuthenticAMD``, ...), or "" where unknown."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


#: The BLAS of the backend call running in this context, ``(mkl or None,)`` (:func:`one_choice`); None outside calls.
_CALL: contextvars.ContextVar = contextvars.ContextVar("cuflash_blas_of_the_call", default=None)


def one_choice(fn):
    """``fn`` (a backend entry point) with one BLAS for the whole call: :func:`_mkl` is asked once, when it starts,
    and every product, ``exp`` and thread pin of the call (its worker threads run in copies of its context) takes
    that answer; likewise its worker threads (:func:`call_threads`). ``CUFLASH_BLAS`` was read again for each
    problem's products, each ``exp`` rule and each worker's pins: another thread changing it during a ragged call
    gave some sequences MKL's bits and others OpenBLAS's, or left MKL's count unpinned in a worker (then
    multithreaded). Calls nest: an inner one keeps the outer choice."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with one_call():
            return fn(*args, **kwargs)
    return call


@contextmanager
def one_call():
    """The scope of :func:`one_choice`'s one answer, for an operation made of several backend calls (a ring's steps,
    each a call of the backend: they read ``CUFLASH_BLAS`` once each before)."""
    if _CALL.get() is not None:
        yield
        return
    token = _CALL.set((_chosen_mkl(), _env.worker_threads()))
    try:
        yield
    finally:
        _CALL.reset(token)


def _mkl():
    """The MKL of the running call (:func:`one_choice`), else :func:`_chosen_mkl`."""
    call = _CALL.get()
    return _chosen_mkl() if call is None else call[0]


def call_threads() -> int:
    """The worker threads of the running call (``CUFLASH_NUM_THREADS``, read once when it starts, as ``CUFLASH_BLAS``:
    another thread changing it to something malformed during a KV-cache call failed it after the cache append), else
    :func:`cuflash._env.worker_threads`."""
    call = _CALL.get()
    return _env.worker_threads() if call is None else call[1]


def _chosen_mkl():
    """MKL when ``CUFLASH_BLAS`` selects it, else None. ``auto`` selects it where it loads and the CPU is Intel's:
    on the 2-core AMD EPYC (Zen 4, AVX-512) this project's machines are on some days, MKL 2026.2's single-threaded
    ``sgemm`` took 0.96-1.24x NumPy's OpenBLAS's time on the tiles' products, ``dgemm`` 1.20-1.29x, and VML's
    ``exp2`` 3x NumPy's (2026-11-27) (``benchmarks/numpy_backend.py`` times the other BLAS beside the one chosen).
    The choice depends on the machine only, never on a measurement, so a machine's results never change between
    runs."""
    choice = _env.get("CUFLASH_BLAS")
    if choice == "numpy" or (choice == "auto" and cpu_vendor() != "GenuineIntel"):
        return None
    mkl, why = _load_mkl()
    if mkl is None and choice == "mkl":
        raise ValueError(f"environment variable CUFLASH_BLAS=mkl, but {why}; expected auto, numpy or mkl")
    return mkl


def describe() -> str:
    """Which BLAS runs the tile products and why, for the list of backends (``python -m cuflash``); a malformed
    ``CUFLASH_BLAS`` is said, not raised (the list is printed in error messages too)."""
    try:
        mkl, choice = _mkl(), _env.get("CUFLASH_BLAS")
    except ValueError as exc:
        return f"tile products: {exc}"
    if mkl is not None:
        return f"tile products in Intel MKL (CUFLASH_BLAS={choice})"
    why = ""
    if choice == "auto":
        vendor = cpu_vendor() or "unknown"
        why = ", the mkl package not installed" if _load_mkl()[0] is None else \
            f", MKL taken on Intel's CPUs only, this one: {vendor}"
    return f"tile products in NumPy's BLAS (CUFLASH_BLAS={choice}{why})"


#: VML_HA (results within 1 ulp: 0.57 measured against NumPy's 0.99) | VML_ERRMODE_IGNORE (no errno, no callback)
_VML_MODE = 0x2 | 0x100


def normal_exp(dtype, base):
    """``exp2`` (``base=2``) or ``exp`` (``base=0``: e) in place for arguments whose results are all known to be
    normal numbers (or inf, NaN): MKL VML's where ``CUFLASH_BLAS`` selects MKL, else None. VML takes 0.8x NumPy's
    time for float32 ``exp2`` and 0.7x for float64 ``exp`` on a 2 x 512 x 512 tile here, but 4x NumPy's (50 ns an
    element) where a result is subnormal or 0, hence only for arguments bounded away from there. One thread (the
    worker's MKL count); its result depends only on the element (checked: the same bits at every offset and length
    of the array)."""
    mkl = _mkl()
    fn = None if mkl is None else mkl.vml.get((np.dtype(dtype), base))
    if fn is None:
        return None

    def exp(x, out=None):
        out = x if out is None else out
        if x.dtype != dtype or out.dtype != dtype or x.shape != out.shape or not (x.flags.c_contiguous and
                                                                                 out.flags.c_contiguous):
            return (np.exp2 if base == 2 else np.exp)(x, out=out)
        fn(x.size, x.ctypes.data, out.ctypes.data, _VML_MODE)
        return out

    return exp


def products():
    """The backend's ``matmul(a, b, out=None)`` for one call: NumPy's, or MKL's gemm (:func:`_mkl_matmul`)."""
    mkl = _mkl()
    return np.matmul if mkl is None else functools.partial(_mkl_matmul, mkl)


def _operand(x):
    """``(transpose flag, leading dimension)`` of the matrices in ``x``'s last two axes as row-major BLAS reads
    them in place, or None when neither axis is contiguous."""
    rows, cols = x.shape[-2:]
    s0, s1 = x.strides[-2:]
    size = x.itemsize
    if (s1 == size or cols == 1) and s0 % size == 0:
        ld = s0 // size if rows > 1 else cols
        if ld >= max(1, cols):
            return _NO_TRANS, ld
    if (s0 == size or rows == 1) and s1 % size == 0:
        ld = s1 // size if cols > 1 else rows
        if ld >= max(1, rows):
            return _TRANS, ld
    return None


def _batch(lead, arrays):
    """The leading axes ``lead`` of the result as ``(count, strides, outer)``: the innermost axes that merge into one
    strided batch for every array (``count`` matrices, ``strides`` in elements, 0 where an array is broadcast) and
    the ``outer`` ones, ``(size, byte strides)`` each, looped over; None for a stride that is negative or no whole
    element."""
    count, strides, outer = 1, [0] * len(arrays), []
    for axis in range(-1, -len(lead) - 1, -1):
        size = lead[axis]
        if size == 1:
            continue
        step = []
        for x in arrays:
            st = x.strides[axis - 2] if x.ndim - 2 >= -axis and x.shape[axis - 2] > 1 else 0
            if st % x.itemsize or st < 0:  # MKL takes no negative batch stride
                return None
            step.append(st // x.itemsize)
        if count == 1 and not outer:
            count, strides = size, step
        elif not outer and all(s == c * count for s, c in zip(step, strides)):  # merges with the axes inside it
            count *= size
        else:
            outer.append((size, [st * x.itemsize for st, x in zip(step, arrays)]))
    return count, strides, outer


def _gemm_worth(a, b, out) -> bool:
    """Whether MKL takes this product, whatever the operands' layout: large enough, and of one dtype."""
    return a.shape[-2] * b.shape[-1] * a.shape[-1] >= MKL_MIN_MACS and out.dtype == a.dtype


def _gemm_plan(a, b, out):
    """The arguments of MKL's strided batch gemm for ``out = a @ b`` other than the pointers, as ``(fixed, offsets)``
    (``offsets``: byte offsets of a, b and out per call, one call per index of the outer axes), or None for NumPy."""
    (m, k), n = a.shape[-2:], b.shape[-1]
    lead = out.shape[:-2]
    if not _gemm_worth(a, b, out):
        return None
    try:
        if np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) != lead:  # NumPy's error for a wrong out, not a broadcast
            return None
        a, b = np.broadcast_to(a, lead + (m, k)), np.broadcast_to(b, lead + (k, n))
    except ValueError:
        return None
    ta, tb, tc = _operand(a), _operand(b), _operand(out)
    batch = _batch(lead, (a, b, out))
    if ta is None or tb is None or tc is None or tc[0] != _NO_TRANS or batch is None:
        return None
    count, (sa, sb, sc), outer = batch
    if count == 1:
        sc = m * tc[1]  # MKL checks stride_c >= ldc * m even for one matrix
    elif sc < m * tc[1]:  # out's matrices interleave: MKL refuses the call (parameter 17) and writes nothing
        return None
    offsets = [tuple(sum(i * st[j] for i, (_, st) in zip(index, outer)) for j in range(3))
               for index in itertools.product(*(range(size) for size, _ in outer))]  # [(0, 0, 0)] without outer axes
    return (ta[0], tb[0], m, n, k, ta[1], sa, tb[1], sb, tc[1], sc, count), offsets


_plans: dict = {}


def add_product(matmul, a, b, out):
    """``out += a @ b`` with the backend's ``matmul`` (:func:`products`): through MKL one gemm with beta = 1, which
    saves a pass over ``out`` and the product's temporary (its blocks of 256 inner terms then add into ``out`` in
    turn: other last bits than a product and a sum, as accurate, as reproducible); NumPy's: the product, then the
    sum."""
    if matmul is np.matmul:
        return _numpy_matmul(a, b, out, 1.0)
    return matmul(a, b, out=out, beta=1.0)


def _mkl_matmul(mkl, a, b, out=None, beta=0.0):
    """``np.matmul(a, b, out=out)`` through MKL's strided batch gemm (one call for the tiles of an item's heads) for
    float32/float64 operands that BLAS reads in place (one contiguous axis per matrix); anything else, and small
    products, go to NumPy. ``beta=1``: ``out += a @ b`` (see :func:`add_product`). Lean on purpose: the Python here
    holds the GIL that the worker threads share, so the arguments other than the pointers are worked out once per
    layout (:func:`_gemm_plan`; 5 us a call then, not 12).
    """
    gemm = mkl.gemm.get(a.dtype)
    if gemm is None or b.dtype != a.dtype or a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        return _numpy_matmul(a, b, out, beta)
    if out is None:
        lead = a.shape[:-2] if a.shape[:-2] == b.shape[:-2] else np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        out = np.empty(lead + (a.shape[-2], b.shape[-1]), dtype=a.dtype)
    key = (a.dtype, a.shape, a.strides, b.shape, b.strides, out.shape, out.strides, out.dtype)
    plan = _plans.get(key, False)
    if plan is False:
        if len(_plans) > 1024:  # layouts are few per problem; bound the table across many problems
            _plans.clear()
        plan = _plans[key] = _gemm_plan(a, b, out) if out.shape[-2:] == (a.shape[-2], b.shape[-1]) else None
    if plan is None and _gemm_worth(a, b, out):
        # operands BLAS cannot read in place (no unit-stride axis, a negative batch stride) are copied, not handed to
        # NumPy's matmul: its other BLAS rounds otherwise, and a strided V changed a third of a call's output bits
        ca, cb = np.ascontiguousarray(a), np.ascontiguousarray(b)
        if ca is not a or cb is not b:
            return _mkl_matmul(mkl, ca, cb, out, beta)
    if plan is None or np.may_share_memory(out, a) or np.may_share_memory(out, b):
        return _numpy_matmul(a, b, out, beta)
    (ta, tb, m, n, k, lda, sa, ldb, sb, ldc, sc, count), offsets = plan
    pa, pb, pc = a.ctypes.data, b.ctypes.data, out.ctypes.data
    for oa, ob, oc in offsets:
        gemm(_ROW_MAJOR, ta, tb, m, n, k, 1.0, pa + oa, lda, sa, pb + ob, ldb, sb, beta, pc + oc, ldc, sc, count)
    return out


def _numpy_matmul(a, b, out, beta):
    """NumPy's ``out = a @ b`` (beta 0) or ``out += a @ b`` (beta 1: the product, then the sum)."""
    if not beta:
        return np.matmul(a, b, out=out)
    out += np.matmul(a, b)
    return out
