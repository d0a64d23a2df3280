"""Ctrl-C during an emulated launch: honoured within a fraction of a second, and the emulator stays usable."""
import os
import signal
import threading
import time

import numpy as np
import pytest

import cuflash.emulate as emu
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
    threads_before = threading.active_count()
    timer = _sigint_after(0.5)
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        emu.launch(launch_spec)
    elapsed = time.perf_counter() - start
    timer.join()
    assert elapsed < 1.5, f"KeyboardInterrupt arrived {elapsed:.1f} s after the launch began (SIGINT at 0.5 s)"
    assert threading.active_count() == threads_before, threading.enumerate()  # the launch's worker has ended
    # The same library, and the runtime state it keeps, work at once.
    out = np.zeros(32, np.int32)
    emu.launch(spec("runtime_tests.cu", "barrier_loop", (np.int32(100), out)))
    np.testing.assert_array_equal(out, sum(range(100)))

