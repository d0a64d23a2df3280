"""Loading an emulated kernel library, checking arguments against its signature, and launching it."""
from __future__ import annotations

import _thread
import ctypes
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Parameter kinds reported by kernels/emulate/wrapper.h.
OTHER, POINTER, SIGNED, UNSIGNED, FLOAT, BOOL = range(6)
SCHEDULES = {"forward": 0, "reverse": 1, "random": 2}
MAX_PARAMS = 256
# One launch at a time in the process: a launch installs a process-wide SIGSEGV hook, and one library's runtime
# state (its bank-conflict counters too) is global to it.
_LAUNCH_LOCK = threading.Lock()


def _after_fork_in_child():
    """A fork while another thread launched: the child's copy of the lock is held by a thread it does not have (its
    first launch waited for ever). No launch runs in the child: a free lock."""
    global _LAUNCH_LOCK
    _LAUNCH_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# How often the waiting main thread wakes up to run Python's signal handlers (Ctrl-C) during a launch.
_POLL_SECONDS = 0.1
# How long a launch waits for its worker thread to begin before running on the main thread instead.
_START_SECONDS = 10.0


class EmulationError(RuntimeError):
    """The emulated kernel failed: device assert, deadlock, divergent barrier, bad warp collective, ...

    ``block`` and ``thread`` are the (x, y, z) indices of the failing thread where one is known, else None.
    """

    def __init__(self, message: str, block=None, thread=None):
        where = []
        if block is not None:
            where.append(f"block {block}")
        if thread is not None:
            where.append(f"thread {thread}")
        super().__init__(message + (f" [{', '.join(where)}]" if where else ""))
        self.block, self.thread = block, thread


@dataclass(frozen=True)
class BankStats:
    """Shared-memory bank conflicts of one launch, for the accesses the emulator sees warp-wide.

    A request is one 8x8 matrix of an ``ldmatrix`` or one quarter-warp of 16-byte ``cp.async`` stores;
    it takes as many wavefronts as the most distinct 4-byte words in one bank (1: conflict-free).
    Plain C++ loads and stores to shared memory are not seen.
    """

    ldmatrix_requests: int
    ldmatrix_wavefronts: int
    cp_async_requests: int
    cp_async_wavefronts: int

    @property
    def conflict_free(self) -> bool:
        return (self.ldmatrix_wavefronts == self.ldmatrix_requests
                and self.cp_async_wavefronts == self.cp_async_requests)


@dataclass(frozen=True)
class Param:
    kind: int
    size: int
    pointee_kind: int
    pointee_size: int
    type_name: str


def _spelled(pretty: str) -> str:
    match = re.search(r"\[with T = (.*)\]$", pretty)
    return match.group(1) if match else pretty


class Library:
    """One compiled kernel: its signature and a launcher."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        self.params = self._signature()

    def _signature(self) -> list[Param]:
        desc = (ctypes.c_int * (4 * MAX_PARAMS))()
        names = (ctypes.c_char_p * MAX_PARAMS)()
        n = self._lib.cuflash_emu_signature(desc, names, MAX_PARAMS)
        if n > MAX_PARAMS:
            raise TypeError(f"kernel has {n} parameters; the emulator supports {MAX_PARAMS}")
        return [Param(*desc[4 * i:4 * i + 4], _spelled(names[i].decode())) for i in range(n)]

    def launch(self, args, grid, block, shared_bytes, schedule, seed, stack_bytes, hw_math=False) -> BankStats:
        buffers = pack_arguments(self.params, args)
        argv = (ctypes.c_void_p * max(1, len(buffers)))(*[ctypes.addressof(b) for b in buffers])
        err = ctypes.create_string_buffer(2048)
        where = (ctypes.c_int * 6)()
        cancel = ctypes.c_int(0)
        fn = self._lib.cuflash_emu_launch
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                       ctypes.c_ulonglong, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong,
                       ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_char_p, ctypes.c_ulonglong,
                       ctypes.POINTER(ctypes.c_int)]
        counts = (ctypes.c_ulonglong * 4)()
        with _LAUNCH_LOCK:
            rc = _interruptible(lambda: fn(argv, (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block),
                                           shared_bytes, schedule, seed, stack_bytes, ctypes.byref(cancel),
                                           int(hw_math), err, len(err), where), cancel)
            # read under the lock: the counters are the library's, and the next launch of it starts them again (read
            # after, a launch of another thread's got the other launch's counts)
            self._lib.cuflash_emu_bank_stats(counts)
        if rc:
            block_idx = tuple(where[0:3]) if where[0] >= 0 else None
            thread_idx = tuple(where[3:6]) if where[3] >= 0 else None
            raise EmulationError(err.value.decode(errors="replace"), block_idx, thread_idx)
        return BankStats(*counts)


def _interruptible(call, cancel: ctypes.c_int) -> int:
    """``call()`` (a launch) on a worker thread, so that Ctrl-C reaches the waiting main thread within
    ``_POLL_SECONDS``; on any exception there (KeyboardInterrupt, SystemExit from a signal handler) the launch is
    told to stop through ``cancel`` (the runtime checks it between blocks and at every barrier), awaited, and the
    exception re-raised: no launch outlives the call, and the library can be launched again.

    ctypes releases the GIL during the call. Python runs signal handlers in the main thread only, and a blocking
    wait would postpone them until the launch ends (24.7 s seen), hence the short timed waits. They wait for an
    Event, not Thread.join: a join interrupted by KeyboardInterrupt marks a running thread as stopped (CPython
    3.11, bpo-45274), after which join returns while the launch still runs.

    The worker is a bare ``_thread`` thread, not ``threading.Thread``: Thread.start waits without a timeout for
    the new thread to report in, and waits forever when that thread dies before it does (CPython gh-140746). A CI
    run hung there once, after some thousand launches, with no such OS thread left. Here a thread that has not
    begun within ``_START_SECONDS`` loses the launch to the main thread (without Ctrl-C for that launch); the
    ``owner`` lock makes sure exactly one of the two runs it.
    """
    if threading.current_thread() is not threading.main_thread():
        return call()  # only the main thread receives KeyboardInterrupt: nothing to wait for (~0.2 ms saved)
    outcome, done, owner = {}, threading.Event(), threading.Lock()

    def run():
        if not owner.acquire(blocking=False):
            return  # too late: the main thread ran the launch itself
        try:
            outcome["rc"] = call()
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc
        finally:
            done.set()

    try:
        _thread.start_new_thread(run, ())
    except RuntimeError:  # no thread to be had: launch here, without Ctrl-C
        return call()
    deadline, stranded = time.monotonic() + _START_SECONDS, False
    try:
        while not done.wait(_POLL_SECONDS):
            if time.monotonic() > deadline and owner.acquire(blocking=False):
                stranded = True  # the worker never began; it will return as soon as it does
                break
    except BaseException:
        cancel.value = 1
        if not owner.acquire(blocking=False):  # the worker runs the launch: await it
            _wait_despite_interrupts(done)
        raise
    if stranded:
        return call()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["rc"]


def _wait_despite_interrupts(done: threading.Event) -> None:
    """Waits for a cancelled launch to return (one barrier round): returning earlier would leave it running on
    buffers the caller may free. Further Ctrl-Cs meanwhile are dropped: the first one is being honoured."""
    while not done.is_set():
        try:
            done.wait(_POLL_SECONDS)
        except KeyboardInterrupt:
            pass


# ------------------------------------------------------------------------------------------------ arguments

def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"ndarray of {value.dtype}"
    if isinstance(value, np.generic):
        return f"np.{type(value).__name__}"
    return type(value).__name__


def _expected(p: Param) -> str:
    if p.kind == POINTER:
        return f"`{p.type_name}` (pointee {p.pointee_size or '?'} bytes)"
    return f"`{p.type_name}` ({p.size} bytes)"


def _pointee_ok(p: Param, dtype: np.dtype) -> bool:
    if p.pointee_size in (0, 1):  # void* and byte pointers address raw memory of any type
        return True
    if p.pointee_kind == FLOAT:
        return dtype.kind == "f" and dtype.itemsize == p.pointee_size
    if p.pointee_kind in (SIGNED, UNSIGNED):
        return dtype.kind in "iu" and dtype.itemsize == p.pointee_size
    # Class types (__half, float4, structs): same size, or a vector type over a smaller element.
    return p.pointee_size % dtype.itemsize == 0


def _scalar_ok(p: Param, value) -> bool:
    if p.kind == BOOL:
        return isinstance(value, (bool, np.bool_))
    if not isinstance(value, np.generic) or value.dtype.itemsize != p.size:
        return False
    kind = value.dtype.kind
    return {SIGNED: kind == "i", UNSIGNED: kind == "u", FLOAT: kind == "f"}.get(p.kind, kind in "fiuV")


def _struct_ok(p: Param, value: np.ndarray) -> bool:
    """A struct passed by value comes as CuPy takes it: a size-1 array of a structured dtype of the struct's size
    (``np.dtype([...], align=True)`` lays fields out as C does)."""
    return value.size == 1 and value.dtype.names is not None and value.dtype.itemsize == p.size


def _value_buffer(raw: bytes):
    """A copy of ``raw`` the kernel's parameter is read from, aligned for any type (16 bytes) and at least 8 long."""
    buffer = (ctypes.c_longdouble * max(1, -(-len(raw) // 16)))()
    ctypes.memmove(buffer, raw, len(raw))
    return buffer


def _pack_one(i: int, p: Param, value):
    mismatch = TypeError(f"argument {i}: kernel expects {_expected(p)}, got {_describe(value)}")
    if p.kind == POINTER:
        if value is None:
            return ctypes.c_void_p(0)
        if not isinstance(value, np.ndarray) or not _pointee_ok(p, value.dtype):
            raise mismatch
        return ctypes.c_void_p(value.__array_interface__["data"][0])
    if isinstance(value, np.ndarray) and p.kind == OTHER:
        if not _struct_ok(p, value):
            raise TypeError(f"argument {i}: kernel expects {_expected(p)} by value (as a size-1 array of a "
                            f"structured dtype of {p.size} bytes), got {_describe(value)} of shape {value.shape}")
        return _value_buffer(value.tobytes())
    if value is None or isinstance(value, np.ndarray) or not _scalar_ok(p, value):
        raise mismatch
    raw = np.asarray(value).tobytes() if not isinstance(value, bool) else bytes([value])
    return _value_buffer(raw)


def pack_arguments(params: list[Param], args) -> list:
    """One ctypes buffer per argument holding the value the kernel receives (the array's address for pointers)."""
    if len(args) != len(params):
        raise TypeError(f"kernel takes {len(params)} arguments, got {len(args)}: "
                        + ", ".join(p.type_name for p in params))
    return [_pack_one(i, p, a) for i, (p, a) in enumerate(zip(params, args))]
