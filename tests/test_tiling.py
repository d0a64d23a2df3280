"""The tile schedule (cuflash.tiling) against brute force from the visibility rule, and its cost."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cuflash import BlockMask
from cuflash.problem import key_range, make_problem, visible
from cuflash.tiling import Schedule, band_grid, classify_grid

N_EXAMPLES = settings.default.max_examples


def _reference(problem, bq, bk):
    """Brute force: (kept, full) per tile from the dense visibility rule and the dense BlockMask."""
    len_q, len_k = problem.lengths
    sq, sk = problem.seqlen_q, problem.seqlen_k
    i = np.arange(sq)[None, :, None]
    j = np.arange(sk)[None, None, :]
    band = visible(i, j, len_q[:, None, None], len_k[:, None, None], problem.window_left, problem.window_right)
    dense = problem.visible_mask()  # band and BlockMask, (B, Hm|1, Sq, Sk)
    nq, nk = -(-sq // bq), -(-sk // bk)
    kept, full = np.zeros((nq, nk), bool), np.zeros((nq, nk), bool)
    for a in range(nq):
        for b in range(nk):
            rows, cols = slice(a * bq, (a + 1) * bq), slice(b * bk, (b + 1) * bk)
            kept[a, b] = band[:, rows, cols].any()
            if problem.block_mask is not None:
                kept[a, b] &= problem.block_mask.to_dense(sq, sk)[:, :, rows, cols].any()
            full[a, b] = dense[:, :, rows, cols].all()
    return kept, full


@st.composite
def problems(draw):
    sq, sk = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    batch = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = np.zeros((batch, sq, 2, 1), np.float32)
    k = np.zeros((batch, sk, 1, 1), np.float32)
    opts = {}
    if draw(st.booleans()):
        opts["causal"] = True
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 80))
        opts["window"] = (draw(side), draw(side))
    if draw(st.booleans()):
        opts["seqlens_q"] = rng.integers(0, sq + 1, batch).astype(np.int32)
        opts["seqlens_k"] = rng.integers(0, sk + 1, batch).astype(np.int32)
    if draw(st.booleans()):
        mb = (draw(st.sampled_from([4, 8, 16])), draw(st.sampled_from([4, 8, 16])))
        shape = (draw(st.sampled_from([1, batch])), draw(st.sampled_from([1, 2])), -(-sq // mb[0]), -(-sk // mb[1]))
        opts["block_mask"] = BlockMask(rng.random(shape) < draw(st.floats(0.1, 1.0)), block=mb,
                                       seqlen_q=sq, seqlen_k=sk)
    tiles = (draw(st.sampled_from([1, 3, 8, 16, 33])), draw(st.sampled_from([1, 5, 8, 16, 40])))
    return make_problem(q, k, k, **opts), tiles


@settings(max_examples=max(20, N_EXAMPLES))
@given(problems())
def test_schedule_matches_brute_force(drawn):
    problem, (bq, bk) = drawn
    sched = Schedule.for_problem(problem, bq, bk)
    kept, full = _reference(problem, bq, bk)
    # by query tile (the forward) and by key tile (the backward): the same tiles, once each
    rows = {i: list(tiles) for i, tiles in sched.rows()}
    cols = {j: list(tiles) for j, tiles in sched.columns()}
    by_row = {(t.i0 // bq, t.k0 // bk): t for tiles in rows.values() for t in tiles}
    by_col = {(t.i0 // bq, t.k0 // bk): t for tiles in cols.values() for t in tiles}
    assert by_row == by_col
    # every query (key) tile that visits a tile, and no other (a BlockMask's dropped row was yielded, empty)
    assert sorted(rows) == np.nonzero(kept.any(axis=1))[0].tolist() and all(rows.values())
    assert sorted(cols) == np.nonzero(kept.any(axis=0))[0].tolist() and all(cols.values())
    got_kept = np.zeros_like(kept)
    got_full = np.zeros_like(full)
    for (a, b), t in by_row.items():
        got_kept[a, b], got_full[a, b] = True, t.full
        assert (t.i0, t.i1, t.k0, t.k1) == (a * bq, min((a + 1) * bq, problem.seqlen_q),
                                            b * bk, min((b + 1) * bk, problem.seqlen_k))
    np.testing.assert_array_equal(got_kept, kept)
    np.testing.assert_array_equal(got_full, full)
    np.testing.assert_array_equal(sched.kept_grid(), kept)
    np.testing.assert_array_equal(sched.full_grid(), full)
    assert sched.counts() == (int(kept.sum()), int(full.sum()))
    # a partial tile's element mask is the dense rule restricted to it
    dense = problem.visible_mask()
    for t in list(by_row.values())[:5]:
        np.testing.assert_array_equal(np.broadcast_to(sched.element_mask(t), dense[:, :, t.i0:t.i1, t.k0:t.k1].shape),
                                      dense[:, :, t.i0:t.i1, t.k0:t.k1])


@settings(max_examples=max(20, N_EXAMPLES))
@given(st.integers(1, 300), st.integers(1, 300), st.one_of(st.none(), st.integers(0, 300)),
       st.one_of(st.none(), st.integers(0, 300)), st.integers(1, 40),
       st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=3))
def test_seen_columns_is_key_range(sq, sk, left, right, bq, lengths):
    """The schedule's hull per query tile is key_range's, tile by tile."""
    len_q = np.array([min(a, sq) for a, _ in lengths])
    len_k = np.array([min(b, sk) for _, b in lengths])
    sched = Schedule(sq, sk, bq, 1, len_q=len_q, len_k=len_k, left=left, right=right)
    for i in range(sched.n_q):
        lo, hi = key_range(i * bq, min((i + 1) * bq, sq), len_q, len_k, left, right)
        assert (sched.lo[i], sched.hi[i]) == ((lo, hi) if hi > lo else (sched.lo[i], sched.lo[i]))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_schedule_at_one_million_is_lazy(causal):
    """N = 1M: the schedule holds a few integers per query tile (not 7.6M tile objects), yields its
    first tile straight away, and counts its tiles without visiting them."""
    n, bq, bk = 1 << 20, 256, 512
    sched = Schedule(n, n, bq, bk, right=0 if causal else None)
    held = sum(a.nbytes for a in (sched.lo, sched.hi, sched.full_lo, sched.full_hi))
    assert held <= 4 * 8 * sched.n_q
    assert sum(sys.getsizeof(v) for v in vars(sched).values()) < 64 * sched.n_q + 10_000
    _, first = next(sched.rows())
    tile = next(first)
    assert (tile.i0, tile.i1, tile.k0, tile.k1) == (0, bq, 0, bk)
    last = next(sched.column(sched.n_k - 1))  # the backward's view, as lazily
    assert (last.k0, last.k1) == (n - bk, n)
    nq, nk = n // bq, n // bk
    visited, full = sched.counts()
    if causal:
        # query tile i sees key tiles 0 .. floor((i+1)*bq - 1) / bk); the diagonal ones are partial
        expect = sum((((i + 1) * bq - 1) // bk) + 1 for i in range(nq))
        assert visited == expect and full == expect - nq
    else:
        assert visited == full == nq * nk


def test_classify_grid_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(30):
        sq, sk = rng.integers(1, 90, 2)
        mb = tuple(int(x) for x in rng.choice([4, 8, 16], 2))
        grid = rng.random((2, 1, -(-sq // mb[0]), -(-sk // mb[1]))) < 0.6
        bq, bk = (int(x) for x in rng.choice([3, 8, 16, 32], 2))
        kept, full = classify_grid(grid, mb, bq, bk, sq, sk)
        dense = BlockMask(grid, block=mb, seqlen_q=sq, seqlen_k=sk).to_dense()
        for a in range(kept.shape[2]):
            for b in range(kept.shape[3]):
                cell = dense[:, :, a * bq:(a + 1) * bq, b * bk:(b + 1) * bk]
                np.testing.assert_array_equal(kept[:, :, a, b], cell.any(axis=(-2, -1)))
                np.testing.assert_array_equal(full[:, :, a, b], cell.all(axis=(-2, -1)))


def _band_by_hand(sq, sk, bq, bk, left, right):
    """The band written out from its definition, not from cuflash: query ``i`` sees key ``j`` iff
    ``i + (sk - sq) - left <= j <= i + (sk - sq) + right`` (the diagonal aligned bottom-right, as FlashAttention-2
    >= 2.1; causal is ``right = 0``; None leaves a side open). Returns the dense element mask and, per tile of
    ``bq x bk`` (the last ones ragged), kept (some element visible) and full (every element visible)."""
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    seen = np.ones((sq, sk), dtype=bool)
    if left is not None:
        seen &= j >= i + (sk - sq) - left
    if right is not None:
        seen &= j <= i + (sk - sq) + right
    rows, cols = np.arange(0, sq, bq), np.arange(0, sk, bk)
    count = np.add.reduceat(np.add.reduceat(seen.astype(np.int64), rows, axis=0), cols, axis=1)
    size = np.diff(np.append(rows, sq))[:, None] * np.diff(np.append(cols, sk))[None, :]
    return seen, count > 0, count == size


SIDES = st.one_of(st.none(), st.just(0), st.integers(0, 100))
#: causal at one-element tiles, spelled out: Sq < Sk (row i sees keys <= i + 2), Sq > Sk (the first two rows see none)
PINNED = {(2, 4, 1, 1, None, 0): [[1, 1, 1, 0], [1, 1, 1, 1]], (4, 2, 1, 1, None, 0): [[0, 0], [0, 0], [1, 0], [1, 1]]}


@example(2, 4, 1, 1, None, 0)
@example(4, 2, 1, 1, None, 0)
@example(37, 90, 8, 16, None, 0)
@example(90, 37, 16, 8, None, 0)
@example(50, 70, 7, 9, 3, 0)  # a window: left edge and diagonal in tiles that do not divide the lengths
@example(70, 50, 9, 7, 5, 2)
@example(64, 64, 16, 16, 0, 0)  # the diagonal alone
@settings(max_examples=max(50, N_EXAMPLES))
@given(st.integers(1, 90), st.integers(1, 90), st.sampled_from([1, 3, 7, 16, 33]), st.sampled_from([1, 5, 8, 16, 40]),
       SIDES, SIDES)
def test_band_grid_is_the_element_rule(sq, sk, bq, bk, left, right):
    """band_grid (the tiles a band keeps) and the schedule's full tiles against the element rule written out by hand
    (_band_by_hand): a tile is kept iff one of its elements is visible, full iff all are; Sq < Sk and Sq > Sk,
    causal and windows, tiles that do not divide the lengths. BlockMask.causal / sliding_window, built from the
    schedule, are held to the same grids; PINNED checks the hand-written rule itself."""
    seen, kept, full = _band_by_hand(sq, sk, bq, bk, left, right)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    np.testing.assert_array_equal(visible(i, j, sq, sk, left, right), seen)  # cuflash's element rule is this one
    np.testing.assert_array_equal(band_grid(sq, sk, bq, bk, left, right), kept)
    sched = Schedule(sq, sk, bq, bk, left=left, right=right)
    np.testing.assert_array_equal(sched.kept_grid(), kept)
    np.testing.assert_array_equal(sched.full_grid(), full)
    assert sched.counts() == (int(kept.sum()), int(full.sum()))
    bm = BlockMask.sliding_window(sq, sk, window=(left, right), block=(bq, bk))
    np.testing.assert_array_equal(bm.grid[0, 0], kept)
    np.testing.assert_array_equal(bm.full[0, 0], full)
    if left is None and right == 0:
        np.testing.assert_array_equal(BlockMask.causal(sq, sk, block=(bq, bk)).grid[0, 0], kept)
    if (sq, sk, bq, bk, left, right) in PINNED:
        np.testing.assert_array_equal(kept, PINNED[sq, sk, bq, bk, left, right])


def test_a_block_masks_tiles_are_classified_once_per_tile_size():
    """Every call classified the whole grid again (two prefix sums in int64 over it): 4-5 s and 1.6 GiB before the
    first tile at N = 1M, on every call with the same mask. Now once per mask and tile size, read-only, kept on the
    mask (BlockMask.derived), and equal to the classification of the grid."""
    from cuflash import BlockMask
    from cuflash.tiling import mask_tiles

    bm = BlockMask.causal(1000, block=(16, 16)) & BlockMask.sliding_window(1000, window=(300, 0), block=(16, 16))
    kept, full = mask_tiles(bm, 64, 128)
    again = mask_tiles(bm, 64, 128)
    assert again[0] is kept and again[1] is full and not kept.flags.writeable and not full.flags.writeable
    args = (bm.block, 64, 128, 1000, 1000)
    assert np.array_equal(kept, classify_grid(bm.grid, *args)[0])
    assert np.array_equal(full, classify_grid(bm.full, *args)[1])
    assert mask_tiles(bm, 32, 128)[0].shape != kept.shape  # another tile size: classified apart


def test_rows_and_columns_skip_a_tile_row_and_column_a_block_mask_drops():
    grid = np.ones((1, 1, 2, 2), bool)
    grid[..., 1, :] = False  # the second query tile sees nothing
    grid[..., :, 1] = False  # nor does any query tile see the second key tile
    sched = Schedule(8, 8, 4, 4, block_mask=BlockMask.from_blocks(grid, block=(4, 4), seqlen_q=8, seqlen_k=8))
    assert [(i, len(list(tiles))) for i, tiles in sched.rows()] == [(0, 1)]
    assert [(j, len(list(tiles))) for j, tiles in sched.columns()] == [(0, 1)]


def test_a_window_that_shows_nothing_keeps_no_tile():
    """Negative sides (a ring's pair windows) with left + right < 0: every row's band is empty, but the rows' union
    spanned keys, and the tile was kept (wasted work, and against the rule that a tile nobody sees is skipped)."""
    sched = Schedule(4, 6, 4, 5, left=1, right=-4)
    assert not sched.kept_grid().any() and sched.counts() == (0, 0) and not list(sched.rows())
