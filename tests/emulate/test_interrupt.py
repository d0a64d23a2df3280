"""Ctrl-C during an emulated launch: honoured within a fraction of a second, and the emulator stays usable."""
import _thread
import os
import signal
import threading
import time

import numpy as np
import pytest

import cuflash.emulate as emu
import cuflash.emulate._runner as runner
from emu_helpers import spec

# Uninterrupted, each launch below runs for ~30 s on the development VM (0.5 us per 32-thread barrier round, 0.4 ms
# per busy block).
LONG_LAUNCHES = {
    "barriers in one block": lambda: spec("runtime_tests.cu", "barrier_loop",
                                          (np.int32(50_000_000), np.zeros(32, np.int32))),
    "many blocks without barriers": lambda: spec("hardening_tests.cu", "busy_blocks_kernel",
                                                 (np.int32(200_000), np.zeros(64, np.uint32)),
                                                 grid=(100_000, 1, 1), block=(1, 1, 1)),
}


def _sigint_after(seconds):
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))  # a real SIGINT, as from a terminal
    timer.start()
    return timer


@pytest.mark.parametrize("name", sorted(LONG_LAUNCHES))
def test_ctrl_c_stops_a_launch_quickly(name):
    launch_spec = LONG_LAUNCHES[name]()
    emu.compile(launch_spec)  # compile first: only the launch is being timed
    threads_before = _thread._count()  # the launch's worker is a bare _thread thread: threading does not list it
    timer = _sigint_after(0.5)
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        emu.launch(launch_spec)
    elapsed = time.perf_counter() - start
    timer.join()
    assert elapsed < 1.5, f"KeyboardInterrupt arrived {elapsed:.1f} s after the launch began (SIGINT at 0.5 s)"
    _assert_worker_ended(threads_before)
    # The same library, and the runtime state it keeps, work at once.
    out = np.zeros(32, np.int32)
    emu.launch(spec("runtime_tests.cu", "barrier_loop", (np.int32(100), out)))
    np.testing.assert_array_equal(out, sum(range(100)))



def _assert_worker_ended(threads_before):
    # The worker returns right after handing its outcome over; give it that moment (not a speed claim).
    for _ in range(100):
        if _thread._count() == threads_before:
            return
        time.sleep(0.01)
    assert _thread._count() == threads_before, "the launch's worker thread is still alive"


def _barrier_loop(rounds):
    out = np.zeros(32, np.int32)
    return spec("runtime_tests.cu", "barrier_loop", (np.int32(rounds), out)), out


def test_a_worker_that_never_begins_leaves_the_launch_to_the_main_thread(monkeypatch):
    """Thread.start hangs forever when the new thread dies before reporting in (CPython gh-140746); the launcher
    must not: a worker that does not begin in time loses the launch to the main thread, which runs it once."""
    launch_spec, out = _barrier_loop(100)
    emu.compile(launch_spec)
    late = []
    monkeypatch.setattr(runner, "_START_SECONDS", 0.2)
    monkeypatch.setattr(runner._thread, "start_new_thread", lambda fn, args: late.append(fn))  # a thread that died
    emu.launch(launch_spec)
    np.testing.assert_array_equal(out, sum(range(100)))
    out[:] = 0
    late[0]()  # the worker begins after all: it must find the launch taken and return without running it
    np.testing.assert_array_equal(out, 0)


def test_no_thread_to_be_had_launches_on_the_main_thread(monkeypatch):
    launch_spec, out = _barrier_loop(100)
    emu.compile(launch_spec)

    def refuse(fn, args):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(runner._thread, "start_new_thread", refuse)
    emu.launch(launch_spec)
    np.testing.assert_array_equal(out, sum(range(100)))
