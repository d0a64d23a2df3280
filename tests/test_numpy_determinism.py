"""The NumPy backend is bitwise reproducible and leaves the process's BLAS as it found it.

Bitwise the same for any ``CUFLASH_NUM_THREADS``, any BLAS thread count the user has set, and any
number of threads calling it at once; forward and backward, with and without dropout; with either source of
the tile products (``CUFLASH_BLAS``: NumPy's BLAS, or MKL where the ``mkl`` package is installed). After every
call the BLAS thread count is what it was before, MKL's per-thread count included.
"""
from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pytest
import threadpoolctl  # a dependency of cuflash (setup.cfg): imported plainly, never skipped

import cuflash
from cuflash.backends import numpy as nb
from cuflash.backends import _blas
from cuflash.backends._blas import blas_threads, single_threaded
from forked import child_exit_code  # tests/forked.py

#: Ragged tiles on purpose: a product whose inner dimension is not a multiple of the BLAS's
#: blocking is where OpenBLAS's result depends on its thread count (1000 x 1000 x 64 float32
#: differs in ~48k elements between 1 and 2 threads).
SHAPE_Q, SHAPE_K = (2, 1000, 4, 64), (2, 1000, 2, 64)
#: For the worker threads: several tiles of the default 512 x 512 (nb.BLOCK_Q, nb.BLOCK_K; the backward's are
#: 256 x 512 for this group of two query heads), the last ones ragged (neither length a multiple of 512 or 64).
#: The forward has 4 query-tile items per block of heads; the backward's 5 key tiles fill all nb.DQ_CHUNKS = 4 dQ
#: accumulators, one of them with two tiles, so dQ is a sum of more than two partials (a sum of two is the same
#: in either order) and the split of the work between workers shows in the bits.
TILED_Q, TILED_K = (2, 1900, 2, 64), (2, 2100, 1, 64)


def _cases(sq, sk, left):
    return {
        "plain": {},
        "causal": dict(causal=True),
        "window_seqlens": dict(window=(left, 40), seqlens_q=np.array([sq, sq * 7 // 10]),
                               seqlens_k=np.array([sk * 9 // 10, sk])),
        "dropout": dict(causal=True, dropout_p=0.25, seed=1234),
    }


CASES = _cases(SHAPE_Q[1], SHAPE_K[1], left=300)
TILED_CASES = _cases(TILED_Q[1], TILED_K[1], left=1100)  # a window over 3-4 key tiles: dQ rows of 3-4 partials


def _inputs(dtype=np.float32, shape_q=SHAPE_Q, shape_k=SHAPE_K):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_k, shape_q)]


def _run(q, k, v, do, options):
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy", **options)
    return (out, lse) + tuple(cuflash.attention_backward(do, q, k, v, out, lse, backend="numpy", **options))


def _assert_same(a, b, what):
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b):
        assert np.array_equal(x, y, equal_nan=True), \
            f"{name} differs ({what}): {int((x != y).sum())} of {x.size} elements"


@pytest.fixture(params=["numpy", "mkl"])
def products(request, monkeypatch):
    """The source of the tile products; MKL where the test extra installs it (Linux x86-64)."""
    if request.param == "mkl" and _blas._load_mkl()[0] is None:
        pytest.skip(f"MKL products: {_blas._load_mkl()[1]}")
    monkeypatch.setenv("CUFLASH_BLAS", request.param)
    return request.param


@pytest.fixture
def restore_blas():
    with threadpoolctl.threadpool_limits(limits=None):  # whatever a test sets is undone after it
        yield


def test_tiled_shapes_span_several_ragged_tiles():
    """Guard: the shapes of test_bitwise_across_worker_threads still cut into several tiles, ragged ones among
    them, and more key tiles than dQ accumulators (else it would check little of the split between workers)."""
    (sq, sk), block_q, block_k = (TILED_Q[1], TILED_K[1]), nb.BLOCK_Q, nb.BLOCK_K
    assert sq // block_q >= 3 and sq % block_q and sq % 64, (sq, block_q)
    assert sk // block_k >= nb.DQ_CHUNKS and sk % block_k and sk % 64, (sk, block_k, nb.DQ_CHUNKS)


@pytest.mark.parametrize("name", TILED_CASES)
def test_bitwise_across_worker_threads(monkeypatch, products, name):
    q, k, v, do = _inputs(shape_q=TILED_Q, shape_k=TILED_K)
    results = {}
    for threads in (1, 2, 3, 4):
        monkeypatch.setenv("CUFLASH_NUM_THREADS", str(threads))
        results[threads] = _run(q, k, v, do, TILED_CASES[name])
    for threads in (2, 3, 4):
        _assert_same(results[1], results[threads], f"CUFLASH_NUM_THREADS=1 vs {threads}")


@pytest.mark.parametrize("name", ["plain", "dropout"])
def test_bitwise_across_user_blas_settings(monkeypatch, restore_blas, products, name):
    q, k, v, do = _inputs()
    results = []
    for blas in (1, 2, 4):
        threadpoolctl.threadpool_limits(limits=blas, user_api="blas")
        for threads in (1, 2):
            monkeypatch.setenv("CUFLASH_NUM_THREADS", str(threads))
            results.append((blas, threads, _run(q, k, v, do, CASES[name])))
    for blas, threads, r in results[1:]:
        _assert_same(results[0][2], r, f"BLAS threads 1 vs {blas}, workers 1 vs {threads}")


@pytest.mark.parametrize("name", ["causal", "dropout"])
def test_bitwise_with_concurrent_callers(restore_blas, products, name):
    """Eight threads calling at once (through a barrier) get the single caller's bits, and the
    process's BLAS setting survives them."""
    threadpoolctl.threadpool_limits(limits=2, user_api="blas")
    before = blas_threads()
    q, k, v, do = _inputs()
    alone = _run(q, k, v, do, CASES[name])
    barrier = threading.Barrier(8)
    results, errors = [None] * 8, []

    def call(n):
        try:
            barrier.wait()
            results[n] = _run(q, k, v, do, CASES[name])
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    workers = [threading.Thread(target=call, args=(n,)) for n in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    for n, r in enumerate(results):
        _assert_same(alone, r, f"concurrent caller {n}")
    assert blas_threads() == before


@pytest.mark.parametrize("setting", [1, 2, 3])
def test_blas_setting_restored_after_every_call(restore_blas, products, setting):
    threadpoolctl.threadpool_limits(limits=setting, user_api="blas")
    before = blas_threads()  # MKL's per-thread count too (0: it follows the process-wide one)
    process = blas_threads(per_thread=False)
    assert process and all(n == setting for n in process), "no BLAS found to control"
    q, k, v, do = _inputs()
    for options in CASES.values():
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        assert blas_threads() == before
        cuflash.attention_backward(do, q, k, v, out, lse, **options)
        assert blas_threads() == before
    # a user's product afterwards runs with the user's setting
    info = [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]
    assert all(n == setting for n in info)


def test_single_threaded_nests_across_threads(restore_blas):
    """Overlapping uses from two threads: BLAS stays at one thread until the last leaves, then
    the saved setting comes back (per-thread save/restore would leave the process at 1)."""
    threadpoolctl.threadpool_limits(limits=2, user_api="blas")
    entered, release = threading.Event(), threading.Event()

    def other():
        with single_threaded():
            entered.set()
            release.wait()

    t = threading.Thread(target=other)
    t.start()
    entered.wait()
    process = lambda: blas_threads(per_thread=False)  # noqa: E731  (MKL's per-thread count is this thread's own)
    with single_threaded():
        assert blas_threads() == [1] * len(blas_threads())
    assert process() == [1] * len(process())  # the other thread is still inside
    release.set()
    t.join()
    assert process() == [2] * len(process())


def test_an_interrupt_between_a_restores_get_and_set_still_restores(restore_blas, monkeypatch):
    """The restore read a count and then set it, in one try: a Ctrl-C landing right after the read was kept for
    later and that count's set skipped, leaving OpenBLAS at one thread for good (found under a timer firing
    KeyboardInterrupt into calls in a loop). Here the read of each count in turn raises once, while restoring."""
    threadpoolctl.threadpool_limits(limits=2, user_api="blas")
    before = blas_threads()
    counts = [c for c in _blas._controllers() if not c.per_thread]
    assert counts, "no process-wide BLAS count: nothing to restore"
    for victim in counts:
        reads = [0]

        def get(real=victim.get):
            reads[0] += 1
            if reads[0] == 2:  # the first read pins (in _pin), the second is the restore's
                raise KeyboardInterrupt
            return real()
        monkeypatch.setattr(victim, "get", get)
        with pytest.raises(KeyboardInterrupt):
            with single_threaded():
                pass
        monkeypatch.undo()
        assert blas_threads() == before and _blas._active == 0


@pytest.mark.parametrize("blas", ["numpy", "mkl"])
def test_an_interrupt_as_the_restore_starts_still_restores(restore_blas, monkeypatch, blas):
    """A Ctrl-C lands where Python calls something, the first line of the function that restores the counts too,
    before any try inside it: the record of the counts to restore was dropped, and OpenBLAS stayed at one thread for
    the rest of the process (every later call then took 1 for the setting to come back to; found under a timer
    firing KeyboardInterrupt into calls in a loop). Here that function raises at its entry, once per call of it."""
    if blas == "mkl" and _blas._mkl_library() is None:
        pytest.skip("MKL is not installed")
    monkeypatch.setenv("CUFLASH_BLAS", blas)
    threadpoolctl.threadpool_limits(limits=2, user_api="blas")
    before, real = blas_threads(), _blas._unpin
    q, k, v, _ = _inputs()
    cuflash.attention(q[:, :10], k[:, :10], v[:, :10])  # MKL loaded (and its count recorded) before
    for victim in range(1, 4):  # the n-th restore of a call (worker, caller, process-wide) meets the interrupt
        seen = [0]

        def unpin(saved):
            seen[0] += 1
            if seen[0] == victim and saved:
                raise KeyboardInterrupt
            return real(saved)
        monkeypatch.setattr(_blas, "_unpin", unpin)
        try:
            cuflash.attention(q[:, :10], k[:, :10], v[:, :10])
        except KeyboardInterrupt:
            pass
        monkeypatch.setattr(_blas, "_unpin", real)
        assert blas_threads() == before and _blas._active == 0, f"restore {victim} interrupted"
        cuflash.attention(q[:, :10], k[:, :10], v[:, :10])
        assert blas_threads() == before, f"after restore {victim} was interrupted, a whole call"


def test_an_interrupt_at_the_entry_of_any_function_the_restore_calls_still_restores(restore_blas):
    """A Ctrl-C lands at a function's first line too (CPython checks for signals as a function starts), before any
    try inside it: the process-wide restore began with a call to a helper whose retries sat inside it, so an interrupt
    at that helper's entry dropped the restore, and OpenBLAS stayed at one thread until some later call (found under
    a timer firing KeyboardInterrupt into calls in a loop: 2 in 1409). Here each Python function the end of a use of
    single_threaded calls in turn raises at its entry."""
    import sys

    threadpoolctl.threadpool_limits(limits=2, user_api="blas")
    before = blas_threads()
    for victim in range(1, 8):
        calls = [0]

        def tracer(frame, event, arg):
            if event == "call" and frame.f_code.co_filename == _blas.__file__:
                calls[0] += 1
                if calls[0] == victim:
                    raise KeyboardInterrupt
            return None

        use = single_threaded()
        use.__enter__()
        sys.settrace(tracer)
        try:
            use.__exit__(None, None, None)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        assert blas_threads() == before and _blas._active == 0 and not _blas._saved, f"call {victim} interrupted"


def test_an_interrupt_while_waiting_for_the_lock_still_restores(restore_blas):
    """The end of a use waits for the lock that another thread's call holds (while it pins or restores), and CPython
    interrupts that wait for a signal: the KeyboardInterrupt left before the use was counted out, so no later call
    ever restored the counts either (the process stayed at one BLAS thread). Here SIGALRM raises it in that wait."""
    import signal

    threadpoolctl.threadpool_limits(limits=2, user_api="blas")
    before = blas_threads()
    held, release = threading.Event(), threading.Event()

    def hold():
        with _blas._lock:
            held.set()
            release.wait(30)

    def on_alarm(signum, frame):
        raise KeyboardInterrupt

    holder = threading.Thread(target=hold)
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        with pytest.raises(KeyboardInterrupt):
            with single_threaded():
                holder.start()
                assert held.wait(30)
                signal.setitimer(signal.ITIMER_REAL, 0.1)  # fires while the end of the use waits for the lock
                threading.Timer(0.5, release.set).start()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        release.set()
        holder.join()
    assert blas_threads() == before and _blas._active == 0


def test_a_per_thread_count_that_cannot_be_restored_still_counts_the_use_out(restore_blas, monkeypatch):
    """A per-thread count whose restore fails every time raises its error, after the use is counted out and the
    process-wide counts are restored (else no later call would ever restore them), and after every other per-thread
    count is restored: the counts unwind last first, and the failing one, pinned last, kept the others (MKL's own
    count of the thread, where a test before had loaded MKL) at 1 for good."""
    threadpoolctl.threadpool_limits(limits=2, user_api="blas")
    real = _blas._controllers()
    before = [c.get() for c in real]

    class Count:
        per_thread = True

        def __init__(self, stubborn):
            self.n, self.stubborn = 2, stubborn

        def get(self):
            return self.n

        def set(self, n):
            if self.stubborn and n != 1:
                raise OSError("this count cannot be set back")
            self.n = n

    obliging, stubborn = Count(False), Count(True)
    monkeypatch.setattr(_blas, "_controllers", lambda: (*real, obliging, stubborn))
    with pytest.raises(OSError, match="cannot be set back"):
        with single_threaded():
            assert obliging.get() == 1 == stubborn.get()
    assert _blas._active == 0 and [c.get() for c in real] == before
    assert obliging.get() == 2 and stubborn.get() == 1


def test_mkls_own_count_of_a_thread_is_left_as_it_was(restore_blas, monkeypatch):
    """With MKL loaded but the products in OpenBLAS (CUFLASH_BLAS=numpy, or auto on AMD's CPUs), MKL's count was read
    as the count in effect (2) but set as the calling thread's own: a thread that followed the process-wide count (0)
    came back with an explicit 2, and a later change of the process-wide count no longer reached it."""
    mkl = _blas._load_mkl()[0]
    if mkl is None:
        pytest.skip(f"MKL: {_blas._load_mkl()[1]}")
    _blas._controllers_of.cache_clear()  # the loaded libraries listed anew: MKL among them (loaded just above)
    assert any(c.per_thread for c in _blas._controllers_of(None))
    monkeypatch.setenv("CUFLASH_BLAS", "numpy")
    q, k, v, _ = _inputs()
    before = mkl.local.get()  # threadpoolctl's limits (other tests') leave an explicit count behind
    try:
        mkl.local.set(0)  # this thread follows MKL's process-wide count
        cuflash.attention(q[:, :10], k[:, :10], v[:, :10])
        assert mkl.local.get() == 0
    finally:
        mkl.local.set(before)


@contextlib.contextmanager
def _a_call_in_another_thread():
    """A thread inside a call's BLAS use (single_threaded) for the duration."""
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with single_threaded():
            inside.set()
            leave.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(30)
        yield
    finally:
        leave.set()
        holder.join()


def test_a_fork_while_another_thread_is_in_a_call_leaves_the_child_free(restore_blas):
    """The child of a fork taken while another thread held the BLAS lock inside a call inherited the lock held (its
    first call waited for ever) and the pinned count, which no thread of its own would restore."""
    threadpoolctl.threadpool_limits(limits=2, user_api="blas")
    before = blas_threads()
    with _a_call_in_another_thread():
        with _blas._lock:  # taken and released here: the fork below comes while the holder is inside its use
            pass
        pid = os.fork()
        if pid == 0:  # the child: one call, then report through the exit status
            ok = False
            try:
                q, k, v, _ = _inputs()
                cuflash.attention(q[:, :10], k[:, :10], v[:, :10])
                ok = blas_threads() == before and _blas._active == 0
            finally:
                os._exit(0 if ok else 1)
        assert child_exit_code(pid) == 0, "the child's BLAS state was not its own"
    assert blas_threads() == before


def test_an_interrupt_while_pinning_or_restoring_restores_the_setting(restore_blas, monkeypatch):
    """A Ctrl-C lands where Python calls something: inside the pinning of a count it left OpenBLAS at one thread for
    the rest of the process (the count was set, the context never entered); inside the restoring, the counts after
    it. Here an interrupt right after each count change in turn, of a use of single_threaded."""
    threadpoolctl.threadpool_limits(limits=2, user_api="blas")
    before = blas_threads()
    counts = _blas._controllers()

    def wrap(stop_at):
        calls = [0]
        for c in counts:
            def counted(n, real=c.set):
                calls[0] += 1
                real(n)
                if calls[0] == stop_at:
                    raise KeyboardInterrupt
            monkeypatch.setattr(c, "set", counted)
        return calls

    calls = wrap(0)  # a use without interrupt: how many changes it makes
    with single_threaded():
        pass
    monkeypatch.undo()
    assert calls[0] >= 2 and blas_threads() == before, "no BLAS count changed: nothing to interrupt"
    for at in range(1, calls[0] + 1):
        wrap(at)
        with pytest.raises(KeyboardInterrupt):
            with single_threaded():
                pass
        monkeypatch.undo()
        assert blas_threads() == before and _blas._active == 0, f"interrupted after change {at} of {calls[0]}"


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "1.5", "", "1_000", "+4", "\u0664\u0664"])
def test_bad_num_threads_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("CUFLASH_NUM_THREADS", raw)
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="CUFLASH_NUM_THREADS"):
        cuflash.attention(q[:, :10], k[:, :10], v[:, :10])


@pytest.mark.parametrize("raw", ["openblas", "MKL ", ""])
def test_bad_blas_choice_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("CUFLASH_BLAS", raw)
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="CUFLASH_BLAS=.*expected auto, numpy or mkl"):
        cuflash.attention(q[:, :10], k[:, :10], v[:, :10])


def test_mkl_asked_for_but_missing_says_why(monkeypatch):
    monkeypatch.setenv("CUFLASH_BLAS", "mkl")
    monkeypatch.setattr(_blas, "_load_mkl", lambda: (None, "the mkl package is not installed"))
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="CUFLASH_BLAS=mkl, but the mkl package is not installed"):
        cuflash.attention(q[:, :10], k[:, :10], v[:, :10])


def test_one_blas_per_call_whatever_another_thread_sets(monkeypatch):
    """``CUFLASH_BLAS`` changed while a call runs (here: right after the call first reads it, as another thread
    could) takes effect from the next call: the ragged forward and backward of three sequences (one problem each)
    give MKL's bits throughout, not MKL's for the first sequence and OpenBLAS's for the rest."""
    if _blas._load_mkl()[0] is None:
        pytest.skip(f"MKL products: {_blas._load_mkl()[1]}")
    rng = np.random.default_rng(3)
    lengths = np.array([600, 700, 650], np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, do = (rng.standard_normal((int(cu[-1]), 2, 64)).astype(np.float32) for _ in range(4))

    def run():
        out, lse = cuflash.attention_varlen(q, k, v, cu, cu, return_lse=True, backend="numpy")
        return (out, lse) + tuple(cuflash.attention_varlen_backward(do, q, k, v, out, lse, cu, cu, backend="numpy"))

    monkeypatch.setenv("CUFLASH_NUM_THREADS", "2")
    runs = {}
    for choice in ("mkl", "numpy"):
        monkeypatch.setenv("CUFLASH_BLAS", choice)
        runs[choice] = run()
    assert any(not np.array_equal(a, b) for a, b in zip(runs["mkl"], runs["numpy"]))  # else this test shows nothing
    get = _blas._env.get

    def flipping(name):
        value = get(name)
        if name == "CUFLASH_BLAS":
            os.environ["CUFLASH_BLAS"] = "numpy"  # every later read sees the other thread's change
        return value

    for forward_call in (True, False):  # each call starts again from mkl; the flip after its first read
        monkeypatch.setenv("CUFLASH_BLAS", "mkl")
        monkeypatch.setattr(_blas._env, "get", flipping)
        if forward_call:
            out, lse = cuflash.attention_varlen(q, k, v, cu, cu, return_lse=True, backend="numpy")
            _assert_same(runs["mkl"][:2], (out, lse), "CUFLASH_BLAS changed during the forward")
        else:
            out, lse = runs["mkl"][:2]
            grads = cuflash.attention_varlen_backward(do, q, k, v, out, lse, cu, cu, backend="numpy")
            for name, x, y in zip(("dq", "dk", "dv"), runs["mkl"][2:], grads):
                assert np.array_equal(x, y), f"{name}: CUFLASH_BLAS changed during the backward"
        monkeypatch.setattr(_blas._env, "get", get)


def test_a_call_reads_the_thread_count_once(monkeypatch):
    """CUFLASH_NUM_THREADS was read again by every pool of a call (a KV-cache call runs one per group of sequences):
    another thread setting a malformed value meanwhile failed the call after its cache append. It is read once, as
    the call starts, with CUFLASH_BLAS; here a KV-cache call of several groups, a backward, and a forward with its
    residual and that residual's backward (its fingerprints of the saved arrays read the variable again, after the
    forward had run)."""
    from cuflash import _env, residual
    from cuflash.backends import numpy_ragged

    reads = [0]

    def counted(real=_env.worker_threads):
        reads[0] += 1
        return real()
    monkeypatch.setattr(_env, "worker_threads", counted)
    monkeypatch.setattr(residual, "worker_threads", counted, raising=False)  # where it was imported by name
    monkeypatch.setattr(numpy_ragged, "KV_GATHER_BYTES", 1)  # one group per sequence
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, 1, 2, 16)).astype(np.float16)  # upcast: copied, so grouped
    kc, vc = (rng.standard_normal((3, 64, 2, 16)).astype(np.float16) for _ in range(2))
    cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([10, 64, 30], np.int32))
    assert reads[0] == 1
    q, k, v, do = _inputs()
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    reads[0] = 0
    cuflash.attention_backward(do, q, k, v, out, lse)
    assert reads[0] == 1
    assert q.nbytes >= 1 << 20  # fingerprinted on the worker threads
    reads[0] = 0
    out, res = cuflash.attention(q, k, v, return_residual=True)
    assert reads[0] == 1
    reads[0] = 0
    cuflash.attention_backward(do, res)
    assert reads[0] == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_worker_computes_a_tile_mask_can_call():
    """The tile masks' derived values were functools.cached_property, whose lock (Python 3.10 and 3.11) is one per
    property for every instance and held while any instance computes: a fork while a worker held it left the child
    waiting for ever in its first masked call (11 of 40 forks beside two threads calling). Here a worker is held
    inside such a computation while the process forks; the child makes a causal call with seqlens."""
    started, release = threading.Event(), threading.Event()

    class Slow(np.ndarray):
        def any(self, *args, **kwargs):
            started.set()
            release.wait(30)
            return np.ndarray.any(self, *args, **kwargs)

    held = nb._TileMask(np.zeros((1, 1, 1, 4, 4), bool).view(Slow))
    worker = threading.Thread(target=lambda: held.start)  # the property the call below reads
    worker.start()
    assert started.wait(30)
    q, k, v, _ = _inputs(shape_q=(2, 40, 2, 16), shape_k=(2, 40, 2, 16))
    pid = os.fork()
    if pid == 0:  # the child: the call, then leave without running the parent's cleanup
        try:
            out = cuflash.attention(q, k, v, causal=True, seqlens_q=np.array([40, 27]), seqlens_k=np.array([33, 40]))
            os._exit(0 if np.isfinite(out).all() else 3)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit code
            os._exit(4)
    release.set()
    worker.join()
    assert child_exit_code(pid) == 0


def test_a_blas_count_the_user_sets_during_a_call_is_theirs_after_it(restore_blas):
    """The restore at a call's end set every count back to its value from before the call, so a count the user set
    from another thread meanwhile (threadpoolctl, while a call ran) was overwritten. Now only a count still at the 1
    cuflash pinned is set back."""
    threadpoolctl.threadpool_limits(limits=2, user_api="blas")
    with _a_call_in_another_thread():
        assert set(blas_threads(per_thread=False)) == {1}  # pinned for the call
        threadpoolctl.threadpool_limits(limits=3, user_api="blas")  # the user's new setting, made during the call
    assert set(blas_threads(per_thread=False)) == {3}
    with single_threaded():  # and a call that runs alone restores as before
        assert set(blas_threads(per_thread=False)) == {1}
    assert set(blas_threads(per_thread=False)) == {3}


@pytest.mark.parametrize("form", ["strided out", "fortran dout", "shifted"])
def test_bitwise_whatever_the_layout_of_out_and_dout(form):
    """D = rowsum(dO ∘ O) was an einsum over views of the caller's out and dout, which sums a last axis that is not
    contiguous in another order: a residual whose out= was every other column of a larger buffer, or a Fortran-ordered
    dout of the same values, changed the last bits of 3879 of 8192 elements of dQ (5236 of dK). "shifted": a strided
    out where dO is near float32's largest and D comes from dO at a power of two (_GradShifts)."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 64, 2, 64)).astype(np.float32) for _ in range(4))
    if form == "shifted":
        dout *= np.float32(2.0 ** 120)
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy")
    want = cuflash.attention_backward(dout, q, k, v, out, lse, backend="numpy")
    if form in ("strided out", "shifted"):
        wide = np.empty(out.shape[:-1] + (2 * out.shape[-1],), np.float32)
        out = wide[..., ::2]
        cuflash.attention(q, k, v, out=out, backend="numpy")
    else:
        dout = np.asfortranarray(dout)
    for g, w in zip(cuflash.attention_backward(dout, q, k, v, out, lse, backend="numpy"), want):
        np.testing.assert_array_equal(g, w)


def test_a_call_left_early_stops_its_worker_items_between_tiles(monkeypatch):
    """Ctrl-C (or an item's error) in the calling thread left the pool's exit waiting for every submitted item: a
    threaded backward raised 6 s after a SIGINT sent 0.3 s into it, later than the whole call takes, and at N = 1M an
    item runs for hours. The running items now end at their next tile and the others never start."""
    import time

    monkeypatch.setenv("CUFLASH_NUM_THREADS", "2")
    tiles_done = []

    def item(x):
        for _ in range(0 if x == 0 else 200):
            nb._check_stop()
            time.sleep(0.005)
            tiles_done.append(x)
        return x

    def consume(x, result):
        raise KeyboardInterrupt  # at the first result, item 0's, while item 1 has 199 tiles to go

    with pytest.raises(KeyboardInterrupt):
        nb._run(item, range(6), consume)
    assert len(tiles_done) < 50, f"{len(tiles_done)} tiles ran after the call was left (of 1000)"
    nb._check_stop()  # the caller's context holds no stopped call afterwards
