"""cuflash.io_cost against the seeds' byte ledger, and the benchmark runner (``benchmarks/``, outside the
package) end to end at toy sizes.

Fast (a few seconds): the runner is exercised through ``--smoke``, the quick mode's code paths at
toy sizes; no timing is asserted anywhere. ``benchmarks`` is imported from the checkout (the repository
root is on ``sys.path``: ``python -m pytest`` from the root, or the root ``conftest.py``).
"""
import functools
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks import cases, impls, inputs, report, run, timing
from cuflash import reference
from cuflash.blockmask import BlockMask
from cuflash.io_cost import io_cost
from cuflash.testing import Case, assert_attention_close, check_backward


# ---------------------------------------------------------------------------------------------
# io_cost: the seeds' ledger
# ---------------------------------------------------------------------------------------------
def test_standard_forward_is_4Nd_plus_4N2_elements():
    n, d = 1024, 64
    cost = io_cost(seqlen_q=n, head_dim=d, dtype="float16", block_q=128, block_k=64)
    assert cost.standard == (4 * n * d + 4 * n * n) * 2  # FA paper, Algorithm 0 ledger, fp16
    assert cost.standard_ledger["write S"] == n * n * 2
    masked = io_cost(seqlen_q=n, head_dim=d, dtype="float16", causal=True, block_q=128, block_k=64)
    assert masked.standard - cost.standard == 2 * n * n * 2  # the mask pass reads and writes S


def test_default_tiles_are_those_the_gpu_runs():
    """io_cost's default tiles are the forward row the kernels select on that compute capability (the H100's own
    head_dim 128 row, specs.ARCH_TILES): its K/V re-reads follow that row's block_m."""
    from cuflash.cuda import specs

    for cc_, limit in specs.SMEM_LIMIT.items():
        spec = specs.select("fwd", "float16", 128, limit, cc=cc_)
        assert io_cost(seqlen_q=4096, head_dim=128, cc=cc_).tiles["fwd"] == (spec.block_m, spec.block_n)
    h100, a100 = (io_cost(seqlen_q=4096, head_dim=128, cc=c) for c in (90, 80))
    assert h100.tiles["fwd"] != a100.tiles["fwd"] and h100.tiled != a100.tiled
    for bad in (75, 90.0, True, "90"):
        with pytest.raises(ValueError, match="cc must be a compute capability"):
            io_cost(seqlen_q=128, head_dim=64, cc=bad)


def test_algorithm1_order_is_theorem2_ledger_with_real_tiles():
    n, d, br, bc = 1000, 64, 64, 128  # ragged last tiles on both sides
    cost = io_cost(seqlen_q=n, head_dim=d, dtype="float32", block_q=br, block_k=bc, order="fa1")
    tr, tc = math.ceil(n / br), math.ceil(n / bc)
    # T_c (2 B_c d + T_r (3 B_r d + 4 B_r)) elements, with the real (ragged) tile extents
    elements = 2 * n * d + tc * (3 * n * d + 4 * n)
    assert cost.tiled == elements * 4
    assert cost.visited["fwd"] == (tr * tc, tr * tc) and cost.tiles == {"fwd": (br, bc)}


def test_theorem2_scaling_with_sram_sized_tiles():
    d, m = 64, 64 * 1024  # M elements of on-chip memory: B_c = M / 4d, B_r = min(B_c, d)
    bc, br = math.ceil(m / (4 * d)), min(math.ceil(m / (4 * d)), d)
    for n in (4096, 16384, 65536):
        cost = io_cost(seqlen_q=n, head_dim=d, dtype="float32", block_q=br, block_k=bc, order="fa1")
        ratio = cost.tiled / 4 / (n * n * d * d / m)
        # Θ(N²d²/M): 12 from 3·B_r·d per inner step, 16/d from m and l, 2M/(Nd) from reading K, V once
        assert ratio == pytest.approx(12 + 16 / d + 2 * m / (n * d))


def test_fa2_reads_q_once_and_kv_once_per_query_tile():
    n, d, b, h = 1000, 64, 2, 3
    cost = io_cost(seqlen_q=n, head_dim=d, batch=b, heads=h, dtype="float16", block_q=128, block_k=64)
    nq = math.ceil(n / 128)
    assert cost.tiled_ledger["read Q"] == b * h * n * d * 2
    assert cost.tiled_ledger["read K, V per visited tile"] == b * h * nq * 2 * n * d * 2
    assert cost.tiled_ledger["write lse"] == b * h * n * 4
    assert cost.ratio > 1


def test_causal_visits_the_lower_triangle_of_tiles():
    cost = io_cost(seqlen_q=1024, head_dim=64, causal=True, block_q=64, block_k=64)
    assert cost.visited["fwd"] == (16 * 17 // 2, 256)


def test_block_sparse_scales_tiled_kv_traffic_by_density():
    n, d = 2048, 64
    grid = np.zeros((16, 16), dtype=bool)
    grid[:, ::4] = True  # density 1/4, aligned with the kernel tiles
    mask = BlockMask.from_grid(grid, block=(128, 128))
    dense = io_cost(seqlen_q=n, head_dim=d, block_q=128, block_k=64)
    sparse = io_cost(seqlen_q=n, head_dim=d, block_q=128, block_k=64, block_mask=mask)
    by_density = io_cost(seqlen_q=n, head_dim=d, block_q=128, block_k=64, density=0.25)
    line = "read K, V per visited tile"
    assert sparse.tiled_ledger[line] * 4 == dense.tiled_ledger[line]
    assert by_density.tiled_ledger[line] == sparse.tiled_ledger[line]
    assert sparse.standard > dense.standard  # standard attention still materializes everything (+ mask pass)


def test_key_tiles_no_query_sees_are_never_loaded():
    """The backward loads K_j, V_j only for a key tile some query tile sees (kernels/flash_bwd.cu), and Algorithm 1
    loads a key tile once per (batch, head) that visits it: counted per (batch, head), not from visits summed over
    heads. Hand counts: a window of (0, 0) at Sq = 128, Sk = 1024 sees keys 896-1023 only (2 tiles of 64); a per-head
    BlockMask keeps key block 0 in head 0 and key block 1 in head 1 (one tile of 64 keys each)."""
    d = 64
    cost = io_cost(op="bwd", seqlen_q=128, seqlen_k=1024, head_dim=d, window=(0, 0), bwd_block_q=64, bwd_block_k=64)
    assert cost.tiled_ledger["read K, V (key tiles some query tile sees)"] == 2 * 128 * d * 2
    assert cost.tiled_ledger["write dK, dV"] == 2 * 1024 * d * 2  # zeros for the keys no query sees
    grid = np.zeros((2, 2, 2), bool)
    grid[0, :, 0] = grid[1, :, 1] = True
    mask = BlockMask.from_grid(grid, block=(64, 64))
    fa1 = io_cost(seqlen_q=128, head_dim=d, heads=2, dtype="float32", block_q=64, block_k=64, block_mask=mask,
                  order="fa1")
    assert fa1.tiled_ledger["read K, V (once per key tile)"] == 2 * (64 + 64) * d * 4
    dense = io_cost(seqlen_q=128, head_dim=d, heads=2, dtype="float32", block_q=64, block_k=64, order="fa1")
    assert dense.tiled_ledger["read K, V (once per key tile)"] == 2 * 2 * 128 * d * 4
    half = io_cost(seqlen_q=128, head_dim=d, heads=2, dtype="float32", block_q=64, block_k=64, order="fa1",
                   density=0.5)  # each key tile kept by one of its 2 query tiles with probability 1 - 0.5**2
    assert half.tiled_ledger["read K, V (once per key tile)"] == 0.75 * dense.tiled_ledger[
        "read K, V (once per key tile)"]


def test_io_cost_refuses_what_it_would_count_wrong():
    mask = BlockMask.from_grid(np.ones((2, 2), bool), block=(64, 64))
    with pytest.raises(ValueError, match="block_mask or density, not both"):
        io_cost(seqlen_q=128, head_dim=64, block_mask=mask, density=0.5)
    with pytest.raises(ValueError, match="order is the forward's loop order"):
        io_cost(seqlen_q=128, head_dim=64, op="bwd", order="fa1")
    with pytest.raises(ValueError, match="got None"):
        io_cost(seqlen_q=128, head_dim=64, dtype=None)
    # a window that masks nothing adds no mask pass to the standard algorithm
    assert io_cost(seqlen_q=128, head_dim=64, window=(None, None)).standard == io_cost(seqlen_q=128,
                                                                                        head_dim=64).standard


def test_fwd_bwd_is_the_sum_and_defaults_come_from_the_tile_table():
    kw = dict(seqlen_q=512, head_dim=128, batch=2, heads=4, causal=True)
    fwd, bwd, both = (io_cost(op=op, **kw) for op in ("fwd", "bwd", "fwd_bwd"))
    assert both.standard == fwd.standard + bwd.standard and both.tiled == fwd.tiled + bwd.tiled
    from cuflash.cuda import specs

    spec, bwd_spec = specs.select("fwd", "float16", 128), specs.select("bwd", "float16", 128)
    assert both.tiles == {"fwd": (spec.block_m, spec.block_n), "bwd": (bwd_spec.block_m, bwd_spec.block_n)}
    assert "standard" in str(fwd) and "read Q" in str(fwd)


def test_backward_ledger_counts_query_tiles_per_key_block():
    n, d = 1024, 64
    cost = io_cost(seqlen_q=n, head_dim=d, op="bwd", dtype="float16", bwd_block_q=64, bwd_block_k=128)
    nk = n // 128
    assert cost.tiles == {"bwd": (64, 128)} and cost.visited["bwd"] == (16 * nk, 16 * nk)
    assert cost.tiled_ledger["read K, V (key tiles some query tile sees)"] == 2 * n * d * 2  # once per key block
    assert cost.tiled_ledger["read Q, dO per visited tile"] == nk * 2 * n * d * 2
    assert cost.tiled_ledger["dQ acc: read+write per visited tile"] == nk * 2 * n * d * 4


@pytest.mark.parametrize("kw, exc, match", [
    (dict(op="both"), ValueError, "op must be"), (dict(seqlen_q=-1), ValueError, "seqlen_q must be an int >= 0"),
    (dict(head_dim=0), ValueError, "head_dim must be an int >= 1"), (dict(density=1.5), ValueError, "density"),
    (dict(order="fa3"), ValueError, "order"), (dict(causal="no"), TypeError, "causal must be a bool"),
    (dict(window=(-300, -300)), ValueError, "window left must be >= 0"),
    (dict(window=(1.5, 0)), TypeError, "window left must be an int"),
    (dict(block_q=64.9), TypeError, "block_q must be an int >= 1, got 64.9"),
    (dict(block_q=True), TypeError, "block_q must be an int >= 1, got True"),
    (dict(batch=np.True_), TypeError, r"batch must be an int >= 0, got (np\.)?True"),
    (dict(density=True), TypeError, "density must be a number"),
    (dict(density="0.5"), TypeError, "density must be a number"),
    (dict(dtype="int8"), ValueError, "dtype must be float16"),
    (dict(block_mask=np.ones((2, 2), bool)), TypeError, "block_mask must be a cuflash")])
def test_io_cost_rejects_bad_arguments(kw, exc, match):
    """A wrong type is a TypeError, a wrong value a ValueError, as everywhere in cuflash."""
    args = dict(seqlen_q=128, head_dim=64, block_q=64, block_k=64) | kw
    with pytest.raises(exc, match=match):
        io_cost(**args)


@pytest.mark.parametrize("kw", [dict(seqlen_q=np.int32(70000), head_dim=np.int32(64)),
                                dict(seqlen_q=np.int64(70000), seqlen_k=np.int16(1000), head_dim=64, op="fwd_bwd"),
                                dict(seqlen_q=128, head_dim=64, batch=np.int64(2**40), heads=np.int64(2**40)),
                                dict(seqlen_q=np.uint16(60000), head_dim=np.uint8(255), heads=np.int8(100))])
def test_io_cost_counts_numpy_int_sizes_as_python_ints(kw):
    """NumPy int sizes give the bytes their Python ints give: the ledgers multiply the sizes, and in a NumPy int
    they wrapped (np.int32(70000) gave 581134336 bytes for 39235840000; batch * heads = 2**80 as np.int64 gave 0)."""
    cost = io_cost(**kw)
    expected = io_cost(**{n: int(v) if isinstance(v, np.integer) else v for n, v in kw.items()})
    assert cost.standard == expected.standard > 0 and cost.tiled == expected.tiled > 0
    assert cost.standard_ledger == expected.standard_ledger and cost.tiled_ledger == expected.tiled_ledger
    assert all(type(b) is int for b in (cost.standard, *cost.standard_ledger.values()))


@pytest.mark.parametrize("kw", [dict(seqlen_q=0), dict(seqlen_q=8, batch=0),
                                dict(seqlen_q=8, heads=0, op="fwd_bwd", causal=True)])
def test_io_cost_of_an_empty_problem_is_nothing(kw):
    """An empty problem, which attention takes, moves no bytes either way (io_cost refused it before)."""
    cost = io_cost(head_dim=64, **kw)
    assert cost.standard == cost.tiled == 0 and cost.ratio == 1.0


@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_io_cost_without_keys_writes_the_empty_rows(order):
    """No keys: no tile is visited, so nothing is read (the kernel loads Q_i with the first K_j), but the zero rows
    of O and their statistics are written, as attention does (FA1's order wrote nothing: its O and l, m come from
    Algorithm 1's initialization, line 2, which Theorem 2 leaves out); standard attention writes its O alone."""
    cost = io_cost(seqlen_q=8, seqlen_k=0, head_dim=64, order=order)
    assert cost.visited == {"fwd": (0, 0)}
    stats = {"fa2": 8 * 4, "fa1": 2 * 8 * 4}[order]  # lse; or m and l
    assert cost.tiled == 8 * 64 * 2 + stats and cost.standard == 8 * 64 * 2


def test_io_cost_without_queries_reads_nothing():
    """No queries: neither ledger reads K or V (standard attention's products have an empty side); the backward
    writes the zero dK, dV."""
    assert io_cost(seqlen_q=0, seqlen_k=64, head_dim=64).standard == 0
    cost = io_cost(seqlen_q=0, seqlen_k=64, head_dim=64, op="bwd")
    assert cost.standard == cost.tiled == 2 * 64 * 64 * 2 and cost.ratio == 1.0


def test_a_window_past_every_key_loads_no_query_tile():
    """Query tiles whose window holds no key are not loaded by FA2's order (the kernel's Q_i comes with the first
    K_j) and are written from Algorithm 1's initialization in FA1's."""
    fa2 = io_cost(seqlen_q=256, seqlen_k=64, head_dim=64, window=(0, 0), block_q=64, block_k=64)
    assert fa2.visited["fwd"][0] == 1 and fa2.tiled_ledger["read Q"] == 64 * 64 * 2  # the last query tile (bottom-right)
    fa1 = io_cost(seqlen_q=256, seqlen_k=64, head_dim=64, window=(0, 0), block_q=64, block_k=64, order="fa1")
    assert fa1.tiled_ledger["initialize O, m, l of rows no key tile visits"] == 3 * 64 * (64 * 2 + 2 * 4)


# ---------------------------------------------------------------------------------------------
# The benchmark runner: cases and suites
# ---------------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results" / "cpu-amd-epyc-2c"


def test_flops_follow_the_fa_convention():
    base = dict(figure="throughput", device="cpu", dtype="float16", batch=2, heads=3, head_dim=64)
    fwd = cases.Case(op="fwd", seqlen_q=512, seqlen_k=512, **base)
    assert fwd.flops == 4 * 2 * 3 * 512 * 512 * 64
    assert cases.Case(op="fwd", seqlen_q=512, seqlen_k=512, causal=True, **base).flops == fwd.flops / 2
    assert cases.Case(op="fwd", seqlen_q=16, seqlen_k=512, causal=True, **base).flops == 4 * 2 * 3 * 16 * 512 * 64
    assert cases.Case(op="bwd", seqlen_q=512, seqlen_k=512, **base).flops == 2.5 * fwd.flops
    assert cases.Case(op="fwd_bwd", seqlen_q=512, seqlen_k=512, **base).flops == 3.5 * fwd.flops
    sparse = cases.Case(op="fwd", seqlen_q=512, seqlen_k=512, density=0.25, mask_block=(64, 64), **base)
    assert sparse.flops == fwd.flops / 4
    assert fwd.bytes == 2 * 3 * 64 * (4 * 512) * 2


@pytest.mark.parametrize("kw, match", [(dict(op="both"), "op must be"), (dict(device="gpu"), "device must be"),
                                       (dict(density=0.5), "mask_block")])
def test_case_rejects_bad_arguments(kw, match):
    args = dict(figure="decode", device="cpu", op="fwd", dtype="float32", batch=1, heads=1, seqlen_q=1,
                seqlen_k=64, head_dim=16) | kw
    with pytest.raises(ValueError, match=match):
        cases.Case(**args)
    with pytest.raises(TypeError):  # the options are keyword-only
        cases.Case("decode", "cpu", "fwd", "float32", 1, 1, 1, 64, 16, True)


@pytest.mark.parametrize("device, mode, match", [("gpu", "quick", "device must be"), ("cpu", "fast", "mode must be")])
def test_suite_rejects_unknown_device_or_mode(device, mode, match):
    with pytest.raises(ValueError, match=match):
        cases.suite(device, mode)


def test_fa_config_and_the_product_case():
    assert cases.fa_config(2048, 128, tokens=16384, hidden=2048) == (8, 16)
    assert cases.fa_config(65536, 64, tokens=16384, hidden=2048) == (1, 32)
    for mode in ("quick", "full"):
        product = [c for c in cases.suite("cpu", mode) if c.figure == "product"]
        assert len(product) == 1
        c = product[0]
        assert (c.op, c.dtype, c.batch, c.seqlen_q, c.seqlen_k, c.heads, c.head_dim, c.causal) == \
               ("fwd", "float32", 1, 4096, 4096, 4, 64, False)
        assert {"cuflash", "numpy", "torch-flash"} <= set(c.impls)


def test_quick_cpu_suite_stays_small():
    suite = cases.suite("cpu", "quick")
    assert len(run.plan_work(suite)) <= 70
    assert max(c.flops for c in suite) <= cases.product_case().flops * 2.5  # nothing much heavier


def test_gpu_full_suite_shape():
    suite = cases.suite("cuda", "full")
    # every figure but the product case, which measures the NumPy backend: no device time for the CPU
    assert {c.figure for c in suite} == set(cases.FIGURES) - {"product"}
    assert all(c.device == "cuda" for m in cases.MODES for c in cases.suite("cuda", m))
    thr = [c for c in suite if c.figure == "throughput"]
    assert {c.seqlen_q for c in thr} == {512, 1024, 2048, 4096, 8192, 16384}
    assert all(c.batch * c.seqlen_q == 16384 and c.heads * c.head_dim == 2048 for c in thr)
    assert {c.op for c in thr} == set(cases.OPS) and {c.causal for c in thr} == {False, True}
    decode = [c for c in suite if c.figure == "decode"]
    assert {c.seqlen_q for c in decode} == {1, 2, 4, 8, 16}
    # JAX goes last so that its allocator cannot starve CuPy and PyTorch
    order = [name for _, name in run.plan_work(suite)]
    first_jax = min(i for i, n in enumerate(order) if n.startswith("jax"))
    assert all(n.startswith("jax") for n in order[first_jax:])


@pytest.mark.parametrize("mode", cases.MODES)
def test_cuda_tile_sweeps_are_valid_kernel_specializations(mode):
    """Every swept key tile is a KernelSpec the CUDA backend accepts (``replace`` validates it)."""
    from dataclasses import replace

    from cuflash.cuda import specs

    tiles = [c for c in cases.suite("cuda", mode) if c.figure == "tiles"]
    assert len({c.block_k for c in tiles}) >= 2
    for c in tiles:
        spec = replace(specs.select("fwd", c.dtype, c.head_dim), block_n=c.block_k)
        assert spec.block_n == c.block_k and spec.smem_bytes <= specs.SMEM_LIMIT[80]


def test_cuda_smoke_suite_fits_the_cpu_emulator():
    """A dry run of gpu_session.sh measures ``--smoke`` on the emulated CUDA backend: toy sizes only."""
    suite = cases.suite("cuda", "smoke")
    assert {c.figure for c in suite} == set(cases.FIGURES) - {"product"}
    assert max(c.batch * c.heads * c.seqlen_q * c.seqlen_k * c.head_dim for c in suite) <= 1 << 22
    assert {c.dtype for c in suite if c.figure != "wide"} == {"float16"}
    assert {(c.dtype, c.precision) for c in suite if c.figure == "wide"} == set(cases.WIDE_MODES)


# ---------------------------------------------------------------------------------------------
# Adapters, timer, runner
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_standard_attention_baseline_is_attention(inplace, causal):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 33, 3, 16))
    k, v = rng.standard_normal((2, 40, 3, 16)), rng.standard_normal((2, 40, 3, 16))
    bias = impls.causal_bias(np, 33, 40, np.float64) if causal else None
    got = impls.standard_attention(q, k, v, bias=bias, inplace=inplace)
    np.testing.assert_allclose(got, reference.attention(q, k, v, causal=causal), rtol=1e-12, atol=1e-12)
    q32 = q.astype(np.float32)
    assert impls.standard_attention(q32, q32, q32, inplace=inplace).dtype == np.float32


def test_timer_and_peak_on_cpu():
    calls = []
    timer = timing.time_it(lambda: calls.append(np.zeros(1000)), lambda r=None: None, device="cpu",
                           timing=timing.Timing(warmup=1, min_repeats=3, max_repeats=5, budget_s=0.0))
    assert len(timer.samples) == 3 and len(calls) == 4 and timer.median_ms >= 0
    peak = timing.first_call_peak(lambda: np.ones(1 << 20), lambda r=None: None, device="cpu", memory="pool")
    assert peak >= 8 << 20


def test_the_host_time_excludes_the_synchronization():
    """host_samples (the record's host_ms on CUDA) time the calls alone: the sync's time is in the sample, not in
    the host's share (a GPU whose sample nears host_ms waited on the host)."""
    timer = timing.Timer(lambda: time.sleep(0.002), lambda r=None: time.sleep(0.02), device="cpu", calls=2)
    for _ in range(3):
        timer.sample()
    assert len(timer.host_samples) == len(timer.samples) == 3
    assert all(2 <= h < s - 5 for h, s in zip(timer.host_samples, timer.samples))  # ms per call: 2+ and 2+ + 20/2


def test_unavailable_and_late_pairs_are_skipped_with_a_reason():
    case = cases.Case("decode", "cpu", "fwd", "float32", 1, 2, 1, 64, 16, impls=("cupy-standard", "cuflash"))
    result = run.run_cases([case], timing=timing.TIMINGS["smoke"], progress=False)
    assert [r.impl for _, r in result.records] == ["cuflash"]
    assert "does not run on cpu" in result.skipped[0][1]["reason"]
    saved = []
    run.run_cases([case], timing=timing.TIMINGS["smoke"], progress=False, checkpoint=saved.append, checkpoint_s=0)
    assert len(saved) == 1 and saved[-1].records  # after each measured pair: a killed run leaves its results
    late = run.run_cases([case], timing=timing.TIMINGS["smoke"], progress=False, deadline=0.0)
    assert late.records == [] and any("time limit" in e["reason"] for _, e in late.skipped)
    assert timing.is_oom(MemoryError()) and timing.is_oom(RuntimeError("CUDA out of memory. Tried"))
    assert not timing.is_oom(ValueError("bad head_dim"))


def test_an_interrupted_run_keeps_what_it_measured(monkeypatch):
    """SIGINT (``timeout -s INT`` in gpu_session.sh) ends the run with its records, marked interrupted."""
    pairs = [cases.Case("decode", "cpu", "fwd", "float32", 1, 2, sq, 64, 16, impls=("cuflash",)) for sq in (1, 2, 4)]
    measure, calls = run.measure, []

    def interrupt_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(*args, **kw)

    monkeypatch.setattr(run, "measure", interrupt_second)
    result = run.run_cases(pairs, timing=timing.TIMINGS["smoke"], progress=False)
    assert result.interrupted and len(calls) == 2
    assert [r.seqlen_q for _, r in result.records] == [1]


def test_a_cuflash_error_is_a_failure_not_a_skip(monkeypatch, tmp_path, capsys):
    """cuflash raising (not Skip, not out of memory) in a benchmark case is a defect: listed under "failed" in the
    JSON and the run ends with status 3, so gpu_session.sh fails the benchmark step; a baseline's error stays a skip,
    cuflash out of memory too."""
    measure = run.measure

    def cuflash_breaks_at_sq_2(case, impl, *args, **kw):
        if impl.name == "cuflash" and case.seqlen_q == 2:
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
        if impl.name == "cuflash" and case.seqlen_q == 4:
            raise MemoryError("out of memory")
        return measure(case, impl, *args, **kw)

    monkeypatch.setattr(run, "measure", cuflash_breaks_at_sq_2)
    pairs = [cases.Case("decode", "cpu", "fwd", "float32", 1, 2, sq, 64, 16, impls=("cuflash",)) for sq in (1, 2, 4)]
    result = run.run_cases(pairs, timing=timing.TIMINGS["smoke"], progress=False)
    assert [r.seqlen_q for _, r in result.records] == [1]
    assert [e["seqlen_q"] for _, e in result.failures] == [2] and "IllegalAddress" in result.failures[0][1]["reason"]
    assert [e["seqlen_q"] for _, e in result.skipped] == [4]
    monkeypatch.setattr(run, "suite", lambda device, mode: pairs)
    assert run.main(["--smoke", "--device", "cpu", "--no-progress", "--no-plot", "--out", str(tmp_path)]) == 3
    payload = json.loads((tmp_path / "fig5_decode.json").read_text())
    assert [e["seqlen_q"] for e in payload["failed"]] == [2]
    assert "cuflash cases FAILED" in capsys.readouterr().out


def test_device_slug():
    from benchmarks.environment import device_slug

    assert device_slug({"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}) == "nvidia-h100-80gb-hbm3"
    assert device_slug({"kind": "cpu", "name": "Intel(R) Xeon(R) Gold 6338", "cores": 2}) == \
        "cpu-intel-xeon-gold-6338-2c"


def _impl_ops():
    cpu = [n for n, i in impls.IMPLS.items() if "cpu" in i.devices] + ["jax-xla"]
    return [(n, op) for n in cpu for op in impls.IMPLS[n].ops]


@pytest.mark.parametrize("impl, op", _impl_ops())
def test_every_cpu_capable_baseline_computes_attention(impl, op):
    """Each impl's timed call computes causal attention (or its gradients); baselines that are not
    installed skip. JAX runs its XLA path on the CPU here (the runner uses JAX on GPUs only)."""
    if impl.startswith(("torch", "jax")):
        pytest.importorskip(impl.split("-")[0])
    case = cases.Case("throughput", "cpu", op, "float32", 2, 3, 64, 64, 16, causal=True)
    x = inputs.make_inputs(case)
    fn, sync = impls.IMPLS[impl].build(case, x)
    got = fn()
    sync(got)

    def host(a):
        return np.asarray(a.detach() if hasattr(a, "detach") else a)

    # held to the project's rule (2x / 3x the naive float32 computation's error against float64, plus the floor)
    held = Case(*(np.asarray(a) for a in (x.q, x.k, x.v, x.dout)), dict(causal=True))
    if op == "fwd":
        out = host(got)
        out = out.transpose(0, 2, 1, 3) if impl.startswith("torch") else out  # torch returns (B, H, S, d)
        assert_attention_close(out, reference.attention(held.q, held.k, held.v, causal=True),
                               reference.attention(held.q, held.k, held.v, causal=True, compute_dtype=np.float32),
                               magnitude=reference.term_magnitudes(held.q, held.k, held.v, causal=True)["out"])
    else:
        check_backward(lambda *a, **o: tuple(host(g) for g in got), held, None, None)


# ---------------------------------------------------------------------------------------------
# Command line, JSON, committed results
# ---------------------------------------------------------------------------------------------
SCHEMA = {"impl", "op", "dtype", "head_dim", "seqlen_q", "seqlen_k", "batch", "heads", "causal", "density", "ms",
          "tflops", "peak_bytes"}
SMOKE = ["--smoke", "--no-plot", "--no-progress"]


def test_smoke_run_writes_every_figure_in_the_schema(tmp_path, capsys, monkeypatch):
    from benchmarks import environment

    monkeypatch.delenv("GPU_SESSION_DRY_RUN", raising=False)
    status = run.main(SMOKE + ["--out", str(tmp_path), "--impl", "cuflash,numpy"])
    assert status == 0
    printed = capsys.readouterr().out
    for fig in ("throughput", "memory", "blocksparse", "tiles", "decode"):
        assert f"== {fig}" in printed
        payload = json.loads((tmp_path / f"{cases.FIGURE_FILES[fig]}.json").read_text())
        assert {"device", "commit", "date", "versions", "records"} <= set(payload)
        assert payload["commit"] == environment.git_commit()[0]  # git's HEAD, "unknown" where there is no git
        assert payload["records"] and all(SCHEMA <= set(r) for r in payload["records"])
        assert all(r["impl"] in ("cuflash", "numpy") and r["ms"] > 0 for r in payload["records"])
    loaded = report.load_results(tmp_path)
    assert set(loaded) == {"throughput", "memory", "blocksparse", "tiles", "decode"}
    memory = loaded["memory"]["records"]
    assert all(r["peak_bytes"] is not None for r in memory)
    assert sorted(r["block_k"] for r in loaded["tiles"]["records"]) == [64, 128]
    assert sorted(r["density"] for r in loaded["blocksparse"]["records"]) == [0.5, 1.0]


def test_committed_results_fit_the_schema():
    """The JSON under benchmarks/results/ is data the current code must still read (and replot)."""
    loaded = report.load_results(COMMITTED)
    assert set(loaded) == set(cases.FIGURES) - {"wide"}  # the float32/float64 figure is GPU-only
    assert report.load_results(str(COMMITTED)) == loaded  # the folder's text too, as the README writes it
    assert all(r["tile"] is None for p in loaded.values() for r in p["records"])  # written before tile existed
    result = report.RunResult(records=[(fig, report.Record(**r)) for fig, p in loaded.items() for r in p["records"]])
    text = report.table(result)
    assert "== product" in text and "product targets (this run):" in text


def test_load_results_names_a_file_that_does_not_fit(tmp_path):
    payload = json.loads((COMMITTED / "fig4_tiles.json").read_text())
    payload["records"][0]["speed"] = 1.0
    (tmp_path / "fig4_tiles.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=r"fig4_tiles.json.*\['speed'\]"):
        report.load_results(tmp_path)


def _committed(tmp_path: Path, *names: str, source: Path = COMMITTED) -> Path:
    """``tmp_path`` holding copies of committed result files (another run's: an AMD EPYC, quick, Nov 21)."""
    for name in names:
        (tmp_path / name).write_bytes((source / name).read_bytes())
    return tmp_path


def _no_measuring(*args, **kw):
    raise AssertionError("measured although the arguments were refused")


def test_a_folder_of_another_run_is_refused_unless_replaced(tmp_path, capsys, monkeypatch):
    """--out into a folder that holds another run's figures mixed the two silently: a usage error before measuring,
    naming the folder and the other run; --replace removes that run's figures (JSON and PNG) first. The same run
    (commit, device, mode) may add figures, its own checkpoints included."""
    import functools

    folder = _committed(tmp_path, "fig5_decode.json", "fig5_decode.png")
    measure = run.run_cases
    monkeypatch.setattr(run, "run_cases", _no_measuring)
    with pytest.raises(SystemExit) as exc:
        run.main(SMOKE + ["--out", str(folder), "--only", "tiles", "--impl", "cuflash"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and str(folder) in err and "d828e844784f" in err and "on 'AMD EPYC', quick" in err
    assert "--replace" in err and {p.name for p in folder.iterdir()} == {"fig5_decode.json", "fig5_decode.png"}
    # checkpoints after every pair: the run's own files are never taken for another run's
    monkeypatch.setattr(run, "run_cases", functools.partial(measure, checkpoint_s=0))
    assert run.main(SMOKE + ["--out", str(folder), "--only", "tiles", "--impl", "cuflash", "--replace"]) == 0
    assert {p.name for p in folder.iterdir()} == {"fig4_tiles.json"}
    assert run.main(SMOKE + ["--out", str(folder), "--only", "decode", "--impl", "cuflash"]) == 0  # the same run
    loaded = report.load_results(folder)
    assert set(loaded) == {"tiles", "decode"} and len({report.run_of(p) for p in loaded.values()}) == 1


def test_an_interrupted_runs_figures_are_not_a_later_runs(tmp_path, capsys, monkeypatch):
    """An interrupted run's checkpoints (marked partial) were taken up by a later run of the same commit into the same
    folder, which then read as one complete run, and --replot said nothing: now they are another run's (refused
    without --replace), and --replot of them says they are partial. A dirty tree's figures are not its commit's."""
    folder = tmp_path / "out"
    args = SMOKE + ["--out", str(folder), "--only", "decode", "--impl", "cuflash"]
    assert run.main(args) == 0
    payload = json.loads((folder / "fig5_decode.json").read_text())
    key = report.run_of(payload)
    assert report.run_of({**payload, "partial": True}) != key
    assert report.run_of({**payload, "dirty": not payload["dirty"]}) != key
    (folder / "fig5_decode.json").write_text(json.dumps({**payload, "partial": True}))  # as a checkpoint leaves it
    monkeypatch.setattr(run, "run_cases", _no_measuring)
    with pytest.raises(SystemExit) as exc:  # the same commit, device and mode as the interrupted run
        run.main(args)
    assert exc.value.code == 2 and "interrupted (partial results)" in capsys.readouterr().err
    import benchmarks.plots as plots

    monkeypatch.setattr(plots, "write_plots", lambda by_fig, out: [out / "fig5_decode.png"])
    assert run.replot(folder) == 0
    assert "holds an interrupted run's results (partial)" in capsys.readouterr().err


@pytest.mark.parametrize("library, check", [("torch", lambda: impls._check_torch("cpu")),
                                            ("jax", lambda: impls._check_jax("cpu"))])
def test_a_library_that_fails_to_import_otherwise_than_importerror_is_a_skip(monkeypatch, library, check):
    """A broken install raises OSError at import (a missing libtorch_cuda.so): the run ended in a traceback, as it
    caught ImportError only; now the implementations that need it are skipped with the reason."""
    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name == library or name.startswith(library + "."):
                raise OSError(f"lib{library}.so: cannot open shared object file")

    for name in [n for n in sys.modules if n == library or n.startswith(library + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with pytest.raises(impls.Skip, match=f"{library} not importable \\(OSError: lib{library}.so"):
        check()


def test_replot_that_writes_no_plot_fails(tmp_path, capsys, monkeypatch):
    """Without matplotlib --replot printed "plots skipped", then "wrote 0 plots" and exited 0, its only job undone;
    a matplotlib whose import raised another error than ImportError was a traceback."""
    import benchmarks.plots as plots

    folder = _committed(tmp_path, "fig5_decode.json")
    monkeypatch.setattr(plots, "write_plots", lambda by_fig, out: [])
    assert run.replot(folder) == 1 and "no plot written" in capsys.readouterr().err

    def broken(by_fig, out):
        raise RuntimeError("matplotlib: could not find a backend")

    monkeypatch.setattr(plots, "write_plots", broken)
    assert run.replot(folder) == 1 and "RuntimeError: matplotlib: could not find" in capsys.readouterr().err


def _odd_file(kind: str, path: Path):
    """Something at a figure's path that is no regular file."""
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(COMMITTED / path.name)


@pytest.mark.parametrize("where, kind", [("fig1_throughput.json", "folder"), ("fig2_memory.png", "folder"),
                                         ("fig1_throughput.json", "fifo"), ("fig2_memory.json", "symlink")])
def test_replace_removes_nothing_where_a_figure_path_is_no_regular_file(
        tmp_path, where, kind, capsys, monkeypatch, within):
    """--replace died in unlink with IsADirectoryError, after removing another run's JSON beside a folder named as
    its PNG (a half-cleaned folder), and hung on a FIFO: every path it would remove is checked first, and any that is
    not a regular file is a usage error naming it, with nothing removed."""
    folder = _committed(tmp_path, "fig2_memory.json", "fig5_decode.json", "fig5_decode.png")
    if where == "fig2_memory.json":
        (folder / where).unlink()
    _odd_file(kind, folder / where)
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()}
    monkeypatch.setattr(run, "run_cases", _no_measuring)
    with within(10), pytest.raises(SystemExit) as exc:
        run.main(SMOKE + ["--out", str(folder), "--only", "decode", "--impl", "cuflash", "--replace"])
    err = capsys.readouterr().err
    words = {"folder": "a folder", "fifo": "a FIFO", "symlink": "a symbolic link"}[kind]
    assert exc.value.code == 2 and f"{where} ({words})" in err and "nothing was removed" in err
    assert "Traceback" not in err
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()} == before
    assert os.path.lexists(folder / where)


def test_load_results_refuses_figures_of_two_runs(tmp_path):
    _committed(tmp_path, "fig5_decode.json")
    _committed(tmp_path, "fig1_throughput.json", source=REPO / "benchmarks" / "results" / "gpu-nvidia-h100-80gb-hbm3")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + ".* 2 runs .*NVIDIA H100.*AMD EPYC"):
        report.load_results(tmp_path)
    assert run.main(["--replot", str(tmp_path)]) == 1  # one line, no traceback


@pytest.mark.parametrize("where, value, match", [
    (["commit"], None, r"\['commit'\] are missing"), (["date"], None, r"\['date'\]"),
    (["mode"], None, r"\['mode'\]"), (["skipped"], None, r"\['skipped'\]"),
    (["device"], {"kind": "cpu"}, r"\['device.name'\]"), (["records"], {}, r"\['records'\]"),
    (["failed"], "none", r"\['failed'\]"), (["figure"], "tiles", "holds figure 'tiles'"),
    (["records", 0, "ms"], "fast", r"\['ms'\] are not of their type \(ms='fast'\)"),
    (["records", 0, "impl"], 42, r"\['impl'\]"), (["records", 0, "seqlen_k"], None, r"\['seqlen_k'\]"),
    (["records", 0, "causal"], 1, r"\['causal'\]"), (["records", 0, "head_dim"], True, r"\['head_dim'\]"),
    (["records", 0, "tile"], "128x64", r"\['tile'\]"), (["records", 0, "peak_bytes"], 1.5, r"\['peak_bytes'\]"),
], ids=lambda x: ".".join(map(str, x)) if isinstance(x, list) else "")
def test_load_results_checks_the_file_fields_and_the_record_types(tmp_path, where, value, match):
    """Only the records' field names were checked: a file without its commit, date, device or mode, or records whose
    values are of the wrong type (bool is no int there), passed; None below means the field is removed."""
    payload = json.loads((COMMITTED / "fig5_decode.json").read_text())
    *path, last = where
    parent = functools.reduce(lambda obj, key: obj[key], path, payload)
    if value is None and not path:
        del parent[last]
    else:
        parent[last] = value
    (tmp_path / "fig5_decode.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=r"fig5_decode.json: .*" + match):
        report.load_results(tmp_path)


def test_load_results_names_a_file_that_is_not_json(tmp_path, capsys):
    text = (COMMITTED / "fig5_decode.json").read_text()
    (tmp_path / "fig5_decode.json").write_text(text[: len(text) // 2])  # as a kill during a plain write left it
    with pytest.raises(ValueError, match=r"fig5_decode.json: not valid JSON"):
        report.load_results(tmp_path)
    assert run.main(["--replot", str(tmp_path)]) == 1
    assert "fig5_decode.json: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["deep", "fifo"])
def test_json_nested_too_deeply_or_a_fifo_is_refused_not_a_hang(tmp_path, bad, capsys, monkeypatch, within):
    """Deeply nested JSON raised RecursionError through --replot and a run's look at --out (only ValueError and
    OSError were caught), and a FIFO named as a figure hung both forever: each is a file that cannot be taken up,
    one error line, the same in both places (report.read_json)."""
    path = tmp_path / "fig2_memory.json"
    if bad == "deep":
        path.write_text("[" * 200000 + "]" * 200000)
        match = "fig2_memory.json: not valid JSON (nested too deeply)"
    else:
        os.mkfifo(path)
        match = "fig2_memory.json: cannot be read (a FIFO, not a regular file)"
    with within(10):
        with pytest.raises(ValueError, match=re.escape(match)):
            report.load_results(tmp_path)
        assert run.main(["--replot", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err
        monkeypatch.setattr(run, "run_cases", _no_measuring)
        with pytest.raises(SystemExit) as exc:
            run.main(SMOKE + ["--out", str(tmp_path), "--only", "decode", "--impl", "cuflash"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unreadable: " in err and match in err
    assert [p.name for p in tmp_path.iterdir()] == ["fig2_memory.json"]


@pytest.mark.parametrize("flag", ["--smoke", "--full"])
def test_replot_names_the_mode_flag_given(tmp_path, flag, capsys):
    """--replot DIR --smoke said "got --full/--smoke", naming a flag that was not given."""
    with pytest.raises(SystemExit) as exc:
        run.main(["--replot", str(tmp_path), flag])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.rstrip().endswith(f"takes no other options, got {flag}"), err


def test_write_results_replaces_each_file_whole(tmp_path, monkeypatch):
    """A run killed while a checkpoint is written keeps the previous file whole, never half a JSON: each file is
    written beside its place and renamed over it."""
    payload = json.loads((COMMITTED / "fig5_decode.json").read_text())
    report.write_results({"decode": payload}, tmp_path, plots=False)
    before = (tmp_path / "fig5_decode.json").read_text()

    def killed(src, dst):
        assert Path(src).parent == Path(dst).parent == tmp_path  # the same file system: the rename is atomic
        raise KeyboardInterrupt

    monkeypatch.setattr(report.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        report.write_results({"decode": dict(payload, records=payload["records"][:1])}, tmp_path, plots=False)
    assert (tmp_path / "fig5_decode.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["fig5_decode.json"]  # no temporary file left behind


@pytest.mark.parametrize("out, match", [("afile", "not a folder"), ("afile/sub", "cannot write results there"),
                                        ("readonly", "cannot write results there")])
def test_a_bad_out_is_a_usage_error_before_measuring(tmp_path, out, match, capsys, monkeypatch):
    """An --out that is a file, or a folder that cannot be made or written, was found after all the measuring."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "readonly").mkdir(mode=0o500)
    if out == "readonly":  # root writes into a 0500 folder anyway: the refusal it would meet, made for everyone
        real_touch = Path.touch

        def touch(self, *a, **k):
            if self.parent == tmp_path / "readonly":
                raise PermissionError(13, "Permission denied", str(self))
            return real_touch(self, *a, **k)

        monkeypatch.setattr(Path, "touch", touch)
    monkeypatch.setattr(run, "run_cases", _no_measuring)
    with pytest.raises(SystemExit) as exc:
        run.main(SMOKE + ["--out", str(tmp_path / out), "--only", "decode", "--impl", "cuflash"])
    assert exc.value.code == 2 and re.search(re.escape(str(tmp_path / out)) + ".*" + match, capsys.readouterr().err)


def test_commit_comes_from_git_in_a_checkout(tmp_path, capsys, monkeypatch):
    """--commit overrode git in a checkout and took any text: git's HEAD is recorded, a --commit it contradicts or
    that is no commit is a usage error."""
    from benchmarks import environment

    monkeypatch.delenv("GPU_SESSION_DRY_RUN", raising=False)
    sha, dirty = environment.git_commit()
    if dirty is None:
        pytest.skip("this tree is no git checkout")
    common = SMOKE + ["--out", str(tmp_path / "out"), "--only", "decode", "--impl", "cuflash", "--commit"]
    measure = run.run_cases
    monkeypatch.setattr(run, "run_cases", _no_measuring)
    other = ("1" if sha[0] == "0" else "0") + sha[1:]
    git_head = environment._git_head
    monkeypatch.setattr(environment, "_git_head", lambda: (sha, False))  # a clean checkout (a dirty one may differ)
    for given, match in ((other, "is not this checkout's HEAD"), ("not-a-commit", "does not look like a commit")):
        with pytest.raises(SystemExit) as exc:
            run.main(common + [given])
        assert exc.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(environment, "_git_head", git_head)
    monkeypatch.setattr(run, "run_cases", measure)
    assert run.main(common + [sha[:10].upper()]) == 0
    payload = json.loads((tmp_path / "out" / "fig5_decode.json").read_text())
    assert payload["commit"] == sha and isinstance(payload["dirty"], bool)


@pytest.mark.parametrize("session", [None, "ab" * 20, "1234567"])
def test_commit_of_a_dirty_checkout_is_the_callers(monkeypatch, session):
    """A dirty tree under a .git that does not know --commit records --commit, with dirty None, only where that is
    the GPU_SESSION_COMMIT of gpu_session.sh (a device machine's copy under the .git of the session's start); a real
    checkout refuses it, as does a clean checkout, or a dirty one whose git knows that other commit."""
    from benchmarks import environment

    sha = "ab" * 20
    if environment._git_head() is None:
        pytest.skip("this tree is no git checkout")
    root = environment._git_head()[0]
    assert environment._git_knows(root) and not environment._git_knows("0" * 39 + "1")
    if session is None:
        monkeypatch.delenv("GPU_SESSION_COMMIT", raising=False)
    else:
        monkeypatch.setenv("GPU_SESSION_COMMIT", session)
    caller = (sha, None) if session == sha else ValueError
    for dirty, known, expected in ((True, False, caller), (False, False, ValueError), (True, True, ValueError)):
        monkeypatch.setattr(environment, "_git_head", lambda dirty=dirty: (root, dirty))
        monkeypatch.setattr(environment, "_git_knows", lambda commit, known=known: known or root.startswith(commit))
        if expected is ValueError:
            with pytest.raises(ValueError, match="is not this checkout's HEAD"):
                environment.git_commit(given=sha)
        else:
            assert environment.git_commit(given=sha.upper()) == expected
        assert environment.git_commit(given=root[:9]) == (root, dirty)


def test_commit_where_git_cannot_tell(tmp_path, capsys, monkeypatch):
    """A copy without .git (a device machine; gpu_session.sh's dry run stands for one) records --commit, if it looks
    like a commit."""
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "no-git"))  # git cannot tell
    common = SMOKE + ["--only", "decode", "--impl", "cuflash", "--commit"]
    for given in ("abc123", "not-a-commit", "0" * 41):
        with pytest.raises(SystemExit) as exc:
            run.main(common + [given, "--out", str(tmp_path / "refused")])
        assert exc.value.code == 2 and "does not look like a commit" in capsys.readouterr().err
    assert run.main(common + ["ABCDEF1", "--out", str(tmp_path / "copy")]) == 0
    payload = json.loads((tmp_path / "copy" / "fig5_decode.json").read_text())
    assert (payload["commit"], payload["dirty"]) == ("abcdef1", None)


def test_plots_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")
    assert run.main(SMOKE[:1] + ["--out", str(tmp_path), "--impl", "cuflash", "--only", "tiles,decode",
                                 "--no-progress"]) == 0
    assert (tmp_path / "fig4_tiles.png").stat().st_size > 0
    assert run.main(["--replot", str(tmp_path)]) == 0


@pytest.mark.parametrize("argv, match", [
    (["--device", "cpu", "--require-device", "cuda"], "would measure on 'cpu'.*refusing"),
    (["--device", "cuda"], "--device cuda needs CuPy and a visible GPU"),
    (["--require-device", "cuda"], "--require-device cuda: .*refusing"),
    (["--only", "speed"], r"unknown figure\(s\) \['speed'\]"),
    (["--impl", "flash3"], r"unknown impl\(s\) \['flash3'\]"),
    pytest.param(["--only", ""], r"no figure\(s\) named in ''", id="empty-only"),
    pytest.param(["--impl", " , "], r"no impl\(s\) named in ' , '", id="empty-impl"),
    pytest.param(["--time-limit", "0"], "--time-limit must be a positive", id="time-limit-0"),
    pytest.param(["--time-limit", "-5"], "--time-limit must be a positive", id="time-limit-negative"),
    pytest.param(["--time-limit", "nan"], "--time-limit must be a positive", id="time-limit-nan"),
])
def test_refusals_are_usage_errors(argv, match, tmp_path, capsys, monkeypatch):
    """No silent fallback: a run that cannot measure what it was asked to exits 2 before measuring."""
    from benchmarks import environment

    monkeypatch.setattr(environment, "gpu_available", lambda: False)  # this machine has no GPU, CI neither
    with pytest.raises(SystemExit) as exc:
        run.main(SMOKE + ["--out", str(tmp_path)] + argv)
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


def test_require_device_fails_a_run_without_cuflash_records(tmp_path, monkeypatch):
    common = SMOKE + ["--out", str(tmp_path), "--only", "decode", "--require-device", "cpu"]
    assert run.main(common + ["--impl", "cuflash"]) == 0
    with pytest.raises(SystemExit) as exc:  # only a baseline asked for: refused before measuring
        run.main(common + ["--impl", "numpy"])
    assert exc.value.code == 2
    skip = run.applicable  # cuflash asked for but never measured: not a cuflash benchmark
    monkeypatch.setattr(run, "applicable", lambda impl, case: "skipped here" if impl.name == "cuflash" else
                        skip(impl, case))
    assert run.main(common + ["--impl", "cuflash,numpy", "--replace"]) == 1


def test_package_no_longer_benchmarks_and_never_imports_them():
    code = ("import pkgutil, sys, importlib, cuflash\n"
            "from cuflash.__main__ import main\n"
            "for m in pkgutil.walk_packages(cuflash.__path__, 'cuflash.'):\n"
            "    importlib.import_module(m.name)\n"
            "status = main(['bench', '--quick'])\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'benchmarks'], 'cuflash imported benchmarks'\n"
            "sys.exit(status)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "python -m benchmarks.run" in lines[0]
    assert not (REPO / "cuflash" / "bench.py").exists()


@pytest.mark.parametrize("command, variable, value", [
    (["demo"], "CUFLASH_NUM_THREADS", "0"), (["build"], "CUFLASH_BLAS", "openblas"),
    (["emulate"], "CUFLASH_EMULATE_STACK_KIB", "1"), (["emulate"], "CUFLASH_EMULATE_SCHEDULE", "backwards"),
    (["emulate"], "CUFLASH_EMULATE_CACHE", "/etc/passwd")])
def test_the_command_line_names_a_bad_environment_variable(command, variable, value, monkeypatch, capsys):
    """`python -m cuflash` died with a traceback, and `python -m cuflash emulate` said "available: True" (rc 0)
    with settings every launch would refuse: now one line naming the variable, status 2, before anything runs."""
    from cuflash.__main__ import main

    monkeypatch.setenv(variable, value)
    assert main(command) == 2
    captured = capsys.readouterr()
    said = (captured.err + captured.out).strip().splitlines()
    assert len(said) == 1 and "error: environment variable " + variable in said[0], said
    assert "available" not in captured.out


# ---------------------------------------------------------------------------------------------
# benchmarks/numpy_backend.py: the floor loop computes attention, a case runs at toy size
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_floor_loop_is_attention_where_scores_are_bounded(causal):
    """The floor that cuflash is measured against does the whole work: its output is attention (float32 rule)."""
    from benchmarks.numpy_backend import floor_loop

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 100, 2, 16)).astype(np.float32) for _ in range(3))
    out = floor_loop(q, k, v, causal, block=32)
    ref = reference.attention(q, k, v, causal=causal)
    naive = reference.attention(q, k, v, causal=causal, compute_dtype=np.float32)
    mags = reference.term_magnitudes(q, k, v, causal=causal)
    assert_attention_close(out, ref, naive, mult=2, name="out", magnitude=mags["out"])


@pytest.mark.parametrize("causal", [False, True])
def test_numpy_products_loop_is_the_two_products_of_the_visited_tiles(causal):
    """The products yardstick does the products cuflash's tiles need, no fewer: sum over the visited key tiles of
    (Q·scale·log2 e) K^T V, a causal diagonal tile whole (float32 against float64, twice the naive float32 error)."""
    from benchmarks.numpy_backend import floor_loop

    rng = np.random.default_rng(1)
    n, d, block = 100, 16, 32
    q, k, v = (rng.standard_normal((1, n, 2, d)).astype(np.float32) for _ in range(3))
    out = floor_loop(q, k, v, causal, block=block, softmax=False)
    i, j = np.arange(n)[:, None] // block, np.arange(n)[None, :] // block
    seen = (j <= i) if causal else np.ones((n, n), dtype=bool)  # whole tiles up to the diagonal one
    c = 1 / np.sqrt(d) / np.log(2)

    def chain(dtype):
        qh, kh, vh = (x[0].transpose(1, 0, 2).astype(dtype) for x in (q, k, v))
        s = (qh * dtype(c)) @ kh.transpose(0, 2, 1)
        return ((s * seen) @ vh).transpose(1, 0, 2)[None]

    exact, naive = chain(np.float64), chain(np.float32)
    assert_attention_close(out, exact, naive, mult=2, name="products", magnitude=np.abs(exact).max())


@pytest.mark.parametrize("argv, match", [(["--rounds", "0"], "--rounds: must be at least 1, got 0"),
                                         (["--rounds", "-1"], "--rounds: must be at least 1, got -1"),
                                         (["--threads", "0"], "--threads: must be at least 1, got 0"),
                                         (["--threads", "-3"], "--threads: must be at least 1, got -3")],
                         ids=["rounds-0", "rounds-negative", "threads-0", "threads-negative"])
def test_numpy_backend_counts_are_at_least_one(argv, match, capsys, monkeypatch):
    """--rounds 0 ran the default rounds (0 read as unset), -1 crashed after the first case (no median of nothing),
    --threads 0 used every core, -3 crashed in torch: all usage errors now, before anything runs."""
    import benchmarks.numpy_backend as bench

    monkeypatch.setattr(bench, "time_case", _no_measuring)
    monkeypatch.delenv("CUFLASH_NUM_THREADS", raising=False)  # main() sets it: restored after the test
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--no-memory"] + argv)
    assert exc.value.code == 2 and match in capsys.readouterr().err


def test_numpy_benchmark_case_with_one_thread(monkeypatch):
    import benchmarks.numpy_backend as bench
    from benchmarks.numpy_backend import OTHER_BLAS, _other_blas, time_case

    monkeypatch.setattr(bench, "IDLE_S", 0.0)  # no BLAS threads to wait for at this size
    rec = time_case(None, np.float32, 64, 16, True, rounds=2, heads=1, threads=1)
    # where MKL is installed, the same code on the BLAS that CUFLASH_BLAS=auto does not pick is timed beside it
    other = _other_blas()
    openblas = {OTHER_BLAS[other]} if other else set()
    assert set(rec["ms"]) == {"cuflash", "floor", "products", "naive"} | openblas
    # every round's time is kept (the spread of a ratio is checkable), the median from them
    assert rec["ms_rounds"].keys() == rec["ms"].keys() and all(len(t) == 2 for t in rec["ms_rounds"].values())
    assert all(min(t) == rec["ms_best"][name] for name, t in rec["ms_rounds"].items())
    assert rec["cuflash_over_floor"] > 0 and rec["cuflash_over_products"] > 0
    assert all(rec[f"cuflash_over_{name}"] > 0 for name in openblas)


needs_proc = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                                reason="peak RSS is read from Linux's /proc/self/status")


def test_pytorch_gets_its_own_layout_contiguous():
    """Each side its own layout: PyTorch's SDPA reads (B, H, S, D); transposed views of cuflash's (B, S, H, D) arrays
    cost it 2-3% on one thread."""
    torch = pytest.importorskip("torch")
    from benchmarks.numpy_backend import _torch_layout

    x = np.arange(2 * 5 * 3 * 4, dtype=np.float32).reshape(2, 5, 3, 4)
    t = _torch_layout(torch, x)
    assert t.is_contiguous() and tuple(t.shape) == (2, 3, 5, 4)
    np.testing.assert_array_equal(t.numpy(), x.transpose(0, 2, 1, 3))


@needs_proc
def test_peak_rss_growth_sees_a_buffer_at_its_size():
    """The RSS yardstick counts a 64 MiB buffer that lived and was freed inside the measured call."""
    from benchmarks.numpy_backend import peak_rss_growth

    total, grown = peak_rss_growth(lambda: np.ones(2**23).sum())
    assert total == 2**23
    assert 60 * 2**20 <= grown <= 80 * 2**20


@needs_proc
def test_rss_of_a_long_sequence_is_far_below_the_score_matrix():
    """In a fresh process, as the operating system counts it: the forward and the backward of one head at N = 8192
    grow the resident set by less than an eighth of the naive score matrix (256 MiB), BLAS buffers included."""
    from benchmarks.numpy_backend import rss_case

    naive = 8192 * 8192 * 4
    rec = rss_case(1, 1, 8192)
    assert 0 < rec["fwd_rss_bytes"] < naive / 8 and 0 < rec["bwd_rss_bytes"] < naive / 8


def test_numpy_benchmark_case_forward_and_backward(monkeypatch):
    import benchmarks.numpy_backend as bench

    monkeypatch.setattr(bench, "IDLE_S", 0.0)
    rec = bench.time_case(None, np.float32, 64, 16, True, rounds=1, heads=1, threads=1, backward=True)
    other = bench._other_blas()
    openblas = {bench.OTHER_BLAS[other]} if other else set()
    assert rec["passes"] == "forward+backward"
    assert set(rec["ms"]) == {"cuflash"} | openblas  # no naive backward, no floor
    assert rec["skipped"] == {"naive": "no backward"}


def test_replot_takes_no_other_option_and_plots_only_what_fits(tmp_path, capsys):
    """--replot measures nothing: another option beside it was silently ignored (a usage error now); values the
    schema lets through but the plots cannot use (no title, a skipped entry without its reason, a density of null
    in the block-sparse figure, a folder where a figure file should be) are one error line, not a traceback."""
    with pytest.raises(SystemExit) as exc:
        run.main(["--replot", str(tmp_path), "--only", "product", "--no-plot"])
    assert exc.value.code == 2 and "takes no other options, got --only, --no-plot" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        run.main(["--out", "", "--smoke"])
    assert exc.value.code == 2 and "must name a folder" in capsys.readouterr().err
    payload = json.loads((COMMITTED / "fig3_blocksparse.json").read_text())
    broken_files = [(lambda p: p.pop("title"), r"\['title'\] are missing"),
                    (lambda p: p["skipped"].append({"impl": "x"}), "'skipped' entry is not an object with a")]
    if importlib.util.find_spec("matplotlib") is not None:  # what only drawing finds (the test extra has none)
        broken_files.append((lambda p: p["records"][0].update(density=None), "cannot be plotted"))
    for change, match in broken_files:
        broken = json.loads(json.dumps(payload))
        change(broken)
        (tmp_path / "fig3_blocksparse.json").write_text(json.dumps(broken))
        assert run.main(["--replot", str(tmp_path)]) == 1
        assert re.search(match, capsys.readouterr().err)
    (tmp_path / "fig3_blocksparse.json").unlink()
    (tmp_path / "product.json").mkdir()
    assert run.main(["--replot", str(tmp_path)]) == 1 and "cannot be read" in capsys.readouterr().err


def test_a_run_that_measures_nothing_fails_and_says_why(tmp_path, capsys):
    """No case to run (the float32/float64 figure is GPU only) or every pair skipped (a time limit of a nanosecond)
    wrote no JSON and exited 0, its table pointing at a JSON that did not exist."""
    assert run.main(SMOKE + ["--device", "cpu", "--only", "wide", "--out", str(tmp_path / "r")]) == 1
    assert "error: no case of --smoke --only wide runs on cpu" in capsys.readouterr().err
    assert run.main(SMOKE + ["--device", "cpu", "--only", "decode", "--time-limit", "1e-9",
                             "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "error: nothing was measured" in err and "time limit" in err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_a_checkpoint_is_not_written_through_a_symlink_planted_at_its_temporary_name(tmp_path):
    """The whole-file write of a results JSON went through a temporary file of a predictable name
    (``.<name>.<pid>.tmp``), written with a plain open: a symlink planted there had its target overwritten."""
    import os

    from benchmarks import report

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    path = tmp_path / "fig1_throughput.json"
    os.symlink(victim, tmp_path / f".{path.name}.{os.getpid()}.tmp")
    report._write_whole(path, '{"a": 1}\n')
    assert victim.read_text() == "keep me"
    assert path.read_text() == '{"a": 1}\n' and not path.is_symlink()
    assert (path.stat().st_mode & 0o777) == 0o644


def test_a_figure_json_over_the_size_bound_is_refused_unread(tmp_path, capsys, monkeypatch):
    """A figure JSON was read whole whatever its size: a (sparse) file of 1 TiB at a figure's name was a MemoryError
    traceback in --replot and in a run's look at its --out. Refused from its size (report.MAX_JSON_BYTES, 256 MiB),
    one line naming the file and its size; --replace removes it as another run's unreadable file."""
    path = tmp_path / "fig1_throughput.json"
    size = 256 * 2**20 + 1
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: no disk taken
    match = f"fig1_throughput.json: cannot be read ({size} bytes, more than the 256 MiB a figure JSON may hold)"
    with pytest.raises(ValueError, match=re.escape(match)):
        report.load_results(tmp_path)
    assert run.main(["--replot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    measure = run.run_cases
    monkeypatch.setattr(run, "run_cases", _no_measuring)
    with pytest.raises(SystemExit) as exc:
        run.main(SMOKE + ["--out", str(tmp_path), "--only", "decode", "--impl", "cuflash"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unreadable: " in err and match in err
    monkeypatch.setattr(run, "run_cases", measure)
    assert run.main(SMOKE + ["--out", str(tmp_path), "--only", "decode", "--impl", "cuflash", "--replace"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig5_decode.json"]


@pytest.mark.parametrize("field, value, match", [
    ("seqlen_q", 10**400,
     r"\['seqlen_q'\] are not of their type \(seqlen_q=1" + "0" * 29 + r"\.\.\. \(401 characters\)\)"),
    ("peak_bytes", 2**63, r"\['peak_bytes'\] are not of their type"),
    ("batch", -2**63, r"\['batch'\] are not of their type"),
    ("ms", 10**400, r"\['ms'\] are not of their type"),  # an integer in a float field is bounded too
    ("ms", float("nan"), r"\['ms'\] are not of their type \(ms=nan\)"),
    ("tflops", float("inf"), r"\['tflops'\] are not of their type \(tflops=inf\)"),
    ("density", float("-inf"), r"\['density'\] are not of their type"),
    ("ms", -1.5, r"\['ms'\] are no measurement \(a finite number >= 0 or null\) \(ms=-1\.5\)"),
    ("gbps", -3, r"\['gbps'\] are no measurement"),
    ("host_ms", -0.001, r"\['host_ms'\] are no measurement"),
], ids=["seqlen_q-10**400", "peak_bytes-2**63", "batch--2**63", "ms-10**400", "ms-nan", "tflops-inf", "density--inf",
        "ms-negative", "gbps-negative", "host_ms-negative"])
def test_load_results_bounds_the_numbers_and_takes_only_measurements(tmp_path, field, value, match, capsys):
    """Any JSON integer passed as an int (10**400 was an OverflowError traceback in --replot's plots), and NaN,
    Infinity and negative times and rates passed as measurements: each is refused naming the field, in one line."""
    payload = json.loads((COMMITTED / "fig5_decode.json").read_text())
    payload["records"][0][field] = value
    (tmp_path / "fig5_decode.json").write_text(json.dumps(payload))  # json writes NaN and Infinity as such
    with pytest.raises(ValueError, match=r"fig5_decode.json: a record's fields " + match):
        report.load_results(tmp_path)
    assert run.main(["--replot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err


def test_load_results_takes_numbers_up_to_the_bounds(tmp_path):
    """The bounds refuse nothing a run writes: int64's extremes, zero times, a null measurement."""
    payload = json.loads((COMMITTED / "fig5_decode.json").read_text())
    payload["records"][0].update(peak_bytes=2**63 - 1, seqlen_q=-(2**63 - 1), ms=0, tflops=0.0, gbps=None)
    (tmp_path / "fig5_decode.json").write_text(json.dumps(payload))
    assert report.load_results(tmp_path)["decode"]["records"][0]["peak_bytes"] == 2**63 - 1


def test_replot_says_in_one_line_when_a_number_overflows_the_plots(tmp_path, capsys, monkeypatch):
    """A number the schema does not bound (a skipped entry's seqlen, the device's bandwidth) that matplotlib cannot
    make a float of was an OverflowError traceback: replot caught ZeroDivisionError alone of the ArithmeticErrors."""
    from benchmarks import plots

    _committed(tmp_path, "fig5_decode.json")

    def overflows(payload_by_fig, out_dir):
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(plots, "write_plots", overflows)
    assert run.main(["--replot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"error: {tmp_path}: its results cannot be plotted (OverflowError: int too large to convert to float)" \
        in err and "Traceback" not in err


def test_a_figure_without_records_is_not_drawn(tmp_path, capsys):
    """A figure whose cuflash cases all failed has failures and no record: its plotter asked matplotlib for a grid
    of 0 x 0 panels (a ValueError); it is skipped, saying so, with or without matplotlib."""
    from benchmarks import plots

    payload = json.loads((COMMITTED / "fig1_throughput.json").read_text())
    payload.update(records=[], failed=[dict(impl="cuflash", reason="RuntimeError: broken")])
    assert plots.write_plots({"throughput": payload}, tmp_path) == []
    assert "plots skipped for throughput: no records" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_plot_error_does_not_replace_the_runs_status(tmp_path, capsys, monkeypatch):
    """Every cuflash case failing (a figure of failures without records) made the plots raise after the JSON was
    written: a traceback and status 1 for the run's 3. The figure is not drawn, and whatever else the plots raise
    is one error line after which the run's status stands (1 where the run itself succeeded: the plots are missing)."""
    from benchmarks import plots

    def cuflash_breaks(case, impl, *args, **kw):
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    pairs = [cases.Case("throughput", "cpu", "fwd", "float32", 1, 2, sq, 64, 16, impls=("cuflash",)) for sq in (1, 2)]
    monkeypatch.setattr(run, "suite", lambda device, mode: pairs)
    measure = run.measure
    monkeypatch.setattr(run, "measure", cuflash_breaks)
    argv = ["--smoke", "--device", "cpu", "--no-progress", "--out", str(tmp_path)]  # plots asked for
    assert run.main(argv) == 3
    err = capsys.readouterr().err
    assert "plots skipped for throughput: no records" in err and "Traceback" not in err
    assert [e["seqlen_q"] for e in json.loads((tmp_path / "fig1_throughput.json").read_text())["failed"]] == [1, 2]

    def plots_break(payload_by_fig, out_dir):
        raise ValueError("Number of rows must be a positive integer, not 0")

    monkeypatch.setattr(plots, "write_plots", plots_break)
    assert run.main(argv) == 3
    err = capsys.readouterr().err
    assert "error: the plots could not be drawn (ValueError: Number of rows must be" in err
    assert "error: cuflash failed in 2 cases" in err
    monkeypatch.setattr(run, "measure", measure)  # a run that succeeds: the missing plots fail it
    assert run.main(argv) == 1
    assert "error: the plots could not be drawn" in capsys.readouterr().err
    assert json.loads((tmp_path / "fig1_throughput.json").read_text())["records"]
