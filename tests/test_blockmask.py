"""BlockMask: constructors, properties, kernel lists, display, and how it combines with masks."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cuflash
from cuflash import BlockMask, reference
from cuflash.backends import numpy as nb
from cuflash.problem import make_problem
from cuflash.testing import assert_attention_close


def cdiv(a, b):
    return -(-a // b)


def band(i, j, sq, sk, left, right):
    """README rule for one element: bottom-right aligned diagonal, (left, right) around it."""
    diag = i + sk - sq
    return (left is None or j >= diag - left) and (right is None or j <= diag + right)


def blocks_meeting(sq, sk, block, left, right):
    """Brute force: a block is kept iff one of its elements is visible."""
    bq, bk = block
    grid = np.zeros((cdiv(sq, bq), cdiv(sk, bk)), dtype=bool)
    for i, j in itertools.product(range(sq), range(sk)):
        if band(i, j, sq, sk, left, right):
            grid[i // bq, j // bk] = True
    return grid


lengths = st.integers(1, 70)
blocks = st.tuples(st.integers(1, 20), st.integers(1, 20))
sides = st.one_of(st.none(), st.integers(0, 80))


# ----------------------------------------------------------------------------- constructors
@given(sq=lengths, sk=lengths, block=blocks)
def test_causal_constructor(sq, sk, block):
    bm = BlockMask.causal(sq, sk, block=block)
    assert bm.shape == (1, 1, cdiv(sq, block[0]), cdiv(sk, block[1]))
    assert (bm.seqlen_q, bm.seqlen_k, bm.block) == (sq, sk, block)
    np.testing.assert_array_equal(bm.grid[0, 0], blocks_meeting(sq, sk, block, None, 0))


def test_causal_default_is_square():
    assert BlockMask.causal(50, block=(16, 16)).shape == (1, 1, 4, 4)
    np.testing.assert_array_equal(BlockMask.causal(64, block=(16, 16)).grid[0, 0], np.tri(4, dtype=bool))


@given(sq=lengths, sk=lengths, block=blocks, left=sides, right=sides)
def test_sliding_window_constructor(sq, sk, block, left, right):
    bm = BlockMask.sliding_window(sq, sk, window=(left, right), block=block)
    np.testing.assert_array_equal(bm.grid[0, 0], blocks_meeting(sq, sk, block, left, right))


@pytest.mark.parametrize("g, local", [(0, 0), (1, 1), (2, 0), (1, 3)])
def test_global_local(g, local):
    bm = BlockMask.global_local(100, 130, global_blocks=g, local_blocks=local, block=(16, 16))
    nq, nk = cdiv(100, 16), cdiv(130, 16)
    assert bm.shape == (1, 1, nq, nk)
    for i, j in itertools.product(range(nq), range(nk)):
        want = i < g or j < g or abs(i - j) <= local
        assert bm.grid[0, 0, i, j] == want, (i, j)
    if g:  # global rows and columns are dense
        assert bm.grid[0, 0, :g].all() and bm.grid[0, 0, :, :g].all()


@pytest.mark.parametrize("stride, local", [(1, 0), (2, 0), (3, 1), (4, 2)])
def test_strided(stride, local):
    bm = BlockMask.strided(96, 80, stride=stride, local_blocks=local, block=(16, 8))
    nq, nk = 6, 10
    assert bm.shape == (1, 1, nq, nk)
    for i, j in itertools.product(range(nq), range(nk)):
        assert bm.grid[0, 0, i, j] == ((i - j) % stride == 0 or abs(i - j) <= local), (i, j)
    if stride == 1:
        assert bm.density == 1.0


@given(data=st.data(), ndim=st.integers(2, 4), sq=lengths, sk=lengths, block=blocks,
       p=st.floats(0.0, 0.3))
def test_from_dense_keeps_blocks_with_any_true(data, ndim, sq, sk, block, p):
    lead = data.draw(st.tuples(*[st.integers(1, 3)] * (ndim - 2)), label="lead")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    dense = rng.random(lead + (sq, sk)) < p  # sparse: many all-False blocks, some single True
    bm = BlockMask.from_dense(dense, block=block)
    bq, bk = block
    full = dense.reshape((1,) * (4 - ndim) + dense.shape)
    assert bm.shape == full.shape[:2] + (cdiv(sq, bq), cdiv(sk, bk))
    assert (bm.seqlen_q, bm.seqlen_k) == (sq, sk)
    for b, h, i, j in np.ndindex(bm.shape):
        assert bm.grid[b, h, i, j] == full[b, h, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
    # it covers the dense mask: every True element lies in a kept block
    assert not (full & ~bm.to_dense()).any()


def test_from_dense_single_element_keeps_whole_block():
    dense = np.zeros((10, 10), dtype=bool)
    dense[9, 0] = True  # last row of a ragged block
    bm = BlockMask.from_dense(dense, block=(4, 4))
    want = np.zeros((3, 3), dtype=bool)
    want[2, 0] = True
    np.testing.assert_array_equal(bm.grid[0, 0], want)
    assert bm.to_dense()[0, 0, 8:, :4].all() and bm.to_dense().sum() == 2 * 4


@pytest.mark.parametrize("grid_shape", [(3, 4), (2, 3, 4), (5, 2, 3, 4)])
def test_from_grid(grid_shape):
    grid = np.random.default_rng(0).random(grid_shape) < 0.5
    bm = BlockMask.from_grid(grid, block=(8, 16))
    assert bm.shape == (1,) * (4 - len(grid_shape)) + grid_shape
    assert (bm.seqlen_q, bm.seqlen_k) == (3 * 8, 4 * 16)
    np.testing.assert_array_equal(bm.grid.reshape(grid_shape), grid)
    assert not bm.grid.flags.writeable
    bm2 = BlockMask.from_grid(np.ones((3, 4), bool), block=(8, 16), seqlen_q=17, seqlen_k=64)
    assert (bm2.seqlen_q, bm2.seqlen_k) == (17, 64)


def test_grid_is_not_aliased():
    grid = np.zeros((2, 2), dtype=bool)
    bm = BlockMask.from_grid(grid, block=(4, 4))
    grid[0, 0] = True
    assert bm.density == 0.0 and not bm.grid.any()


# ----------------------------------------------------------------------------- properties
@given(data=st.data(), shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 6), st.integers(1, 6)),
       block=blocks)
def test_density_shape_to_dense(data, shape, block):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    grid = rng.random(shape) < 0.5
    bq, bk = block
    sq = data.draw(st.integers((shape[2] - 1) * bq + 1, shape[2] * bq), label="sq")
    sk = data.draw(st.integers((shape[3] - 1) * bk + 1, shape[3] * bk), label="sk")
    bm = BlockMask(grid, block=block, seqlen_q=sq, seqlen_k=sk)
    assert bm.shape == shape
    assert bm.density == pytest.approx(grid.sum() / grid.size, abs=1e-15)
    dense = bm.to_dense()
    assert dense.shape == shape[:2] + (sq, sk) and dense.dtype == bool
    for b, h in np.ndindex(shape[:2]):
        for i in range(sq):
            for j in range(sk):
                assert dense[b, h, i, j] == grid[b, h, i // bq, j // bk]
    # refine: the same element mask on a finer grid of divisors
    fq = data.draw(st.sampled_from([d for d in range(1, bq + 1) if bq % d == 0]), label="fq")
    fk = data.draw(st.sampled_from([d for d in range(1, bk + 1) if bk % d == 0]), label="fk")
    fine = bm.refine(fq, fk)
    assert fine.block == (fq, fk) and fine.shape == shape[:2] + (cdiv(sq, fq), cdiv(sk, fk))
    np.testing.assert_array_equal(fine.to_dense(), dense)


def test_refine_rejects_non_divisors():
    bm = BlockMask.causal(64, block=(16, 16))
    with pytest.raises(ValueError, match="multiples"):
        bm.refine(5, 16)
    with pytest.raises(ValueError, match="multiples"):
        bm.refine(16, 32)


def test_empty_mask_density():
    bm = BlockMask(np.zeros((1, 1, 0, 0), dtype=bool), block=(4, 4))
    assert bm.density == 0.0 and bm.shape == (1, 1, 0, 0)


# ----------------------------------------------------------------------------- kernel lists
def _pairs(counts, indices):
    """{(b, h, row, col)} from (counts, indices) lists; checks sortedness along the way."""
    pairs = set()
    for b, h, r in np.ndindex(counts.shape):
        row = indices[b, h, r, :counts[b, h, r]]
        assert np.all(np.diff(row) > 0), "kept indices must be strictly increasing"
        pairs.update((b, h, r, int(c)) for c in row)
    return pairs


@given(data=st.data(), shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(0, 9), st.integers(0, 9)),
       p=st.floats(0, 1))
def test_kv_and_q_lists(data, shape, p):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    grid = rng.random(shape) < p
    bm = BlockMask(grid, block=(4, 4))
    counts, indices = bm.kv_lists()
    tcounts, tindices = bm.q_lists()
    for a in (counts, indices, tcounts, tindices):
        assert a.dtype == np.int32
    assert counts.shape == shape[:3] and indices.shape == shape
    assert tcounts.shape == shape[:2] + (shape[3],) and tindices.shape == shape[:2] + shape[3:] + shape[2:3]
    np.testing.assert_array_equal(counts, grid.sum(axis=-1))
    np.testing.assert_array_equal(tcounts, grid.sum(axis=-2))
    kv = _pairs(counts, indices)
    assert kv == {tuple(int(x) for x in t) for t in zip(*np.nonzero(grid))}
    # the backward's lists are the transpose of the forward's
    assert _pairs(tcounts, tindices) == {(b, h, j, i) for b, h, i, j in kv}


def test_lists_of_causal_mask():
    counts, indices = BlockMask.causal(64, block=(16, 16)).kv_lists()
    np.testing.assert_array_equal(counts[0, 0], [1, 2, 3, 4])
    assert [list(indices[0, 0, i, :i + 1]) for i in range(4)] == [list(range(i + 1)) for i in range(4)]
    tcounts, tindices = BlockMask.causal(64, block=(16, 16)).q_lists()
    np.testing.assert_array_equal(tcounts[0, 0], [4, 3, 2, 1])
    assert [list(tindices[0, 0, j, :4 - j]) for j in range(4)] == [list(range(j, 4)) for j in range(4)]


# ----------------------------------------------------------------------------- display
def test_repr_draws_the_grid():
    bm = BlockMask.causal(48, block=(16, 16))
    text = repr(bm)
    lines = text.splitlines()
    assert "BlockMask" in lines[0] and "density=0.667" in lines[0] and "(16, 16)" in lines[0]
    drawn = [line.strip() for line in lines[1:]]
    assert drawn == ["█··", "██·", "███"]
    grid = np.random.default_rng(3).random((2, 3, 5, 7)) < 0.5
    lines = repr(BlockMask(grid, block=(2, 2))).splitlines()
    assert "batch 0, head 0" in lines[0]
    assert [[c == "█" for c in line.strip()] for line in lines[1:]] == grid[0, 0].tolist()


def test_repr_large_grid_is_one_line():
    text = repr(BlockMask.causal(4096, block=(64, 64)))
    assert "\n" not in text and "BlockMask" in text and "(1, 1, 64, 64)" in text


# ----------------------------------------------------------------------------- bad grids
@pytest.mark.parametrize("grid, block, kw, exc", [
    (np.ones((2, 2), dtype=np.int8), (4, 4), {}, TypeError),
    (np.ones((2, 2)), (4, 4), {}, TypeError),
    (np.ones(3, dtype=bool), (4, 4), {}, ValueError),
    (np.ones((1, 1, 1, 2, 2), dtype=bool), (4, 4), {}, ValueError),
    (np.ones((2, 2), dtype=bool), (0, 4), {}, ValueError),
    (np.ones((2, 2), dtype=bool), (-4, 4), {}, ValueError),
    (np.ones((2, 2), dtype=bool), (4.0, 4), {}, ValueError),
    (np.ones((2, 2), dtype=bool), (True, 4), {}, ValueError),
    (np.ones((2, 2), dtype=bool), (4,), {}, ValueError),
    (np.ones((2, 2), dtype=bool), 4, {}, ValueError),
    (np.ones((2, 2), dtype=bool), (4, 4), dict(seqlen_q=9), ValueError),   # needs 3 query blocks
    (np.ones((2, 2), dtype=bool), (4, 4), dict(seqlen_k=4), ValueError),   # needs 1 key block
], ids=["int8", "float", "1d", "5d", "block0", "block-neg", "block-float", "block-bool", "block-arity",
        "block-int", "seqlen_q", "seqlen_k"])
def test_bad_grids_rejected(grid, block, kw, exc):
    with pytest.raises(exc, match="grid|block"):
        BlockMask(grid, block=block, **kw)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="stride"):
        BlockMask.strided(64, stride=0, block=(16, 16))
    with pytest.raises(ValueError, match="mask"):
        BlockMask.from_dense(np.ones((4, 4)), block=(2, 2))
    with pytest.raises(ValueError, match="mask"):
        BlockMask.from_dense(np.ones(4, dtype=bool), block=(2, 2))


# ----------------------------------------------------------------------------- with element masks
def _qkv(sq, sk, hq=2, hkv=1, d=8, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in ((2, sq, hq, d), (2, sk, hkv, d), (2, sk, hkv, d))]


def dense_attention(q, k, v, keep, scale):
    """Softmax over exactly the kept elements; keep: (B, H|1, Sq, Sk) bool. Rows keeping none give 0."""
    g = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = scale * np.einsum("bihd,bjhd->bhij", q, kr)
    s = np.where(keep, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    e = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    p = e / np.maximum(e.sum(-1, keepdims=True), np.finfo(np.float64).tiny)
    return np.einsum("bhij,bjhd->bihd", p, vr)


@pytest.mark.parametrize("sq, sk, block", [(64, 64, (16, 16)), (50, 77, (16, 8)), (77, 50, (8, 16))])
def test_causal_block_mask_with_element_causal_is_causal(sq, sk, block):
    q, k, v = _qkv(sq, sk)
    bm = BlockMask.causal(sq, sk, block=block)
    both = cuflash.attention(q, k, v, causal=True, block_mask=bm)
    plain = cuflash.attention(q, k, v, causal=True)
    mag = reference.term_magnitudes(q, k, v, causal=True)["out"]
    np.testing.assert_allclose(both, plain, rtol=0, atol=2 * np.finfo(np.float64).eps * mag)
    # while the BlockMask alone keeps whole diagonal blocks: more than causal
    alone = cuflash.attention(q, k, v, block_mask=bm)
    assert np.abs(alone - plain).max() > 1e-3
    # unless its blocks are single elements
    bm1 = BlockMask.causal(sq, sk, block=(1, 1))
    np.testing.assert_allclose(cuflash.attention(q, k, v, block_mask=bm1), plain, rtol=0,
                               atol=2 * np.finfo(np.float64).eps * mag)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(10, 3)), dict(window=(None, 5), causal=True)],
                         ids=["causal", "window", "window-causal"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_block_mask_combined_with_element_masks_keeps_both(options, dtype):
    sq, sk, block = 70, 90, (16, 8)
    q, k, v = _qkv(sq, sk, hq=4, hkv=2, dtype=dtype)
    grid = np.random.default_rng(5).random((2, 4, cdiv(sq, 16), cdiv(sk, 8))) < 0.6
    bm = BlockMask(grid, block=block, seqlen_q=sq, seqlen_k=sk)
    out = cuflash.attention(q, k, v, block_mask=bm, **options)
    # the expected keep set, written from the README rule and the grid directly
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    diag = i + sk - sq
    left, right = options.get("window", (None, None))
    elem = np.ones((sq, sk), dtype=bool)
    if options.get("causal"):
        elem &= j <= diag
    if left is not None:
        elem &= j >= diag - left
    if right is not None:
        elem &= j <= diag + right
    keep = elem & grid[:, :, i // 16, j // 8]
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    want = dense_attention(q64, k64, v64, keep, 1 / np.sqrt(8))
    base = reference.attention(q, k, v, block_mask=bm, compute_dtype=q.dtype, **options)
    mag = reference.term_magnitudes(q, k, v, block_mask=bm, **options)["out"]
    assert_attention_close(out, want, base, magnitude=mag)
    # and neither mask alone gives that
    for alone in (dict(block_mask=bm), options):
        assert np.abs(cuflash.attention(q, k, v, **alone) - want).max() > 1e-3


def test_plan_rounds_tiles_to_mask_blocks():
    """A tile size that is not a multiple of the mask's block still honours the mask exactly."""
    q, k, v = _qkv(100, 100)
    grid = np.random.default_rng(7).random((1, 1, 10, 10)) < 0.5
    bm = BlockMask(grid, block=(10, 10))
    p = make_problem(q, k, v, block_mask=bm)
    out, _ = nb.forward(p, block_q=16, block_k=7)
    want = dense_attention(q, k, v, bm.to_dense(), 1 / np.sqrt(8))
    mag = reference.term_magnitudes(q, k, v, block_mask=bm)["out"]
    np.testing.assert_allclose(out, want, rtol=0, atol=2 * np.finfo(np.float64).eps * mag)
