"""Values that a result does not see never reach it, NaN and infinities included.

Padding (query rows past ``seqlens_q``, key rows past ``seqlens_k``) is never read by any backend. In the float64
reference and the NumPy backend a zero of P or dS contributes nothing to a product (IEEE's ``0 * inf`` would be
NaN), so a key that a mask hides from a row does not reach that row, nor a query row the keys it does not see.
(The CUDA kernels multiply whole tiles: there a non-finite key inside a tile reaches the rows of that tile that do
not see it, as in FlashAttention-2's kernels; padding is zero-filled on load.)

Each test poisons such positions and holds the results to the float64 reference of the clean inputs (the
tolerance rule of :func:`cuflash.testing.assert_attention_close`), with the poisoned reference equal, bit for bit,
to the clean one wherever it is finite.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference
from cuflash.problem import make_problem
from cuflash.testing import (Case, assert_attention_close, attention_cases, check_backward, check_forward,
                             reference_dtype)

N_EXAMPLES = settings.default.max_examples
POISONS = (np.nan, np.inf, -np.inf)


def _forward(backend, arrays):
    """``fn(q, k, v, **options) -> (out, lse)`` that runs on ``arrays`` (q, k, v) instead of its inputs."""
    return lambda q, k, v, **o: cuflash.attention(*arrays, return_lse=True, backend=backend, **o)


def _backward(backend, arrays):
    """``fn(dout, q, k, v, out, lse, **options)`` that runs on ``arrays`` (dout, q, k, v) instead."""
    return lambda dout, q, k, v, out, lse, **o: cuflash.attention_backward(*arrays, out, lse, backend=backend, **o)


def _poisoned(x, where, rng):
    """A copy of ``x`` with NaN, +inf or -inf (drawn per element) where ``where`` (broadcast to ``x``) holds."""
    y = x.copy()
    where = np.broadcast_to(where, x.shape)
    y[where] = rng.choice(np.array(POISONS, dtype=x.dtype), size=int(where.sum()))
    return y


def _padding(case, rng):
    """Per-sequence lengths for ``case`` (if it has none) and its arrays with the padding poisoned:
    ``(clean case, poisoned q, k, v, dout)``; the clean case has zeros there."""
    batch = case.q.shape[:-3]
    sq, sk = case.q.shape[-3], case.k.shape[-3]
    opts = dict(case.options)
    opts.setdefault("seqlens_q", rng.integers(0, sq + 1, size=batch).astype(np.int32))
    opts.setdefault("seqlens_k", rng.integers(0, sk + 1, size=batch).astype(np.int32))
    past_q = np.arange(sq) >= np.asarray(opts["seqlens_q"])[..., None]  # (*batch, Sq)
    past_k = np.arange(sk) >= np.asarray(opts["seqlens_k"])[..., None]
    pq, pk = past_q[..., None, None], past_k[..., None, None]
    clean = Case(*(np.where(m, x.dtype.type(0), x) for x, m in
                   ((case.q, pq), (case.k, pk), (case.v, pk), (case.dout, pq))), options=opts)
    poisoned = (_poisoned(clean.q, pq, rng), _poisoned(clean.k, pk, rng), _poisoned(clean.v, pk, rng),
                _poisoned(clean.dout, pq, rng))
    return clean, poisoned


def _reference_is_blind(clean, poisoned):
    """The reference on the poisoned inputs equals, bit for bit, the reference on the clean ones."""
    q, k, v, do = poisoned
    opts = {n: x for n, x in clean.options.items() if n not in ("dropout_p", "seed")}
    a = reference.attention(clean.q, clean.k, clean.v, return_lse=True, **opts)
    b = reference.attention(q, k, v, return_lse=True, **opts)
    a += reference.attention_backward(clean.dout, clean.q, clean.k, clean.v, **opts)
    b += reference.attention_backward(do, q, k, v, **opts)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b):
        assert np.array_equal(x, y), f"reference {name} reads padding"


@settings(max_examples=max(4, N_EXAMPLES // 4))
@given(attention_cases(dtypes=("float32", "float16"), max_seqlen=130, seqlens=False, modifiers=True, dropout=True),
       st.integers(0, 2**32 - 1))
def test_padding_is_never_read_numpy(case, seed):
    assume(case.q.ndim > 3)  # per-sequence lengths need a batch dimension
    rng = np.random.default_rng(seed)
    clean, (q, k, v, do) = _padding(case, rng)
    out, lse = check_forward(_forward("numpy", (q, k, v)), clean)
    check_backward(_backward("numpy", (do, q, k, v)), clean, out, lse)
    _reference_is_blind(clean, (q, k, v, do))


def test_padding_is_never_read_emulated():
    """The CUDA kernels (on the CPU emulator) load no padding: K/V past seqlens_k and Q/dO past seqlens_q are
    zero-filled in shared memory, and a row past its length gets D = 0 whatever its dO."""
    from cuflash import emulate

    ok, why = emulate.available()
    if not ok:
        pytest.skip(f"CPU emulation unavailable: {why}")
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((2, 150, 2, 64)).astype(np.float16) for _ in range(4))
    case = Case(q, k, v, do, dict(causal=True, seqlens_q=np.array([120, 90], np.int32),
                                  seqlens_k=np.array([100, 70], np.int32)))
    clean, (q, k, v, do) = _padding(case, rng)
    out, lse = check_forward(_forward("emulate", (q, k, v)), clean)
    check_backward(_backward("emulate", (do, q, k, v)), clean, out, lse)


@pytest.mark.parametrize("poison", ["max", "nan", "inf"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_padding_changes_no_bit_numpy(dtype, poison):
    """The NumPy backend's results of the sequences are bit for bit those of zero padding, whatever the padding
    holds: the largest finite values (their scores overflowed, which changed the bounds' decisions and so the last
    bits, and raised RuntimeWarnings: an exception for a caller running with warnings as errors), NaN or infinities
    (which sent the call down the guarded path: other bits again)."""
    rng = np.random.default_rng(8)
    q, k, v, do = (rng.standard_normal((2, 600, 2, 32)).astype(dtype) for _ in range(4))
    opts = dict(seqlens_q=np.array([300, 600], np.int32), seqlens_k=np.array([200, 600], np.int32))
    fill = dict(max=np.finfo(dtype).max, nan=np.nan, inf=-np.inf)[poison]
    q[0, 300:], k[0, 200:], v[0, 200:], do[0, 300:] = 0, 0, 0, 0
    hq, hk, hv, hdo = q.copy(), k.copy(), v.copy(), do.copy()
    hq[0, 300:], hk[0, 200:], hv[0, 200:], hdo[0, 300:] = fill, fill, fill, fill
    clean = cuflash.attention(q, k, v, return_lse=True, backend="numpy", **opts)
    clean += cuflash.attention_backward(do, q, k, v, *clean, backend="numpy", **opts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        poisoned = cuflash.attention(hq, hk, hv, return_lse=True, backend="numpy", **opts)
        poisoned += cuflash.attention_backward(hdo, hq, hk, hv, *poisoned, backend="numpy", **opts)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), poisoned, clean):
        assert np.array_equal(a, b), name


@pytest.mark.parametrize("poison_out", [False, True], ids=["lse", "lse_and_out"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_backward_reads_no_out_or_lse_of_padding_rows_numpy(dtype, poison_out):
    """lse (and out) rows past seqlens_q poisoned (a NaN lse there, beside a finite out, made every P of the row NaN,
    and through P^T dO and dS^T Q every dK and dV of the sequence): the same gradients, bit for bit, as from the
    forward's own. (A non-finite out sends the call down the guarded path, which masked them already.)"""
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((2, 70, 2, 16)).astype(dtype) for _ in range(4))
    opts = dict(seqlens_q=np.array([50, 3], np.int32), seqlens_k=np.array([70, 40], np.int32))
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy", **opts)
    clean = cuflash.attention_backward(do, q, k, v, out, lse, backend="numpy", **opts)
    past = np.arange(70) >= opts["seqlens_q"][:, None]  # (B, Sq)
    out_p = _poisoned(out, past[:, :, None, None], rng) if poison_out else out
    lse_p = _poisoned(lse, past[:, None, :], rng)
    lse_p[past[:, None, :].repeat(2, axis=1)] = np.nan  # NaN in every padding row's lse (the harshest of the three)
    with np.errstate(invalid="ignore"):
        poisoned = cuflash.attention_backward(do, q, k, v, out_p, lse_p, backend="numpy", **opts)
    for name, a, b in zip(("dq", "dk", "dv"), poisoned, clean):
        assert np.array_equal(a, b, equal_nan=True), name


def _seers(p, j):
    """Rows (B, Hq, Sq) that see key ``j`` of every batch entry and head."""
    return p.visible_mask()[..., j]


def test_reference_a_hidden_key_reaches_exactly_the_rows_that_see_it():
    """A NaN key and value reach the outputs of the rows that see them and the key gradients of the keys those rows
    see, nothing else: counted from the visibility rule in a window, a causal and a per-sequence-length problem."""
    rng = np.random.default_rng(5)
    for opts in (dict(window=(10, 0)), dict(causal=True), dict(window=(3, 5), seqlens_q=np.array([40, 25]))):
        q, k, v, do = (rng.standard_normal((2, 40, 2, 8)) for _ in range(4))
        j = 17
        k[:, j], v[:, j] = np.nan, np.nan
        p = make_problem(q, k, v, **opts)
        vis = p.visible_mask()  # (B, Hq, Sq, Sk)
        rows = vis[..., j]  # (B, Hq, Sq)
        keys = (vis & rows[..., None]).any(axis=-2)  # keys some poisoned row sees: (B, Hq, Sk)
        out = reference.attention(q, k, v, **opts)
        dq, dk, dv = reference.attention_backward(do, q, k, v, **opts)
        for name, x, expect in (("out", out, rows), ("dq", dq, rows), ("dk", dk, keys), ("dv", dv, keys)):
            bad = ~np.isfinite(x).all(axis=-1).transpose(0, 2, 1)  # (B, H, S)
            assert np.array_equal(bad, np.broadcast_to(expect, bad.shape)), f"{opts}: {name}"
        assert rows.any() and not rows.all()


def _independent(case, opts, i, j):
    """Masks, shaped as ``out``, ``lse``, ``dq``, ``dk``, ``dv``, of the results that do not depend on the query
    rows ``i`` (a tuple; Q and dO) nor on key ``j`` (K and V): rows that see neither, keys no dependent row sees."""
    p = make_problem(case.q, case.k, case.v, **opts)
    b, hq, hkv, sq, sk = p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k
    vis = np.broadcast_to(p.visible_mask(), (b, hq, sq, sk))
    rows = vis[..., j].copy()
    rows[..., list(i)] = True  # (B, Hq, Sq)
    keys = (vis & rows[..., None]).any(axis=-2).reshape(b, hkv, hq // hkv, sk).any(axis=2)
    keys[..., j] = True  # (B, Hkv, Sk)
    row_major = ~rows.transpose(0, 2, 1)[..., None]
    key_major = ~keys.transpose(0, 2, 1)[..., None]
    masks = (row_major, ~rows, row_major, key_major, key_major)
    shapes = (case.q.shape, case.q.shape[:-3] + (hq, sq), case.q.shape, case.k.shape, case.k.shape)
    return [np.broadcast_to(m, (b,) + sh[len(sh) - m.ndim + 1:]).reshape(sh) for m, sh in zip(masks, shapes)]


@settings(max_examples=max(4, N_EXAMPLES // 4))
@given(attention_cases(dtypes=("float32", "float64"), max_seqlen=140, dropout=True), st.integers(0, 2**32 - 1))
def test_hidden_keys_and_rows_do_not_leak_numpy(case, seed):
    """Poison one key (K and V) and one query row (Q and dO): the NumPy backend's results are non-finite exactly
    where the reference's are; results that depend on neither (by the visibility rule) are, in the reference,
    bit for bit those of the clean inputs, and in the backend within the rule against them."""
    from cuflash.testing import _reference_options

    rng = np.random.default_rng(seed)
    i, i2, j = rng.integers(case.q.shape[-3], size=2).tolist() + [rng.integers(case.k.shape[-3])]
    q, k, v, do = (x.copy() for x in (case.q, case.k, case.v, case.dout))
    k[..., j, :, :], v[..., j, :, :] = rng.choice(POISONS), rng.choice(POISONS)
    q[..., i, :, :], do[..., i2, :, :] = rng.choice(POISONS), rng.choice(POISONS)  # one row or two
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy", **case.options)
    got = (out, lse) + cuflash.attention_backward(do, q, k, v, out, lse, backend="numpy", **case.options)
    opts, drop = _reference_options(case)
    wide = reference_dtype(case.q.dtype)  # long double for float64 inputs
    ref = reference.attention(q, k, v, return_lse=True, compute_dtype=wide, **opts, **drop)
    ref += reference.attention_backward(do, q, k, v, compute_dtype=wide, **opts, **drop)
    clean = reference.attention(case.q, case.k, case.v, return_lse=True, compute_dtype=wide, **opts, **drop)
    clean += reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=wide, **opts, **drop)
    base = reference.attention(case.q, case.k, case.v, return_lse=True, compute_dtype=case.q.dtype, **opts, **drop)
    base += reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=case.q.dtype,
                                         **opts, **drop)
    mags = reference.term_magnitudes(case.q, case.k, case.v, case.dout, **opts, **drop)
    names = ("out", "lse", "dq", "dk", "dv")
    for n, (name, x, r, c, b, free) in enumerate(zip(names, got, ref, clean, base, _independent(case, opts, (i, i2), j))):
        bad = ~np.isfinite(r)
        assert np.array_equal(~np.isfinite(x), bad), f"{name}: non-finite elsewhere than the reference's"
        assert np.array_equal(x[bad], r[bad], equal_nan=True), f"{name}: other infinities or NaN than the reference's"
        assert np.array_equal(r[free], c[free]), f"reference {name}: the poison reached a result that does not see it"
        if free.any():
            assert_attention_close(x[free], c[free], b[free], mult=2 if n < 2 else 3, name=name, magnitude=mags[name])


def test_a_dropped_infinite_value_reaches_nothing():
    """Row i sees key j, but dropout drops (i, j): V_j = inf then reaches neither out_i nor dQ_i (dS_ij = -P_ij D_i:
    the dropped dP_ij contributes nothing, not 0 * inf), in the NumPy backend and in the reference."""
    from cuflash.dropout import dropout_mask

    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((1, 4, 1, 8)) for _ in range(4))
    keep = dropout_mask((1, 1, 4, 4), seed=7, p=0.5)[0, 0]
    i, j = 0, 2
    assert not keep[i, j] and keep[1:, j].any()  # dropped for row 0, kept for some other row
    clean = v.copy()
    v[0, j, 0, 0] = np.inf
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy", dropout_p=0.5, seed=7)
    dq = cuflash.attention_backward(do, q, k, v, out, lse, backend="numpy", dropout_p=0.5, seed=7)[0]
    drop = dict(dropout_mask=keep[None, None], dropout_p=0.5)
    assert not np.isfinite(out[0, 1:]).all()  # the rows that keep it do see it
    # row i: in the reference bit for bit that of the clean V, and in the backend within the rule against it (the
    # clean V also gives the naive baseline and the term magnitudes, which the infinity would make infinite)
    wide = reference_dtype(q.dtype)  # long double for float64 inputs
    with np.errstate(all="ignore"):
        ref = (reference.attention(q, k, v, compute_dtype=wide, **drop),
               reference.attention_backward(do, q, k, v, compute_dtype=wide, **drop)[0])
    want = (reference.attention(q, k, clean, compute_dtype=wide, **drop),
            reference.attention_backward(do, q, k, clean, compute_dtype=wide, **drop)[0])
    base = (reference.attention(q, k, clean, **drop), reference.attention_backward(do, q, k, clean, **drop)[0])
    mags = reference.term_magnitudes(q, k, clean, do, **drop)
    for name, x, r, w, b in zip(("out", "dq"), (out, dq), ref, want, base):
        assert np.array_equal(r[0, i], w[0, i]), f"reference {name}: the dropped infinity reached row {i}"
        assert_attention_close(x[0, i], w[0, i], b[0, i], mult=2 if name == "out" else 3, name=name,
                               magnitude=mags[name])


def test_a_nan_factor_is_not_turned_into_an_infinity():
    """A NaN in P (a row that sees a NaN query) against an infinite dO of another row: dV is NaN, as the reference
    says, not the infinity of the other term (_seen_product keeps the NaN of BLAS's finite part)."""
    for dtype in (np.float32, np.float64):
        rng = np.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((1, 2, 1, 4)).astype(dtype) for _ in range(4))
        q[0, 0, 0, 0], do[0, 1, 0, 0] = np.nan, np.inf
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy")
        dv = cuflash.attention_backward(do, q, k, v, out, lse, backend="numpy")[2]
        rdv = reference.attention_backward(do, q, k, v)[2]
        assert np.isnan(rdv[0, :, 0, 0]).all() and np.isnan(dv[0, :, 0, 0]).all()
