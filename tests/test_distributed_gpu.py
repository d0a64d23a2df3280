"""cuflash.distributed on real GPUs (CuPy): skipped cleanly without CuPy or a usable GPU.

- **NCCL, one rank per GPU** (ranks as threads of this process, ``NcclCommunicator.initAll``): forward and backward
  of the ring and of Ulysses against the float64 reference. NCCL refuses two ranks of one communicator on the same
  GPU ("duplicate GPU"), so with one GPU this runs the one-rank ring (the adapter, its stream and events, the
  all-gather, the kernels) and the multi-rank NCCL case skips, saying so: it runs on the next multi-GPU machine.
- **MPI, several ranks sharing one GPU** (``mpiexec -n 2``, CuPy arrays, buffers staged through host memory): every
  case of tests/mpi/ring_cases.py in float16/bfloat16 on the CUDA kernels, so one GPU is enough to run the
  shifted-window pair problems and the merge on the device.
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

import cuflash.distributed as dist
from cuflash.testing import Case, check_backward, check_forward

import gpu_support  # noqa: E402

cp, pytestmark, DTYPES = gpu_support.setup()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi"))
import mpi_launch  # noqa: E402  (tests/mpi/mpi_launch.py)
import ring_cases  # noqa: E402  (tests/mpi/ring_cases.py)


def _gpus():
    return cp.cuda.runtime.getDeviceCount()


def _nccl():
    try:
        from cupy.cuda import nccl

        nccl.get_version()
        return nccl
    except Exception as exc:  # noqa: BLE001 - CuPy built without NCCL, or no libnccl
        pytest.skip(f"NCCL is not available to CuPy: {exc}")


def make_case(dtype, lq=300, lk=300, hq=8, hkv=2, d=64, **options):
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype) if dtype != "bfloat16" else np.dtype(__import__("ml_dtypes").bfloat16)
    q = rng.standard_normal((2, lq, hq, d)).astype(dt)
    k, v = (rng.standard_normal((2, lk, hkv, d)).astype(dt) for _ in range(2))
    return Case(q, k, v, rng.standard_normal(q.shape).astype(dt), options=options)


def nccl_ring(case, ranks, *, layout, method):
    """Forward + backward on ``ranks`` GPUs, one thread and one NCCL communicator each; whole results on the host."""
    nccl = _nccl()
    comms = nccl.NcclCommunicator.initAll(list(range(ranks)))
    results, errors = [None] * ranks, [None] * ranks

    def target(rank):
        try:
            with cp.cuda.Device(rank):
                part = lambda x: cp.asarray(dist.shard_sequence(x, ranks, rank, layout=layout))  # noqa: E731
                q, k, v, dout = (part(x) for x in (case.q, case.k, case.v, case.dout))
                opts = dict(case.options, layout=layout, method=method)
                out, lse = dist.ring_attention(q, k, v, comms[rank], return_lse=True, **opts)
                grads = dist.ring_attention_backward(dout, q, k, v, out, lse, comms[rank], **opts)
                cp.cuda.Device().synchronize()
                results[rank] = [cp.asnumpy(x) for x in (out, lse, *grads)]
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for rank, exc in enumerate(errors):
        if exc is not None:
            raise AssertionError(f"rank {rank}: {type(exc).__name__}: {exc}") from exc
    axes = (-3, -1, -3, -3, -3)
    return [dist.unshard_sequence([r[i] for r in results], layout=layout, axis=axes[i]) for i in range(5)]


def check(case, got):
    out, lse, *grads = got
    check_forward(lambda *a, **o: (out, lse), case)
    check_backward(lambda *a, **o: tuple(grads), case, out, lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nccl_one_rank(dtype):
    case = make_case(dtype, causal=True)
    check(case, nccl_ring(case, 1, layout="zigzag", method="ring"))


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nccl_several_gpus(dtype, method):
    if _gpus() < 2:
        pytest.skip(f"NCCL allows one rank per GPU and this machine has {_gpus()}: the multi-rank NCCL ring runs on "
                    f"a machine with 2 or more GPUs")
    ranks = 4 if _gpus() >= 4 else 2  # Ulysses needs the rank count to divide heads (8) and kv heads (4)
    case = make_case(dtype, lq=1000, lk=1000, hkv=4, causal=True, window=(300, None))  # Ulysses: 4 | heads_kv
    check(case, nccl_ring(case, ranks, layout="zigzag", method=method))


@pytest.mark.skipif(mpi_launch.why_not() is not None, reason=str(mpi_launch.why_not()))
def test_mpi_ranks_sharing_one_gpu(tmp_path):
    records = mpi_launch.run_cases(2, "cupy", tmp_path / "out.json", timeout=600)
    assert not isinstance(records, str), records
    failed = {name: records[name].get("error") for name in ring_cases.CASES if not records[name].get("ok")}
    assert not failed, failed
