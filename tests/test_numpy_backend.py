"""The blocked NumPy backend against the float64 reference.

Every comparison uses :func:`cuflash.testing.assert_attention_close`: the backend's error against
float64 may be at most 2x (forward) / 3x (gradients) the error of the naive computation in the
input dtype, plus two roundings at the term magnitude.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import BlockMask, reference
from cuflash.backends import numpy as nb
from cuflash.tiling import Schedule
from cuflash.problem import make_problem
from cuflash.testing import Case, assert_attention_close, attention_cases, check_backward, check_forward

try:
    import ml_dtypes  # noqa: F401

    HAVE_BF16 = True
except ImportError:
    HAVE_BF16 = False

DTYPES = ["float64", "float32", "float16",
          pytest.param("bfloat16", marks=pytest.mark.skipif(not HAVE_BF16, reason="ml_dtypes not installed"))]
N_EXAMPLES = settings.default.max_examples


def forward(q, k, v, **options):
    return cuflash.attention(q, k, v, return_lse=True, backend="numpy", **options)


def backward(dout, q, k, v, out, lse, **options):
    return cuflash.attention_backward(dout, q, k, v, out, lse, backend="numpy", **options)


def rng_arrays(seed, *shapes, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


# ----------------------------------------------------------------------------- property tests
@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
def test_forward_backward_match_reference(dtype, data):
    case = data.draw(attention_cases(dtypes=(dtype,)), label="case")
    out, lse = check_forward(forward, case)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert lse.shape == case.q.shape[:-3] + (case.q.shape[-2], case.q.shape[-3])
    grads = check_backward(backward, case, out, lse)
    for g, x in zip(grads, (case.q, case.k, case.v)):
        assert g.dtype == x.dtype and g.shape == x.shape


def test_scores_past_the_exponent_range():
    """Scores whose exponentials overflow float32 without the running max's shift stay exact."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 64, 1, 8)) for _ in range(3))
    for big in (30.0, 300.0, 3000.0):  # |S| up to big*|q|*|k|: past float32's range without a shift
        qs, ks = q * big, k.copy()
        case = Case(qs.astype(np.float32), ks.astype(np.float32), v.astype(np.float32), v.astype(np.float32), {})
        out, lse = check_forward(forward, case)
        assert np.isfinite(out).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [1e8, 1e10, 1e20, 1e30])
def test_backward_with_huge_scores(dtype, scale):
    """Scores so large that the lse's rounding exceeds 1 (|S| >= 2^23 for float32, 2^52 for float64): the backward's
    exp(S - lse) must not overflow (P <= 1), and the gradients stay finite and within the rule."""
    rng = np.random.default_rng(4)
    q, k, v, do = (rng.standard_normal((1, 160, 2, 16)).astype(dtype) for _ in range(4))
    for causal in (False, True):
        case = Case(q, k, v, do, dict(scale=scale, causal=causal))
        out, lse = check_forward(forward, case)
        grads = check_backward(backward, case, out, lse)
        assert all(np.isfinite(g).all() for g in grads)


def test_single_key_float64_gradients():
    """One key per row: dS = P(dP - D) is exactly 0, so dq, dk are pure rounding of dP - D."""
    failures = []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        q, k, v, do = (rng.standard_normal((1, 1, 10)) for _ in range(4))
        case = Case(q, k, v, do, {})
        out, lse = forward(q, k, v)
        try:
            check_backward(backward, case, out, lse)
        except AssertionError as exc:
            failures.append(f"seed {seed}: {exc}")
    assert not failures, f"{len(failures)} of 200 cases fail, e.g. {failures[0]}"


@st.composite
def _past_default_tiles(draw, kind):
    """A Case longer than the forward's default tile (nb.BLOCK_Q x nb.BLOCK_K) on both axes: 2-3 query tiles, each
    taller than a strip (nb.STRIP_ROWS), and 2-3 key tiles (not 3 of both), the last one ragged; head_dim 8, a GQA
    group of at most 2 (which keeps the default tile), at most 4 query heads over the batch. ``kind``: causal, a
    window with a short right side, per-sequence lengths (the first sequence full, the others shorter) or a
    BlockMask; each leaves partial tiles past the first key tile."""
    dtype = np.dtype(draw(st.sampled_from(["float32", "float16"])))
    whole_q, whole_k = draw(st.sampled_from([(1, 1), (1, 2), (2, 1)]))  # whole tiles before the ragged last ones
    sq = whole_q * nb.BLOCK_Q + draw(st.integers(nb.STRIP_ROWS + 1, nb.BLOCK_Q - 1))
    sk = whole_k * nb.BLOCK_K + draw(st.integers(1, nb.BLOCK_K - 1))
    batch = 2 if kind == "seqlens" else draw(st.integers(1, 2))
    hkv, group = draw(st.integers(1, 3 - batch)), draw(st.integers(1, 2))  # batch x query heads <= 4: CI's time
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arrays = [rng.standard_normal((batch, n, h, 8)).astype(dtype)
              for n, h in ((sq, hkv * group), (sk, hkv), (sk, hkv), (sq, hkv * group))]
    opts = {}
    left = draw(st.one_of(st.none(), st.integers(0, sq + sk)))
    if kind == "causal":  # the last query tile holds the diagonal's end: partial in the last key tile
        opts.update(causal=True, window=(left, None))
    elif kind == "window":  # right < rows of the last query tile - 1: partial in the last key tile
        opts["window"] = (left, draw(st.integers(0, nb.STRIP_ROWS - 2)))
    elif kind == "block_mask":
        mb = (draw(st.sampled_from([64, 128])), draw(st.sampled_from([64, 128])))
        shape = ((draw(st.sampled_from([1, batch])), draw(st.sampled_from([1, hkv * group])))
                 + (-(-sq // mb[0]), -(-sk // mb[1])))
        mask = draw(st.sampled_from(["causal", "window", "strided", "blocks"]))
        if mask == "causal":
            bm = BlockMask.causal(sq, sk, block=mb)
        elif mask == "window":
            bm = BlockMask.sliding_window(sq, sk, window=(left, draw(st.integers(0, nb.STRIP_ROWS - 2))), block=mb)
        elif mask == "strided":  # every tile past the first key tile mixes kept and skipped blocks
            bm = BlockMask.strided(sq, sk, stride=draw(st.integers(2, 3)), block=mb)
        else:  # random blocks; in the last key column the last query tile keeps its last block, drops its first
            grid = rng.random(shape) < draw(st.floats(0.2, 1.0))
            grid[..., -1, -1], grid[..., sq // nb.BLOCK_Q * nb.BLOCK_Q // mb[0], -1] = True, False
            bm = BlockMask(grid, block=mb, seqlen_q=sq, seqlen_k=sk)
        opts["block_mask"] = bm
    if kind == "seqlens" or (batch > 1 and draw(st.booleans())):
        # the first sequence full (the tiles the options above make partial stay partial), the others shorter keys
        opts["seqlens_q"] = np.concatenate([[sq], rng.integers(0, sq + 1, batch - 1)]).astype(np.int32)
        opts["seqlens_k"] = np.concatenate([[sk], rng.integers(0, sk, batch - 1)]).astype(np.int32)
    if draw(st.booleans()):
        opts["scale"] = draw(st.floats(0.05, 2.0))
    return Case(*arrays, options=opts)


LONG_KINDS = ("causal", "window", "seqlens", "block_mask")


@pytest.mark.parametrize("kind", LONG_KINDS)
@settings(max_examples=max(1, N_EXAMPLES // (5 * len(LONG_KINDS))))
@given(data=st.data())
def test_long_sequences_default_tiles(kind, data):
    """Past the forward's default tile (nb.BLOCK_Q x nb.BLOCK_K) on both axes, through the public API: several query
    and key tiles, the last ones ragged, and partial tiles past the first key tile cut into strips (_Masks.strips)."""
    case = data.draw(_past_default_tiles(kind), label="case")
    p = make_problem(case.q, case.k, case.v, **case.options)
    lay = nb.layout(p)
    assert (lay.block_q, lay.block_k) == (nb.BLOCK_Q, nb.BLOCK_K)
    sched = Schedule.for_problem(p, lay.block_q, lay.block_k)
    assert sched.n_q >= 2 and sched.n_k >= 2 and p.seqlen_q % lay.block_q and p.seqlen_k % lay.block_k
    deep = [t for _, row in sched.rows() for t in row if not t.full and t.k0 > 0 and t.i1 - t.i0 > nb.STRIP_ROWS]
    assert deep, "the case must have a partial tile past the first key tile, taller than a strip"
    out, lse = check_forward(forward, case)
    check_backward(backward, case, out, lse)


@settings(max_examples=max(2, N_EXAMPLES // 2))
@given(attention_cases(dtypes=("float32", "float64")))
def test_vjp_round_trip(case):
    out, vjp = cuflash.attention_vjp(case.q, case.k, case.v, **case.options)
    out2, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, **case.options)
    np.testing.assert_array_equal(out, out2)
    grads = vjp(case.dout)
    direct = cuflash.attention_backward(case.dout, case.q, case.k, case.v, out2, lse, **case.options)
    for g, d in zip(grads, direct):
        np.testing.assert_array_equal(g, d)
    # and the round trip is right, not merely consistent
    check_backward(lambda *a, **o: grads, case, out, lse)


def test_vjp_rejects_return_lse():
    q, = rng_arrays(0, (4, 1, 8))
    with pytest.raises(TypeError, match="return_lse"):
        cuflash.attention_vjp(q, q, q, return_lse=True)


# ----------------------------------------------------------------------------- fixed shift and exp clamp
def _count_fixed(monkeypatch):
    """Count the work items that leave the online max for shift 0 (nb._Bounds.fixed_shift)."""
    seen = {"fixed": 0, "online": 0}
    real = nb._Bounds.fixed_shift

    def spy(self, u):
        held = real(self, u)
        seen["fixed" if held else "online"] += 1
        return held

    monkeypatch.setattr(nb._Bounds, "fixed_shift", spy)
    return seen


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("options", [{}, dict(causal=True), dict(window=(70, 20)), dict(dropout_p=0.25, seed=3)],
                         ids=["plain", "causal", "window", "dropout"])
def test_fixed_shift_where_scores_are_bounded(monkeypatch, dtype, options):
    """Query tiles whose scores |q||k| bounds take shift 0 (no row max, masks applied after exp; from the first key
    tile where every row sees two keys in it, else from the second): within the rule of the float64 reference;
    inputs whose bound allows overflow keep the online max."""
    seen = _count_fixed(monkeypatch)
    q, k, v, do = rng_arrays(5, (1, 300, 4, 32), (1, 260, 2, 32), (1, 260, 2, 32), (1, 300, 4, 32), dtype=dtype)
    case = Case(q, k, v, do, options)
    out, lse, *grads = _blocked(case, 64, 48)
    check_forward(lambda *a, **o: (out, lse), case)  # with dropout too: the reference draws the same keep-mask
    check_backward(lambda *a, **o: grads, case, out, lse)
    assert seen["fixed"] > 0
    assert seen["online"] == 0 or "window" in options  # a window's first tile leaves some rows without a key
    big = Case((q * 1e3).astype(dtype), k, v, do, options)  # |S| bound past the exponent range: online max
    out, lse, *grads = _blocked(big, 64, 48)
    check_forward(lambda *a, **o: (out, lse), big)
    assert seen["online"] > 0 and np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_first_diagonal_tile_shifts_by_zero_after_its_first_strip(monkeypatch, dtype):
    """A causal call's first query tile is one diagonal tile, cut into strips: only the strip that holds the row
    seeing one key takes the online max; the others shift by 0 (the masking pass after ``exp``). That row returns
    its key's value exactly, the rest is held to the rule."""
    online = []
    real = nb._mask_scores

    def spy(s, masks, tile, chunk, fill=-np.inf):
        if fill == -np.inf:  # before the row max: the online path
            online.append((tile.i0, tile.i1))
        return real(s, masks, tile, chunk, fill)

    monkeypatch.setattr(nb, "_mask_scores", spy)
    q, k, v, do = rng_arrays(8, (1, 256, 2, 16), (1, 256, 2, 16), (1, 256, 2, 16), (1, 256, 2, 16), dtype=dtype)
    case = Case(q, k, v, do, dict(causal=True))
    p = make_problem(q, k, v, causal=True)
    out, lse = nb.forward(p, schedule=Schedule.for_problem(p, 256, 256))  # one tile: strips of nb.STRIP_ROWS rows
    assert online and set(online) == {(0, nb.STRIP_ROWS)}
    out = p.unflatten(out, q.shape[1:])
    assert np.array_equal(out[0, 0], v[0, 0])
    check_forward(lambda *a, **o: (out, p.unflatten(lse, (2, 256))), case)


def test_fixed_shift_refuses_non_finite_inputs(monkeypatch):
    """A NaN or infinity anywhere in K or V fails the bound, so non-finite values keep their online semantics."""
    seen = _count_fixed(monkeypatch)
    q, k, v = rng_arrays(6, (1, 200, 1, 16), (1, 200, 1, 16), (1, 200, 1, 16))
    for x, value in ((k, np.inf), (v, np.nan), (v, np.inf)):
        x[0, 150, 0, 3] = value
        p = make_problem(q, k, v)
        nb.forward(p, block_q=64, block_k=64)
        x[0, 150, 0, 3] = 0.0
    assert seen["fixed"] == 0 and seen["online"] >= 3 * 4


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(30, 7)), dict(causal=True, seqlens="ragged"),
                                     dict(block_mask="strided")], ids=["causal", "window", "lengths", "block_mask"])
def test_strips_cover_every_visible_element(options):
    """Schedule tiles cut into row strips (_Masks.strips): every visible element lies in exactly one strip, a strip
    marked full sees all its elements, and a causal diagonal tile computes (n + 1) / 2n of its elements."""
    q, k, v = rng_arrays(3, (2, 200, 2, 8), (2, 170, 1, 8), (2, 170, 1, 8))
    if options.get("seqlens") == "ragged":
        options = dict(causal=True, seqlens_q=np.array([200, 77]), seqlens_k=np.array([150, 170]))
    if options.get("block_mask") == "strided":
        options = dict(block_mask=BlockMask.strided(200, 170, stride=3, block=(8, 8)))
    p = make_problem(q, k, v, **options)
    sched = Schedule.for_problem(p, 64, 48)
    masks, chunk = nb._Masks(sched, p), (slice(0, 2), slice(0, 1))
    cut_any = False
    for _, row in sched.rows():
        for tile in row:
            keep = sched.element_mask(tile).any(axis=(0, 1))
            covered = np.zeros_like(keep, dtype=int)
            for t in masks.strips(tile, chunk, rows=16):
                part = (slice(t.i0 - tile.i0, t.i1 - tile.i0), slice(t.k0 - tile.k0, t.k1 - tile.k0))
                covered[part] += 1
                if t.full:
                    assert sched.element_mask(t).all()
            assert covered.max() <= 1 and (covered[keep] == 1).all()
            cut_any |= covered.sum() < covered.size
    assert cut_any
    diag = Schedule(512, 512, 512, 512, right=0)
    tile, = diag.row(0)
    strips = nb._Masks(diag, make_problem(*rng_arrays(0, (1, 512, 1, 8), (1, 512, 1, 8), (1, 512, 1, 8)),
                                          causal=True)).strips(tile, chunk, rows=128)
    assert sum((t.i1 - t.i0) * (t.k1 - t.k0) for t in strips) == 512 * 512 * 5 // 8


def test_band_masks_kept_across_calls_are_each_tiles_own():
    """_Masks keeps the masks of band tiles across calls, keyed by shape and offset from the diagonal (_band): for
    problems of other lengths, alignments and windows in one process, every partial tile's mask is its element mask,
    read-only; the diagonal tiles of two causal problems of other lengths share one kept object."""
    chunk = (slice(0, 1), slice(0, 1))
    partial = 0
    for sq, sk, window in [(200, 170, (None, 0)), (170, 200, (None, 0)), (200, 200, (30, 7)), (137, 300, (5, None)),
                           (200, 170, (None, 0))]:
        p = make_problem(*rng_arrays(1, (1, sq, 1, 4), (1, sk, 1, 4), (1, sk, 1, 4)), window=window)
        sched = Schedule.for_problem(p, 64, 48)
        masks = nb._Masks(sched, p)
        for _, row in sched.rows():
            for tile in (t for t in row if not t.full):
                mask = masks._mask(tile, chunk)
                np.testing.assert_array_equal(mask.hidden.reshape(tile.i1 - tile.i0, tile.k1 - tile.k0),
                                              ~sched.element_mask(tile)[0, 0])
                assert not mask.hidden.flags.writeable
                partial += 1
    assert partial > 20
    diagonal = []
    for n in (256, 512):
        p = make_problem(*rng_arrays(2, (1, n, 1, 4), (1, n, 1, 4), (1, n, 1, 4)), causal=True)
        sched = Schedule.for_problem(p, 64, 64)
        tile = list(sched.row(1))[-1]
        diagonal.append(nb._Masks(sched, p)._mask(tile, chunk))
    assert diagonal[0] is diagonal[1]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_clamp_is_exact_where_it_matters(dtype):
    """_exp: arguments at or below the smallest one with a normal result give exactly 0 (-inf included, NaN stays
    NaN); the others are exp to the last bit where the smallest normal number is below their rounding, and off
    by at most that number near it."""
    p = make_problem(*rng_arrays(0, (1, 4, 1, 8), (1, 4, 1, 8), (1, 4, 1, 8), dtype=dtype))
    rule = nb._exp_rule(p, np.dtype(dtype), p.q)
    assert rule.floor is not None
    x = np.array([-np.inf, -1e4, rule.floor, rule.floor + 1, -3.25, -1e-3, 0.0, np.nan], dtype=dtype)
    want = rule.exp(x)
    want[:3] = 0
    got = nb._exp(x.copy(), rule)
    np.testing.assert_array_equal(got[:3], 0)
    np.testing.assert_array_equal(got[4:], want[4:])
    assert 0 < got[3] < want[3] and want[3] - got[3] <= rule.exp(rule.floor) * (1 + 4 * np.finfo(dtype).eps)


# ----------------------------------------------------------------------------- tile sizes
TILES = [(16, 16), (16, 64), (64, 16), (32, 48), (7, 5), (1, 3), (256, 512)]


def _blocked(case, block_q, block_k):
    """Backend forward + backward at the given tile size, reshaped to the public layout."""
    p = make_problem(case.q, case.k, case.v, **case.options)
    lay = nb.layout(p, block_q, block_k)  # a BlockMask rounds tiles to whole mask blocks
    sched = Schedule.for_problem(p, lay.block_q, lay.block_k)
    out, lse = nb.forward(p, schedule=sched)
    out = p.unflatten(out, p.q.shape[1:])
    lse = p.unflatten(lse, (p.heads_q, p.seqlen_q))
    dq, dk, dv = nb.backward(p, case.dout.reshape((p.batch,) + p.q.shape[1:]), out.reshape(p.q.shape),
                             lse.reshape(p.batch, p.heads_q, p.seqlen_q), schedule=sched)
    return (out, lse, p.unflatten(dq, p.q.shape[1:]), p.unflatten(dk, p.k.shape[1:]),
            p.unflatten(dv, p.v.shape[1:]))


@pytest.mark.parametrize("block_q, block_k", TILES, ids=[f"{a}x{b}" for a, b in TILES])
@settings(max_examples=max(2, N_EXAMPLES // 2))
@given(case=attention_cases(dtypes=("float32", "float64"), max_seqlen=100, max_head_dim=24))
def test_tile_sizes(block_q, block_k, case):
    out, lse, *grads = _blocked(case, block_q, block_k)
    check_forward(lambda *a, **o: (out, lse), case)
    check_backward(lambda *a, **o: grads, case, out, lse)
    # the direct call agrees with the keyword tile-size arguments
    p = make_problem(case.q, case.k, case.v, **case.options)
    out2, _ = nb.forward(p, block_q=block_q, block_k=block_k)
    np.testing.assert_array_equal(out2, out.reshape(out2.shape))


def _rising_scores(offset, rise, n=96, dtype=np.float32, seed=0):
    """A case whose scores start near ``offset`` and climb along the keys by ``rise`` per 16-key tile.

    Stresses the running max: with a rise of 20 per tile l_i would pass 1/eps without rescaling, with
    200 exp(S - m) overflows unless m is the max so far; a first tile far from 0 tests the first m_i.
    """
    rng = np.random.default_rng(seed)
    d = 8
    q = rng.standard_normal((1, n, 2, d))
    q[..., 0] = np.abs(q[..., 0]) + 1  # every query leans on feature 0, so scores follow k[..., 0]
    k = rng.standard_normal((1, n, 2, d))
    k[..., 0] = ((offset + np.arange(n) * rise / 16) * np.sqrt(d))[None, :, None]
    v, dout = (rng.standard_normal((1, n, 2, d)) for _ in range(2))
    return Case(*(x.astype(dtype) for x in (q, k, v, dout)), options={})


RISES = [(0, 0), (0, 20), (0, 200), (0, 2000), (-1000, 0), (1000, -200)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset, rise", RISES, ids=[f"{a}{b:+}" for a, b in RISES])
@pytest.mark.parametrize("options", [{}, dict(causal=True), dict(window=(40, 0))], ids=["plain", "causal", "window"])
def test_running_max_over_extreme_score_ranges(offset, rise, dtype, options):
    case = _rising_scores(offset, rise, dtype=dtype)
    case.options.update(options)
    out, lse, *grads = _blocked(case, 16, 16)
    check_forward(lambda *a, **o: (out, lse), case)
    check_backward(lambda *a, **o: grads, case, out, lse)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_tile_kinds_are_exercised():
    """The tile-size tests above meet all three kinds of tile: full, partial (masked), skipped."""
    q, k, v = rng_arrays(1, (100, 2, 8), (90, 1, 8), (90, 1, 8))
    p = make_problem(q, k, v, causal=True, window=(40, None))
    tiles = [t for _, row in Schedule.for_problem(p, 16, 16).rows() for t in row]
    n_grid = -(-100 // 16) * -(-90 // 16)
    kinds = {t.full for t in tiles}
    assert kinds == {True, False} and len(tiles) < n_grid
    # ragged last tiles
    assert any(t.i1 - t.i0 < 16 for t in tiles) and any(t.k1 - t.k0 < 16 for t in tiles)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(5, 3)),
                                     dict(block_mask="strided")], ids=["causal", "window", "block_mask"])
def test_skipped_tiles_are_not_computed(options):
    """A key tile no row of a query tile sees is never touched: a NaN in its values (which
    0·NaN would spread to every row that computes with it) leaves those rows exact."""
    s, d, tile = 64, 8, 16
    q, k, v = rng_arrays(2, (s, 1, d), (s, 1, d), (s, 1, d), dtype=np.float64)
    if options.get("block_mask") == "strided":
        options = dict(block_mask=BlockMask.strided(s, stride=2, block=(tile, tile)))
    p = make_problem(q, k, v, **options)
    sched = Schedule.for_problem(p, tile, tile)
    visited = {(t.i0, t.k0) for _, row in sched.rows() for t in row}
    # the last key tile, poisoned
    v_bad = v.copy()
    v_bad[s - tile:] = np.nan
    out, _ = nb.forward(make_problem(q, k, v_bad, **options), schedule=sched)
    ref = reference.attention(q, k, v, **options)
    clean_rows = [i for i0 in range(0, s, tile) if (i0, s - tile) not in visited for i in range(i0, i0 + tile)]
    assert clean_rows, "the setup must skip at least one tile"
    assert np.isfinite(out[0, clean_rows]).all()
    mag = reference.term_magnitudes(q, k, v, **options)["out"]
    np.testing.assert_allclose(out[0, clean_rows], ref[clean_rows], rtol=0, atol=2 * np.finfo(np.float64).eps * mag)


# ----------------------------------------------------------------------------- threads
def _run_all(monkeypatch, threads, p, dout, block):
    monkeypatch.setenv("CUFLASH_NUM_THREADS", str(threads))
    out, lse = nb.forward(p, block_q=block, block_k=block)
    return (out, lse) + tuple(nb.backward(p, dout, out, lse, block_q=block, block_k=block))


def _thread_problem(dtype=np.float32):
    # many key tiles so that two workers each own several
    q, k, v, do = rng_arrays(3, (2, 300, 4, 32), (2, 260, 2, 32), (2, 260, 2, 32), (2, 300, 4, 32), dtype=dtype)
    p = make_problem(q, k, v, window=(100, 40), seqlens_k=np.array([260, 200]))
    return p, do


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_threads_forward_bitwise(monkeypatch, dtype):
    p, do = _thread_problem(dtype)
    one = _run_all(monkeypatch, 1, p, do, 16)[:2]
    two = _run_all(monkeypatch, 2, p, do, 16)[:2]
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


def test_threads_same_count_reproducible(monkeypatch):
    p, do = _thread_problem()
    first, second = (_run_all(monkeypatch, 2, p, do, 16) for _ in range(2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_threads_backward_bitwise(monkeypatch):
    p, do = _thread_problem()
    one = _run_all(monkeypatch, 1, p, do, 16)
    two = _run_all(monkeypatch, 2, p, do, 16)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), one, two):
        assert np.array_equal(a, b), f"{name} differs between 1 and 2 threads"


# ----------------------------------------------------------------------------- zero lengths
ZERO_SHAPES = {
    "sq0": ((2, 0, 4, 8), (2, 5, 2, 8)),
    "sk0": ((2, 5, 4, 8), (2, 0, 2, 8)),
    "both0": ((2, 0, 4, 8), (2, 0, 2, 8)),
    "batch0": ((0, 3, 5, 2, 8), (0, 3, 6, 1, 8)),
}


@pytest.mark.parametrize("name", ZERO_SHAPES)
@pytest.mark.parametrize("options", [{}, dict(causal=True), dict(window=(1, 2))], ids=["plain", "causal", "window"])
def test_zero_lengths(name, options):
    shape_q, shape_k = ZERO_SHAPES[name]
    q, k, v, do = rng_arrays(4, shape_q, shape_k, shape_k, shape_q)
    out, lse = forward(q, k, v, **options)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == shape_q[:-3] + (shape_q[-2], shape_q[-3]) and lse.dtype == np.float32
    # a row with no key at all: out = 0, lse = -inf
    assert np.all(out == 0) and np.all(lse == -np.inf)
    dq, dk, dv = backward(do, q, k, v, out, lse, **options)
    for g, x in zip((dq, dk, dv), (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and np.all(g == 0)


def test_zero_seqlens():
    q, k, v, do = rng_arrays(5, (3, 7, 2, 8), (3, 9, 2, 8), (3, 9, 2, 8), (3, 7, 2, 8))
    opts = dict(seqlens_q=np.array([0, 7, 3]), seqlens_k=np.array([9, 0, 4]))
    out, lse = forward(q, k, v, **opts)
    assert np.all(out[:2] == 0) and np.all(lse[:2] == -np.inf)
    assert np.all(out[2, 3:] == 0) and np.all(lse[2, :, 3:] == -np.inf)
    assert np.isfinite(lse[2, :, :3]).all()
    dq, dk, dv = backward(do, q, k, v, out, lse, **opts)
    assert np.all(dq[:2] == 0) and np.all(dk[:2] == 0) and np.all(dv[:2] == 0)


# ----------------------------------------------------------------------------- rows that see nothing
DEAD_ROWS = {
    # causal with Sq > Sk: the first Sq - Sk rows precede every key
    "causal_long_q": (dict(causal=True), 40, 25),
    # a window entirely left of the keys for the first rows
    "window_left_open": (dict(window=(None, 0)), 30, 10),
    "window_band": (dict(window=(0, 0)), 50, 20),
    "seqlens": (dict(seqlens_q=np.array([13, 0]), seqlens_k=np.array([20, 17]), causal=True), 30, 20),
}


@pytest.mark.parametrize("name", DEAD_ROWS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_that_see_nothing(name, dtype):
    options, sq, sk = DEAD_ROWS[name]
    q, k, v, do = rng_arrays(6, (2, sq, 2, 16), (2, sk, 1, 16), (2, sk, 1, 16), (2, sq, 2, 16), dtype=dtype)
    dead = ~make_problem(q, k, v, **options).visible_mask().any(axis=-1)  # (B, H|1, Sq)
    dead = np.broadcast_to(dead, (2, 2, sq))
    assert dead.any() and not dead.all()
    out, lse = forward(q, k, v, **options)
    dead_o = dead.transpose(0, 2, 1)  # (B, Sq, H)
    assert np.all(out[dead_o] == 0) and np.all(lse[dead] == -np.inf)
    assert np.isfinite(lse[~dead]).all()
    dq, dk, dv = backward(do, q, k, v, out, lse, **options)
    assert np.all(dq[dead_o] == 0)
    # dead rows contribute nothing: neither their dout nor their q moves dk, dv (bitwise)
    do2, q2 = do.copy(), q.copy()
    do2[dead_o] = 7.0
    q2[dead_o] = -3.0
    out2, lse2 = forward(q2, k, v, **options)
    np.testing.assert_array_equal(out2, out)
    _, dk2, dv2 = backward(do2, q2, k, v, out2, lse2, **options)
    np.testing.assert_array_equal(dk2, dk)
    np.testing.assert_array_equal(dv2, dv)


# ----------------------------------------------------------------------------- NaN / Inf
def _poisoned(where, value, j=20, causal=True):
    q, k, v = rng_arrays(7, (1, 40, 1, 8), (1, 40, 1, 8), (1, 40, 1, 8), dtype=np.float64)
    arrays = dict(q=q, k=k, v=v)
    arrays[where] = arrays[where].copy()
    arrays[where][0, j, 0, 3] = value
    return (q, k, v), (arrays["q"], arrays["k"], arrays["v"])


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_non_finite_inputs_do_not_crash(where, value):
    """Non-finite where the reference is, and within the rule of the (long double) reference where it is finite."""
    clean, (q, k, v) = _poisoned(where, value)
    with np.errstate(all="ignore"):
        out, lse = forward(q, k, v, causal=True)
        grads = backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    assert out.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    # IEEE: what the reference's float64 arithmetic makes NaN or infinite, so does the backend
    with np.errstate(all="ignore"):
        ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    if value != value:  # a NaN input: NaN lse exactly where the reference has one
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    with np.errstate(all="ignore"):  # the gradients: NaN and infinite exactly where the reference's are
        refs = reference.attention_backward(np.ones_like(out), q, k, v, causal=True)
    for g, r in zip(grads, refs):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
        np.testing.assert_array_equal(np.isinf(g), np.isinf(r))
    # (a +inf score makes lse +inf in the reference's direct sum and NaN after the running-max
    # subtraction, inf - inf: both are non-finite, neither is wrong)
    # The finite entries: the rule against the long double reference of the same (poisoned) inputs, the float64 one
    # the naive baseline. The magnitudes are the poisoned inputs' terms, or the clean inputs' where the poison makes
    # them non-finite (an infinite V in out's terms).
    do = np.ones_like(out)
    with np.errstate(all="ignore"):
        wide = reference.attention(q, k, v, causal=True, return_lse=True, compute_dtype=np.longdouble)
        wide += reference.attention_backward(do, q, k, v, causal=True, compute_dtype=np.longdouble)
        mags = reference.term_magnitudes(q, k, v, do, causal=True)
    clean_mags = reference.term_magnitudes(*clean, do, causal=True)
    for n, (name, x, r, b) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + grads, wide,
                                            (ref, ref_lse) + refs)):
        fin = np.isfinite(r)
        mag = mags[name] if np.isfinite(mags[name]) else clean_mags[name]
        assert_attention_close(x[fin], r[fin], b[fin], mult=2 if n < 2 else 3, name=name, magnitude=mag)


@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_row_poisons_only_rows_that_see_it(where):
    """A NaN in key row j (causal) poisons the out rows i >= j; a NaN in query row j only row j."""
    j = 20
    (q0, k0, v0), (q, k, v) = _poisoned(where, np.nan, j)
    with np.errstate(invalid="ignore"):
        out, lse = forward(q, k, v, causal=True)
    clean, clean_lse = forward(q0, k0, v0, causal=True)
    hit = np.arange(40) >= j if where == "k" else np.arange(40) == j
    assert np.isnan(out[0, hit]).all()
    assert not np.isnan(out[0, ~hit]).any()
    np.testing.assert_array_equal(out[0, ~hit], clean[0, ~hit])
    np.testing.assert_array_equal(lse[0][:, ~hit], clean_lse[0][:, ~hit])


def test_nan_key_row_lse():
    (_, _, _), (q, k, v) = _poisoned("k", np.nan, 20)
    with np.errstate(invalid="ignore"):
        _, lse = forward(q, k, v, causal=True)
    assert np.isnan(lse[0, 0, 20:]).all(), f"lse of rows that see a NaN key: {lse[0, 0, 20:]}"


# ----------------------------------------------------------------------------- layout
def test_non_contiguous_inputs():
    """Strided views (transposed batch dims) give the copies' result, to a rounding (BLAS may
    block a strided operand differently)."""
    q, k, v, do = rng_arrays(8, (33, 3, 2, 4, 16), (40, 3, 2, 2, 16), (40, 3, 2, 2, 16), (3, 2, 33, 4, 16))
    views = [x.transpose(1, 2, 0, 3, 4) for x in (q, k, v)]
    copies = [np.ascontiguousarray(x) for x in views]
    assert not views[0].flags.c_contiguous
    mags = reference.term_magnitudes(*copies, do, causal=True)
    u = np.finfo(np.float32).eps
    results = []
    for qq, kk, vv in (views, copies):
        out, lse = forward(qq, kk, vv, causal=True)
        results.append((out, lse) + tuple(backward(do, qq, kk, vv, out, lse, causal=True)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
        fin = np.isfinite(b)
        np.testing.assert_allclose(a[fin], b[fin], rtol=0, atol=2 * u * mags[name], err_msg=name)


def test_default_backend_is_numpy():
    q, k, v = rng_arrays(9, (2, 5, 2, 8), (2, 6, 1, 8), (2, 6, 1, 8))
    np.testing.assert_array_equal(cuflash.attention(q, k, v), cuflash.attention(q, k, v, backend="numpy"))


def test_together_runs_each_part_once_on_every_worker_that_asks():
    """A block's preparation (nb._Together): the workers that ask at once share its parts, each part runs once, and
    every one of them gets the same finished value."""
    import threading

    ran, barrier = [], threading.Barrier(4)

    def part(n):
        ran.append((n, threading.get_ident()))
        return n * n

    together = nb._Together([lambda n=n: part(n) for n in range(16)], lambda results: sum(results))
    got = []

    def worker():
        barrier.wait()
        got.append(together())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(n for n, _ in ran) == list(range(16))
    assert got == [sum(n * n for n in range(16))] * 4


def test_together_raises_a_part_error_in_every_worker():
    import threading

    def bad():
        raise ValueError("part failed")

    together = nb._Together([lambda: 1, bad, lambda: 2], lambda results: results)
    errors = []

    def worker():
        try:
            together()
        except ValueError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == ["part failed"] * 3


def test_a_nonfinite_value_leaves_other_blocks_of_heads_bitwise_unchanged():
    """Whether an input holds an infinity is decided per block of heads (the guarded products of _seen_product): the
    heads of the other blocks keep the bits, forward and backward, that they have when every input is finite."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1024, 8, 64)).astype(np.float32) for _ in range(3))
    chunks = nb.layout(make_problem(q, k, v)).chunks
    assert len(chunks) > 1, chunks
    hs = chunks[0][1]
    bad = v.copy()
    bad[0, 7, hs.start, 3] = np.inf
    (out, lse), (bad_out, bad_lse) = forward(q, k, v), forward(q, k, bad)
    others = [h for h in range(8) if not hs.start <= h < hs.stop]
    np.testing.assert_array_equal(bad_out[:, :, others], out[:, :, others])
    assert not np.isfinite(bad_out[:, :, hs.start]).all()
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads, bad_grads = backward(dout, q, k, v, out, lse), backward(dout, q, k, bad, bad_out, bad_lse)
    for g, bad_g in zip(grads, bad_grads):
        np.testing.assert_array_equal(bad_g[:, :, others], g[:, :, others])


def test_a_call_leaves_nothing_for_the_cycle_collector():
    """What a call allocates is freed when it returns, by reference counting alone: a reference cycle (a block's
    preparation reaching back to the cache that holds it) kept each call's copies of K^T alive until the cycle
    collector ran, so that ring attention's peak grew with its number of steps."""
    import gc

    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 1024, 4, 64)).astype(np.float32) for _ in range(4))
    out, lse = forward(q, k, v, causal=True)
    gc.collect()
    gc.disable()
    try:
        out, lse = forward(q, k, v, causal=True)
        assert gc.collect() == 0
        backward(dout, q, k, v, out, lse, causal=True)
        assert gc.collect() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rows_that_see_nothing_raise_no_floating_point_warnings(dtype):
    """Finite inputs where some query rows see no key (causal with seqlen_q > seqlen_k: lse = -inf there): forward
    and backward give those rows 0 and their gradients 0 without an invalid operation on the way (the backward
    carries a finite lse through its score product, never an infinite one into BLAS)."""
    import warnings

    rng = np.random.default_rng(6)
    # small: the products go to NumPy's matmul, which reports BLAS's floating-point flags (MKL's calls do not)
    q, dout = (rng.standard_normal((1, 100, 2, 16)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, 40, 2, 16)).astype(dtype) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out, lse = forward(q, k, v, causal=True)
        dq, dk, dv = backward(dout, q, k, v, out, lse, causal=True)
    blind = np.isneginf(lse[0, 0])
    assert blind.any() and not blind.all()
    assert not out[0, blind, 0].any() and not dq[0, blind, 0].any()
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


def _dtype(name):
    return np.dtype(pytest.importorskip("ml_dtypes").bfloat16) if name == "bfloat16" else np.dtype(name)


@pytest.mark.parametrize("name, big", [("float32", 2e38), ("bfloat16", 1.99e38), ("float64", 1e308)])
def test_v_near_the_dtypes_largest_does_not_overflow_the_accumulator(name, big):
    """FA2's acc = sum_j exp(S_j - m) V_j is divided by l only at the end: with V near the dtype's largest it
    overflowed to inf where the output, an average of rows of V, is an ordinary number; now V runs scaled by a
    power of two there. Held to the rule, causal and not."""
    rng = np.random.default_rng(0)
    dt = _dtype(name)
    q, k = (rng.standard_normal((1, 40, 2, 8)).astype(dt) for _ in range(2))
    v = (big * rng.uniform(0.5, 1.0, (1, 40, 2, 8))).astype(dt)
    dout = rng.standard_normal((1, 40, 2, 8)).astype(dt)
    for causal in (False, True):
        case = Case(q, k, v, dout, dict(causal=causal))
        out, lse = check_forward(lambda *a, **o: cuflash.attention(*a, **o, return_lse=True), case)
        assert np.isfinite(out.astype(np.float64)).all()


@pytest.mark.parametrize("name, kv, vexp", [("float32", 33.0, -120), ("bfloat16", 33.0, -120), ("float64", 600.0, -600)])
def test_v_whose_squares_vanish_is_not_taken_for_zero(name, kv, vexp):
    """The bounds take max|V| from V's row norms, computed in the working dtype: elements below 2^(e_min / 2) square
    to 0 there, and the norm of 0 was read as V = 0, nothing to keep normal, so the forward took shift 0 with
    scores near -U, where P V fell below the subnormals: out was 0 (7e5x the naive error in float32). A norm of 0
    now gives no shift-0 bound."""
    rng = np.random.default_rng(0)
    dt = _dtype(name)
    q = np.full((1, 600, 2, 1), -1.0).astype(dt)
    k = rng.uniform(kv, kv * 1.03, (1, 600, 2, 1)).astype(dt)
    v = (rng.standard_normal((1, 600, 2, 1)) * 2.0 ** vexp).astype(dt)
    case = Case(q, k, v, rng.standard_normal(q.shape).astype(dt), dict(scale=1.0))
    out, lse = check_forward(lambda *a, **o: cuflash.attention(*a, **o, return_lse=True), case)
    check_backward(cuflash.attention_backward, case, out, lse)


@pytest.mark.parametrize("op", ["forward", "backward"])
def test_a_problem_too_large_for_memory_fails_before_its_plan(op, monkeypatch):
    """A zero-stride batch of 2**30 costs no memory as input; its plan listed 2**28 blocks of (batch, head) pairs
    (minutes and gigabytes) before the outputs' allocation failed with a bare MemoryError. The outputs (forward) or
    an array of the rows (backward) come first now, and fail at once, saying how much."""
    x = np.broadcast_to(np.ones(1, np.float32), (2 ** 30, 512, 1, 8))
    lse = np.broadcast_to(np.zeros(1, np.float32), (2 ** 30, 1, 512))

    def no_plan(*args, **kwargs):
        raise AssertionError("the plan was built before the outputs")

    monkeypatch.setattr(nb, "layout", no_plan)
    with pytest.raises(MemoryError, match="Unable to allocate"):
        if op == "forward":
            cuflash.attention(x, x, x)
        else:
            cuflash.attention_backward(x, x, x, x, x, lse)


def test_a_zero_query_against_keys_whose_norms_overflow_raises_no_warning():
    """The shift-0 bound of a row is |q_i| times the keys' largest norm: 0 * inf for a zero row against float32 keys
    near the largest (their squares overflow) made NumPy warn of an invalid value; the NaN fails the test, as meant."""
    q = np.zeros((1, 600, 1, 1), np.float32)
    q[0, :300] = 1e-30
    k = np.full((1, 600, 1, 1), 3e38, np.float32)
    v = np.arange(600, dtype=np.float32).reshape(1, 600, 1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out, lse = cuflash.attention(q, k, v, scale=1e-37, return_lse=True)
        dq, dk, dv = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, scale=1e-37)
    # every key weighs alike: out is the mean of v (299.5), dV each key's weight 1/600 summed over 600 rows (1.0);
    # held to the rule, not a hand-set tolerance. (dq, dk: what this test is about is that they raise no warning.)
    do = np.ones_like(out)
    check_forward(lambda *a, **o: (out, lse), Case(q, k, v, do, dict(scale=1e-37)))
    ref_dv = reference.attention_backward(do, q, k, v, scale=1e-37, compute_dtype=np.float64)[2]
    base_dv = reference.attention_backward(do, q, k, v, scale=1e-37, compute_dtype=np.float32)[2]
    mag = reference.term_magnitudes(q, k, v, do, scale=1e-37)["dv"]
    assert_attention_close(dv, ref_dv, base_dv, mult=3, name="dv", magnitude=mag)


@pytest.mark.parametrize("pad", [1.0, 3e38])
def test_values_in_the_padding_do_not_set_the_forwards_range_of_v(pad):
    """Padding past seqlens_k is never read for its values: V's scale and the lower bound on max|V| of the shift-0
    test came from all of V, so a padding of ordinary (1.0: the bound) or huge (3e38: V scaled by 2^-k) values
    pushed the products of the sequence's tiny V into the subnormals (out 361x the naive error)."""
    rng = np.random.default_rng(0)
    if pad == 1.0:  # scores near -33 that the shift-0 test would take
        q = np.full((1, 600, 2, 1), -1.0, np.float32)
        k = rng.uniform(33.0, 34.0, (1, 1100, 2, 1)).astype(np.float32)
        v = (rng.standard_normal((1, 1100, 2, 1)) * 2.0 ** -120).astype(np.float32)
        scale = 1.0
    else:
        q, k, v = (rng.standard_normal((1, n, h, 32)).astype(np.float32) for n, h in ((600, 2), (1100, 1), (1100, 1)))
        v *= np.float32(2.0 ** -120)
        scale = None
    v[:, 800:] = pad
    case = Case(q, k, v, np.ones_like(q), dict(scale=scale, seqlens_k=np.array([800], np.int32)))
    check_forward(lambda *a, **o: cuflash.attention(*a, **o, return_lse=True), case)


@pytest.mark.parametrize("name, qv, kv, scale", [("float32", 3e38, 1e-38, None), ("bfloat16", 3e38, 1e-38, None),
                                                 ("float32", 2e38, 1e-37, 2.0), ("float64", 1e308, 1e-307, 2.0)])
def test_q_near_the_dtypes_largest_is_not_scaled_into_an_overflow(name, qv, kv, scale):
    """The scale (times log2 e for float32) was folded into Q before Q K^T: q = 3e38 overflowed to inf and the
    output to NaN, where scale * (q . k) is 3. A factor above 1 that could overflow Q now scales the score tiles."""
    dt = _dtype(name)
    q = np.full((1, 1, 1, 1), qv).astype(dt)
    k = np.array([kv, -kv]).reshape(1, 2, 1, 1).astype(dt)
    v = np.array([1.0, 2.0]).reshape(1, 2, 1, 1).astype(dt)
    case = Case(q, k, v, np.ones_like(q), dict(scale=scale))
    out, lse = check_forward(lambda *a, **o: cuflash.attention(*a, **o, return_lse=True), case)
    if name != "float64":  # there the rule's own term magnitudes (|dS| |Q|, in float64) overflow: no bound to hold
        check_backward(cuflash.attention_backward, case, out, lse)
    assert np.isfinite(lse).all()


def _nonfinite_case(name, rows):
    """float64 problems where V's infinity or NaN meets a weight at the edge of the range (the reference is the naive
    float64 computation): the NaN and inf of the output must be the reference's, the rest held to the rule."""
    d = 4
    q = np.zeros((1, rows, 1, d))
    q[..., 0] = 1.0
    if name == "nan-at-subnormal-weight":  # weight exp(-720): subnormal, not 0, in float64: NaN * w is NaN
        k = np.zeros((1, 2, 1, d))
        k[0, 0, 0, 0] = -720.0
        v = np.ones((1, 2, 1, d))
        v[0, 0, 0, 0] = np.nan
    elif name == "inf-then-far-larger-max":  # a later tile 800 higher: the earlier weights are exactly 0
        k = np.zeros((1, 1024, 1, d))
        k[0, 512:, 0, 0] = 800.0
        v = np.ones((1, 1024, 1, d))
        v[0, 0, 0, 0] = np.inf
    else:  # "inf-beside-v-near-max": one infinity must not switch off the scaling of V's finite values
        rng = np.random.default_rng(0)
        q, k = (0.1 * rng.standard_normal((1, 64, 1, d)) for _ in range(2))
        v = np.ones((1, 64, 1, d))
        v[..., 1] = np.finfo(np.float64).max / 8
        v[0, 5, 0, 0] = np.inf
    return q, k, v


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("name", ["nan-at-subnormal-weight", "inf-then-far-larger-max", "inf-beside-v-near-max"])
def test_nonfinite_values_at_the_edges_of_the_range(name, rows):
    """The clamp of exp made a subnormal weight 0 and dropped the NaN it carries; a rescale by alpha = 0 turned an
    accumulated inf into NaN (inf * 0) where the reference, whose weight is exactly 0, is finite; an infinity in V
    switched off the scaling of V near the dtype's largest, so the finite columns overflowed."""
    q, k, v = _nonfinite_case(name, rows)
    options = dict(scale=1.0) if name != "inf-beside-v-near-max" else {}
    with np.errstate(all="ignore"):
        out = cuflash.attention(q, k, v, backend="numpy", **options)
        ref = reference.attention(q, k, v, **options)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    with np.errstate(all="ignore"):  # the rule: against long double, 2x the naive float64 computation's error
        exact = reference.attention(q, k, v, compute_dtype=np.longdouble, **options)
    ruled = np.isfinite(ref) & np.isfinite(exact)
    assert_attention_close(out[ruled], exact[ruled], ref[ruled])
    # where long double still sees the infinity (its exp(-800) is no 0), float64's range decides: the naive float64
    # computation's weight is exactly 0 there, and so is the backend's
    np.testing.assert_array_equal(out[np.isfinite(ref) & ~ruled], ref[np.isfinite(ref) & ~ruled])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_row_that_sees_one_key_returns_its_value_exactly_beside_longer_rows(dtype):
    """Row 0 of a causal sequence sees key 0 only: weight exp(0) = 1, the value exactly. Beside a shorter query
    sequence (seqlens_q, bottom-right aligned: its rows reach the next key tile) the item switched to shift 0 after
    its first tile and rescaled that row too, which then came back rounded in 13-14 of 64 elements."""
    rng = np.random.default_rng(0)
    n, d = 1024, 64
    q, k, v = (rng.standard_normal((2, n, 1, d)).astype(dtype) for _ in range(3))
    out = cuflash.attention(q, k, v, causal=True, seqlens_q=np.array([n, 600]), seqlens_k=np.array([n, n]),
                            backend="numpy")
    np.testing.assert_array_equal(out[0, 0, 0], v[0, 0, 0])


@pytest.mark.parametrize("threads", ["1", "2"])
def test_the_callers_floating_point_error_settings_change_nothing(monkeypatch, threads):
    """``np.seterr(all="raise")`` in the caller made ordinary calls raise FloatingPointError (underflow in a product,
    in exp2: the softmax's tail underflows as a rule), and warnings as errors made them raise RuntimeWarning: the
    workers run in copies of the caller's context, which holds NumPy's error state. The backend, the merge and the
    reference now ignore floating-point errors whatever the caller set (the algorithm handles what they would
    report), with the same bits; the caller's setting is as it was after the call."""
    monkeypatch.setenv("CUFLASH_NUM_THREADS", threads)
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((2, 600, 2, 16)).astype(np.float32) * 4 for _ in range(4))
    opts = dict(causal=True, seqlens_q=np.array([600, 300], np.int32), dropout_p=0.1, seed=1)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    grads = cuflash.attention_backward(do, q, k, v, out, lse, **opts)
    merged = cuflash.merge_attention_states([out, out], [lse, lse - 200])
    ref = cuflash.reference.attention(q, k, v, causal=True, compute_dtype=np.float32)
    old = np.seterr(all="raise")
    try:
        assert np.array_equal(ref, cuflash.reference.attention(q, k, v, causal=True, compute_dtype=np.float32))
        assert all(np.array_equal(a, b) for a, b in zip(
            (out, lse), cuflash.attention(q, k, v, return_lse=True, **opts)))
        assert all(np.array_equal(a, b) for a, b in zip(grads, cuflash.attention_backward(do, q, k, v, out, lse,
                                                                                          **opts)))
        assert all(np.array_equal(a, b) for a, b in zip(
            merged, cuflash.merge_attention_states([out, out], [lse, lse - 200])))
        assert np.geterr() == dict(divide="raise", over="raise", under="raise", invalid="raise")
    finally:
        np.seterr(**old)


def test_v_at_the_largest_float32_stays_finite():
    """Every row of V at float32's largest: each output is an average of them, that number. V runs at a power of two
    there (_v_scale), and acc / l rounded to 1 + ulp: 120 of 256 outputs came back inf (so in attention_varlen and
    attention_with_kvcache, the same forward). Now held to the rule, and the other two calls to the same bits."""
    big = np.finfo(np.float32).max
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 16, 2, 8)).astype(np.float32) for _ in range(2))
    v = np.full((1, 16, 2, 8), big, np.float32)
    case = Case(q, k, v, np.zeros_like(q))
    check_forward(lambda *a, **o: cuflash.attention(*a, return_lse=True, backend="numpy", **o), case)
    out = cuflash.attention(q, k, v, backend="numpy")
    cu = np.array([0, 16], np.int32)
    np.testing.assert_array_equal(cuflash.attention_varlen(q[0], k[0], v[0], cu, cu, backend="numpy"), out[0])
    np.testing.assert_array_equal(cuflash.attention_with_kvcache(q, k, v, cache_seqlens=np.array([16], np.int32),
                                                                 num_splits=1, backend="numpy"), out)
