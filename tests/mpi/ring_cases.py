"""Cases for cuflash.distributed run under ``mpiexec -n P python -m mpi4py tests/mpi/ring_cases.py OUT.json``.

Every rank draws the same whole q, k, v, dout (fixed seeds), takes its part (``shard_sequence`` or explicit uneven
lengths), runs the distributed forward and backward, and the parts are gathered back (``gather_sequence``). Rank 0
holds the gathered results to cuflash's rule against the float64 reference (``cuflash.testing.check_forward`` /
``check_backward``: at most 2x / 3x the error of the naive same-dtype computation, plus the floor) and writes one
JSON record per case; tests/test_distributed_mpi.py turns each record into a test. Error cases check that every rank
raises the same exception. One mpiexec call runs all cases (process start-up dominates small cases).

``CUFLASH_MPI_ARRAYS`` picks the arrays each rank passes: ``numpy`` (default), ``cupy`` (a real GPU; ranks share the
GPUs round-robin, MPI staged through host memory unless ``CUFLASH_MPI_CUDA_AWARE=1``) or ``fake-cupy`` (tests/fake_cupy.py
with its kernels run by the CPU emulator: the CuPy-over-MPI path without a GPU). With CuPy arrays the cases run in
float16 (bfloat16 stays), the kernels' dtypes; the error cases and the memory probe run with NumPy only.

Importing this module (as the test does, for the case names) needs neither mpi4py nor MPI.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _case(lq=37, lk=None, hq=4, hkv=2, d=16, batch=(), dtype="float32", causal=False, window=None, layout="contiguous",
          method="ring", splits=None, vjp=False, scale=None):
    return dict(lq=lq, lk=lq if lk is None else lk, hq=hq, hkv=hkv, d=d, batch=batch, dtype=dtype, causal=causal,
                window=window, layout=layout, method=method, splits=splits, vjp=vjp, scale=scale)


#: name -> parameters; every case runs forward and backward and is checked against the float64 reference
CASES = {
    "full_f32": _case(),
    "causal_f32": _case(causal=True),
    "causal_zigzag_f32": _case(causal=True, layout="zigzag"),
    "causal_zigzag_f16": _case(causal=True, layout="zigzag", dtype="float16", lq=45),
    "causal_bf16": _case(causal=True, dtype="bfloat16"),
    "full_f64_mqa_batch": _case(dtype="float64", hq=3, hkv=1, batch=(2,), lq=30, scale=0.3),
    "window_f32": _case(window=(6, 2)),
    "window_causal_zigzag": _case(window=(9, None), causal=True, layout="zigzag", lq=50),
    "window_right_only_f64": _case(window=(None, 4), dtype="float64"),
    "cross_lengths_causal": _case(lq=23, lk=41, causal=True),
    "cross_lengths_zigzag_window": _case(lq=41, lk=23, causal=True, window=(5, None), layout="zigzag"),
    "skewed_splits_causal": _case(lq=33, lk=40, causal=True, splits="skewed"),
    "skewed_splits_window_gqa": _case(lq=40, hq=6, hkv=2, window=(3, 3), splits="skewed", d=7),
    "ulysses_causal": _case(method="ulysses", hq=4, hkv=4, causal=True),
    "ulysses_zigzag_gqa_window": _case(method="ulysses", hq=8, hkv=4, window=(7, 0), layout="zigzag", lq=42),
    "ulysses_skewed_cross": _case(method="ulysses", hq=4, hkv=4, lq=27, lk=35, splits="skewed", dtype="float64"),
    "vjp_zigzag_causal": _case(causal=True, layout="zigzag", vjp=True, lq=40),
}

#: name -> expected exception type name and a fragment of its message, raised alike on every rank
ERRORS = {
    "error_ranks_disagree": ("ValueError", "the ranks' calls do not match"),
    "error_zigzag_lengths": ("ValueError", "layout='zigzag': rank 0 holds"),
    "error_bad_window": ("ValueError", "window left must be >= 0"),
    "error_bad_comm": ("TypeError", "comm must be an mpi4py communicator"),
    "error_bad_layout": ("ValueError", "layout must be one of"),
    "error_bad_method": ("ValueError", "method must be one of"),
    "error_ulysses_heads": ("ValueError", "must be divisible by the number of ranks"),
    # rank 0 asks for the ring, the others for Ulysses with heads it cannot split: the ranks that could not go on
    # raised alone before the agreement and left rank 0 in the all-gather (a hang)
    "error_ulysses_on_some_ranks": ("ValueError", "the ranks' calls do not match"),
    "error_comm_null": ("TypeError", "got MPI.COMM_NULL"),
    "error_backward_lse_shape": ("ValueError", "lse must have shape"),
    "error_vjp_modified_on_one_rank": ("ValueError", "modified in place after ring_attention_vjp on rank(s)"),
    # a pair computation raising in the second ring step: the transfers in flight complete before the error leaves
    # (abandoned, MPI would write into freed buffers), and the communicator is clean for the next call
    "error_in_a_ring_step": ("RuntimeError", "pair computation failed; the next call matched the one before"),
}

#: name -> exception type name and message fragment of the one rank (rank 0) whose own checks fail: it raised alone
#: before the first exchange and left the others waiting in it for ever; now it raises its error, and every other
#: rank a ValueError naming it (ONE_RANK_REFUSED)
ONE_RANK_ERRORS = {
    "one_rank_bad_shape": ("ValueError", "head_dim of q (16) and k (8) must match"),
    "one_rank_bad_environment": ("ValueError", "CUFLASH_NUM_THREADS"),
    "one_rank_bad_dout": ("ValueError", "dout must have q's shape"),
    "one_rank_gather_bad_axis": ("ValueError", "axis 5 is out of range"),
    # flags and keywords checked before the exchange: rank 0 raised alone
    "one_rank_bad_return_lse": ("TypeError", "return_lse must be a bool"),
    "one_rank_bad_deterministic": ("TypeError", "deterministic must be a bool"),
    "one_rank_vjp_bad_keyword": ("TypeError", "got an unexpected keyword argument 'foo'"),
}
ONE_RANK_REFUSED = ("ValueError", "the call was refused on rank(s) [0]")

#: name -> (method, what): rank 0's pair computation raises mid-call (its second in the ring, its only one in
#: Ulysses). It raised alone and the other ranks waited for ever for the blocks it no longer passed on; now rank 0
#: raises its own error (MID_CALL_OWN) and every other rank MID_CALL_TOLD, and the next call matches a clean one
MID_CALL_ERRORS = {
    "mid_call_ring_forward": ("ring", "forward"),
    "mid_call_ring_backward": ("ring", "backward"),
    "mid_call_ulysses_forward": ("ulysses", "forward"),
}
MID_CALL_OWN = ("RuntimeError", "failed on rank 0; the next call matched a clean one")
MID_CALL_TOLD = ("RuntimeError", "the call failed on rank(s) [0]")

#: local length per rank of the memory probe (the same at every P, so its peak must not grow with P)
MEMORY_LOCAL = 512


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _arrays(c, seed=0):
    rng = np.random.default_rng(seed)
    dt = _dtype(c["dtype"])
    b = tuple(c["batch"])
    q = rng.standard_normal(b + (c["lq"], c["hq"], c["d"])).astype(dt)
    k = rng.standard_normal(b + (c["lk"], c["hkv"], c["d"])).astype(dt)
    v = rng.standard_normal(b + (c["lk"], c["hkv"], c["d"])).astype(dt)
    dout = rng.standard_normal(q.shape).astype(dt)
    return q, k, v, dout


def skewed_lengths(total, size, seed):
    """Uneven contiguous lengths, rank 0 empty when there are several ranks: the cuts are random but shared."""
    rng = np.random.default_rng(seed)
    if size == 1:
        return [total]
    cuts = np.sort(rng.integers(0, total + 1, size=size - 2))
    edges = [0, 0, *cuts.tolist(), total]
    return [b - a for a, b in zip(edges[:-1], edges[1:])]


def _part(x, lengths, rank, axis=-3):
    start = sum(lengths[:rank])
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + lengths[rank])
    return x[tuple(index)]


def _shard(c, x, which, comm):
    from cuflash.distributed import shard_sequence

    size, rank = comm.Get_size(), comm.Get_rank()
    if c["splits"] == "skewed":
        total = x.shape[-3]
        return _part(x, skewed_lengths(total, size, seed=total + (which == "k")), rank)
    return shard_sequence(x, size, rank, layout=c["layout"])


def _options(c):
    opts = dict(causal=c["causal"], window=c["window"])
    if c["scale"] is not None:
        opts["scale"] = c["scale"]
    return opts


def run_case(name, c, comm, xp=np):
    """Run one case on every rank (with arrays of module ``xp``); on rank 0 return its check's record."""
    from cuflash.distributed import gather_sequence, ring_attention, ring_attention_backward, ring_attention_vjp
    from cuflash.testing import Case, check_backward, check_forward

    if xp is not np and c["dtype"] != "bfloat16":
        c = dict(c, dtype="float16")  # the CUDA kernels' dtypes
    q, k, v, dout = _arrays(c)
    ql, dl = (xp.asarray(_shard(c, x, "q", comm)) for x in (q, dout))
    kl, vl = (xp.asarray(_shard(c, x, "k", comm)) for x in (k, v))
    opts = dict(_options(c), layout=c["layout"], method=c["method"])
    t0 = time.perf_counter()
    out_l, lse_l = ring_attention(ql, kl, vl, comm, return_lse=True, **opts)
    if c["vjp"]:
        out_v, vjp = ring_attention_vjp(ql, kl, vl, comm, **opts)
        assert np.array_equal(_host(out_v), _host(out_l)), "ring_attention_vjp's out differs from ring_attention's"
        grads_l = vjp(dl)
    else:
        grads_l = ring_attention_backward(dl, ql, kl, vl, out_l, lse_l, comm, **opts)
    seconds = time.perf_counter() - t0
    layout = "contiguous" if c["splits"] == "skewed" else c["layout"]
    assert out_l.shape == ql.shape and out_l.dtype == ql.dtype
    assert all(g.shape == x.shape and g.dtype == x.dtype for g, x in zip(grads_l, (ql, kl, vl)))
    out = _host(gather_sequence(out_l, comm, layout=layout))
    lse = _host(gather_sequence(lse_l, comm, layout=layout, axis=-1))
    grads = [_host(gather_sequence(g, comm, layout=layout)) for g in grads_l]
    if comm.Get_rank() != 0:
        return None
    case = Case(q, k, v, dout, options=_options(c))
    check_forward(lambda *a, **o: (out, lse), case)
    check_backward(lambda *a, **o: tuple(grads), case, out, lse)
    return {"ok": True, "seconds": seconds}


def run_error(name, comm):
    """Provoke one error; return ``(exception type name, message)`` on this rank (None if nothing was raised)."""
    import cuflash.distributed as dist

    size, rank = comm.Get_size(), comm.Get_rank()
    c = _case(causal=True)
    q, k, v, dout = _arrays(c)
    ql, kl, vl, dl = (dist.shard_sequence(x, size, rank) for x in (q, k, v, dout))
    try:
        if name == "error_ranks_disagree":
            d = 8 if rank == 1 % size else 16  # one rank's head_dim differs: found by the metadata all-gather
            dist.ring_attention(ql[..., :d], kl[..., :d], vl[..., :d], comm)
        elif name == "error_zigzag_lengths":
            lengths = [sum(b - a for a, b in dist.local_segments(37, size, r, layout="zigzag")) for r in range(size)]
            lengths[0] += 1
            lengths[-1] -= 1
            dist.ring_attention(_part(q, lengths, rank), _part(k, lengths, rank), _part(v, lengths, rank), comm,
                                layout="zigzag")
        elif name == "error_bad_window":
            dist.ring_attention(ql, kl, vl, comm, window=(-1, 0))
        elif name == "error_bad_comm":
            dist.ring_attention(ql, kl, vl, 42)
        elif name == "error_bad_layout":
            dist.ring_attention(ql, kl, vl, comm, layout="striped")
        elif name == "error_bad_method":
            dist.ring_attention(ql, kl, vl, comm, method="allgather")
        elif name == "error_ulysses_heads":
            dist.ring_attention(ql[..., :3, :], kl[..., :1, :], vl[..., :1, :], comm, method="ulysses")
        elif name == "error_ulysses_on_some_ranks":
            dist.ring_attention(ql[..., :3, :], kl[..., :1, :], vl[..., :1, :], comm,
                                method="ring" if rank == 0 else "ulysses")
        elif name == "error_comm_null":
            from mpi4py import MPI

            dist.ring_attention(ql, kl, vl, MPI.COMM_NULL)
        elif name == "error_backward_lse_shape":
            out, lse = dist.ring_attention(ql, kl, vl, comm, return_lse=True)
            dist.ring_attention_backward(dl, ql, kl, vl, out, lse[..., :1, :], comm)
        elif name == "error_vjp_modified_on_one_rank":
            ql = ql.copy()
            _, vjp = dist.ring_attention_vjp(ql, kl, vl, comm, causal=True)
            if rank == size - 1:
                ql[..., 0, 0, 0] += 1.0
            vjp(dl)
        elif name == "error_in_a_ring_step":
            return _error_in_a_ring_step(ql, kl, vl, comm)
        elif name in MID_CALL_ERRORS:
            return _error_on_one_rank_mid_call(*MID_CALL_ERRORS[name], comm)
        elif name == "one_rank_bad_shape":
            dist.ring_attention(ql, kl[..., :8] if rank == 0 else kl, vl, comm)
        elif name == "one_rank_bad_environment":
            old = os.environ.get("CUFLASH_NUM_THREADS")
            if rank == 0:
                os.environ["CUFLASH_NUM_THREADS"] = "abc"
            try:
                dist.ring_attention(ql, kl, vl, comm)
            finally:
                if rank == 0:
                    os.environ.pop("CUFLASH_NUM_THREADS") if old is None else os.environ.update(CUFLASH_NUM_THREADS=old)
        elif name == "one_rank_bad_dout":
            out, lse = dist.ring_attention(ql, kl, vl, comm, causal=True, return_lse=True)
            dist.ring_attention_backward(dl[..., :1, :, :] if rank == 0 else dl, ql, kl, vl, out, lse, comm,
                                         causal=True)
        elif name == "one_rank_bad_return_lse":
            dist.ring_attention(ql, kl, vl, comm, return_lse="yes" if rank == 0 else True)
        elif name == "one_rank_bad_deterministic":
            out, lse = dist.ring_attention(ql, kl, vl, comm, return_lse=True)
            dist.ring_attention_backward(dl, ql, kl, vl, out, lse, comm, deterministic=1 if rank == 0 else False)
        elif name == "one_rank_vjp_bad_keyword":
            dist.ring_attention_vjp(ql, kl, vl, comm, **({"foo": 1} if rank == 0 else {}))
        elif name == "one_rank_gather_bad_axis":
            dist.gather_sequence(ql, comm, axis=5 if rank == 0 else -3)
    except Exception as exc:  # noqa: BLE001 - the record says what was raised
        return type(exc).__name__, str(exc)
    return None


def _error_in_a_ring_step(ql, kl, vl, comm):
    """Every rank's second pair computation raises (not causal: every rank computes a pair in every step); then the
    same call again, which every rank makes (collective) whatever the first one did."""
    import cuflash.distributed as dist
    from cuflash.backends import numpy as nb

    before = dist.ring_attention(ql, kl, vl, comm)
    real, calls, raised = nb.forward, [], None

    def second_raises(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("pair computation failed")
        return real(*args, **kwargs)

    nb.forward = second_raises
    try:
        dist.ring_attention(ql, kl, vl, comm)
    except RuntimeError as exc:
        raised = exc
    finally:
        nb.forward = real
    # a message left over from the failed call would be received in place of this call's: different bits
    same = np.array_equal(dist.ring_attention(ql, kl, vl, comm), before)
    if raised is None:
        return None
    return type(raised).__name__, f"{raised}; the next call {'matched' if same else 'differed from'} the one before"


def _error_on_one_rank_mid_call(method, what, comm):
    """Rank 0's pair computation raises mid-call (see MID_CALL_ERRORS); then the same call again on every rank. Not
    causal: rank 0 computes a pair in every ring step; 4 heads of each kind: Ulysses splits them over 2 or 4 ranks."""
    import cuflash.distributed as dist
    from cuflash.backends import numpy as nb

    size, rank = comm.Get_size(), comm.Get_rank()
    ql, kl, vl, dl = (dist.shard_sequence(x, size, rank) for x in _arrays(_case(hq=4, hkv=4)))
    kw = dict(method=method)

    def call():
        out, lse = dist.ring_attention(ql, kl, vl, comm, return_lse=True, **kw)
        return (out, lse) if what == "forward" else dist.ring_attention_backward(dl, ql, kl, vl, out, lse, comm, **kw)

    before = call()
    real, calls, raised = getattr(nb, what), [], None

    def fails_on_rank_0(*args, **kwargs):
        calls.append(1)
        if comm.Get_rank() == 0 and len(calls) == (1 if method == "ulysses" else 2):
            raise RuntimeError(f"{what} failed on rank 0")
        return real(*args, **kwargs)

    setattr(nb, what, fails_on_rank_0)
    try:
        call()
    except RuntimeError as exc:
        raised = exc
    finally:
        setattr(nb, what, real)
    same = all(np.array_equal(x, y) for x, y in zip(call(), before))
    if raised is None:
        return None
    return type(raised).__name__, f"{raised}; the next call {'matched' if same else 'differed from'} a clean one"


def memory_probe(comm, sizes=(3, 4)):
    """Peak traced memory of forward + backward with MEMORY_LOCAL positions per rank (float32, causal, zigzag), on
    sub-communicators of the given sizes: at a fixed local length the peak must not depend on the number of ranks
    (gathering K/V, or keeping every block, would add one local K/V block per extra rank). Returns
    ``{size: peak}`` on the ranks of each sub-communicator (None where this run has too few ranks)."""
    import tracemalloc

    from mpi4py import MPI

    from cuflash.distributed import ring_attention, ring_attention_backward

    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    n, h, d = MEMORY_LOCAL, 2, 64
    q, k, v, dout = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(4))
    peaks = {}
    for size in sizes:
        if size > comm.Get_size():
            return None
        sub = comm.Split(0 if rank < size else MPI.UNDEFINED, rank)
        if sub != MPI.COMM_NULL:
            # zigzag wants the zigzag lengths of n * size: equal here since 2 * size divides n * size
            ring_attention(q, k, v, sub, causal=True, layout="zigzag")  # warm-up: lazy imports are not the ring's
            tracemalloc.start()
            out, lse = ring_attention(q, k, v, sub, causal=True, layout="zigzag", return_lse=True)
            ring_attention_backward(dout, q, k, v, out, lse, sub, causal=True, layout="zigzag")
            peaks[size] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            sub.Free()
        comm.Barrier()
    return {"peaks": peaks, "kv_block_bytes": k.nbytes + v.nbytes}


def _host(x):
    return x.get() if hasattr(x, "get") else x


def array_module(mode, rank):
    """The array module of ``CUFLASH_MPI_ARRAYS`` for this rank."""
    if mode == "numpy":
        return np
    if mode == "cupy":
        import cupy

        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        return cupy
    if mode == "fake-cupy":
        import pytest

        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import fake_cupy
        import fake_nccl

        patch = pytest.MonkeyPatch()  # never undone: this process ends with the run
        fake = fake_cupy.install(patch, fake_cupy.make())
        fake_nccl.add_math(patch, fake)
        return fake
    raise ValueError(f"CUFLASH_MPI_ARRAYS must be numpy, cupy or fake-cupy, got {mode!r}")


def main(out_path):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    mode = os.environ.get("CUFLASH_MPI_ARRAYS", "numpy")
    xp = array_module(mode, rank)
    only = os.environ.get("CUFLASH_MPI_CASES")
    records = {"arrays": mode}
    for name, c in CASES.items():
        if only and name not in only.split(","):
            continue
        try:
            record = run_case(name, c, comm, xp)
        except Exception:  # noqa: BLE001 - one failing case must not stop the others
            record = {"ok": False, "error": traceback.format_exc()}
        # a case that raised on some ranks only: report every rank's error
        errors = comm.gather(None if record is None or record.get("ok") else record.get("error"), root=0)
        if rank == 0:
            failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
            records[name] = record if not failed else {"ok": False, "error": "\n".join(failed)}
    for name in (*ERRORS, *ONE_RANK_ERRORS, *MID_CALL_ERRORS) if mode == "numpy" else ():
        if only and name not in only.split(","):
            continue
        raised = comm.gather(run_error(name, comm), root=0)
        if rank == 0:
            records[name] = {"raised": raised}
    memory = comm.gather(memory_probe(comm) if mode == "numpy" else None, root=0)
    if rank == 0:
        records["memory"] = memory
        records["size"] = comm.Get_size()
        with open(out_path, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
