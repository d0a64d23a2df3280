"""cuflash.distributed in one process: the pair visibility (the heart of the ring), layouts, the cost model, the
choice of adapter, and the ring fuzzed by hypothesis over rank counts, lengths, masks, GQA and dtypes with ranks as
threads (a queue transport standing in for the adapters). The adapters run in tests/test_distributed_mpi.py
(mpiexec) and tests/test_distributed_nccl_fake.py (NCCL ranks as threads)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cuflash
import cuflash.distributed as dist
from cuflash.distributed import comm as comms
from cuflash.distributed.cost import busy_fraction, min_local_seqlen, ring_step, table
from cuflash.distributed.ring import Segment, pair_window
from cuflash.problem import _check_window, make_problem, visible


# ------------------------------------------------------------------------------------------- pair visibility
@given(lq=st.integers(1, 60), lk=st.integers(1, 60), causal=st.booleans(),
       left=st.one_of(st.none(), st.integers(0, 70)), right=st.one_of(st.none(), st.integers(0, 70)),
       data=st.data())
def test_pair_window_is_the_global_band_seen_from_the_pair(lq, lk, causal, left, right, data):
    """For any global geometry and any query/key segments, the pair problem built as the ring builds it
    (make_problem + dataclasses.replace of the window) sees exactly the global visibility restricted to the pair, and
    pair_window returns None exactly when that restriction is empty."""
    a = data.draw(st.integers(0, lq - 1), label="a")
    n = data.draw(st.integers(1, lq - a), label="n")
    c = data.draw(st.integers(0, lk - 1), label="c")
    m = data.draw(st.integers(1, lk - c), label="m")
    g_left, g_right = _check_window((left, right), causal, lq + lk)
    s = types.SimpleNamespace(left=g_left, right=g_right, off=lk - lq)
    bounds = pair_window(s, Segment(a, a + n, 0), Segment(c, c + m, 0))
    i, j = np.arange(n)[:, None], np.arange(m)[None, :]
    want = visible(a + i, c + j, lq, lk, g_left, g_right)
    if bounds is None:
        assert not want.any()
        return
    q = np.zeros((1, n, 1, 4), np.float32)
    kv = np.zeros((1, m, 1, 4), np.float32)
    p = dataclasses.replace(make_problem(q, kv, kv), window_left=bounds[0], window_right=bounds[1])
    got = p.visible_mask()[0, 0]
    assert np.array_equal(got, want)
    # a bound that cuts nothing is dropped, so fully visible pairs run without any element mask
    if want.all():
        assert bounds == (None, None)


def test_pair_window_skips_blocks_above_the_causal_diagonal():
    s = types.SimpleNamespace(left=None, right=0, off=0)
    assert pair_window(s, Segment(0, 10, 0), Segment(10, 20, 0)) is None       # keys entirely in the future
    assert pair_window(s, Segment(10, 20, 0), Segment(0, 10, 0)) == (None, None)  # entirely in the past: no mask
    assert pair_window(s, Segment(0, 10, 0), Segment(0, 10, 0)) == (None, 0)    # the diagonal block: causal itself
    assert pair_window(s, Segment(0, 0, 0), Segment(0, 10, 0)) is None          # empty segments


# ------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", dist.LAYOUTS)
@pytest.mark.parametrize("length, size", [(0, 3), (1, 4), (7, 2), (16, 4), (37, 4), (5, 8)])
def test_segments_partition_the_sequence_and_shards_round_trip(layout, length, size):
    seen = np.zeros(length, int)
    for rank in range(size):
        for a, b in dist.local_segments(length, size, rank, layout=layout):
            assert 0 <= a <= b <= length
            seen[a:b] += 1
    assert (seen == 1).all()
    x = np.arange(2 * length * 3).reshape(2, length, 3, 1)
    parts = [dist.shard_sequence(x, size, r, layout=layout) for r in range(size)]
    assert sum(p.shape[1] for p in parts) == length
    np.testing.assert_array_equal(dist.unshard_sequence(parts, layout=layout), x)
    lse = np.arange(length * 6.0).reshape(2, 3, length)  # the sequence on the last axis, as an lse
    parts = [dist.shard_sequence(lse, size, r, layout=layout, axis=-1) for r in range(size)]
    np.testing.assert_array_equal(dist.unshard_sequence(parts, layout=layout, axis=-1), lse)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work(size):
    length = 2 * size * 16
    work = []
    for layout in dist.LAYOUTS:
        counts = []
        for rank in range(size):
            rows = np.concatenate([np.arange(a, b) for a, b in dist.local_segments(length, size, rank, layout=layout)])
            counts.append(int((rows + 1).sum()))  # causal: global row g sees g + 1 keys
        work.append(counts)
    contiguous, zigzag = work
    assert len(set(zigzag)) == 1
    assert max(contiguous) / min(contiguous) == pytest.approx(2 * size - 1, rel=0.1)


def test_layout_helpers_refuse_what_they_would_misread():
    """A bool or float axis (True read as 1), an array for parts (split along its first axis), parts of mixed
    dtypes (silently promoted) or libraries, masked parts: refused."""
    x = np.arange(24.0).reshape(2, 4, 3)
    with pytest.raises(TypeError, match="axis must be an int, got bool"):
        dist.shard_sequence(x, 2, 0, axis=True)
    with pytest.raises(TypeError, match="axis must be an int, got float"):
        dist.shard_sequence(x, 2, 0, axis=1.0)
    with pytest.raises(TypeError, match="parts must be a list or tuple of arrays"):
        dist.unshard_sequence(x)
    with pytest.raises(TypeError, match=r"parts\[1\] must be a numpy array of dtype float32"):
        dist.unshard_sequence([x.astype(np.float32), x])
    with pytest.raises(TypeError, match=r"parts\[1\] is a numpy.ma.MaskedArray"):
        dist.unshard_sequence([x, np.ma.masked_array(x, mask=x > 3)])


def test_arrays_of_other_libraries_are_refused_with_the_right_advice():
    """cuflash.distributed takes NumPy and CuPy only: the error must not list torch as accepted."""
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 2, 8)
    for call in (lambda: dist.ring_attention(t, t, t, ThreadComm(ThreadWorld(1), 0)),
                 lambda: dist.unshard_sequence([t, t], layout="zigzag")):
        with pytest.raises(TypeError, match="cuflash.distributed takes NumPy and CuPy arrays only") as info:
            call()
        assert "torch" not in str(info.value)


def test_ring_attention_refuses_a_non_bool_return_lse():
    x = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        dist.ring_attention(x, x, x, ThreadComm(ThreadWorld(1), 0), return_lse="no")


def test_layout_errors():
    x = np.zeros((5, 2, 3))
    with pytest.raises(ValueError, match="layout must be one of"):
        dist.shard_sequence(x, 2, 0, layout="striped")
    with pytest.raises(ValueError, match="0 <= rank < size"):
        dist.shard_sequence(x, 2, 2)
    with pytest.raises(TypeError, match="rank must be an int"):
        dist.local_segments(5, 2, 1.0)
    with pytest.raises(ValueError, match="length must be an int >= 0"):
        dist.local_segments(-1, 2, 0)
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        dist.shard_sequence(x, 2, 0, axis=3)
    with pytest.raises(ValueError, match=r"parts\[0\] has length 2 .* gives rank 0 3"):
        dist.unshard_sequence([x[:2], x[:3]], layout="zigzag", axis=0)
    with pytest.raises(ValueError, match="one array per rank"):
        dist.unshard_sequence([])


def test_a_rank_count_beyond_a_communicator_is_refused_and_any_other_answered_at_once(within):
    """local_segments built all size + 1 edges in a Python loop: size=2**70 never returned (and 2**31 - 1, a real
    communicator's largest size, took minutes and gigabytes). Now only the rank's own edges are computed, and a size
    no MPI or NCCL communicator can have (a C int) is a ValueError naming the bound."""
    x = np.zeros((1, 6, 2, 2))
    with within(3):
        with pytest.raises(ValueError, match=r"size <= 2\*\*31 - 1 .*got size=1180591620717411303424"):
            dist.local_segments(6, 2**70, 0)
        with pytest.raises(ValueError, match=r"size <= 2\*\*31 - 1"):
            dist.shard_sequence(x, np.uint64(2**63), 0)
        big = 2**31 - 1
        assert dist.local_segments(10, big, 3) == ((3, 4),)
        assert dist.local_segments(10, big, big - 1) == ((10, 10),)
        assert dist.local_segments(10, big, 4, layout="zigzag") == ((4, 5), (10, 10))
        assert dist.local_segments(2 * big + 1, big, big - 1, layout="zigzag") == ((big, big + 1), (big + 1, big + 2))
        assert dist.shard_sequence(x, big, 5).shape == (1, 1, 2, 2)


def test_wrong_types_are_type_errors_and_wrong_values_value_errors():
    """The same function gave TypeError for size=True and ValueError for length=True; the cost model gave ValueError
    for a bool or a float count. A wrong type is a TypeError everywhere in cuflash.distributed, a value out of range
    of the right type a ValueError."""
    x = np.zeros((5, 2, 3))
    comm = ThreadComm(ThreadWorld(1), 0)
    for call, match in ((lambda: dist.local_segments(True, 2, 0), "length must be an int, got bool"),
                        (lambda: dist.local_segments(6.0, 2, 0), "length must be an int, got float"),
                        (lambda: dist.local_segments(6, 2, np.True_), "rank must be an int, got bool"),
                        (lambda: dist.shard_sequence(x, 2, 0, layout=None), "layout must be a str"),
                        (lambda: dist.unshard_sequence([x], layout=1), "layout must be a str"),
                        (lambda: dist.ring_attention(x, x, x, comm, method=1), "method must be a str"),
                        (lambda: dist.ring_attention(x, x, x, comm, layout=0), "layout must be a str")):
        with pytest.raises(TypeError, match=match):
            call()
    kw = dict(heads=8, head_dim=64, flops_per_s=1e12, bytes_per_s=1e9)
    for change, match in ((dict(seqlen_local=True), "seqlen_local must be an int, got bool"),
                          (dict(seqlen_local=4.0), "seqlen_local must be an int, got float"),
                          (dict(heads=2.5), "heads must be an int, got float"),
                          (dict(head_dim=np.True_), "head_dim must be an int, got bool"),
                          (dict(batch="2"), "batch must be an int, got str"),
                          (dict(flops_per_s="1e12"), "flops_per_s must be a finite number, got str"),
                          (dict(latency_s=False), "latency_s must be a finite number, got bool"),
                          (dict(op=1), "op must be a str"),
                          (dict(layout=None), "layout must be a str"),
                          (dict(dtype=None), "dtype must be a dtype"),  # NumPy reads None as float64
                          (dict(dtype=2), "dtype must be a dtype")):
        args = {"seqlen_local": 100, **kw, **change}
        with pytest.raises(TypeError, match=match):
            ring_step(args.pop("seqlen_local"), **args)
    for change, match in ((dict(seqlen_local=0), "seqlen_local must be an int > 0"),
                          (dict(bytes_per_s=float("inf")), "bytes_per_s must be finite"),
                          (dict(flops_per_s=10**400), "flops_per_s must be finite"),  # math.isfinite overflowed
                          (dict(op="both"), "op must be 'fwd' or 'bwd'"),
                          (dict(dtype=np.int8), "dtype must be one of")):
        args = {"seqlen_local": 100, **kw, **change}
        with pytest.raises(ValueError, match=match):
            ring_step(args.pop("seqlen_local"), **args)
    assert ring_step(100, dtype=np.dtype("float64"), **kw) == ring_step(100, dtype="float64", **kw)


def test_the_cost_model_names_results_past_floats_range():
    """Sizes and rates the checks accept, whose results leave float's range: a bare OverflowError (an exact int of
    bytes divided by a rate) and an infinite or NaN closed form given to math.ceil."""
    with pytest.raises(ValueError, match=r"about 10\^310 bytes a step, past float's range"):
        ring_step(10 ** 300, heads=10 ** 10, head_dim=1, flops_per_s=1.0, bytes_per_s=1.0)
    for flops, rate in ((1e308, 1e-300), (1e-320, 1e-320)):
        with pytest.raises(ValueError, match="past what the model computes in floats"):
            min_local_seqlen(heads=1, head_dim=1, flops_per_s=flops, bytes_per_s=rate)
    # FLOPs past float's range were inf seconds of computation, beside which any transfer read as hidden
    with pytest.raises(ValueError, match=r"more than 1.8e308 FLOPs a step, past float's range"):
        ring_step(10**160, heads=1, head_dim=1, flops_per_s=1e300, bytes_per_s=1e9)


def test_min_local_seqlen_answers_at_once_where_a_float_step_spans_many_lengths():
    """The guard after the closed form stepped by 1: an answer near 8e31, where a float's spacing is ~2e16 lengths,
    took ~10^17 steps (it never returned). Now the first hidden length from the closed form on, by doubling steps
    and bisection."""
    args = dict(heads=33, head_dim=127, flops_per_s=8.640986208056138e+28, bytes_per_s=0.002491695571611462,
                causal=True, op="bwd", dtype="float16")
    n = min_local_seqlen(**args)
    assert 1e31 < n < 1e32 and ring_step(n, **args).hidden and not ring_step(n - 1, **args).hidden
    small = dict(heads=32, head_dim=128, flops_per_s=1e12, bytes_per_s=1e9, latency_s=1e-5)
    m = min_local_seqlen(**small)
    assert ring_step(m, **small).hidden and not ring_step(m - 1, **small).hidden


def test_an_axis_order_for_layout_says_what_layout_means_here():
    """layout is the axis order on cuflash.attention but the sharding here: "bshd" was answered only with "must be
    one of 'contiguous', 'zigzag'"."""
    class Untouchable:  # the error comes before the communicator is used
        __slots__ = ()

    x = np.zeros((4, 2, 8), np.float32)
    match = (r"layout='(bshd|bhsd)' is an axis order, but in cuflash.distributed layout is how the sequence is "
             r"sharded over ranks: one of 'contiguous', 'zigzag'.*\(\.\.\., seqlen, heads, head_dim\)")
    for call in (lambda: dist.ring_attention(x, x, x, Untouchable(), layout="bshd"),
                 lambda: dist.ring_attention_vjp(x, x, x, Untouchable(), layout="bhsd"),
                 lambda: dist.shard_sequence(x, 2, 0, layout="bhsd"),
                 lambda: dist.gather_sequence(x, Untouchable(), layout="bshd"),
                 lambda: ring_step(10, heads=1, head_dim=8, layout="bshd", flops_per_s=1, bytes_per_s=1)):
        with pytest.raises(ValueError, match=match):
            call()


def test_parts_of_different_shapes_are_named():
    """Parts that differ outside the sequence axis gave NumPy's concatenate error, which names no argument."""
    x = np.arange(24.0).reshape(1, 6, 2, 2)
    for layout in dist.LAYOUTS:
        parts = [dist.shard_sequence(x, 2, r, layout=layout) for r in range(2)]
        parts[1] = parts[1][:, :, :1]
        with pytest.raises(ValueError, match=r"parts\[1\] has shape \(1, 3, 1, 2\), but every part must have "
                                             r"parts\[0\]'s shape except along axis 1 .*: \(1, any, 2, 2\)"):
            dist.unshard_sequence(parts, layout=layout)
    lse = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match=r"parts\[2\] has shape \(2, 2, 1\).*axis 2 .*: \(2, 3, any\)"):
        dist.unshard_sequence([lse, lse, lse[:, :2, :1]], axis=-1)


# ------------------------------------------------------------------------------------------- cost model
def test_ring_step_counts():
    # n = 1000 local positions, 8 heads (2 kv heads), head_dim 64, bf16, no mask
    step = ring_step(1000, heads=8, heads_kv=2, head_dim=64, dtype="bfloat16", flops_per_s=1e12, bytes_per_s=1e9)
    assert step.bytes_sent == 2 * 1000 * 2 * 64 * 2
    assert step.flops == 4 * 8 * 1000 * 1000 * 64
    assert step.comm_s == pytest.approx(step.bytes_sent / 1e9) and step.compute_s == pytest.approx(step.flops / 1e12)
    bwd = ring_step(1000, heads=8, heads_kv=2, head_dim=64, dtype="bfloat16", op="bwd", flops_per_s=1e12,
                    bytes_per_s=1e9)
    assert bwd.bytes_sent == 2 * 1000 * 2 * 64 * (2 + 4)  # K, V in bf16 and dK, dV accumulators in float32
    assert bwd.flops == 2.5 * step.flops
    assert busy_fraction(True, "zigzag") == 0.5 and busy_fraction(True, "contiguous") == 1.0


@pytest.mark.parametrize("causal, heads_kv, latency", [(False, 32, 0.0), (True, 32, 0.0), (True, 8, 5e-6),
                                                       (False, 4, 3e-5)])
def test_min_local_seqlen_is_the_threshold(causal, heads_kv, latency):
    kw = dict(heads=32, heads_kv=heads_kv, head_dim=128, causal=causal, flops_per_s=495e12, bytes_per_s=450e9,
              latency_s=latency)
    n = min_local_seqlen(**kw)
    assert ring_step(n, **kw).hidden and not ring_step(n - 1, **kw).hidden


def test_threshold_is_flops_over_bandwidth_for_bf16_multi_head():
    # Liu et al. 2023: the block must be at least F/B for bf16 K, V without a mask (and no latency)
    n = min_local_seqlen(heads=16, head_dim=128, flops_per_s=312e12, bytes_per_s=300e9)
    assert n == pytest.approx(312e12 / 300e9, abs=1)
    assert min_local_seqlen(heads=16, head_dim=128, causal=True, flops_per_s=312e12, bytes_per_s=300e9) \
        == pytest.approx(2 * n, abs=2)  # half the work per step with the causal zigzag layout


def test_table_and_errors():
    text = table()
    assert text.count("\n") >= 6 and "NVLink" in text and "InfiniBand" in text and "Ethernet" in text
    with pytest.raises(ValueError, match="op must be"):
        ring_step(10, heads=1, head_dim=8, op="both", flops_per_s=1, bytes_per_s=1)
    with pytest.raises(ValueError, match="dtype must be one of"):
        ring_step(10, heads=1, head_dim=8, dtype="int8", flops_per_s=1, bytes_per_s=1)
    # every argument checked: a rate of 0 divided by zero, a negative one never ended min_local_seqlen's search
    for kw, error, match in ((dict(flops_per_s=-1e12), ValueError, "flops_per_s must be a finite number > 0"),
                             (dict(bytes_per_s=0), ValueError, "bytes_per_s must be"),
                             (dict(heads=0), ValueError, "heads must be an int > 0"),
                             (dict(heads_kv=3), ValueError, r"heads \(8\) must be a multiple of heads_kv \(3\)"),
                             (dict(causal="no"), TypeError, "causal must be a bool"),
                             (dict(latency_s=-1.0), ValueError, "latency_s must be a finite number >= 0")):
        args = {**dict(heads=8, head_dim=64, flops_per_s=1e12, bytes_per_s=1e9), **kw}
        with pytest.raises(error, match=match):
            min_local_seqlen(**args)
    with pytest.raises(ValueError, match="seqlen_local must be an int > 0"):
        ring_step(-100, heads=8, head_dim=64, flops_per_s=1e12, bytes_per_s=1e9)
    # dtypes as NumPy spells them; the float64 backward sends float64 dK, dV accumulators (ring.py)
    kw = dict(heads=8, head_dim=64, flops_per_s=1e12, bytes_per_s=1e9)
    assert ring_step(100, dtype=np.float16, **kw).bytes_sent == ring_step(100, dtype="float16", **kw).bytes_sent
    assert ring_step(100, dtype="float64", op="bwd", **kw).bytes_sent == 2 * 100 * 8 * 64 * (8 + 8)
    done = subprocess.run([sys.executable, "-m", "cuflash.distributed", "--heads", "8"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "unrecognized arguments" in done.stderr


# ------------------------------------------------------------------------------------------- adapters
def test_comm_of_another_kind_is_a_type_error():
    q = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator .* got builtins.object"):
        dist.ring_attention(q, q, q, object())


def test_nccl_communicator_with_numpy_arrays_is_a_type_error():
    NcclCommunicator = type("NcclCommunicator", (), {})  # noqa: N806 - chosen by its type's name, as CuPy's
    q = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(TypeError, match="NCCL communicator, which moves GPU memory: q, k, v must be CuPy arrays"):
        dist.ring_attention(q, q, q, NcclCommunicator())
    assert comms.is_nccl(NcclCommunicator()) and not comms.is_mpi(NcclCommunicator())


def test_bad_local_input_raises_before_the_communicator_is_touched():
    class Untouchable:  # any use would raise AttributeError, not the ValueError/TypeError below
        __slots__ = ()

    q = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="window left must be >= 0"):
        dist.ring_attention(q, q, q, Untouchable(), window=(-1, 0))
    with pytest.raises(ValueError, match="head_dim of q"):
        dist.ring_attention(q, q[..., :4], q[..., :4], Untouchable())
    with pytest.raises(TypeError, match="unexpected keyword argument 'seqlens_q'"):
        dist.ring_attention(q, q, q, Untouchable(), seqlens_q=np.array(4))
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        dist.ring_attention_backward(q, q, q, q, q, np.zeros((2, 4), np.float32), Untouchable(), deterministic=1)
    with pytest.raises(TypeError, match="does not take return_lse"):
        dist.ring_attention_vjp(q, q, q, Untouchable(), return_lse=True)
    with pytest.raises(TypeError, match="deterministic must be a bool"):  # now, not when vjp() is called
        dist.ring_attention_vjp(q, q, q, Untouchable(), deterministic="yes")
    # the function called, not the ring_attention it passes the options to
    with pytest.raises(TypeError, match=r"^ring_attention_vjp\(\) got an unexpected keyword argument 'foo' \(it "
                                        r"takes causal, window, scale, layout, method, precision, backend, "
                                        r"deterministic\)"):
        dist.ring_attention_vjp(q, q, q, Untouchable(), foo=1)
    for bad, error in (([[0.0]], TypeError), (np.ma.masked_array(q), TypeError)):
        for layout in ("contiguous", "zigzag"):  # both layouts check x (contiguous sliced it silently)
            with pytest.raises(error, match="x must be a numpy.ndarray|x is a numpy.ma.MaskedArray"):
                dist.shard_sequence(bad, 2, 0, layout=layout)
    with pytest.raises(TypeError, match=r"parts\[0\] must be a numpy.ndarray"):
        dist.unshard_sequence([[[0.0]], [[0.0]]], layout="contiguous")


def test_ring_backward_takes_a_numpy_bool(monkeypatch):
    """deterministic=np.True_ was refused by the ring ("must be a bool, got bool") and taken by attention_backward."""
    thread_comms(monkeypatch)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 2, 8))

    def rank(_, comm):
        out, lse = dist.ring_attention(q, q, q, comm, return_lse=True)
        return dist.ring_attention_backward(q, q, q, q, out, lse, comm, deterministic=np.True_)

    out, lse = cuflash.attention(q, q, q, return_lse=True)
    want = cuflash.attention_backward(q, q, q, q, out, lse, deterministic=True)
    for g, w in zip(run_threads(1, rank)[0], want):
        np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-15)


def test_ring_vjp_keeps_the_window_the_forward_saw(monkeypatch):
    """ring_attention_vjp kept the caller's window list (a shallow copy of the options): a caller reusing the list
    after the forward got the gradients of another mask than the saved lse's, silently. attention_vjp snapshots it."""
    thread_comms(monkeypatch)
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((8, 2, 4)) for _ in range(4))

    def rank(r, comm):
        window = [1, 0]
        _, vjp = dist.ring_attention_vjp(*(dist.shard_sequence(x, 2, r) for x in (q, k, v)), comm, window=window)
        window[0] = None  # the caller reuses its list: causal, had the backward read it
        return vjp(dist.shard_sequence(dout, 2, r))

    got = run_threads(2, rank)
    want = cuflash.attention_vjp(q, k, v, window=(1, 0))[1](dout)
    for i in range(3):
        np.testing.assert_allclose(dist.unshard_sequence([g[i] for g in got]), want[i], rtol=1e-12, atol=1e-13)


def test_an_intercommunicator_is_refused():
    class Intercomm:  # what mpi4py's Intercomm answers; its Allgather returns the other group's values
        __module__ = "mpi4py.MPI"
        Isend = Get_rank = None

        def Is_inter(self):  # noqa: N802 - mpi4py's name
            return True

    q = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(TypeError, match="intracommunicator .* got an intercommunicator"):
        dist.ring_attention(q, q, q, Intercomm())


def test_a_subclass_of_an_mpi4py_communicator_is_one():
    """Told by the class and its bases (mpi4py stays an optional import): a user's subclass of MPI.Intracomm was
    refused as 'not an mpi4py communicator'."""
    class Intracomm:  # stands for mpi4py.MPI.Intracomm
        __module__ = "mpi4py.MPI"

    class Mine(Intracomm):
        __module__ = "mylab.comm"

    assert comms.is_mpi(Mine()) and comms.is_mpi(Intracomm()) and not comms.is_mpi(object())


def test_importing_needs_neither_mpi4py_nor_cupy():
    code = ("import sys, cuflash.distributed; "
            "assert 'mpi4py' not in sys.modules and 'cupy' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_have_numpy_docstrings():
    for name in ("ring_attention", "ring_attention_backward", "shard_sequence", "unshard_sequence",
                 "gather_sequence", "local_segments", "ring_step"):
        doc = getattr(dist, name).__doc__
        assert "Parameters\n    ----------" in doc and "Returns\n    -------" in doc, name
    assert "{options}" not in dist.ring_attention.__doc__


def test_cost_table_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "cuflash.distributed"], capture_output=True, text=True, check=True)
    assert "A MODEL, not a measurement" in done.stdout and table() in done.stdout


def test_readme_shows_the_model_table():
    import pathlib

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("## Sequence parallelism"):readme.index("## Not done yet")]
    assert table() in section and "It is a model, not a measurement" in section


# ------------------------------------------------------------------------------------------- the ring, fuzzed
class ThreadComm:
    """A test communicator: ranks are threads, messages go through queues (``ThreadTransport`` below stands in
    for the MPI adapter, so the ring's logic can be fuzzed in one process; the adapters themselves are tested under
    mpiexec and with the fake NCCL)."""

    def __init__(self, world, rank):
        self.world, self.rank = world, rank


class ThreadWorld:
    def __init__(self, size, timeout=60):
        import queue
        import threading

        self.size, self.queue, self.timeout = size, queue, timeout  # a rank left waiting fails after timeout s
        self.boxes = {}
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots = [None] * size

    def box(self, src, dst, tag):
        with self.lock:
            return self.boxes.setdefault((src, dst, tag), self.queue.Queue())


class ThreadTransport:
    refusal = None

    def __init__(self, comm):
        self.world, self.rank, self.size = comm.world, comm.rank, comm.world.size

    def allgather_ints(self, values):
        self.world.slots[self.rank] = np.asarray(values, np.int64)
        self.world.barrier.wait()
        out = np.stack(self.world.slots)
        self.world.barrier.wait()
        return out

    def start(self, sends, recvs):
        for a, peer, tag in sends:
            if a.nbytes:
                self.world.box(self.rank, peer, tag).put(a.copy())
        world, rank = self.world, self.rank

        class Pending:
            def poke(self):
                pass

            def wait(self):  # idempotent, as the adapters' handles are
                nonlocal recvs
                recvs, todo = (), recvs
                for a, peer, tag in todo:
                    if a.nbytes:
                        got = world.box(peer, rank, tag).get(timeout=world.timeout)
                        assert got.shape == a.shape and got.dtype == a.dtype, (got.shape, a.shape)
                        a[...] = got

        return Pending()


def run_threads(size, fn, timeout=60):
    import threading

    world = ThreadWorld(size, timeout)
    results, errors = [None] * size, [None] * size

    def target(rank):
        try:
            results[rank] = fn(rank, ThreadComm(world, rank))
        except BaseException as exc:  # noqa: BLE001
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * timeout)
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def thread_comms(monkeypatch):
    """Route ThreadComm to ThreadTransport (every other communicator to the real adapters)."""
    real = comms.transport
    monkeypatch.setattr(comms, "transport",
                        lambda comm, xp: ThreadTransport(comm) if isinstance(comm, ThreadComm) else real(comm, xp))


def _split(rng, total, size):
    cuts = np.sort(rng.integers(0, total + 1, size=size - 1))
    edges = [0, *cuts.tolist(), total]
    return [b - a for a, b in zip(edges[:-1], edges[1:])]


@given(size=st.integers(1, 4), lq=st.integers(1, 40), lk=st.integers(1, 40), hkv=st.sampled_from([1, 2, 4]),
       group=st.sampled_from([1, 2]), d=st.integers(1, 20), causal=st.booleans(),
       window=st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 30)),
                                             st.one_of(st.none(), st.integers(0, 30)))),
       layout=st.sampled_from(dist.LAYOUTS), ulysses=st.booleans(),
       dtype=st.sampled_from(["float32", "float64", "float16"]), seed=st.integers(0, 2**31))
def test_ring_fuzzed_against_the_reference(size, lq, lk, hkv, group, d, causal, window, layout,
                                           ulysses, dtype, seed):
    """Any rank count, lengths (uneven and empty parts in the contiguous layout), masks, GQA and dtype: the gathered
    forward and backward hold to the 2x/3x rule against the float64 reference."""
    from cuflash.testing import Case, check_backward, check_forward

    hq = hkv * group
    method = "ulysses" if ulysses and hq % size == 0 and hkv % size == 0 else "ring"
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((lq, hq, d)).astype(dtype)
    k, v = (rng.standard_normal((lk, hkv, d)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    options = dict(causal=causal, window=window)
    split_q, split_k = _split(rng, lq, size), _split(rng, lk, size)

    def part(x, rank, split):
        if layout == "zigzag":
            return dist.shard_sequence(x, size, rank, layout="zigzag")
        start = sum(split[:rank])
        return x[start:start + split[rank]]

    def rank_fn(rank, comm):
        ql, dl = part(q, rank, split_q), part(dout, rank, split_q)
        kl, vl = part(k, rank, split_k), part(v, rank, split_k)
        kw = dict(options, layout=layout, method=method)
        out, lse = dist.ring_attention(ql, kl, vl, comm, return_lse=True, **kw)
        return (out, lse, *dist.ring_attention_backward(dl, ql, kl, vl, out, lse, comm, **kw))

    with pytest.MonkeyPatch.context() as patch:
        thread_comms(patch)
        per_rank = run_threads(size, rank_fn)
    axes = (-3, -1, -3, -3, -3)
    out, lse, dq, dk, dv = (dist.unshard_sequence([r[i] for r in per_rank], layout=layout, axis=axes[i])
                            for i in range(5))
    case = Case(q, k, v, dout, options=options)
    check_forward(lambda *a, **o: (out, lse), case)
    check_backward(lambda *a, **o: (dq, dk, dv), case, out, lse)


# ------------------------------------------------------------------------------------- an error inside a ring step
# 3 ranks: the forward posts K/V twice; the backward posts K/V, then dK/dV (K/V in flight), then K/V (dK/dV in flight)
@pytest.mark.parametrize("what, where", [("forward", "pair"), ("forward", "post 2"), ("backward", "pair"),
                                         ("backward", "post 2"), ("backward", "post 3")])
def test_an_error_in_a_ring_step_leaves_after_the_transfers_in_flight(monkeypatch, what, where):
    """An error inside a ring step (every rank alike: the second pair computation, or the second or third transfer
    posted, as a device out-of-memory would) leaves ring_attention only once every transfer posted before it has
    completed: an abandoned MPI request goes on writing into a buffer that the unwinding frees (2 ranks on the fake
    GPU aborted with "malloc(): invalid size")."""
    import threading

    from cuflash.backends import numpy as nb

    started = []  # (rank, [waited])
    armed = threading.Event()  # the forward before a backward runs clean
    posts = threading.local()

    class Recorded(ThreadTransport):
        def start(self, sends, recvs):
            posts.n = getattr(posts, "n", 0) + 1
            if armed.is_set() and where == f"post {posts.n}":
                raise MemoryError("posting a transfer failed")
            handle, waited = super().start(sends, recvs), []
            real = handle.wait
            handle.wait = lambda: (waited.append(True), real())[1]
            started.append((self.rank, waited))
            return handle

    monkeypatch.setattr(comms, "transport", lambda comm, xp: Recorded(comm))
    calls = threading.local()
    real = getattr(nb, what)

    def second_raises(*args, **kwargs):
        calls.n = getattr(calls, "n", 0) + 1
        if armed.is_set() and where == "pair" and calls.n == 2:
            raise RuntimeError("pair computation failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(nb, what, second_raises)
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((3, 24, 2, 8)) for _ in range(4))
    barrier = threading.Barrier(3, timeout=60)

    def rank_fn(rank, comm):
        part = [dist.shard_sequence(x, 3, rank) for x in (q, k, v, dout)]
        if what == "forward":
            armed.set()
            return dist.ring_attention(*part[:3], comm)
        out, lse = dist.ring_attention(*part[:3], comm, return_lse=True)
        if barrier.wait() == 0:
            started.clear()
            armed.set()
        barrier.wait()
        posts.n = 0
        return dist.ring_attention_backward(part[3], *part[:3], out, lse, comm)

    with pytest.raises((RuntimeError, MemoryError), match="failed"):
        run_threads(3, rank_fn)
    assert {rank for rank, _ in started} == {0, 1, 2}
    assert all(waited for _, waited in started), [(r, bool(w)) for r, w in started]


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("what", ["forward", "backward"])
def test_an_error_in_one_ranks_computation_is_raised_on_every_rank(monkeypatch, what, method):
    """One rank's pair computation raises (its second one in the ring, as a device out-of-memory on one GPU would; its
    only one in Ulysses): it raised alone, and its neighbours waited for ever for the blocks it no longer passed on
    (here the thread transport's 60 s timeout, then queue.Empty). Now that rank passes every block on without
    computing, and at the end it raises its own error and every other rank a RuntimeError naming it; the
    communicator is clean for the next call (a message left over would be received in its place: other bits)."""
    import threading

    from cuflash.backends import numpy as nb

    thread_comms(monkeypatch)
    size, failing = 3, 1
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((24, 3, 8)) for _ in range(4))
    local = [[dist.shard_sequence(x, size, r) for x in (q, k, v, dout)] for r in range(size)]
    armed, calls, real = threading.Event(), threading.local(), getattr(nb, what)

    def fails_on_one_rank(*args, **kwargs):
        calls.n = getattr(calls, "n", 0) + 1
        if armed.is_set() and calls.rank == failing and calls.n == (1 if method == "ulysses" else 2):
            raise RuntimeError(f"{what} failed on rank {failing}")
        return real(*args, **kwargs)

    monkeypatch.setattr(nb, what, fails_on_one_rank)

    def call(r, comm):
        kw = dict(method=method, backend="numpy")
        out, lse = dist.ring_attention(*local[r][:3], comm, return_lse=True, **kw)
        if what == "forward":
            return out, lse
        return dist.ring_attention_backward(local[r][3], *local[r][:3], out, lse, comm, **kw)

    def rank_fn(r, comm):
        calls.rank, calls.n = r, 0
        try:
            call(r, comm)
        except Exception as exc:  # noqa: BLE001 - each rank's error is checked below
            return exc
        return None

    clean = run_threads(size, call)
    armed.set()
    raised = run_threads(size, rank_fn)
    for r, exc in enumerate(raised):
        want = f"{what} failed on rank {failing}" if r == failing else f"the call failed on rank(s) [{failing}]"
        assert isinstance(exc, RuntimeError) and want in str(exc), (r, repr(exc))
    armed.clear()
    for r, (got, want) in enumerate(zip(run_threads(size, call), clean)):
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y, err_msg=f"rank {r}")


@pytest.mark.parametrize("what", ["forward", "backward"])
def test_ulysses_pasting_that_fails_on_one_rank_is_raised_on_every_rank(monkeypatch, what):
    """Ulysses pastes the parts it received into whole-sequence arrays, the call's largest allocation: a MemoryError
    there on one rank (after the first all-to-all) left the others waiting for ever in the second. Now the pasting
    is part of the guarded computation: that rank raises it, the others a RuntimeError naming it."""
    import threading

    from cuflash.distributed import ulysses

    thread_comms(monkeypatch)
    size, failing = 2, 1
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((16, 2, 8)) for _ in range(4))
    local = [[dist.shard_sequence(x, size, r) for x in (q, k, v, dout)] for r in range(size)]
    armed, real, ranks = threading.Event(), ulysses._paste, threading.local()

    def paste(*args, **kwargs):
        if armed.is_set() and ranks.r == failing:
            raise MemoryError(f"pasting failed on rank {failing}")
        return real(*args, **kwargs)

    monkeypatch.setattr(ulysses, "_paste", paste)

    barrier = threading.Barrier(size, timeout=60)

    def rank_fn(r, comm):
        ranks.r = r
        kw = dict(method="ulysses", backend="numpy")
        try:
            if what == "forward":
                armed.set()
            out, lse = dist.ring_attention(*local[r][:3], comm, return_lse=True, **kw)
            if barrier.wait() == 0:  # both forwards done: the backward's pasting fails
                armed.set()
            barrier.wait()
            dist.ring_attention_backward(local[r][3], *local[r][:3], out, lse, comm, **kw)
        except Exception as exc:  # noqa: BLE001 - each rank's error is checked below
            return exc
        return None

    raised = run_threads(size, rank_fn)
    assert isinstance(raised[failing], MemoryError), raised
    for r in set(range(size)) - {failing}:
        assert isinstance(raised[r], RuntimeError) and f"the call failed on rank(s) [{failing}]" in str(raised[r]), \
            raised


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_an_allocation_that_fails_on_one_rank_leaves_no_rank_waiting(monkeypatch, method):
    """Each allocation that cuflash.distributed makes in a forward + backward fails in turn on one rank (as a device
    out of memory on one GPU would): the ring's K/V and dK/dV transfer buffers, made as each step posted them, and
    Ulysses' exchange buffers and joins, failed on that rank alone and left its neighbours waiting for ever in the
    transfer it would have made (here the thread transport's timeout, then queue.Empty), and one failing after the
    call's last exchange (joining the results) left the others waiting in the next call. Now that rank raises its own
    MemoryError and every other rank a RuntimeError naming it; the communicator is clean for the next call."""
    thread_comms(monkeypatch)
    size, failing = 3, 1
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((2, 25, 3, 8)) for _ in range(4))
    local = [[dist.shard_sequence(x, size, r) for x in (q, k, v, dout)] for r in range(size)]
    state = threading.local()
    armed = {"at": None}  # the n-th allocation of the failing rank's own thread fails

    def failing_(name):
        real = getattr(np, name)

        def allocate(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if armed["at"] is not None and getattr(state, "rank", None) == failing and \
                    caller.startswith("cuflash.distributed"):
                state.n += 1
                if state.n == armed["at"]:
                    raise MemoryError(f"allocation {state.n} failed on rank {failing}")
            return real(*args, **kwargs)
        return allocate

    for name in ("empty", "zeros", "full", "concatenate"):
        monkeypatch.setattr(np, name, failing_(name))

    def call(r, comm):
        state.rank, state.n = r, 0
        kw = dict(method=method, backend="numpy")
        out, lse = dist.ring_attention(*local[r][:3], comm, return_lse=True, **kw)
        return (out, lse, *dist.ring_attention_backward(local[r][3], *local[r][:3], out, lse, comm, **kw))

    def rank_fn(r, comm):
        try:
            return call(r, comm)
        except Exception as exc:  # noqa: BLE001 - each rank's outcome is checked below
            return exc

    clean = run_threads(size, call)
    failed_at = []
    for at in range(1, 200):
        armed["at"] = at
        outcome = run_threads(size, rank_fn, timeout=10)
        armed["at"] = None
        if not isinstance(outcome[failing], Exception):  # past the last allocation: a clean call
            break
        failed_at.append(at)
        assert isinstance(outcome[failing], MemoryError), (at, repr(outcome[failing]))
        for r in set(range(size)) - {failing}:
            got = outcome[r]
            assert isinstance(got, RuntimeError) and f"the call failed on rank(s) [{failing}]" in str(got), \
                (at, r, repr(got))
        for r, (got, want) in enumerate(zip(run_threads(size, call, timeout=10), clean)):
            for x, y in zip(got, want):
                np.testing.assert_array_equal(x, y, err_msg=f"the call after allocation {at} failed, rank {r}")
    assert len(failed_at) >= 20, failed_at  # 24 in the ring, 46 in Ulysses


def test_a_ring_call_takes_one_blas_whatever_another_thread_sets(monkeypatch):
    """A ring call is one backend call per step; CUFLASH_BLAS changed during it (here: after the ranks' first reads,
    as another thread could) takes effect from the next call: each rank's out, and its gradients, are the all-MKL
    bits, not a mix of MKL's and OpenBLAS's steps (the NumPy backend's call_scope around the steps)."""
    from cuflash.backends import _blas

    if _blas._load_mkl()[0] is None:
        pytest.skip(f"MKL products: {_blas._load_mkl()[1]}")
    thread_comms(monkeypatch)
    monkeypatch.setenv("CUFLASH_NUM_THREADS", "1")
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 1200, 2, 64)).astype(np.float32) for _ in range(4))
    local = [[dist.shard_sequence(x, 2, r) for x in (q, k, v, do)] for r in range(2)]

    def forward(r, comm):
        return dist.ring_attention(*local[r][:3], comm, return_lse=True, backend="numpy")

    def backward(r, comm, saved):
        return dist.ring_attention_backward(local[r][3], *local[r][:3], *saved[r], comm, backend="numpy")

    runs = {}
    for choice in ("mkl", "numpy"):
        monkeypatch.setenv("CUFLASH_BLAS", choice)
        saved = run_threads(2, forward)
        runs[choice] = saved, run_threads(2, lambda r, comm: backward(r, comm, saved))
    assert not np.array_equal(runs["mkl"][0][0][0], runs["numpy"][0][0][0])  # else this test would show nothing
    chosen = _blas._chosen_mkl

    def flip_after_two_reads():
        reads, lock = [], threading.Lock()

        def read():
            with lock:
                answer = chosen()  # MKL until the change below
                reads.append(answer)
                if len(reads) == 2:  # both ranks have read it: every later read sees the other thread's "numpy"
                    os.environ["CUFLASH_BLAS"] = "numpy"
                return answer
        return read

    saved_mkl = runs["mkl"][0]
    for phase in ("forward", "backward"):
        monkeypatch.setenv("CUFLASH_BLAS", "mkl")
        monkeypatch.setattr(_blas, "_chosen_mkl", flip_after_two_reads())
        if phase == "forward":
            got, want = run_threads(2, forward), saved_mkl
        else:
            got, want = run_threads(2, lambda r, comm: backward(r, comm, saved_mkl)), runs["mkl"][1]
        for r in range(2):
            for x, y in zip(got[r], want[r]):
                np.testing.assert_array_equal(x, y, err_msg=f"{phase}, rank {r}")


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_precision_reaches_each_blocks_kernels(monkeypatch, method):
    """ring_attention takes precision= as attention does (it had none): on the kernels (emulated), float32 blocks run
    the asked arithmetic, forward and backward; the ranks must agree on it; float16 takes only "ieee"."""
    from cuflash.cuda import launch as launches

    thread_comms(monkeypatch)
    asked = []
    wide_math = launches.specs.wide_math
    monkeypatch.setattr(launches.specs, "wide_math", lambda dtype, precision, cc: asked.append(precision) or
                        wide_math(dtype, precision, cc))
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((1, 40, 2, 16)).astype(np.float32) for _ in range(4))

    def rank(r, comm, precision):
        local = [dist.shard_sequence(x, 2, r) for x in (q, k, v, do)]
        opts = dict(causal=True, method=method, backend="emulate", precision=precision)
        out, lse = dist.ring_attention(*local[:3], comm, return_lse=True, **opts)
        return (out,) + dist.ring_attention_backward(local[3], *local[:3], out, lse, comm, **opts)

    tf32 = run_threads(2, lambda r, comm: rank(r, comm, "tf32"))
    assert asked and set(asked) == {"tf32"}
    ieee = run_threads(2, lambda r, comm: rank(r, comm, "ieee"))
    assert all(not np.array_equal(a, b) for a, b in zip(tf32[0], ieee[0]))  # out, dq, dk, dv of rank 0
    with pytest.raises(ValueError, match="the ranks' calls do not match"):
        run_threads(2, lambda r, comm: rank(r, comm, ("tf32", "ieee")[r]))
    # the same name as a np.str_ on one rank is the same call (its repr differs: the ranks compared reprs)
    mixed = run_threads(2, lambda r, comm: rank(r, comm, (np.str_("tf32"), "tf32")[r]))
    for r in range(2):
        for a, b in zip(mixed[r], tf32[r]):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="float16 inputs take only precision='ieee'"):
        dist.ring_attention(*(x.astype(np.float16) for x in (q, k, v)), ThreadComm(ThreadWorld(1), 0),
                            precision="tf32")


def test_a_ring_step_whose_weight_underflows_reaches_nothing(monkeypatch):
    """The ring merges each step's (out, lse) into its running one. A block of keys whose probabilities underflow to 0
    (scores 3000 below the row's largest, past even float64's range) holding an infinite value: the whole call gives
    the finite result (a key of probability 0 contributes nothing), the ring gave NaN (its step's out is inf, its
    weight exactly 0, and 0 * inf is NaN). merge_parts(unseen=True) drops a part of weight 0 as the call drops such a
    key."""
    thread_comms(monkeypatch)
    q = np.zeros((8, 1, 4))
    q[..., 0] = 1.0
    k = np.zeros((8, 1, 4))
    k[:4, 0, 0], k[4:, 0, 0] = 3000.0, -3000.0  # scores +-1500: the second rank's keys have probability exp(-3000)
    v = np.ones((8, 1, 4))
    v[6] = np.inf
    want = cuflash.attention(q, k, v)
    np.testing.assert_array_equal(want, np.ones_like(v))  # the reference's rule, as the NumPy backend keeps it

    def rank(r, comm):
        return dist.ring_attention(*(dist.shard_sequence(x, 2, r) for x in (q, k, v)), comm)

    np.testing.assert_array_equal(dist.unshard_sequence(run_threads(2, rank)), want)


@pytest.mark.parametrize("case", ["inf in V", "float16 underflow"])
def test_the_ring_runs_under_numpys_raise_setting_as_one_device_does(monkeypatch, case):
    """Under np.seterr(all="raise") (or -W error) the one-device call runs: cuflash's arithmetic ignores NumPy's
    floating-point errors. The ring's own casts and sums did not: a -inf in one rank's V made dK += the carried block
    raise on one rank outside the agreed failure (the others waited for ever), and float16 results that underflow in
    the final cast raised on every rank. Now the same NaN/inf pattern as the one-device call, and its finite values
    (forward and gradients) by the rule against the float64 reference."""
    from cuflash.testing import assert_attention_close

    thread_comms(monkeypatch)
    rng = np.random.default_rng(2 if case == "inf in V" else 0)
    dtype, size, options = (np.float32, 4, dict(causal=True, window=(5, None))) if case == "inf in V" else \
        (np.float16, 2, {})
    q, k, v, dout = (rng.standard_normal((12, 1, 4)).astype(dtype) for _ in range(4))
    if case == "inf in V":
        v[5, 0, 1] = -np.inf
    else:
        dout *= dtype(1e-4)  # dQ, dK round into float16's subnormals
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    want = cuflash.attention_backward(dout, q, k, v, out, lse, **options)

    def rank(r, comm):
        qs, ks, vs, ds = (dist.shard_sequence(x, size, r) for x in (q, k, v, dout))
        with np.errstate(all="raise"):
            o, l = dist.ring_attention(qs, ks, vs, comm, return_lse=True, **options)
            return (o,) + tuple(dist.ring_attention_backward(ds, qs, ks, vs, o, l, comm, **options))

    results = run_threads(size, rank, timeout=20)
    with np.errstate(all="ignore"):
        ref64 = (cuflash.reference.attention(q, k, v, **options),) + tuple(
            cuflash.reference.attention_backward(dout, q, k, v, **options))
        naive = (cuflash.reference.attention(q, k, v, compute_dtype=dtype, **options),) + tuple(
            cuflash.reference.attention_backward(dout, q, k, v, compute_dtype=dtype, **options))
    for i, w in enumerate((out,) + tuple(want)):
        got = dist.unshard_sequence([g[i] for g in results])
        np.testing.assert_array_equal(np.isnan(got), np.isnan(w))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(w))
        finite = np.isfinite(w)
        assert finite.any()
        assert_attention_close(got[finite], ref64[i][finite], naive[i][finite], mult=2 if i == 0 else 3)


def test_gather_sequence_out_of_memory_on_one_rank_raises_on_every_rank(monkeypatch):
    """gather_sequence makes the module's largest allocation (P times a rank's data): one rank out of memory raised
    alone and left the others waiting in the transfer for ever. Its buffers are made before any transfer now, the
    failure agreed (comm.together), as in the ring and Ulysses."""
    thread_comms(monkeypatch)
    failing = threading.local()
    empty = np.empty

    def short_of_memory(*args, **kwargs):
        if getattr(failing, "rank", None) == 1:
            raise MemoryError("cannot allocate on rank 1")
        return empty(*args, **kwargs)

    monkeypatch.setattr(np, "empty", short_of_memory)
    x = np.arange(2 * 12 * 3 * 4, dtype=np.float32).reshape(2, 12, 3, 4)

    def rank(r, comm):
        failing.rank = r
        try:
            dist.gather_sequence(dist.shard_sequence(x, 3, r), comm)
        except (MemoryError, RuntimeError) as exc:
            return type(exc).__name__, str(exc)
        return None

    results = run_threads(3, rank, timeout=10)
    assert results[1] == ("MemoryError", "cannot allocate on rank 1")
    assert all(kind == "RuntimeError" and "rank(s) [1]" in text for kind, text in (results[0], results[2]))
