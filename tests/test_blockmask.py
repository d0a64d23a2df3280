"""BlockMask: every constructor is exactly its definition (element by element), its block states are consistent
(skipped blocks keep nothing, full blocks everything), masks combine with & and |, display, bad arguments, and how it
combines with the element masks of attention."""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cuflash
from cuflash import BlockMask, reference
from cuflash.backends import numpy as nb
from cuflash.problem import make_problem
from cuflash.testing import Case, assert_attention_close, check_backward, check_forward


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


def assert_states_consistent(bm):
    """Skipped blocks keep no element, full blocks keep all of theirs (inside the lengths)."""
    dense = bm.to_dense()
    bq, bk = bm.block
    for b, h, i, j in np.ndindex(bm.shape):
        block = dense[b, h, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        if bm.states[b, h, i, j] == 0:
            assert not block.any(), ("skipped block keeps elements", b, h, i, j)
        if bm.states[b, h, i, j] == 2:
            assert block.all(), ("full block drops elements", b, h, i, j)


def band_dense(sq, sk, left, right):
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    return np.vectorize(lambda a, b: band(a, b, sq, sk, left, right))(i, j) if sq and sk else np.zeros((sq, sk), bool)


# ----------------------------------------------------------------------------- constructors
@given(sq=lengths, sk=lengths, block=blocks)
def test_causal_constructor_is_exactly_causal(sq, sk, block):
    bm = BlockMask.causal(sq, sk, block=block)
    assert bm.shape == (1, 1, cdiv(sq, block[0]), cdiv(sk, block[1]))
    assert (bm.seqlen_q, bm.seqlen_k, bm.block) == (sq, sk, block)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], band_dense(sq, sk, None, 0))
    np.testing.assert_array_equal(bm.grid[0, 0], blocks_meeting(sq, sk, block, None, 0))  # skipping stays exact
    assert_states_consistent(bm)


def test_causal_default_is_square():
    assert BlockMask.causal(50, block=(16, 16)).shape == (1, 1, 4, 4)
    np.testing.assert_array_equal(BlockMask.causal(64, block=(16, 16)).grid[0, 0], np.tri(4, dtype=bool))


@given(sq=lengths, sk=lengths, block=blocks, left=sides, right=sides)
def test_sliding_window_constructor_is_exactly_the_band(sq, sk, block, left, right):
    bm = BlockMask.sliding_window(sq, sk, window=(left, right), block=block)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], band_dense(sq, sk, left, right))
    np.testing.assert_array_equal(bm.grid[0, 0], blocks_meeting(sq, sk, block, left, right))
    assert_states_consistent(bm)


@given(n=st.integers(1, 60), p=st.integers(0, 70), block=blocks)
def test_prefix_lm(n, p, block):
    bm = BlockMask.prefix_lm(n, p, block=block)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    np.testing.assert_array_equal(bm.to_dense()[0, 0], (j < p) | (j <= i))
    assert_states_consistent(bm)


@given(data=st.data(), block=blocks, batch=st.booleans())
def test_document_with_and_without_causal(data, block, batch):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    n = data.draw(st.integers(1, 60), label="n")
    lengths_ = rng.integers(1, 12, size=20)
    ids = np.repeat(np.arange(20), lengths_)[:n]  # packed documents: sorted ids
    if data.draw(st.booleans(), label="unsorted"):
        ids = rng.integers(0, 4, size=n)
    ids = np.stack([ids, rng.permutation(ids)]) if batch else ids
    bm = BlockMask.document(ids, block=block)
    ids2 = ids.reshape(-1, n)
    want = ids2[:, None, :, None] == ids2[:, None, None, :]
    np.testing.assert_array_equal(bm.to_dense(), want)
    assert_states_consistent(bm)
    both = bm & BlockMask.causal(n, block=block)
    np.testing.assert_array_equal(both.to_dense(), want & np.tri(n, dtype=bool))
    assert_states_consistent(both)


def test_sorted_documents_skip_and_fill_almost_every_block():
    ids = np.repeat(np.arange(16), 1024)  # 16 documents of 1024 tokens, blocks of 128
    bm = BlockMask.document(ids, block=(128, 128))
    assert (bm.states == 1).sum() == 0 and (bm.states == 2).sum() == 16 * 8 * 8 and bm.density == 1 / 16


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


@given(data=st.data(), ndim=st.integers(2, 4), sq=lengths, sk=lengths, block=blocks, p=st.floats(0.0, 1.0))
def test_from_dense_is_exact(data, ndim, sq, sk, block, p):
    lead = data.draw(st.tuples(*[st.integers(1, 3)] * (ndim - 2)), label="lead")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    dense = rng.random(lead + (sq, sk)) < p
    if data.draw(st.booleans(), label="blocky"):  # whole blocks on or off too, so full and skipped blocks occur
        bq, bk = block
        coarse = rng.random(lead + (cdiv(sq, bq), cdiv(sk, bk))) < 0.5
        dense &= coarse[..., np.arange(sq) // bq, :][..., np.arange(sk) // bk]
    bm = BlockMask.from_dense(dense, block=block)
    full = dense.reshape((1,) * (4 - ndim) + dense.shape)
    assert bm.shape == full.shape[:2] + (cdiv(sq, block[0]), cdiv(sk, block[1]))
    np.testing.assert_array_equal(bm.to_dense(), full)
    assert_states_consistent(bm)


def test_from_dense_keeps_bits_of_partial_blocks_only():
    """A 16k x 16k document mask: O(partial blocks x block area / 8) bytes, not O(N^2)."""
    n, block = 16384, (128, 128)
    ids = np.repeat(np.arange(20), cdiv(n, 20))[:n]  # documents of 820 tokens: boundaries inside blocks
    dense = ids[:, None] == ids[None, :]
    bm = BlockMask.from_dense(dense, block=block)
    del dense
    partial = int((bm.states == 1).sum())
    stored = sum(np.asarray(v).nbytes for v in bm.values.values())
    assert 0 < partial < 1000  # the blocks the 19 document boundaries cross
    assert stored <= partial * (128 * 128 // 8) + 3 * bm.states.size * 4  # bits + states + slot map
    assert stored < n * n // 100  # under 1% of the dense boolean mask


def test_from_mask_mod_classifies_and_is_exact():
    bm = BlockMask.from_mask_mod("(q_idx // 50) % 2 == (kv_idx // 50) % 2 and kv_idx <= q_idx + skew[h]",
                                 seqlen_q=130, seqlen_k=170, heads=3, mod_arrays={"skew": np.array([0, 5, -5])},
                                 block=(32, 16))
    i, j, h = np.arange(130)[:, None], np.arange(170)[None, :], np.array([0, 5, -5])[:, None, None]
    want = (((i // 50) % 2) == ((j // 50) % 2)) & (j <= i + h)
    np.testing.assert_array_equal(bm.to_dense()[0], want)
    assert_states_consistent(bm)
    with pytest.raises(ValueError, match=r"skew\[h\] needs shape \(3,\)"):
        BlockMask.from_mask_mod("kv_idx <= q_idx + skew[h]", seqlen_q=8, heads=3, mod_arrays={"skew": np.zeros(2)})


@given(data=st.data(), block=blocks)
def test_and_or_are_elementwise(data, block):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    sq, sk = data.draw(lengths, label="sq"), data.draw(lengths, label="sk")
    pool = [BlockMask.causal(sq, sk, block=block), BlockMask.sliding_window(sq, sk, window=(5, 2), block=block),
            BlockMask.from_dense(rng.random((2, 1, sq, sk)) < 0.4, block=block),
            BlockMask(rng.random((cdiv(sq, block[0]), cdiv(sk, block[1]))) < 0.5, block=block, seqlen_q=sq,
                      seqlen_k=sk)]
    a, b = data.draw(st.sampled_from(pool), label="a"), data.draw(st.sampled_from(pool), label="b")
    for combined, want in ((a & b, a.to_dense() & b.to_dense()), (a | b, a.to_dense() | b.to_dense())):
        np.testing.assert_array_equal(combined.to_dense(), want)
        assert_states_consistent(combined)
    with pytest.raises(ValueError, match="combine only at the same block and lengths"):
        a & BlockMask.causal(sq + 1, sk, block=block)


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
def test_blocks_density_shape_to_dense(data, shape, block):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    grid = rng.random(shape) < 0.5
    bq, bk = block
    sq = data.draw(st.integers((shape[2] - 1) * bq + 1, shape[2] * bq), label="sq")
    sk = data.draw(st.integers((shape[3] - 1) * bk + 1, shape[3] * bk), label="sk")
    bm = BlockMask.from_blocks(grid, block=block, seqlen_q=sq, seqlen_k=sk)
    assert bm.shape == shape and set(np.unique(bm.states)) <= {0, 2}  # FA1 block-sparse: no partial block
    assert bm.density == pytest.approx(grid.sum() / grid.size, abs=1e-15)
    dense = bm.to_dense()
    assert dense.shape == shape[:2] + (sq, sk) and dense.dtype == bool
    np.testing.assert_array_equal(dense, grid[:, :, np.arange(sq) // bq][:, :, :, np.arange(sk) // bk])


def test_empty_mask_density():
    bm = BlockMask(np.zeros((1, 1, 0, 0), dtype=bool), block=(4, 4))
    assert bm.density == 0.0 and bm.shape == (1, 1, 0, 0)


# ----------------------------------------------------------------------------- kernel lists
def test_kernel_tile_lists_of_a_causal_mask():
    from cuflash.cuda.launch import tile_lists
    from cuflash.tiling import mask_tiles

    kept, full = mask_tiles(BlockMask.causal(64, block=(16, 16)), 16, 16)
    counts, lists = tile_lists(kept, full)
    np.testing.assert_array_equal(counts[0, 0], [1, 2, 3, 4])
    # the diagonal tile needs the element test (~i), the others are full
    assert [list(lists[0, 0, i, :i + 1]) for i in range(4)] == [list(range(i)) + [~i] for i in range(4)]
    counts, lists = tile_lists(kept.transpose(0, 1, 3, 2), full.transpose(0, 1, 3, 2))  # the backward's
    np.testing.assert_array_equal(counts[0, 0], [4, 3, 2, 1])
    assert [list(lists[0, 0, j, :4 - j]) for j in range(4)] == [[~j] + list(range(j + 1, 4)) for j in range(4)]


# ----------------------------------------------------------------------------- display
def test_repr_draws_the_grid():
    bm = BlockMask.causal(48, block=(16, 16))
    text = repr(bm)
    lines = text.splitlines()
    assert "BlockMask" in lines[0] and "density=0.667" in lines[0] and "(16, 16)" in lines[0]
    assert "█ full  ▒ partial  · skipped" in lines[0]
    drawn = [line.strip() for line in lines[1:]]
    assert drawn == ["▒··", "█▒·", "██▒"]
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
    (np.ones((2, 2), dtype=bool), (4.0, 4), {}, TypeError),
    (np.ones((2, 2), dtype=bool), (True, 4), {}, TypeError),
    (np.ones((2, 2), dtype=bool), (4,), {}, ValueError),
    (np.ones((2, 2), dtype=bool), 4, {}, TypeError),
    (np.ones((2, 2), dtype=bool), (4, 4), dict(seqlen_q=9), ValueError),   # needs 3 query blocks
    (np.ones((2, 2), dtype=bool), (4, 4), dict(seqlen_k=4), ValueError),   # needs 1 key block
], ids=["int8", "float", "1d", "5d", "block0", "block-neg", "block-float", "block-bool", "block-arity",
        "block-int", "seqlen_q", "seqlen_k"])
def test_bad_grids_rejected(grid, block, kw, exc):
    with pytest.raises(exc, match="grid|block"):
        BlockMask(grid, block=block, **kw)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: BlockMask.strided(64, stride=0, block=(16, 16)), ValueError, "stride must be an int >= 1"),
    (lambda: BlockMask.strided(64, stride=1.5, block=(16, 16)), TypeError, "stride must be an int >= 1"),
    (lambda: BlockMask.global_local(64, global_blocks=-1, block=(16, 16)), ValueError,
     "global_blocks must be an int >= 0"),
    (lambda: BlockMask.global_local(64, local_blocks=-1, block=(16, 16)), ValueError,
     "local_blocks must be an int >= 0"),
    (lambda: BlockMask.sliding_window(64, window=(-5, 0), block=(16, 16)), ValueError,
     "window left must be an int >= 0"),
    (lambda: BlockMask.sliding_window(64, window=5, block=(16, 16)), TypeError, "window must be a pair"),
    (lambda: BlockMask.sliding_window(64, window=(1, 2, 3), block=(16, 16)), ValueError, "window must be a pair"),
    (lambda: BlockMask.causal(-3, block=(16, 16)), ValueError, "seqlen_q must be an int >= 0"),
    (lambda: BlockMask.causal(8, 2.5, block=(16, 16)), TypeError, "seqlen_k must be an int >= 0"),
    (lambda: BlockMask.prefix_lm(8, -1), ValueError, "prefix_len must be an int >= 0"),
    (lambda: BlockMask.document(np.zeros((2, 2, 2), int)), ValueError, "doc_ids_q must be an integer array"),
    (lambda: BlockMask.document(np.zeros(4)), TypeError, "doc_ids_q must be an integer array"),
    (lambda: BlockMask.document(np.zeros((2, 4), int), np.zeros((3, 4), int)), ValueError, "same batch"),
    (lambda: BlockMask.from_dense(np.ones((4, 4)), block=(2, 2)), TypeError, "mask must be a boolean array"),
    (lambda: BlockMask.from_dense(np.ones(4, dtype=bool), block=(2, 2)), ValueError, "mask must be a boolean array"),
    (lambda: BlockMask.from_dense(np.ones((3, 8), dtype=bool), block=(3, 2 ** 30)), ValueError,
     "fewer than 2\\*\\*31 elements"),
    (lambda: BlockMask.from_mask_mod("q_idx", seqlen_q=4), ValueError, "must evaluate to a bool"),
    (lambda: BlockMask.from_mask_mod("True", seqlen_q=4, heads=0), ValueError, "heads must be an int >= 1"),
])
def test_bad_constructor_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


_RAGGED = [[True], [True, False]]


@pytest.mark.parametrize("make, name", [
    (lambda: BlockMask(_RAGGED, block=(4, 4)), "grid"),
    (lambda: BlockMask.from_blocks(_RAGGED, block=(4, 4)), "grid"),
    (lambda: BlockMask.from_dense(_RAGGED, block=(4, 4)), "mask"),
    (lambda: BlockMask.document([[0], [0, 1]], block=(4, 4)), "doc_ids_q"),
    (lambda: BlockMask.document([0, 1], [[0], [0, 1]], block=(4, 4)), "doc_ids_k"),
    (lambda: BlockMask.causal(8, block=(4, 4)).keep(0, 0, [[0], [0, 1]], 0), "q_idx"),
], ids=["grid", "from_blocks", "from_dense", "doc_ids_q", "doc_ids_k", "keep"])
def test_ragged_nested_lists_are_refused_naming_the_argument(make, name):
    """NumPy's "setting an array element with a sequence ... inhomogeneous shape" named neither the argument nor the
    form it takes."""
    with pytest.raises(ValueError, match=f"^{name} must be an? (boolean|integer|int).* got a sequence NumPy makes no "
                                         f"array of"):
        make()


@pytest.mark.parametrize("bad", [3.0, True, np.array(3), np.bool_(True)], ids=["float", "bool", "0d-array", "np.bool"])
def test_a_wrong_type_where_an_int_is_expected_is_a_type_error(bad):
    """A float, bool or array where an int is expected is a TypeError in every constructor, as attention()'s own
    ints (window=(3.0, 0) was a TypeError there, a ValueError in BlockMask.sliding_window); negative ints stay
    ValueErrors."""
    q = np.zeros((1, 8, 1, 4), np.float32)
    with pytest.raises(TypeError, match="window left must be an int >= 0"):
        cuflash.attention(q, q, q, window=(bad, 0))
    block = dict(block=(4, 4))
    calls = {
        "window left": lambda: BlockMask.sliding_window(8, window=(bad, 0), **block),
        "window right": lambda: BlockMask.sliding_window(8, window=(None, bad), **block),
        "seqlen_q": lambda: BlockMask.causal(bad, **block),
        "seqlen_k": lambda: BlockMask.causal(8, bad, **block),
        "seqlen": lambda: BlockMask.prefix_lm(bad, 2, **block),
        "prefix_len": lambda: BlockMask.prefix_lm(8, bad, **block),
        "global_blocks": lambda: BlockMask.global_local(8, global_blocks=bad, **block),
        "local_blocks": lambda: BlockMask.strided(8, stride=1, local_blocks=bad, **block),
        "stride": lambda: BlockMask.strided(8, stride=bad, **block),
        "batch": lambda: BlockMask.from_mask_mod("True", seqlen_q=8, batch=bad, **block),
        "heads": lambda: BlockMask.from_mask_mod("True", seqlen_q=8, heads=bad, **block),
        "start": lambda: BlockMask.causal(8, **block).columns(bad, 4),
        "stop": lambda: BlockMask.causal(8, **block).columns(0, bad),
        "block": lambda: BlockMask.causal(8, block=(bad, 4)),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=f"^{name} must be"):
            call()
    with pytest.raises(TypeError, match="seqlen_q must be an int >= 0"):
        BlockMask.causal(8, **block).to_dense(bad)
    with pytest.raises(ValueError, match="window left must be an int >= 0"):
        BlockMask.sliding_window(8, window=(-1, 0), **block)  # the right type, a wrong value


@pytest.mark.parametrize("make, name", [
    (lambda: BlockMask(np.ones((2, 2), int), block=(4, 4)), "grid"),
    (lambda: BlockMask.from_dense(np.ones((8, 8), int), block=(4, 4)), "mask"),
    (lambda: BlockMask.from_dense(np.ones((8, 8), object), block=(4, 4)), "mask"),
    (lambda: BlockMask.document(np.zeros(8), block=(4, 4)), "doc_ids_q"),
    (lambda: BlockMask.document(np.zeros(8, int), np.zeros(8, bool), block=(4, 4)), "doc_ids_k"),
    (lambda: BlockMask.document(None, block=(4, 4)), "doc_ids_q"),
], ids=["grid-int", "mask-int", "mask-object", "ids-float", "ids-bool", "ids-None"])
def test_an_array_of_the_wrong_dtype_is_a_type_error(make, name):
    """An int grid was a TypeError in BlockMask(...) but a ValueError in from_dense, float ids a ValueError."""
    with pytest.raises(TypeError, match=f"^{name} must be an? (boolean|integer) array"):
        make()


def test_to_dense_and_keep_take_dtype_by_keyword_only():
    """dtype is an option: keyword-only, as every option of cuflash (a third positional argument of to_dense was
    dtype)."""
    bm = BlockMask.causal(8, block=(4, 4))
    with pytest.raises(TypeError, match="positional argument"):
        bm.to_dense(8, 8, np.float32)
    with pytest.raises(TypeError, match="positional argument"):
        bm.keep(0, 0, 1, 1, np.float32)
    np.testing.assert_array_equal(bm.to_dense(8, 8, dtype=np.float32), bm.to_dense())
    assert bm.keep(0, 0, 1, 1, dtype=np.float32) and not bm.keep(0, 0, 1, 2, dtype=np.float64)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, bool, np.float16, np.complex64, "int32", np.dtype(object),
                                   "bfloat16", "not a dtype", object()])
def test_to_dense_and_keep_refuse_a_dtype_that_is_no_working_precision(dtype):
    """dtype is the precision the rule's floats are computed in, float32 or float64: an int or bool one gave other
    elements (``kv_idx <= q_idx * 0.5 + 0.5`` kept 16 of 64 differently in int32), silently; "bfloat16" raised
    NumPy's own error, which named no argument."""
    bm = BlockMask.from_mask_mod("kv_idx <= q_idx * 0.5 + 0.5", seqlen_q=8, block=(4, 4))
    form = re.escape("dtype must be float32 or float64 (the working precision of the problem) or None, got ")
    with pytest.raises(TypeError, match=form):
        bm.to_dense(dtype=dtype)
    with pytest.raises(TypeError, match=form):
        bm.keep(0, 0, np.arange(8)[:, None], np.arange(8), dtype=dtype)
    i, j = np.arange(8)[:, None], np.arange(8)
    for working in (np.float32, "float64", np.dtype(np.float32), np.float64):  # every spelling of the two
        np.testing.assert_array_equal(bm.to_dense(dtype=working)[0, 0], j <= i * 0.5 + 0.5)
        np.testing.assert_array_equal(bm.keep(0, 0, i, j, dtype=working), j <= i * 0.5 + 0.5)


def test_from_mask_mod_takes_any_mapping_of_mod_arrays():
    """mod_arrays is a Mapping: a read-only MappingProxyType was refused ("must be a dict")."""
    from types import MappingProxyType

    rule, t = "kv_idx <= q_idx + t[q_idx]", np.arange(8) % 3
    want = BlockMask.from_mask_mod(rule, seqlen_q=8, mod_arrays={"t": t}, block=(4, 4))
    got = BlockMask.from_mask_mod(rule, seqlen_q=8, mod_arrays=MappingProxyType({"t": t}), block=(4, 4))
    np.testing.assert_array_equal(got.states, want.states)
    np.testing.assert_array_equal(got.to_dense(), want.to_dense())
    with pytest.raises(TypeError, match="mod_arrays must be a"):
        BlockMask.from_mask_mod(rule, seqlen_q=8, mod_arrays=[("t", t)], block=(4, 4))


@pytest.mark.parametrize("make, name", [
    (lambda m: BlockMask(m, block=(16, 16)), "grid"),
    (lambda m: BlockMask.from_dense(m, block=(2, 2)), "mask"),
    (lambda m: BlockMask.document(np.ma.masked_array(np.zeros(4, int), mask=[0, 1, 0, 0])), "doc_ids_q"),
    (lambda m: BlockMask.from_mask_mod("w[kv_idx] > 0", seqlen_q=4, mod_arrays={"w": np.ma.masked_array(
        np.ones(4), mask=[0, 1, 0, 0])}, block=(2, 2)), "mod_arrays\\['w'\\]"),
])
def test_masked_arrays_are_refused_not_read_without_their_mask(make, name):
    with pytest.raises(TypeError, match=f"{name} is a numpy.ma.MaskedArray"):
        make(np.ma.masked_array(np.ones((4, 4), bool), mask=np.eye(4, dtype=bool)))


@pytest.mark.parametrize("call,exc,match", [
    (lambda m: m.to_dense(16, 16), ValueError, "seqlen_q, seqlen_k = 16, 16 exceed this mask's 8, 8"),
    (lambda m: m.to_dense(4, -1), ValueError, "seqlen_k must be an int >= 0"),
    (lambda m: m.keep(0, 0, 100, 100), ValueError, r"q_idx must lie in \[0, 8\)"),
    (lambda m: m.keep(0, 0, 0, np.arange(9)), ValueError, r"kv_idx must lie in \[0, 8\).* from 0 to 8"),
    (lambda m: m.keep(0, 0, -1, 0), ValueError, r"q_idx must lie in \[0, 8\)"),  # it wrapped to the last block
    (lambda m: m.keep(-1, 0, 0, 0), ValueError, "b must lie in >= 0"),
    (lambda m: m.keep(0, 0, 1.5, 0), TypeError, "q_idx must be integers"),
    (lambda m: m.keep(0, 0, np.ma.masked_array([1]), 0), TypeError, "q_idx is a numpy.ma.MaskedArray"),
])
def test_indices_outside_the_mask_are_refused_naming_them(call, exc, match):
    """keep and to_dense raised NumPy's IndexError past the mask's lengths and read index -1 as the last block."""
    with pytest.raises(exc, match=match):
        call(BlockMask.causal(8, block=(4, 4)))


def test_indices_inside_the_mask_and_any_batch_of_a_broadcast_grid_are_kept():
    m = BlockMask.causal(8, block=(4, 4))
    np.testing.assert_array_equal(m.to_dense(5, 3)[0, 0], np.tril(np.ones((5, 3), bool)))
    assert m.keep(7, 3, 7, 7) and not m.keep(7, 3, 0, 1)  # a grid of one batch and head serves every one
    per_batch = BlockMask.from_mask_mod("w[b] > 0", seqlen_q=8, batch=2, mod_arrays={"w": np.array([1, 0])},
                                        block=(4, 4))
    assert per_batch.keep(0, 0, 1, 1) and not per_batch.keep(1, 0, 1, 1)
    with pytest.raises(ValueError, match=r"b must lie in \[0, 2\)"):
        per_batch.keep(2, 0, 1, 1)


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
def test_causal_block_mask_is_causal(sq, sk, block):
    q, k, v = _qkv(sq, sk)
    plain = cuflash.attention(q, k, v, causal=True)
    mag = reference.term_magnitudes(q, k, v, causal=True)["out"]
    for kw in (dict(block_mask=BlockMask.causal(sq, sk, block=block)),
               dict(block_mask=BlockMask.causal(sq, sk, block=block), causal=True)):
        np.testing.assert_allclose(cuflash.attention(q, k, v, **kw), plain, rtol=0,
                                   atol=2 * np.finfo(np.float64).eps * mag)


@given(sq=st.integers(1, 300), sk=st.integers(1, 300), left=sides, right=sides,
       block=st.sampled_from([(16, 16), (64, 32), (128, 128), (512, 512)]))
def test_sliding_window_mask_equals_window_bit_for_bit(sq, sk, left, right, block):
    """The names promise the same thing: on the NumPy backend they give the same bits."""
    q, k, v = _qkv(sq, sk, dtype=np.float32)
    a = cuflash.attention(q, k, v, window=(left, right), return_lse=True)
    b = cuflash.attention(q, k, v, block_mask=BlockMask.sliding_window(sq, sk, window=(left, right), block=block),
                          return_lse=True)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("block", [(1024, 1024), (1536, 768), (2048, 2048), (1031, 1031)])
def test_blocks_larger_than_a_tile_keep_the_tile_budget_and_the_bits(block):
    """A BlockMask block larger than the NumPy backend's tile grew the tile to the block (a 8192-row block: an
    O(N^2) tile, 776 MiB at N = 8192), and the same elements as causal=True gave other bits (a partial block's tiles
    that see all or nothing took the masked path). Tiles now divide such blocks, and take the path their elements
    make them take: the bits of causal=True, forward and backward, where the tiles are causal=True's (blocks that
    are multiples of them); the rule elsewhere."""
    n = 2048
    q, k, v = _qkv(n, n, dtype=np.float32)
    dout = np.random.default_rng(9).standard_normal(q.shape).astype(np.float32)
    mask = BlockMask.causal(n, block=block)
    lay = nb.layout(make_problem(q, k, v, block_mask=mask))
    assert lay.block_q <= nb.BLOCK_Q and lay.block_k <= nb.BLOCK_K
    # a divisor of the block where one keeps half the tile at least, else the tile itself (1031 rows: a 1-row
    # divisor took 2400x the time)
    assert (block[0] % lay.block_q == 0 and 2 * lay.block_q >= nb.BLOCK_Q) or lay.block_q == nb.BLOCK_Q
    assert (block[1] % lay.block_k == 0 and 2 * lay.block_k >= nb.BLOCK_K) or lay.block_k == nb.BLOCK_K
    if block[0] % nb.BLOCK_Q or block[1] % nb.BLOCK_K:  # tiles of another shape than causal=True's: the rule
        case = Case(q, k, v, dout, dict(block_mask=mask))
        out, lse = check_forward(lambda *a, **o: cuflash.attention(*a, **o, return_lse=True), case)
        check_backward(cuflash.attention_backward, case, out, lse)
        return
    plain = cuflash.attention(q, k, v, causal=True, return_lse=True)
    masked = cuflash.attention(q, k, v, block_mask=mask, return_lse=True)
    assert all(np.array_equal(a, b) for a, b in zip(plain, masked))
    grads = cuflash.attention_backward(dout, q, k, v, *plain, causal=True)
    masked_grads = cuflash.attention_backward(dout, q, k, v, *plain, block_mask=mask)
    assert all(np.array_equal(a, b) for a, b in zip(grads, masked_grads))


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


# ---------------------------------------------------------------------------------------------- from_mask_mod's rule
@pytest.mark.parametrize("rule, f32, f64", [
    # 15.9999999 is 16.0 in float32: key 16 dropped in float32, kept in float64 (key block 1 full in float64 only)
    ("1.0 * kv_idx > 15.9999999", lambda j: j > 16, lambda j: j >= 16),
    # ... kept in float32, dropped in float64 (key block 1 skipped in float64 only)
    ("1.0 * kv_idx <= 15.9999999", lambda j: j <= 16, lambda j: j <= 15),
], ids=["full_in_float64_only", "skipped_in_float64_only"])
def test_from_mask_mod_classifies_in_float32_and_float64(rule, f32, f64):
    """A BlockMask does not know the problem's precision: a block is full or skipped only where float32 and float64
    agree, else partial, its elements then tested in the working precision (classified in float64 alone, the block
    kept key 16 in float32, or hid it, whatever mask_mod= of the same text does)."""
    bm = BlockMask.from_mask_mod(rule, seqlen_q=32, block=(16, 16))
    np.testing.assert_array_equal(bm.states[0, 0], [[2 if f64(0) else 0, 1]] * 2)
    j = np.broadcast_to(np.arange(32), (32, 32))
    np.testing.assert_array_equal(bm.to_dense(dtype=np.float32)[0, 0], f32(j))
    np.testing.assert_array_equal(bm.to_dense(dtype=np.float64)[0, 0], f64(j))
    with pytest.raises(ValueError, match="other elements in float32 than in float64: pass dtype="):
        bm.to_dense()
    for dtype in (np.float32, np.float64):
        q, k, v = _qkv(32, 32, dtype=dtype)
        np.testing.assert_array_equal(reference.attention(q, k, v, block_mask=bm),
                                      reference.attention(q, k, v, mask_mod=rule))
        check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, **o),
                      Case(q, k, v, q, dict(block_mask=bm)))


@pytest.mark.parametrize("c", [1e300, np.longdouble(1e300), np.array([1e300, 1.0])],
                         ids=["float", "longdouble", "array"])
def test_a_mask_operand_beyond_the_working_precision_is_refused_as_mask_mods(c):
    """from_mask_mod's float operands are refused where they overflow the working precision, as mask_mod='s are: a
    float32 problem turned c = 1e300 into inf and dropped every element of its partial blocks (all-zero outputs,
    silently), where float64 inputs keep key 0. Float64 inputs take the same mask."""
    read = "kv_idx * c < 1e30" if np.ndim(c) == 0 else "kv_idx * c[h] < 1e30"
    bm = BlockMask.from_mask_mod(read, seqlen_q=32, heads=np.size(c) if np.ndim(c) else 1, mod_arrays={"c": c},
                                 block=(16, 16))
    q, k, v = _qkv(32, 32, dtype=np.float32)
    with pytest.raises(ValueError, match=r"block_mask's mod_arrays\['c'\] holds finite values beyond the largest "
                                         r"float32"):
        cuflash.attention(q, k, v, block_mask=bm)
    with pytest.raises(ValueError, match=r"mod_arrays\['c'\] holds finite values beyond the largest float32"):
        cuflash.attention(q, k, v, mask_mod=read, mod_arrays={"c": c})  # the same refusal
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, **o), Case(q, k, v, q, dict(block_mask=bm)))


def test_a_literal_of_a_mask_rule_beyond_the_working_precision_is_refused_as_mask_mods():
    """A float literal of from_mask_mod's rule was not checked where mask_mod='s is: with float32 inputs 1e39 became
    inf, and the mask kept 225 of 256 elements where it meant the 136 of q >= kv (no error); building it showed
    NumPy's overflow warning."""
    import warnings

    rule = "q_idx * 1e39 >= kv_idx * 1e39"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bm = BlockMask.from_mask_mod(rule, seqlen_q=16, block=(4, 4))
    q, k, v = _qkv(16, 16, dtype=np.float32)
    with pytest.raises(ValueError, match=r"block_mask's rule's constant 1e\+39 holds finite values beyond the "
                                         r"largest float32"):
        cuflash.attention(q, k, v, block_mask=bm)
    with pytest.raises(ValueError, match=r"mask_mod's constant 1e\+39 holds finite values beyond the largest float32"):
        cuflash.attention(q, k, v, mask_mod=rule)  # the same refusal
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, **o), Case(q, k, v, q, dict(block_mask=bm)))


def test_from_mask_mod_reads_its_own_lengths():
    """q_len / kv_len in a BlockMask's rule are the mask's seqlen_q / seqlen_k, fixed when it is built: the rule below
    is BlockMask.causal's at those lengths, whatever seqlens_q / seqlens_k the call passes (the kernels read each
    sequence's lengths, NumPy and the reference the mask's)."""
    bm = BlockMask.from_mask_mod("kv_idx <= q_idx + kv_len - q_len", seqlen_q=40, seqlen_k=56, block=(16, 16))
    np.testing.assert_array_equal(bm.to_dense(), BlockMask.causal(40, 56, block=(16, 16)).to_dense())
    # what the kernels do: the member evaluated with a sequence's own q_len / kv_len gives the same elements
    i, j = np.arange(40)[:, None], np.arange(56)[None, :]
    env = dict(b=np.zeros(1, int), h=np.zeros(1, int), q_idx=i, kv_idx=j, q_len=25, kv_len=30)
    np.testing.assert_array_equal(bm.member.evaluate(env, bm.values), bm.to_dense()[0, 0])
    q, k, v = _qkv(40, 56, dtype=np.float32)
    lengths = dict(seqlens_q=np.array([40, 25]), seqlens_k=np.array([56, 30]))
    np.testing.assert_array_equal(reference.attention(q, k, v, block_mask=bm, **lengths),
                                  reference.attention(q, k, v, mask_mod="kv_idx <= q_idx + 16", **lengths))


@pytest.mark.parametrize("rule, axis, built, size", [
    ("b == 0 and kv_idx <= q_idx", "batch", 1, 2),
    ("h == 1 or kv_idx <= q_idx", "heads", 1, 2),
    ("w[b, kv_idx] > 0", "batch", 1, 2),
])
def test_a_rule_reading_b_or_h_is_built_for_the_problems_batch_or_heads(rule, axis, built, size):
    """A rule that reads b (h) built for batch=1 (heads=1) is refused by a problem with more, naming the axis: its grid
    broadcasts, but NumPy and the reference evaluated it at b = 0 (h = 0) everywhere, the kernels at the real one."""
    q, k, v = _qkv(32, 32, hq=2, hkv=2, dtype=np.float32)
    arrays = {"w": np.ones((1, 32), np.int32)} if "w[" in rule else None
    bm = BlockMask.from_mask_mod(rule, seqlen_q=32, block=(16, 16), mod_arrays=arrays)
    var = "b" if axis == "batch" else "h"
    msg = (f"block_mask's rule reads {var} but was built for {axis}={built}; this problem has {axis} {size}: "
           f"build it with {axis}={size}")
    wide = BlockMask(np.ones((2, 2, 2, 2), bool), block=(16, 16))  # a grid of the problem's batch and heads
    for mask in (bm, bm & BlockMask.causal(32, block=(16, 16)), wide | bm):
        for call in (cuflash.attention, reference.attention):
            with pytest.raises(ValueError, match=re.escape(msg)):
                call(q, k, v, block_mask=mask)
    if arrays is None:  # built for the problem: taken, and the same as mask_mod=
        fitted = BlockMask.from_mask_mod(rule, seqlen_q=32, block=(16, 16), **{axis: size})
        np.testing.assert_array_equal(reference.attention(q, k, v, block_mask=fitted),
                                      reference.attention(q, k, v, mask_mod=rule))
    # a rule that reads neither still broadcasts
    cuflash.attention(q, k, v, block_mask=BlockMask.from_mask_mod("kv_idx <= q_idx", seqlen_q=32, block=(16, 16)))


# ------------------------------------------------------------------------------------------------ derived, once
def test_derived_is_computed_once_and_again_after_a_change_in_place():
    """BlockMask.derived keeps what the kernels derive from a mask (tile lists, device operands) for every later
    call with it, and derives it again when the states or an operand were changed in place (unfrozen first)."""
    rule = BlockMask.from_mask_mod("kv_idx <= q_idx + t[q_idx]", seqlen_q=64, seqlen_k=64, block=(16, 16),
                                   mod_arrays={"t": np.arange(64)})
    for mask in (BlockMask(np.tril(np.ones((4, 4), bool)), block=(16, 16)), rule):
        made = []

        def make():
            made.append(1)
            return len(made)

        assert [mask.derived("k", make) for _ in range(3)] == [1, 1, 1]
        assert mask.derived("other", make) == 2  # one entry per key
        arrays = [a for a in mask.values.values() if isinstance(a, np.ndarray)]
        assert any(a is mask.states for a in arrays) and (mask is not rule or len(arrays) == 2)
        for a in arrays:
            a.setflags(write=True)
            a.flat[0] += 1
            n = len(made)
            assert mask.derived("k", make) == n + 1 == mask.derived("k", make)  # derived again, then kept


def test_derived_keeps_a_bounded_number_of_entries():
    """One entry per device, stream and tile size: a caller making a new stream for every call would have grown
    the mask's memory without end; the least recently used entries go."""
    from cuflash.blockmask import _DERIVED_LIMIT

    mask = BlockMask(np.ones((2, 2), bool), block=(16, 16))
    for key in range(3 * _DERIVED_LIMIT):
        mask.derived(key, lambda: np.zeros(4))
        mask.derived(0, lambda: 1 / 0)  # kept: used again each time, never recomputed
    assert len(mask._derived) == _DERIVED_LIMIT and 0 in mask._derived and 1 not in mask._derived


def test_a_mask_used_by_a_backend_still_pickles_and_copies():
    """derived()'s entries (device arrays, array modules) are a cache: pickle and deepcopy leave them behind, and the
    copy computes the same attention."""
    import copy
    import pickle

    mask = BlockMask.from_mask_mod("kv_idx <= q_idx + t[q_idx]", seqlen_q=64, seqlen_k=64, block=(16, 16),
                                   mod_arrays={"t": np.arange(64) % 7})
    q, k, v = (np.random.default_rng(i).standard_normal((1, 64, 2, 32)).astype(np.float32) for i in range(3))
    out = cuflash.attention(q, k, v, block_mask=mask, backend="emulate")
    assert mask.__dict__.get("_derived")  # the backend kept its tile lists on the mask
    for twin in (pickle.loads(pickle.dumps(mask)), copy.deepcopy(mask)):
        assert "_derived" not in twin.__dict__ and np.array_equal(twin.states, mask.states)
        assert np.array_equal(cuflash.attention(q, k, v, block_mask=twin, backend="emulate"), out)


def test_a_copied_mask_stays_read_only():
    """Pickle and deepcopy gave back writeable arrays: the copy could be changed in place (the original refuses), and
    every derived() call of it took a CRC of all its operands (0.5 ms a call for a 4096^2 dense mask)."""
    import copy
    import pickle

    mask = BlockMask.from_mask_mod("kv_idx <= q_idx + t[q_idx]", seqlen_q=64, seqlen_k=64, block=(16, 16),
                                   mod_arrays={"t": np.arange(64) % 7})
    for twin in (pickle.loads(pickle.dumps(mask)), copy.deepcopy(mask)):
        arrays = [twin.states] + [a for a in twin.values.values() if isinstance(a, np.ndarray)]
        assert len(arrays) >= 2 and not any(a.flags.writeable for a in arrays)
        with pytest.raises(ValueError, match="read-only"):
            twin.states[...] = 2
        checks = []
        twin._checksum = lambda: checks.append(1)  # derived() of a read-only mask trusts what it kept
        twin.derived(("k",), lambda: 1)
        assert not checks


def test_a_mask_is_its_own_value_and_names_its_operands_uniquely(monkeypatch):
    """from_mask_mod copies the caller's arrays (a later change of theirs does not reach the mask, whose states were
    classified from the old values); operand names are unique across processes, so a mask built in another process
    (a forked data-loader worker, unpickled) combines with one built here without either overwriting the other's
    operands (a per-process counter named both cuflash_m0_...); and a read-only mask is never read again to check
    what derived() kept."""
    import pickle
    import subprocess
    import sys

    t = (np.arange(64) % 5).astype(np.int32)
    rule = "kv_idx <= q_idx + t[q_idx]"
    mask = BlockMask.from_mask_mod(rule, seqlen_q=64, seqlen_k=64, block=(16, 16), mod_arrays={"t": t})
    keep = mask.to_dense()
    t += 40  # the caller's array, changed after the mask was built
    assert np.array_equal(mask.to_dense(), keep)
    assert all(not v.flags.writeable for v in mask.values.values() if isinstance(v, np.ndarray))

    code = ("import pickle, sys, numpy as np; from cuflash import BlockMask; "
            "sys.stdout.buffer.write(pickle.dumps(BlockMask.from_mask_mod('kv_idx >= q_idx - w[q_idx]', seqlen_q=64,"
            " block=(16, 16), mod_arrays={'w': np.full(64, 3, np.int32)})))")
    theirs = pickle.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout)
    both = mask & theirs
    want = keep & theirs.to_dense()
    assert np.array_equal(both.to_dense(), want) and want.any() and not want.all()
    q = np.random.default_rng(0).standard_normal((1, 64, 1, 16))

    def naive(x):  # the truth, from the dense mask alone
        s = np.where(want.reshape(64, 64), x @ x.T / 4, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        return (p / p.sum(axis=1, keepdims=True)) @ x

    out = cuflash.attention(q, q, q, block_mask=both)[0, :, 0]
    assert_attention_close(out, naive(q[0, :, 0].astype(np.longdouble)), naive(q[0, :, 0]))

    checks = []
    monkeypatch.setattr(BlockMask, "_checksum", lambda self: checks.append(1) or ())
    for _ in range(3):
        cuflash.attention(q.astype(np.float32), q.astype(np.float32), q.astype(np.float32), block_mask=both,
                          backend="emulate")
    assert checks == []


def test_a_mask_combines_with_its_copy():
    """A deep copy or an unpickled mask keeps its operands' names with arrays of the same values: combining it with
    the original is the mask combined with itself (an identity check of the operands refused it)."""
    import copy
    import pickle

    m = BlockMask.causal(256, 256)
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        for a, b in ((m & other, m & m), (m | other, m | m)):
            assert np.array_equal(a.states, b.states) and a.values.keys() == b.values.keys()


def test_columns_past_the_keys_mean_up_to_the_last_key_on_every_backend():
    """columns(0, 2**40) was taken as given, and the kernels' int32 parameters refused it in their packing with a
    bare OverflowError naming neither bound; bounds past the last key now clamp to it, which selects the same
    columns."""
    mask = BlockMask.causal(8, block=(4, 4))
    far, near = mask.columns(0, 2**40), mask.columns(0, 8)
    np.testing.assert_array_equal(far.to_dense(), near.to_dense())
    q, k, v = (np.random.default_rng(i).standard_normal((1, 8, 2, 16)).astype(np.float32) for i in range(3))
    want = cuflash.attention(q, k, v, block_mask=near, backend="emulate")
    np.testing.assert_array_equal(cuflash.attention(q, k, v, block_mask=far, backend="emulate"), want)
    assert not mask.columns(2**40, 2**41).to_dense().any()  # past the last key: nothing


def test_from_mask_mod_takes_a_block_larger_than_the_sequence_in_the_sequences_memory():
    """from_mask_mod counted each block's kept elements in a copy padded to whole key blocks: a block of 2**33 keys
    over 12 keys asked for 32 GiB (MemoryError), where BlockMask.causal takes the same block."""
    mask = BlockMask.from_mask_mod("q_idx >= kv_idx", seqlen_q=12, block=(4, 2**33))
    np.testing.assert_array_equal(mask.to_dense(), BlockMask.causal(12, block=(4, 2**33)).to_dense())
    q, k, v = (np.random.default_rng(i).standard_normal((1, 12, 2, 8)) for i in range(3))
    check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, **o),
                  Case(q, k, v, np.zeros_like(q), options=dict(block_mask=mask)))


def test_document_ids_of_an_empty_batch_give_an_empty_mask():
    """doc_ids of shape (0, n) failed in a NumPy reshape naming no argument; they give a mask of batch 0, which a
    batch-0 call takes."""
    mask = BlockMask.document(np.zeros((0, 4), np.int32), block=(2, 2))
    assert mask.states.shape == (0, 1, 2, 2)
    q = np.zeros((0, 4, 2, 8), np.float32)
    assert cuflash.attention(q, q, q, block_mask=mask).shape == q.shape


def test_the_kernels_operand_table_limit_names_each_argument():
    """A BlockMask of two rules with a bias, ALiBi slopes and a one-array mask_mod reads 9 arrays: the kernels' table
    holds 8. The refusal said "9 readings" and named no argument; it now counts them by argument, before anything
    is compiled, and the NumPy backend (no such table) runs the call against the reference."""
    rng = np.random.default_rng(0)
    s, h, d = 64, 2, 16
    mask = BlockMask.prefix_lm(s, 8, block=(16, 16)) & BlockMask.document(np.repeat(np.arange(4), 16), block=(16, 16))
    q, k, v = (rng.standard_normal((1, s, h, d)).astype(np.float32) for _ in range(3))
    opts = dict(block_mask=mask, bias=rng.standard_normal((s, s)).astype(np.float32),
                alibi_slopes=np.array([0.5, 0.25], np.float32), mask_mod="keep[kv_idx]",
                mod_arrays={"keep": np.arange(s) % 7 != 3})
    with pytest.raises(ValueError, match=re.escape("9 readings (bias: 1, alibi_slopes: 1, mod_arrays['keep']: 1, "
                                                   "block_mask: 6)")):
        cuflash.attention(q, k, v, backend="emulate", **opts)
    case = Case(q, k, v, np.zeros_like(q), options=opts)
    check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, backend="numpy", **o), case)


def test_repr_of_a_mask_of_no_batch_and_a_combination_that_keeps_its_parts_as_they_were():
    """repr of a mask with an empty batch read states[0, 0] (IndexError; a residual's repr too). A combined mask
    (m1 | m2) computes its grid once: its rule read m1's live arrays, so m1 made writeable and changed later moved the
    rule but not the grid, and the NumPy backend (by tile) and the reference disagreed by 0.25. The combination keeps
    copies of its parts' operands now."""
    empty = BlockMask.document(np.zeros((0, 16), np.int32), block=(8, 8))
    assert repr(empty).startswith("BlockMask(shape=(0, 1, 2, 2)")
    s, blk = 2048, (1024, 1024)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, s, 1, 8)).astype(np.float32) for _ in range(3))
    m1 = BlockMask(np.array([[True, False], [False, True]]), block=blk)
    both = m1 | BlockMask.causal(s, block=blk)
    dense = both.to_dense()
    m1.states.setflags(write=True)
    m1.states[0, 0, 0, 1] = 2  # m1 now keeps block (0, 1) too: the combination does not
    np.testing.assert_array_equal(both.to_dense(), dense)
    check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, backend="numpy", **o),
                  Case(q, k, v, np.zeros_like(q), options=dict(block_mask=both)))


def test_from_dense_never_copies_the_dense_mask():
    """Its docstring's promise: the blocks are classified and the partial ones packed one band of query blocks at a
    time. A padded copy of the whole mask and a byte per element of every partial block took three times the mask's
    memory at the peak (a 137 MiB mask: +285 MiB), for bits that were a tenth of it."""
    import tracemalloc

    i = np.arange(4096)
    mask = (i[:, None] >= i[None, :]) & ((i[:, None] // 100 == i[None, :] // 100) | (i[None, :] < 50))
    BlockMask.from_dense(mask[:300, :300], block=(128, 128))  # what a first call builds once (the rule's parse)
    tracemalloc.start()
    try:
        bm = BlockMask.from_dense(mask, block=(128, 128))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < mask.nbytes / 4, f"peak {peak} bytes for a mask of {mask.nbytes}"
    assert np.array_equal(np.asarray(bm.to_dense()).reshape(mask.shape), mask)


def test_a_combined_mask_edited_in_place_is_refused_by_every_use():
    """A mask's element rule reads its own states, so a mask made writeable and edited is one mask to every use
    (:meth:`BlockMask.derived`). A combination's rule is its parts': a block of it edited to full kept the parts'
    elements in to_dense and the reference, all of them in the NumPy backend (by tile). Reading the combination's
    states in its rule too would cost the kernels a reading per combination (prefix_lm is four), so an edited
    combination is refused instead, by every use, naming what to do."""
    s, blk = 2048, (1024, 1024)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, s, 1, 8)).astype(np.float32) for _ in range(3))
    both = BlockMask.causal(s, block=blk) & BlockMask.sliding_window(s, window=(1500, 0), block=blk)
    assert both.states[0, 0, 1, 0] == 1  # partial: the window drops part of it
    both.states.setflags(write=True)
    dense = both.to_dense()  # writeable, not changed: as before
    check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, backend="numpy", **o),
                  Case(q, k, v, np.zeros_like(q), options=dict(block_mask=both)))
    both.states[0, 0, 1, 0] = 2  # now full
    for use in (both.to_dense, lambda: both.keep(0, 0, 0, 0), lambda: both.derived("key", lambda: 1),
                lambda: cuflash.attention(q, k, v, block_mask=both, backend="numpy")):
        with pytest.raises(ValueError, match=r"states were changed in place, but a combination"):
            use()
    both.states[0, 0, 1, 0] = 1  # as computed again: usable
    assert np.array_equal(both.to_dense(), dense)
