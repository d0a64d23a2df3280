"""cuflash.distributed's NCCL path without GPUs: tests/fake_cupy.py (kernels run by the CPU emulator) plus
tests/fake_nccl.py (NCCL ranks as threads, one fake GPU each).

What runs here is the real code path of CuPy arrays: the NCCL adapter (send/recv in groups on its own stream, the
metadata allGather, events ordering the two streams), the CUDA kernels on pair problems with shifted (negative)
window bounds, the float32 merge on device arrays, the travelling dK/dV accumulators and Ulysses' all-to-alls; the
gathered results are held to the float16 rule against the float64 reference. The log of the fake shows the stream
discipline and that each step's transfer is posted before that step's kernels. Real NCCL on real GPUs is covered by
tests/test_distributed_gpu.py.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import cuflash
import cuflash.distributed as dist
from cuflash import emulate
from cuflash.backends import cuda
from cuflash.testing import Case, check_backward, check_forward

import fake_cupy
import fake_nccl

_ok, _why = emulate.available()
pytestmark = [pytest.mark.emulate, pytest.mark.skipif(not _ok, reason=f"CPU emulation unavailable: {_why}")]


@pytest.fixture
def world(monkeypatch):
    """``world(size) -> (fake cupy, World, nccl module)`` with ``size`` fake H100s."""

    def build(size):
        fake = fake_cupy.install(monkeypatch, fake_cupy.make(gpus=(fake_cupy.H100,) * size))
        cuda._memoized.cache_clear()
        w = fake_nccl.World(size)
        return fake, w, fake_nccl.install(monkeypatch, fake, w)

    yield build
    cuda._memoized.cache_clear()


def run_ranks(fake, w, nccl, fn):
    """Run ``fn(rank, comm)`` on one thread per rank, each on its own fake GPU; return the results by rank."""
    results, errors = [None] * w.size, [None] * w.size

    def target(rank):
        try:
            with fake.cuda.Device(rank):
                results[rank] = fn(rank, nccl.NcclCommunicator(rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(w.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    for rank, exc in enumerate(errors):
        if exc is not None:
            raise AssertionError(f"rank {rank} raised {type(exc).__name__}: {exc}") from exc
    return results


def refusal(call):
    """The message of the ValueError ``call()`` raises (None if it raises none)."""
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


def make_case(lq, lk, hq, hkv, d=32, seed=0, **options):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, lq, hq, d)).astype(np.float16)
    k, v = (rng.standard_normal((1, lk, hkv, d)).astype(np.float16) for _ in range(2))
    return Case(q, k, v, rng.standard_normal(q.shape).astype(np.float16), options=options)


def ring_on_ranks(fake, w, nccl, case, *, layout="contiguous", method="ring"):
    """Forward and backward on every rank; returns the whole (out, lse, dq, dk, dv), gathered on the host."""

    def rank_fn(rank, comm):
        part = lambda x: fake.asarray(dist.shard_sequence(x, w.size, rank, layout=layout))  # noqa: E731
        q, k, v, dout = (part(x) for x in (case.q, case.k, case.v, case.dout))
        opts = dict(case.options, layout=layout, method=method)
        out, lse = dist.ring_attention(q, k, v, comm, return_lse=True, **opts)
        assert isinstance(out, fake.ndarray) and out.dtype == np.float16 and lse.dtype == np.float32
        grads = dist.ring_attention_backward(dout, q, k, v, out, lse, comm, **opts)
        return [x.get() for x in (out, lse, *grads)]

    per_rank = run_ranks(fake, w, nccl, rank_fn)
    axes = (-3, -1, -3, -3, -3)
    return [dist.unshard_sequence([r[i] for r in per_rank], layout=layout, axis=axes[i]) for i in range(5)]


def check(case, got):
    out, lse, *grads = got
    check_forward(lambda *a, **o: (out, lse), case)
    check_backward(lambda *a, **o: tuple(grads), case, out, lse)


@pytest.mark.parametrize("size, layout, lengths, options", [
    (2, "zigzag", (40, 40), dict(causal=True)),
    (3, "contiguous", (29, 41), dict(causal=True, window=(6, None))),
    (3, "zigzag", (36, 36), dict(window=(5, 3))),
], ids=["2-zigzag-causal", "3-contiguous-cross-window", "3-zigzag-band"])
def test_ring_over_nccl_matches_reference(world, size, layout, lengths, options):
    fake, w, nccl = world(size)
    case = make_case(*lengths, hq=4, hkv=2, **options)
    check(case, ring_on_ranks(fake, w, nccl, case, layout=layout))


def test_ulysses_over_nccl_matches_reference(world):
    fake, w, nccl = world(2)
    case = make_case(30, 30, hq=4, hkv=2, causal=True)
    check(case, ring_on_ranks(fake, w, nccl, case, layout="zigzag", method="ulysses"))


def _by_device(log, device):
    return [(what, d) for dev, what, d in log if dev == device]


def test_transfers_use_their_own_stream_and_are_posted_before_each_step(world):
    fake, w, nccl = world(3)
    case = make_case(48, 48, hq=2, hkv=2)  # no mask: every rank computes at every step

    def rank_fn(rank, comm):
        q, k, v = (fake.asarray(dist.shard_sequence(x, 3, rank)) for x in (case.q, case.k, case.v))
        dist.ring_attention(q, k, v, comm)

    run_ranks(fake, w, nccl, rank_fn)
    launch_streams = {launch.stream.ptr for launch in fake._launches}
    assert launch_streams == {0}  # the kernels run on the current (here the null) stream
    for device in range(3):
        events = _by_device(w.log, device)
        p2p = [d for what, d in events if what in ("send", "recv", "allGather")]
        comm_streams = {d["stream"] for d in p2p}
        assert len(comm_streams) == 1 and 0 not in comm_streams  # one stream of its own, not the compute stream
        (comm_stream,) = comm_streams
        kinds = [what for what, _ in events]
        sends = [i for i, what in enumerate(kinds) if what == "send"]
        launches = [i for i, what in enumerate(kinds) if what == "launch"]
        assert len(sends) == 2 * 2  # K and V, at steps 0 and 1 of 3 (the last step receives nothing)
        # each step's transfer is posted before that step's kernels: a send precedes the first launch, and the
        # second step's sends come after some launches (step 0's) and before others (step 1's)
        assert sends[0] < launches[0]
        assert launches[0] < sends[2] < launches[-1]
        for i in sends:
            # since the last kernel queued on the compute stream, the communication stream was made to wait for it
            # (the block sent and the buffer received into may still be in use by that kernel)
            last = max([j for j in launches if j < i], default=-1)
            assert any(what == "wait_event" and d["stream"] == comm_stream and d["on"] == 0
                       for what, d in events[last + 1:i]), (i, events[last + 1:i])
        # and the compute stream waits for the transfers before the next step's kernels read them
        compute_waits = [i for i, (what, d) in enumerate(events) if what == "wait_event" and d["stream"] == 0
                         and d["on"] == comm_stream]
        assert len(compute_waits) >= 2 and all(any(s < i for s in sends) for i in compute_waits)


def test_nccl_communicator_of_another_gpu_is_refused(world):
    """Rank 1 calls with its arrays and current device on GPU 0 but its communicator of GPU 1: it raised as its adapter
    was made, before the metadata exchange, and rank 0 waited in that exchange for ever. Now rank 1 makes the exchange
    on its communicator's GPU and raises its error after it, rank 0 a ValueError naming rank 1; no data moves."""
    fake, w, nccl = world(2)

    def rank_fn(rank, comm):
        with fake.cuda.Device(0):  # rank 1 too, whose communicator is GPU 1's
            q = fake.asarray(np.zeros((8, 2, 32), np.float16))
            return refusal(lambda: dist.ring_attention(q, q, q, comm))

    raised = run_ranks(fake, w, nccl, rank_fn)
    assert "NCCL communicator of GPU 1 but the current device is GPU 0" in (raised[1] or ""), raised
    assert "the call was refused on rank(s) [1]" in (raised[0] or ""), raised
    assert not {what for _, what, _ in w.log} & {"send", "recv"}  # no transfer of data


def test_arrays_of_another_gpu_are_refused_before_any_transfer(world):
    """q, k, v on GPU 0 on the rank whose current device (and communicator) is GPU 1: refused before any transfer of
    data; it failed inside NCCL on that rank only, and the other ranks waited for it. Now that rank raises its error
    and the other one a ValueError naming it, after the metadata exchange only."""
    fake, w, nccl = world(2)
    q0 = fake.asarray(np.zeros((8, 2, 32), np.float16))
    raised = run_ranks(fake, w, nccl, lambda rank, comm: refusal(lambda: dist.ring_attention(q0, q0, q0, comm)))
    assert "q is on GPU 0 but the current device is GPU 1" in (raised[1] or "")
    assert "the call was refused on rank(s) [1]" in (raised[0] or "")
    assert not {what for _, what, _ in w.log} & {"send", "recv"}  # no transfer of data


def test_gather_sequence_over_nccl(world):
    fake, w, nccl = world(3)
    x = np.arange(2 * 23 * 3, dtype=np.float32).reshape(2, 23, 3)

    def rank_fn(rank, comm):
        part = fake.asarray(dist.shard_sequence(x, 3, rank, layout="zigzag", axis=1))
        return dist.gather_sequence(part, comm, layout="zigzag", axis=1).get()

    for whole in run_ranks(fake, w, nccl, rank_fn):
        np.testing.assert_array_equal(whole, x)


def test_merge_attention_states_on_device_arrays(world):
    fake, _, _ = world(1)
    rng = np.random.default_rng(0)
    outs = [rng.standard_normal((5, 2, 8)).astype(np.float16) for _ in range(3)]
    lses = [rng.standard_normal((2, 5)).astype(np.float32) for _ in range(3)]
    lses[1][0, 0] = -np.inf
    out, lse = cuflash.merge_attention_states([fake.asarray(o) for o in outs], [fake.asarray(x) for x in lses])
    assert isinstance(out, fake.ndarray) and out.dtype == np.float16 and lse.dtype == np.float32
    ref_out, ref_lse = cuflash.merge_attention_states(outs, lses)
    np.testing.assert_array_equal(out.get(), ref_out)
    np.testing.assert_array_equal(lse.get(), ref_lse)


def test_merge_attention_states_runs_on_its_parts_gpu(world):
    """Unlike attention, the merge runs on its parts' GPU whatever the current one (the call-start device check of
    the other entry points must not refuse it)."""
    fake, _, _ = world(2)
    rng = np.random.default_rng(0)
    outs = [rng.standard_normal((5, 2, 8)).astype(np.float16) for _ in range(2)]
    lses = [rng.standard_normal((2, 5)).astype(np.float32) for _ in range(2)]
    with fake.cuda.Device(1):
        parts = [fake.asarray(o) for o in outs], [fake.asarray(x) for x in lses]
    out, lse = cuflash.merge_attention_states(*parts)  # GPU 0 current
    assert out.device.id == 1 and lse.device.id == 1
    np.testing.assert_array_equal(out.get(), cuflash.merge_attention_states(outs, lses)[0])


def test_fake_nccl_catches_mismatched_sizes(world):
    fake, w, nccl = world(2)

    def rank_fn(rank, comm):
        buf = fake.zeros(4 if rank == 0 else 8, dtype=np.uint8)
        stream = fake.cuda.Stream(non_blocking=True)
        nccl.groupStart()
        if rank == 0:
            comm.send(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, 1, stream.ptr)
            nccl.groupEnd()
        else:
            comm.recv(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, 0, stream.ptr)
            nccl.groupEnd()

    with pytest.raises(AssertionError, match="receives 8 bytes from rank 0, which sent 4"):
        run_ranks(fake, w, nccl, rank_fn)
