"""Argument checks of the public helpers ``cuflash.warmup``, ``cuflash.io_cost`` and ``cuflash.tiling``: a bad
argument raises a ValueError/TypeError naming it before any work (no GPU needed: warmup checks its arguments before
the device), and io_cost's memory is O(number of tiles) without a BlockMask."""
from __future__ import annotations

import importlib
import tracemalloc

import numpy as np
import pytest

import cuflash
from cuflash import tiling
from cuflash.backends import cuda
from cuflash.blockmask import BlockMask
from cuflash.cuda import specs
from cuflash.io_cost import io_cost
from cuflash.tiling import Schedule, classify_grid, kv_splits

import fake_cupy

io_cost_module = importlib.import_module("cuflash.io_cost")  # cuflash.io_cost is also the function's name


# ------------------------------------------------------------------------------------------------
# warmup
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def no_device(monkeypatch):
    """A device query fails the test: the arguments must be refused before it (on any machine)."""

    def queried():
        raise AssertionError("warmup queried the device before checking its arguments")

    monkeypatch.setattr(cuda, "available", queried)


@pytest.fixture
def cp(monkeypatch):
    """One fake H100 (sm_90) in sys.modules["cupy"], the backend's device caches emptied before and after."""
    fake = fake_cupy.install(monkeypatch, fake_cupy.make())
    cuda._memoized.cache_clear()
    yield fake
    cuda._memoized.cache_clear()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(precision="bogus"), ValueError, r"precision must be one of 'ieee', '3xtf32', 'tf32', got 'bogus'"),
    (dict(precision=None), TypeError, "precision must be one of .* got NoneType"),
    (dict(head_dims=(0,)), ValueError, r"head_dims must be an int or a sequence of ints in \[1, 256\], got 0"),
    (dict(head_dims=(-64,)), ValueError, "head_dims must be .* got -64"),
    (dict(head_dims=(257,)), ValueError, "head_dims must be .* got 257"),
    (dict(head_dims=(64.0,)), TypeError, "head_dims must be .* got 64.0"),
    (dict(head_dims=(True,)), TypeError, "head_dims must be .* got True"),
    (dict(head_dims="64"), TypeError, "head_dims must be"),
    (dict(head_dims=64.0), TypeError, "head_dims must be"),
    (dict(head_dims=None), TypeError, "head_dims must be"),
    (dict(dtypes="float8"), ValueError, r"dtypes must each be one of float16, bfloat16, float32, float64 .*'float8'"),
    (dict(dtypes="foo"), ValueError, "dtypes must each be one of"),
    (dict(dtypes=("float16", "int8")), ValueError, "dtypes must each be one of .*'int8'"),
    (dict(dtypes=(np.int32,)), ValueError, "dtypes must each be one of"),
    (dict(dtypes=(None,)), ValueError, "dtypes must each be one of"),
    (dict(dtypes=16), TypeError, "dtypes must be a dtype or a sequence of dtypes"),
    # checked since 2026-11-28: a truth test compiled the backward for "yes", file=123 failed at the first progress
    # line, and without a GPU each was "no usable CUDA device"
    (dict(backward="yes"), TypeError, "backward must be a bool, got str"),
    (dict(progress=1), TypeError, "progress must be a bool, got int"),
    (dict(file=123), TypeError, "file must be a writable text stream .* got int"),
])
def test_warmup_refuses_bad_arguments_before_the_device(no_device, kwargs, error, match):
    with pytest.raises(error, match=match):
        cuflash.warmup(**kwargs)


def test_warmup_takes_one_dtype_and_one_head_dim(cp):
    """``warmup("float16")`` is one dtype (it was read letter by letter), ``head_dims=64`` one head dim (it was not
    iterable); NumPy spellings of a dtype are the same dtype."""
    want = [specs.select("fwd", "float16", 64, 227 * 1024, cc=90)]
    assert cuflash.warmup("float16", 64, progress=False) == want
    assert cuflash.warmup(np.float16, head_dims=np.int64(64), progress=False) == want
    assert cuflash.warmup(np.dtype("f2"), head_dims=[64], progress=False) == want
    assert cuflash.warmup(dtypes="half", head_dims=(64,), progress=False) == want
    wide = cuflash.warmup("f4", 64, precision="3xtf32", progress=False)
    assert [(s.family, s.dtype, s.head_dim, s.math) for s in wide] == [("wfwd", "float32", 64, "3xtf32")]
    assert cuflash.warmup((), progress=False) == []


# ------------------------------------------------------------------------------------------------
# io_cost
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["foo", "float8", object(), "int8", None])
def test_io_cost_names_a_bad_dtype(dtype):
    with pytest.raises(ValueError, match="dtype must be float16, bfloat16, float32 or float64, got"):
        io_cost(seqlen_q=128, head_dim=64, dtype=dtype)


def test_io_cost_memory_is_linear_in_the_number_of_tiles():
    """Without a BlockMask the visited pairs come from the schedule's per-query-tile ranges: a dense (nq, nk) grid
    at 256K tokens and 64-wide tiles is 16 MB of booleans and 128 MB of float counts (1M tokens took 2.2 GB, 4M
    raised MemoryError)."""
    tracemalloc.start()
    try:
        cost = io_cost(seqlen_q=1 << 18, head_dim=64, causal=True, block_q=64, block_k=64, op="fwd_bwd")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    n = (1 << 18) // 64
    assert cost.visited["fwd"] == (n * (n + 1) // 2, n * n)
    assert peak < 4 << 20, peak
    big = io_cost(seqlen_q=4_000_000, head_dim=64, causal=True)
    bq, bk = big.tiles["fwd"]
    assert big.visited["fwd"][1] == -(-4_000_000 // bq) * -(-4_000_000 // bk)


SHAPES = [(1000, 1000, 64, 64), (129, 1031, 48, 80), (2000, 77, 32, 112), (1, 1, 16, 16), (300, 300, 300, 7)]


@pytest.mark.parametrize("sq, sk, block_q, block_k", SHAPES)
@pytest.mark.parametrize("window", [None, (None, 0), (100, 37), (None, 5), (3, None), (0, 0)])
@pytest.mark.parametrize("density", [None, 0.3, 0.25])
def test_io_cost_ranges_give_the_dense_grid_numbers(sq, sk, block_q, block_k, window, density):
    """The range-based totals equal the ones from the dense grid of visited tiles: bit for bit where they are exact
    in binary; under density=0.3 the range sums are exact integers scaled once, the grid's summed 0.3-multiples
    round per cell, so the two may differ in the last bits (never in the bytes reported, rounded to ints)."""
    left, right = (None, None) if window is None else window
    sched = Schedule(sq, sk, block_q, block_k, left=left, right=right)
    rows, cols = io_cost_module._tile_extent(sq, block_q), io_cost_module._tile_extent(sk, block_k)
    band = io_cost_module._band_visits(*sched.row_ranges(), rows, cols, 6, density)
    grid = io_cost_module._grid_visits(sched.kept_grid()[None, None], rows, cols, 6, density)
    if density == 0.3:
        for name in ("pairs", "pairs_rows", "pairs_cols", "kv_seen"):
            assert getattr(band, name) == pytest.approx(getattr(grid, name), rel=1e-13, abs=1e-9)
        assert band.total == grid.total
    else:
        assert band == grid
    ledger = dict(seqlen_q=sq, seqlen_k=sk, head_dim=64, heads=6, block_q=block_q, block_k=block_k,
                  bwd_block_q=block_q, bwd_block_k=block_k, window=window, density=density, op="fwd_bwd")
    cost = io_cost(**ledger)
    assert cost.visited["fwd"] == (round(grid.pairs), grid.total)
    if density is None:  # as a BlockMask keeping every block (the dense-grid path) counts them
        mask = BlockMask.from_blocks(np.ones((-(-sq // 16), -(-sk // 16)), bool), block=(16, 16), seqlen_q=sq,
                                     seqlen_k=sk)
        assert io_cost(**{**ledger, "block_mask": mask}).tiled_ledger == cost.tiled_ledger


# ------------------------------------------------------------------------------------------------
# tiling
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, kwargs, error, match", [
    ((-5, 10, 4, 4), {}, ValueError, r"seqlen_q must be an int >= 0, got -5"),
    ((10, -1, 4, 4), {}, ValueError, r"seqlen_k must be an int >= 0, got -1"),
    ((10.0, 10, 4, 4), {}, TypeError, r"seqlen_q must be an int >= 0, got 10.0"),
    ((10, 10, 4.5, 4), {}, TypeError, r"block_q must be an int >= 1, got 4.5"),
    ((10, 10, 4, 0), {}, ValueError, r"block_k must be an int >= 1, got 0"),
    ((10, 10, True, 4), {}, TypeError, r"block_q must be an int >= 1"),
    ((10, 10, 4, 4), dict(left=2.5), TypeError, r"left must be an int, got 2.5"),
    ((10, 10, 4, 4), dict(right=True), TypeError, r"right must be an int, got True"),
    ((8, 8, 4, 4), dict(len_q=[20]), ValueError, r"len_q values must lie in \[0, 8\], got range \[20, 20\]"),
    ((8, 8, 4, 4), dict(len_k=[-1, 3]), ValueError, r"len_k values must lie in \[0, 8\]"),
    ((8, 8, 4, 4), dict(len_q=[2.5]), TypeError, r"len_q must be ints"),
    ((8, 8, 4, 4), dict(len_q=[[2, 3]]), ValueError, r"len_q must be a scalar or a 1-D array"),
    ((8, 8, 4, 4), dict(len_q=[1, 2, 3], len_k=[4, 5]), ValueError,
     r"len_q and len_k must have one length per sequence each, got shapes \(3,\) and \(2,\)"),
])
def test_schedule_refuses_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        Schedule(*args, **kwargs)


def test_schedule_takes_negative_windows():
    """Ring attention's pair windows (the global band seen from a pair of shards) may be negative on either side."""
    shifted = Schedule(8, 16, 4, 4, left=-5, right=9)
    assert shifted.counts() == Schedule(8, 16, 4, 4, left=-5, right=9).counts() and shifted.left == -5


def test_schedule_one_side_of_the_lengths_defaults_to_full_per_sequence():
    """``len_q`` alone: every sequence has all ``seqlen_k`` keys (len_k was kept as one value for B sequences)."""
    one = Schedule(40, 40, 8, 8, len_q=np.array([40, 13]), left=5, right=0)
    both = Schedule(40, 40, 8, 8, len_q=np.array([40, 13]), len_k=np.array([40, 40]), left=5, right=0)
    assert one.len_k.tolist() == [40, 40] and one.counts() == both.counts()
    assert (one.kept_grid() == both.kept_grid()).all()
    tile = next(one.row(2))
    assert (one.element_mask(tile, batch=[1]) == both.element_mask(tile, batch=[1])).all()
    numpy_ints = Schedule(np.int64(10), 10, np.int32(4), 4, left=np.int64(2))
    assert numpy_ints.counts() == Schedule(10, 10, 4, 4, left=2).counts()
    assert Schedule(0, 0, 4, 4, len_q=[], len_k=[]).counts() == (0, 0)


def test_classify_grid_refuses_bad_blocks_and_grids():
    mask = BlockMask.causal(16, 16, block=(4, 4))
    grid = mask.grid
    assert classify_grid(grid, (4, 4), 8, 8, 16, 16)[0].shape == (1, 1, 2, 2)
    with pytest.raises(ValueError, match=r"block rows must be an int >= 1, got 0"):
        classify_grid(grid, (0, 4), 8, 8, 16, 16)
    with pytest.raises(TypeError, match=r"block columns must be an int >= 1, got 4.0"):
        classify_grid(grid, (4, 4.0), 8, 8, 16, 16)
    with pytest.raises(ValueError, match="block must be a pair"):
        classify_grid(grid, 4, 8, 8, 16, 16)
    with pytest.raises(ValueError, match=r"block_q must be an int >= 1, got 0"):
        classify_grid(grid, (4, 4), 0, 8, 16, 16)
    with pytest.raises(ValueError, match=r"grid must have shape \(batch\|1, heads\|1, 8, 8\) .* got \(1, 1, 4, 4\)"):
        classify_grid(grid, (4, 4), 8, 8, 32, 32)
    with pytest.raises(ValueError, match="grid must have shape"):
        classify_grid(grid[0, 0], (4, 4), 8, 8, 16, 16)


def test_kv_splits_refuses_bad_arguments():
    assert kv_splits(132, 4, 100) == 16 and kv_splits(132, 200, 100) == 1 and kv_splits(8, 1, 3) == 1
    with pytest.raises(ValueError, match=r"blocks must be an int >= 1, got 0"):
        kv_splits(1, 0, 100)
    with pytest.raises(ValueError, match=r"sm_count must be an int >= 1, got 0"):
        kv_splits(0, 4, 100)
    with pytest.raises(ValueError, match=r"key_tiles must be an int >= 0, got -1"):
        kv_splits(8, 4, -1)
    with pytest.raises(TypeError, match=r"blocks must be an int >= 1, got 2.5"):
        kv_splits(8, 2.5, 100)


def test_band_grid_goes_through_the_schedule_checks():
    with pytest.raises(TypeError, match="left must be an int, got 1.5"):
        tiling.band_grid(16, 16, 4, 4, left=1.5)


def test_an_io_cost_is_unhashable_plainly():
    """IOCost is a frozen dataclass with dict fields: frozen made a hash of its fields, which raised "unhashable type:
    'dict'" only when used as a key; it declares itself unhashable (equality stays field by field)."""
    cost = io_cost(seqlen_q=128, head_dim=64)
    assert type(cost).__hash__ is None and cost == io_cost(seqlen_q=128, head_dim=64)
    with pytest.raises(TypeError, match="unhashable type: 'IOCost'"):
        hash(cost)


@pytest.mark.parametrize("make", [
    lambda: BlockMask(np.ones((1, 1), bool), block=(2**63, 4), seqlen_q=5, seqlen_k=3),
    lambda: BlockMask.causal(10, block=(4, 2**63)),
    lambda: BlockMask.document(np.zeros(5, np.int64), block=(2**63, 4)),
    lambda: BlockMask.causal(2**63, block=(4, 4)),
    lambda: io_cost(seqlen_q=10, head_dim=64, block_q=2**63, block_k=64),
    lambda: io_cost(seqlen_q=2**63, head_dim=64, block_q=2**62, block_k=2**62),
    lambda: Schedule(8, 8, 4, 4, left=-2**63),
], ids=["grid-block", "causal-block", "document-block", "causal-seqlen", "io_cost-block_q", "io_cost-seqlen_q",
        "schedule-left"])
def test_sizes_past_int64_index_arithmetic_are_refused_naming_them(make):
    """A block or length of 2**63 was taken, then every use raised NumPy's OverflowError ("Python int too large to
    convert to C long"), or MemoryError, naming nothing."""
    names = r"(block\[[01]\]|seqlen_q|block_q|left)"
    with pytest.raises(ValueError, match=names + r" must be an int in \[-?[0-9*]+, 2\*\*62\]"):
        make()


def test_io_cost_names_its_own_arguments_when_a_block_mask_does_not_fit():
    """The message said "q, k have 128, 128": io_cost takes no q or k."""
    with pytest.raises(ValueError, match=r"built for seqlen_q=100, seqlen_k=100, but the arguments seqlen_q, seqlen_k "
                                         r"are 128, 128"):
        io_cost(seqlen_q=128, head_dim=64, block_mask=BlockMask.causal(100, block=(32, 32)))
