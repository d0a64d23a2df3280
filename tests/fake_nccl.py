"""A fake ``cupy.cuda.nccl`` for tests/fake_cupy.py: NCCL ranks as threads of one process.

:func:`install` adds to a fake CuPy (without changing tests/fake_cupy.py) what cuflash.distributed's NCCL path uses:

- ``cupy.cuda.nccl``: ``NcclCommunicator`` (``rank_id``, ``size``, ``device_id``, ``send``, ``recv``, ``allGather``,
  with CuPy's signatures: raw device addresses, element counts, NCCL datatype enums, a stream handle) and
  ``groupStart``/``groupEnd``. Point-to-point calls inside a group are queued and run at ``groupEnd``: sends first
  (their bytes are read from the address and put in the (sender, receiver) mailbox), then receives (which wait for
  their message and write it at the address), so a ring of ranks that each send and receive in one group does not
  deadlock, as with NCCL. A receive whose size differs from the message's fails (NCCL would corrupt or hang), and so
  does a call on the null stream, an unknown datatype, a peer out of range, or a buffer address outside the fake's
  device memory.
- ``Stream.record()``/``Stream.wait_event()`` and ``cupy.cuda.Event``: the fake runs everything synchronously, so
  events only order the log.
- element-wise array math on the fake's device arrays (operators, ``exp``, ``log``, ``where``, ``stack``,
  ``concatenate``, ``swapaxes``, ``max``/``sum``), computed by NumPy on the arrays' memory and returned as device
  arrays of the same device (arrays of different devices in one operation raise, as in CuPy).
- a lock around kernel launches: the CPU emulator runs one kernel at a time.

Every NCCL call, group, event record/wait and kernel launch is appended to ``world.log`` as ``(device, what,
details)``, in the order the threads made them, so tests can check stream discipline and overlap.
"""
from __future__ import annotations

import ctypes
import queue
import threading
import types

import numpy as np

NCCL_TYPES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}  # enum -> bytes (CuPy's values)
TIMEOUT_S = 60


class World:
    """The ranks of one fake NCCL clique: mailboxes, an all-gather rendezvous and the event log."""

    def __init__(self, size):
        self.size = size
        self.boxes = {(s, d): queue.Queue() for s in range(size) for d in range(size)}
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self.slots = [None] * size
        self.log = []
        self.lock = threading.Lock()

    def record(self, device, what, **details):
        with self.lock:
            self.log.append((device, what, details))


def install(monkeypatch, fake, world):
    """Add nccl, events, array math and the launch lock to ``fake`` (a tests/fake_cupy.py module already installed
    in sys.modules); everything is undone by ``monkeypatch``. Returns ``fake.cuda.nccl``."""
    import sys

    nccl = _nccl_module(fake, world)
    monkeypatch.setattr(fake.cuda, "nccl", nccl, raising=False)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    _add_events(monkeypatch, fake, world)
    add_math(monkeypatch, fake)
    _lock_launches(monkeypatch, fake, world)
    return nccl


# ----------------------------------------------------------------------------------------------------- nccl
def _nccl_module(fake, world):
    nccl = types.ModuleType("cupy.cuda.nccl")
    for name, value in (("NCCL_INT8", 0), ("NCCL_UINT8", 1), ("NCCL_INT32", 2), ("NCCL_UINT32", 3), ("NCCL_INT64", 4),
                        ("NCCL_UINT64", 5), ("NCCL_FLOAT16", 6), ("NCCL_FLOAT32", 7), ("NCCL_FLOAT64", 8),
                        ("NCCL_BFLOAT16", 9)):
        setattr(nccl, name, value)
    group = threading.local()

    def pending():
        if not hasattr(group, "depth"):
            group.depth, group.ops = 0, []
        return group

    def groupStart():  # noqa: N802 - CuPy's name
        pending().depth += 1

    def groupEnd():  # noqa: N802
        g = pending()
        if g.depth == 0:
            raise RuntimeError("NCCL error: groupEnd without groupStart (ncclInvalidUsage)")
        g.depth -= 1
        if g.depth == 0:
            ops, g.ops = g.ops, []
            for op in sorted(ops, key=lambda o: o[0] != "send"):  # sends first, then the receives wait
                _run(*op)

    def _run(kind, comm, ptr, nbytes, peer, stream):
        world.record(comm._device, kind, peer=peer, nbytes=nbytes, stream=stream)
        if kind == "send":
            world.boxes[(comm._rank, peer)].put(ctypes.string_at(ptr, nbytes))
            return
        try:
            data = world.boxes[(peer, comm._rank)].get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"fake NCCL: rank {comm._rank} waited {TIMEOUT_S} s for a message from rank {peer} "
                               f"(a deadlock: the peer never sent)") from None
        if len(data) != nbytes:
            raise RuntimeError(f"fake NCCL: rank {comm._rank} receives {nbytes} bytes from rank {peer}, which sent "
                               f"{len(data)} (mismatched sizes corrupt memory or hang under NCCL)")
        ctypes.memmove(ptr, data, nbytes)

    class NcclCommunicator:
        __module__ = "cupy_backends.cuda.libs.nccl"

        def __init__(self, rank, device=None):
            self._rank, self._device = rank, rank if device is None else device

        def rank_id(self):
            return self._rank

        def size(self):
            return world.size

        def device_id(self):
            return self._device

        def _check(self, ptr, count, datatype, peer, stream):
            if datatype not in NCCL_TYPES:
                raise RuntimeError(f"NCCL error: invalid datatype {datatype} (ncclInvalidArgument)")
            if peer is not None and not 0 <= peer < world.size:
                raise RuntimeError(f"NCCL error: peer {peer} out of range (ncclInvalidArgument)")
            if not isinstance(stream, int) or stream == 0:
                raise RuntimeError(f"fake NCCL: stream {stream!r}: cuflash must use its own stream, not the null one")
            nbytes = count * NCCL_TYPES[datatype]
            _check_device_memory(fake, ptr, nbytes, self._device)
            return nbytes

        def send(self, sendbuf, count, datatype, peer, stream):
            self._p2p("send", sendbuf, count, datatype, peer, stream)

        def recv(self, recvbuf, count, datatype, peer, stream):
            self._p2p("recv", recvbuf, count, datatype, peer, stream)

        def _p2p(self, kind, ptr, count, datatype, peer, stream):
            op = (kind, self, ptr, self._check(ptr, count, datatype, peer, stream), peer, stream)
            g = pending()
            if g.depth:
                g.ops.append(op)
            else:
                _run(*op)

        def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802
            nbytes = self._check(sendbuf, count, datatype, None, stream)
            _check_device_memory(fake, recvbuf, nbytes * world.size, self._device)
            world.record(self._device, "allGather", nbytes=nbytes, stream=stream)
            world.slots[self._rank] = ctypes.string_at(sendbuf, nbytes)
            world.barrier.wait()
            data = b"".join(world.slots)
            world.barrier.wait()  # every rank has read the slots before any may refill them
            ctypes.memmove(recvbuf, data, len(data))

    nccl.NcclCommunicator, nccl.groupStart, nccl.groupEnd = NcclCommunicator, groupStart, groupEnd
    return nccl


def _check_device_memory(fake, ptr, nbytes, device):
    """``[ptr, ptr + nbytes)`` must lie in one allocation of the fake on ``device`` (read from the fake's allocator,
    the closure of its ``empty``)."""
    if not isinstance(ptr, int) or ptr == 0:
        raise RuntimeError(f"fake NCCL: buffer address {ptr!r} is not a device pointer")
    allocations = _allocations(fake)
    for lo, hi, dev, _ in allocations:
        if lo <= ptr and ptr + nbytes <= hi:
            if dev != device:
                raise RuntimeError(f"fake NCCL: buffer on GPU {dev} passed to the communicator of GPU {device}")
            return
    raise RuntimeError(f"fake NCCL: [{ptr:#x}, +{nbytes}) is not inside the fake's device memory (an illegal address)")


def _allocations(fake):
    alloc = dict(zip(fake.empty.__code__.co_freevars, fake.empty.__closure__))["alloc"].cell_contents
    return dict(zip(alloc.__code__.co_freevars, alloc.__closure__))["allocations"].cell_contents


# ----------------------------------------------------------------------------------------------------- events
def _add_events(monkeypatch, fake, world):
    class Event:
        __module__ = "cupy.cuda.stream"
        _count = 0

        def __init__(self, block=False, disable_timing=False, interprocess=False):
            Event._count += 1
            self.id, self.stream = Event._count, None

        def record(self, stream=None):
            self.stream = stream or fake.cuda.get_current_stream()
            world.record(fake.cuda.get_device_id(), "record", event=self.id, stream=self.stream.ptr)

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        if event.stream is None:
            raise RuntimeError("fake CUDA: waiting on an event that was never recorded")
        world.record(fake.cuda.get_device_id(), "wait_event", event=event.id, stream=self.ptr, on=event.stream.ptr)

    monkeypatch.setattr(fake.cuda, "Event", Event, raising=False)
    monkeypatch.setattr(fake.cuda.Stream, "record", record, raising=False)
    monkeypatch.setattr(fake.cuda.Stream, "wait_event", wait_event, raising=False)


def _lock_launches(monkeypatch, fake, world):
    lock = threading.Lock()
    call = fake.RawKernel.__call__

    def locked(self, grid, block, args, **kw):
        world.record(fake.cuda.get_device_id(), "launch", name=self.name)
        with lock:
            return call(self, grid, block, args, **kw)

    monkeypatch.setattr(fake.RawKernel, "__call__", locked)


# ----------------------------------------------------------------------------------------------------- array math
def add_math(monkeypatch, fake):
    """The element-wise math (and ``ndarray.set``) cuflash.distributed uses, on ``fake``'s device arrays."""
    nd = fake.ndarray

    def device_of(*xs):
        devs = {x._dev for x in xs if isinstance(x, nd)}
        if len(devs) > 1:
            raise ValueError(f"arrays on devices {sorted(devs)} in one operation")
        return devs.pop() if devs else fake.cuda.get_device_id()

    def host(x):
        return x._a if isinstance(x, nd) else x

    def wrap(result, dev):
        with fake.cuda.Device(dev):
            return fake.asarray(np.asarray(result))

    def function(fn):
        def apply(*args, **kw):
            arrays = [a for a in args if isinstance(a, nd)] + [a for seq in args if isinstance(seq, (list, tuple))
                                                              for a in seq if isinstance(a, nd)]
            dev = device_of(*arrays)
            args = [[host(a) for a in x] if isinstance(x, (list, tuple)) else host(x) for x in args]
            return wrap(fn(*args, **kw), dev)
        return apply

    for name in ("exp", "log", "where", "stack", "concatenate", "swapaxes", "maximum", "isfinite"):
        monkeypatch.setattr(fake, name, function(getattr(np, name)), raising=False)

    def binary(op, reflected=False):
        def method(self, other):
            dev = device_of(self, other)
            a, b = (host(other), self._a) if reflected else (self._a, host(other))
            return wrap(op(a, b), dev)
        return method

    def inplace(op):
        def method(self, other):
            device_of(self, other)
            op(self._a, host(other), out=self._a)
            return self
        return method

    ops = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide, "matmul": np.matmul}
    for name, op in ops.items():
        monkeypatch.setattr(nd, f"__{name}__", binary(op), raising=False)
        monkeypatch.setattr(nd, f"__r{name}__", binary(op, reflected=True), raising=False)
        monkeypatch.setattr(nd, f"__i{name}__", inplace(op), raising=False)
    for name, op in {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "gt": np.greater}.items():
        monkeypatch.setattr(nd, f"__{name}__", binary(op), raising=False)
    monkeypatch.setattr(nd, "__hash__", None, raising=False)
    monkeypatch.setattr(nd, "__neg__", lambda self: wrap(-self._a, self._dev), raising=False)

    def reduction(f):
        def method(self, axis=None, keepdims=False, out=None, **kw):
            result = f(self._a, axis=axis, keepdims=keepdims, **kw)
            if out is None:
                return wrap(result, self._dev)
            device_of(self, out)
            out._a[...] = result  # CuPy's out=: written in place, on the same device
            return out
        return method

    for name in ("max", "sum"):
        monkeypatch.setattr(nd, name, reduction(getattr(np, name)), raising=False)
    monkeypatch.setattr(nd, "__float__", lambda self: float(self._a), raising=False)

    def set_(self, arr, stream=None):  # CuPy's host-to-device copy into an existing array
        arr = np.asarray(arr)
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"set: shape {arr.shape} / dtype {arr.dtype} differ from the array's {self.shape} / "
                             f"{self.dtype}")
        self._a[...] = arr

    monkeypatch.setattr(nd, "set", set_, raising=False)
