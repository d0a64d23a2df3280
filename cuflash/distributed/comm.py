"""Thin adapters from the communicators users already have to the two operations the ring needs.

cuflash ships no transport of its own. Everything goes through either

* **MPI** via mpi4py (``mpi4py.MPI.Comm``): NumPy arrays, sent with ``Isend``/``Irecv`` as raw bytes (any dtype,
  bfloat16 included) and completed with ``Waitall``. CuPy arrays are staged through host memory, unless
  ``CUFLASH_MPI_CUDA_AWARE=1`` says the MPI library is CUDA-aware, in which case mpi4py hands it the device buffers
  (``__cuda_array_interface__``) directly. mpi4py cannot ask the library, hence the variable.
* **NCCL** via ``cupy.cuda.nccl.NcclCommunicator``: CuPy arrays, ``ncclSend``/``ncclRecv`` inside
  ``groupStart``/``groupEnd`` on a separate CUDA stream owned by the adapter, so transfers run beside the
  attention kernels of the current stream. Events order the two streams both ways: the communication stream waits
  for the work already queued on the current stream (the buffers it sends, and the last reads of the buffers it
  receives into) and the current stream waits for the transfers before it reads what arrived. The host never
  blocks.

An adapter offers ``rank``, ``size``, ``refusal`` (None, or the error of a communicator this rank cannot use for the
call's data, raised after the metadata exchange), ``allgather_ints(values)`` (the small metadata exchange every call
starts with) and ``start(sends, recvs)``: post non-blocking point-to-point transfers, each ``(array, peer, tag)``, and
get a handle whose ``wait()`` completes them and whose ``poke()`` lets MPI progress them meanwhile. Buffers must be
contiguous; zero-byte messages are skipped on both sides (both know the sizes).
"""
from __future__ import annotations

import sys

import numpy as np

from .. import _env

#: MPI tags of cuflash's messages (a range of its own, so other traffic on the same communicator does not match)
TAG_BASE = 0x4346  # "CF"
TAG_K, TAG_V, TAG_DK, TAG_DV, TAG_GATHER, TAG_A2A = range(6)


def is_mpi(comm) -> bool:
    """An mpi4py communicator, a subclass of one too, told without importing mpi4py (an optional dependency)."""
    return any(c.__module__.split(".")[0] == "mpi4py" for c in type(comm).__mro__)


def is_nccl(comm) -> bool:
    return type(comm).__name__ == "NcclCommunicator"


def transport(comm, xp):
    """The adapter for ``comm`` (chosen by its type), for arrays of module ``xp``. TypeError for anything else."""
    if is_mpi(comm):
        if not (hasattr(comm, "Isend") and hasattr(comm, "Get_rank")):
            raise TypeError(f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), got {type(comm).__name__}")
        mpi = sys.modules.get("mpi4py.MPI")  # loaded where comm is one of its objects
        if mpi is not None and comm == mpi.COMM_NULL:  # MPI would raise its own error from the first call on it
            raise TypeError("comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), got MPI.COMM_NULL")
        if comm.Is_inter():  # its Get_size is its own group's, its Allgather returns the other group's values
            raise TypeError("comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), got an intercommunicator")
        return MpiTransport(comm, xp)
    if is_nccl(comm):
        if xp.__name__ != "cupy":
            raise TypeError("comm is a NCCL communicator, which moves GPU memory: q, k, v must be CuPy arrays (use an "
                            "mpi4py communicator for NumPy arrays)")
        return NcclTransport(comm, xp)
    raise TypeError(f"comm must be an mpi4py communicator (mpi4py.MPI.Comm) or a CuPy NCCL communicator "
                    f"(cupy.cuda.nccl.NcclCommunicator), got {type(comm).__module__}.{type(comm).__name__}")


def module_of(a):
    """CuPy for a CuPy array, else NumPy: the transport a rank needs for the first exchange even where its own checks
    of ``a`` failed (it must still take part, see :func:`allgather_checked`)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def allgather_checked(comm, xp, values, failure):
    """``(transport, meta)``: the adapter for ``comm`` (:func:`transport`) and the all-gather of each rank's ints
    ``values``, with whether its own checks failed (``failure``: the exception, or None), raised on every rank: a
    rank that raised alone before a collective left the others waiting in it for ever (a bad shape, or a malformed
    CUFLASH_NUM_THREADS, on one rank only). The failed rank raises its own error, the others a ValueError naming it.
    Where ``comm`` is no communicator either, no exchange can tell the others: this rank's own error is raised."""
    try:
        adapter = transport(comm, xp)
    except Exception:
        if failure is not None:
            raise failure from None
        raise
    if failure is None:
        failure = adapter.refusal  # a communicator this rank cannot use for the call's data (NCCL: another GPU's)
    meta = adapter.allgather_ints([0] * len(values) + [1] if failure is not None else list(values) + [0])
    _raise_together(failure, meta[:, -1], ValueError, "was refused")
    return adapter, meta[:, :-1]


def _raise_together(failure, flags, error, what):
    """After an exchange of every rank's failed flag (``flags``, one per rank): this rank's own ``failure`` raised, or
    ``error`` naming the ranks whose call ``what`` ("was refused", "failed"); nothing where no rank failed."""
    if failure is not None:
        raise failure
    failed = [int(r) for r in np.flatnonzero(flags)]
    if failed:
        raise error(f"the call {what} on rank(s) {failed} (the error is raised there); every rank raises, none is "
                    f"left waiting for the others")


class Failure:
    """This rank's first error in the computations of one call between its transfers (the pair computations of the
    ring's steps, Ulysses' one attention call). A rank that raised there alone left the others waiting for ever in
    the transfers it would have made; now it computes no more but makes every transfer the call posts (the ring
    passes K/V, and the backward's dK/dV accumulators, on as they came), and at the call's next exchange all ranks
    learn of it (:meth:`raise_together`). Exceptions only: KeyboardInterrupt and SystemExit leave at once (after
    the transfers in flight), as on one device."""

    def __init__(self):
        self.error = None

    def attempt(self, compute, *args):
        """``compute(*args)``, or nothing once this rank has failed; its result, or None on failure."""
        if self.error is not None:
            return None
        try:
            return compute(*args)
        except Exception as exc:  # noqa: BLE001 - raised on this rank by raise_together, after the transfers
            self.error = exc
            return None

    def raise_together(self, adapter):
        """One all-gather of each rank's failed flag (a host synchronization on NCCL): the failed rank raises its own
        error, every other rank a RuntimeError naming it; nothing where no rank failed."""
        flags = adapter.allgather_ints([int(self.error is not None)])
        _raise_together(self.error, flags[:, 0], RuntimeError, "failed")


def together(adapter, make):
    """``make()``: what a rank does alone between two of the call's transfers (its allocations for the next transfer,
    or Ulysses' one attention call), a failure of which is told to every rank by one all-gather of failed flags
    before any rank goes on: the failed rank raises its own error, the others a RuntimeError naming it. A rank that
    raised there alone (out of memory on one GPU) left the others waiting for ever in the next transfer."""
    failure = Failure()
    result = failure.attempt(make)
    failure.raise_together(adapter)
    return result


def _bytes(a, xp):
    """A contiguous array as a flat uint8 view (the wire format: any dtype travels as its bytes)."""
    if not a.flags.c_contiguous:
        raise ValueError("internal: a message buffer must be C-contiguous")
    return a.reshape(-1).view(xp.uint8)


class _Done:
    def wait(self):
        pass

    def poke(self):
        pass


# ----------------------------------------------------------------------------------------------------------- MPI
class MpiTransport:
    def __init__(self, comm, xp):
        from mpi4py import MPI

        self.MPI, self.comm, self.xp = MPI, comm, xp
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.refusal = None  # see NcclTransport
        self.device = xp.__name__ == "cupy"
        self.cuda_aware = _env.get("CUFLASH_MPI_CUDA_AWARE")

    def allgather_ints(self, values) -> np.ndarray:
        send = np.ascontiguousarray(values, dtype=np.int64)
        recv = np.empty((self.size, send.size), dtype=np.int64)
        self.comm.Allgather([send, self.MPI.INT64_T], [recv, self.MPI.INT64_T])
        return recv

    def start(self, sends, recvs):
        MPI, requests, landing = self.MPI, [], []
        try:
            return self._post(sends, recvs, requests, landing)
        except BaseException:  # what was posted completes before its buffers can go (see ring._completed_on_error)
            MPI.Request.Waitall(requests)
            raise

    def _post(self, sends, recvs, requests, landing):
        MPI = self.MPI
        if self.device and self.cuda_aware:
            # MPI touches device memory outside any CUDA stream: the buffers sent must be final, and memory received
            # into may have been freed by an array a kernel still queued on the current stream reads
            self.xp.cuda.get_current_stream().synchronize()
        for a, peer, tag in recvs:
            if a.nbytes == 0:
                continue
            if self.device and not self.cuda_aware:
                host = np.empty(a.nbytes, dtype=np.uint8)  # staged: received here, copied to the device on wait()
                landing.append((a, host))
                buf = host
            else:
                buf = _bytes(a, self.xp)
            requests.append(self.comm.Irecv([buf, MPI.BYTE], source=peer, tag=TAG_BASE + tag))
        keep = []
        for a, peer, tag in sends:
            if a.nbytes == 0:
                continue
            if self.device and not self.cuda_aware:
                buf = _bytes(a, self.xp).get()  # synchronizes with the current stream: the data is final
            else:
                buf = _bytes(a, self.xp)
            keep.append(buf)
            requests.append(self.comm.Isend([buf, MPI.BYTE], dest=peer, tag=TAG_BASE + tag))
        return _MpiPending(MPI, requests, landing, keep, self.xp)


class _MpiPending:
    def __init__(self, MPI, requests, landing, keep, xp):
        self.MPI, self.requests, self.landing, self.keep, self.xp = MPI, requests, landing, keep, xp

    def poke(self):
        """Let MPI progress the transfers. Without an asynchronous progress thread (MPICH:
        ``MPIR_CVAR_ASYNC_PROGRESS=1``) a large message moves only while the process is inside MPI, so the ring
        calls this between the pair computations of a step."""
        if self.requests:
            self.MPI.Request.Testall(self.requests)

    def wait(self):
        self.MPI.Request.Waitall(self.requests)
        for a, host in self.landing:
            _bytes(a, self.xp).set(host)
        self.requests, self.landing, self.keep = [], [], []


# ---------------------------------------------------------------------------------------------------------- NCCL
class NcclTransport:
    def __init__(self, comm, xp):
        from cupy.cuda import nccl

        self.nccl, self.comm, self.xp = nccl, comm, xp
        self.rank, self.size = comm.rank_id(), comm.size()
        device = xp.cuda.Device().id
        # A communicator of another GPU than the current one is refused, but only after the metadata exchange
        # (allgather_checked), which this adapter still makes on the communicator's GPU: a rank raising here alone
        # left the others in that exchange for ever.
        self.refusal = None if comm.device_id() == device else ValueError(
            f"comm is a NCCL communicator of GPU {comm.device_id()} but the current device is GPU {device}: call "
            f"inside `with cupy.cuda.Device({comm.device_id()}):`")
        # The transfers' own stream: NCCL kernels queued on the current stream would run only between attention
        # kernels, never beside them.
        with xp.cuda.Device(comm.device_id()):
            self.stream = xp.cuda.Stream(non_blocking=True)

    def _after_current(self):
        """Make the communication stream wait for everything queued so far on the current stream."""
        self.stream.wait_event(self.xp.cuda.get_current_stream().record())

    def allgather_ints(self, values) -> np.ndarray:
        xp = self.xp
        self._after_current()
        with xp.cuda.Device(self.comm.device_id()):  # the communicator's GPU, even where the call is refused
            send = xp.asarray(np.ascontiguousarray(values, dtype=np.int64))
            recv = xp.empty((self.size, send.size), dtype=np.int64)
            self.comm.allGather(send.data.ptr, recv.data.ptr, send.size, self.nccl.NCCL_INT64, self.stream.ptr)
            self.stream.synchronize()  # the host needs the values (shapes) now
            return recv.get()

    def start(self, sends, recvs):
        self._after_current()
        nccl = self.nccl
        nccl.groupStart()
        try:
            for a, peer, _ in sends:
                if a.nbytes:
                    self.comm.send(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, peer, self.stream.ptr)
            for a, peer, _ in recvs:
                if a.nbytes:
                    self.comm.recv(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, peer, self.stream.ptr)
        finally:
            nccl.groupEnd()
        # the buffers are kept alive until wait(): after it, the current stream is ordered after the transfers, so
        # CuPy's pool may hand their memory out again safely
        return _NcclPending(self.xp, self.stream.record(), (sends, recvs))


class _NcclPending:
    def __init__(self, xp, event, keep):
        self.xp, self.event, self.keep = xp, event, keep

    def poke(self):
        pass  # NCCL progresses on its own stream

    def wait(self):
        self.xp.cuda.get_current_stream().wait_event(self.event)
        self.keep = None
