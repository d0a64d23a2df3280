"""The test cases and checks shared by every backend's tests (the NumPy backend, the emulated kernels, the fake CuPy and
the GPU): one explicit forward case per feature and the cases built from them (the golden vectors:
tests/golden.py), the backward's 3x same-dtype rule for (dq, dk, dv), and dropout cases with the read-back of the
kernels' keep-mask (through the output, and through dV)."""
from __future__ import annotations

import numpy as np

import cuflash
from cuflash import reference, testing
from cuflash.blockmask import BlockMask
from cuflash.problem import visible
from cuflash.testing import Case, check_forward  # noqa: F401  (re-exported for the kernel tests)


# ================================================================================================ forward
def bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def make_case(batch, sq, sk, hq, hkv, d, dtype=np.float16, seed=0, **options) -> Case:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape).astype(dtype)
              for shape in ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d), (batch, sq, hq, d))]
    return Case(*arrays, options=options)


def feature_cases(dtype=np.float16):
    """(id, Case) for every mask feature and shape awkwardness of the forward kernel."""
    rng = np.random.default_rng(1)
    c = []
    c.append(("plain_d64", make_case(2, 64, 64, 2, 2, 64, dtype)))
    c.append(("ragged_sq_ne_sk", make_case(1, 113, 203, 2, 2, 32, dtype)))
    c.append(("causal_long_q", make_case(1, 200, 77, 2, 1, 64, dtype, causal=True)))
    c.append(("causal_short_q", make_case(1, 77, 200, 2, 2, 64, dtype, causal=True)))
    c.append(("window", make_case(1, 150, 150, 2, 1, 96, dtype, window=(20, 5))))
    c.append(("window_left_only", make_case(1, 130, 130, 1, 1, 32, dtype, window=(8, None))))
    c.append(("window_causal", make_case(1, 129, 140, 2, 2, 64, dtype, causal=True, window=(70, None))))
    c.append(("gqa_mqa", make_case(2, 65, 65, 8, 1, 64, dtype, causal=True)))
    c.append(("seqlens", make_case(3, 100, 130, 2, 1, 64, dtype, causal=True,
                                   seqlens_q=np.array([100, 37, 0], np.int32),
                                   seqlens_k=np.array([130, 64, 5], np.int32))))
    c.append(("seqlens_zero_keys", make_case(2, 40, 40, 1, 1, 32, dtype,
                                             seqlens_k=np.array([0, 17], np.int32))))
    c.append(("odd_head_dim_59", make_case(1, 70, 90, 2, 2, 59, dtype, causal=True)))
    c.append(("odd_head_dim_111", make_case(1, 50, 50, 1, 1, 111, dtype)))
    c.append(("head_dim_40_in_place", make_case(1, 66, 66, 1, 1, 40, dtype, window=(3, 3))))
    c.append(("head_dim_8", make_case(1, 20, 20, 1, 1, 8, dtype)))
    c.append(("scale", make_case(1, 64, 64, 1, 1, 64, dtype, scale=0.37)))
    c.append(("negative_scale", make_case(1, 64, 80, 1, 1, 32, dtype, scale=-0.5, causal=True)))
    c.append(("zero_scale", make_case(1, 33, 47, 1, 1, 32, dtype, scale=0.0, window=(4, 4))))
    grid = rng.random((1, 2, 2, 4)) < 0.6
    grid[0, 0, 0, 0] = True
    c.append(("blockmask_tile_multiple", make_case(1, 256, 256, 2, 2, 64, dtype, block_mask=BlockMask(
        grid, block=(128, 64), seqlen_q=256, seqlen_k=256))))
    grid = rng.random((2, 1, 10, 7)) < 0.5
    c.append(("blockmask_finer_than_tile", make_case(2, 150, 200, 2, 1, 64, dtype, causal=True, block_mask=BlockMask(
        grid, block=(16, 32), seqlen_q=150, seqlen_k=200))))
    grid = rng.random((1, 1, 4, 4)) < 0.7
    c.append(("blockmask_straddling", make_case(1, 190, 190, 1, 1, 32, dtype, block_mask=BlockMask(
        grid, block=(48, 48), seqlen_q=190, seqlen_k=190))))
    grid = np.zeros((1, 2, 9, 3), bool)  # per head, with query tiles whose list is empty in one head only
    grid[0, 0, [0, 5]], grid[0, 1, [0, 5, 8]] = True, True
    c.append(("blockmask_per_head", make_case(1, 129, 40, 2, 1, 32, dtype, block_mask=BlockMask(
        grid, block=(16, 16), seqlen_q=129, seqlen_k=40))))
    grid = np.zeros((1, 1, 2, 2), bool)
    c.append(("blockmask_empty", make_case(1, 100, 100, 1, 1, 32, dtype, block_mask=BlockMask(
        grid, block=(64, 64), seqlen_q=100, seqlen_k=100))))
    return c


def modifier_cases() -> dict:
    """``{name: options}``: one case per modifier and mask kind, for ``make_case(2, 75, 75, 4, 2, d, dtype, **options)``
    (GQA and awkward lengths; the arrays are shaped for 75 queries and keys and 4 query heads)."""
    out = {}
    rng = np.random.default_rng(11)
    docs = np.sort(rng.integers(0, 4, 75))
    out["bias_full"] = dict(bias=rng.standard_normal((2, 4, 75, 75)).astype(np.float32))
    out["bias_per_key_broadcast"] = dict(bias=rng.standard_normal((75,)).astype(np.float32), causal=True)
    out["bias_heads_rows"] = dict(bias=rng.standard_normal((4, 75, 1)).astype(np.float32), window=(20, 5))
    out["alibi"] = dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32), causal=True)
    out["softcap"] = dict(softcap=2.0)
    out["score_mod"] = dict(score_mod="where(q_idx >= kv_idx, score, score - 1.5) + w[kv_idx]",
                            mod_arrays={"w": rng.standard_normal(75).astype(np.float32)})
    out["mask_mod"] = dict(mask_mod="d[q_idx] == d[kv_idx] and kv_idx <= q_idx", mod_arrays={"d": docs})
    out["everything"] = dict(bias=rng.standard_normal((4, 75, 75)).astype(np.float32), softcap=5.0,
                             alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32), score_mod="score * 0.8",
                             mask_mod="(q_idx + kv_idx) % 5 != 2", causal=True)
    out["document_causal"] = dict(block_mask=BlockMask.document(docs, block=(16, 32)) &
                                  BlockMask.causal(75, block=(16, 32)))
    out["prefix_lm"] = dict(block_mask=BlockMask.prefix_lm(75, 30, block=(32, 16)))
    out["dense_bits"] = dict(block_mask=BlockMask.from_dense(rng.random((2, 1, 75, 75)) < 0.3, block=(16, 16)))
    out["mask_or"] = dict(block_mask=BlockMask.sliding_window(75, window=(10, 0), block=(16, 16)) |
                          BlockMask.from_mask_mod("kv_idx < 4", seqlen_q=75, block=(16, 16)))
    out["blockmask_and_bias"] = dict(block_mask=BlockMask.causal(75, block=(32, 32)),
                                     bias=rng.standard_normal((1, 75, 75)).astype(np.float32))
    return out


def hostile_modifier_cases() -> dict:
    """``{name: options}``: modifiers at the edges of the language's arithmetic, for float32 ``(1, 8, 2, 32)`` inputs
    (tests/test_modifiers.py on the NumPy backend and the emulator, tests/test_gpu_modifiers.py on a GPU): each
    backend against the float64 reference, NaN exactly where it has NaN."""
    field = np.array([(1, 5), (2, 0)], dtype=[("a", "i1"), ("x", "<i4")])["x"]  # a strided view of int32 fields
    return {
        "mod-zero": dict(mask_mod="q_idx % kv_idx == 0"),  # x % 0: the kernels trapped (SIGFPE); now 0, as NumPy
        "div-zero": dict(mask_mod="q_idx // kv_idx >= 0"),
        "uint8": dict(mask_mod="u[kv_idx] - 5 < 0", mod_arrays={"u": np.full(8, 3, np.uint8)}),  # 64-bit, not 254
        "max-nan": dict(score_mod="max(score, nan)"),  # NaN propagates, as numpy.maximum (fmaxf dropped it)
        "min-nan": dict(score_mod="min(score, nan)"),
        "field-view": dict(mask_mod="s[h] > 0", mod_arrays={"s": field}),
        # INT_MIN % -1 (and // -1) trapped too, inside the problem or in a tile's padding rows, where q_idx = 8 wraps
        "intmin-mod": dict(mask_mod="w[q_idx] % (kv_idx - 1) == 0",
                           mod_arrays={"w": np.array([0] * 3 + [-2 ** 31] + [0] * 4, np.int32)}),
        "padding-wrap": dict(score_mod="score + (q_idx * 268435456) % (kv_idx - 1)"),
        # float literals as NumPy takes them: rounded to float32 once (1 + 2^-24 is a tie: 1, not the 1 + 2^-23 the
        # compiler made of the double's digits with an f), and past float32's range as 0, not an NVRTC error
        "literal-tie": dict(mask_mod="kv_idx * 1.0000000596046448 == kv_idx * 1.0"),
        "literal-range": dict(score_mod="score * 1e-50 + score / 1e25 / 1e25 + score * 1e-40 + score"),
    }


# ================================================================================================ backward
def _bf16_rule_works() -> bool:
    try:
        testing.rounding(bf16())
    except ValueError:
        return False
    x = np.ones((1, 2, 1, 2), dtype=bf16())
    return reference.attention(x, x, x, compute_dtype=x.dtype).dtype == x.dtype


def host(x):
    return np.asarray(x.get() if hasattr(x, "get") else x)


def check_backward(fn, case: Case, out, lse):
    """cuflash.testing.check_backward: ``fn(dout, q, k, v, out, lse, **options) -> (dq, dk, dv)`` within 3x the
    naive same-dtype error plus two roundings at the term magnitude. For bfloat16, while cuflash.testing cannot
    handle it (rounding() calls np.finfo on bfloat16, and the naive bfloat16 reference runs its matmuls in
    float32), the same rule with the bfloat16 constants: the naive baseline rounded to bfloat16 once, the floor
    2 * 2**-7 * magnitude. Returns the gradients as host arrays."""
    if case.q.dtype.name != "bfloat16" or _bf16_rule_works():
        return tuple(host(g) for g in testing.check_backward(fn, case, out, lse))
    grads = tuple(host(g) for g in fn(case.dout, case.q, case.k, case.v, out, lse, **case.options))
    refs = reference.attention_backward(case.dout, case.q, case.k, case.v, **case.options)
    bases = reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=case.q.dtype,
                                         **case.options)
    mags = reference.term_magnitudes(case.q, case.k, case.v, case.dout, **case.options)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bases):
        g = g.astype(np.float64)
        assert g.shape == r.shape and not np.isnan(g).any(), name
        err = np.abs(g - r).max(initial=0.0)
        base = np.abs(np.asarray(b).astype(bf16()).astype(np.float64) - r).max(initial=0.0)
        floor = 2 * 2.0 ** -7 * mags[name]
        assert err <= 3 * base + floor, f"{name}: max error {err:.3e} > 3 x {base:.3e} + {floor:.3e} (bf16)"
    return grads


def assert_bitwise_equal_runs(runs):
    """Every run's (dq, dk, dv) has the same bits as the first run's."""
    for r in runs[1:]:
        for a, b in zip(r, runs[0]):
            assert np.array_equal(host(a).view(np.uint16), host(b).view(np.uint16))


def check_golden_grads(grads, case: Case, name: str):
    """Gradients of the fp16-rounded golden inputs against the golden float64 gradients (of the unrounded
    inputs): within 3x the naive same-dtype error against the same golden, plus two fp16 roundings at the
    term magnitude."""
    from golden import GoldenVector

    z = GoldenVector(name).arrays
    bases = reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=case.q.dtype,
                                         **case.options)
    mags = reference.term_magnitudes(case.q, case.k, case.v, case.dout, **case.options)
    for gname, g, b in zip(("dq", "dk", "dv"), grads, bases):
        gold = z[gname]
        base_err = np.abs(np.asarray(b, np.float64) - gold).max(initial=0.0)
        err = np.abs(np.asarray(host(g), np.float64) - gold).max(initial=0.0)
        assert err <= 3 * base_err + 2 * 2.0 ** -10 * mags[gname], (gname, err, base_err, case.options)


# ================================================================================================ dropout
SEED = 0x9E3779B97F4A7C15  # both 32-bit halves nonzero: seed_lo and seed_hi both reach the kernel


def dropout_case(*shape, p, seed, **options):
    """make_case (whose own ``seed`` draws the arrays) with ``dropout_p=p, seed=seed`` among the options."""
    case = make_case(*shape, **options)
    case.options.update(dropout_p=p, seed=seed)
    return case


def dropout_feature_cases():
    """(id, Case) with dropout: the mask features that change which rows/keys/tiles a block visits."""
    rng = np.random.default_rng(5)
    c = []
    c.append(("plain_p0.5", dropout_case(2, 64, 64, 2, 2, 64, p=0.5, seed=SEED)))
    c.append(("ragged_p0.1", dropout_case(1, 113, 203, 2, 2, 32, p=0.1, seed=7)))
    c.append(("causal_long_q_p0.9", dropout_case(1, 200, 77, 2, 1, 64, causal=True, p=0.9, seed=2**64 - 1)))
    c.append(("window_causal", dropout_case(1, 129, 140, 2, 2, 64, causal=True, window=(70, None), p=0.3,
                                            seed=11)))
    c.append(("gqa_mqa", dropout_case(2, 65, 65, 8, 1, 64, causal=True, p=0.2, seed=SEED)))
    c.append(("seqlens_batch3", dropout_case(3, 100, 130, 2, 1, 128, causal=True, p=0.25, seed=3,
                                             seqlens_q=np.array([100, 37, 0], np.int32),
                                             seqlens_k=np.array([130, 64, 5], np.int32))))
    grid = rng.random((2, 1, 10, 7)) < 0.5
    c.append(("blockmask_finer_than_tile", dropout_case(2, 150, 200, 2, 1, 64, causal=True, p=0.4, seed=SEED,
                                                        block_mask=BlockMask(grid, block=(16, 32), seqlen_q=150,
                                                                             seqlen_k=200))))
    grid = np.zeros((1, 2, 9, 3), bool)
    grid[0, 0, [0, 5]], grid[0, 1, [0, 5, 8]] = True, True
    c.append(("blockmask_per_head", dropout_case(1, 129, 40, 2, 1, 32, p=0.5, seed=19, block_mask=BlockMask(
        grid, block=(16, 16), seqlen_q=129, seqlen_k=40))))
    c.append(("odd_head_dim_59", dropout_case(1, 70, 90, 2, 2, 59, window=(20, 5), p=0.5, seed=23)))
    return c


def one_hot_problem(batch, sq, sk, hq, hkv, d):
    """q = k = 0 (every visible key gets the same probability) and v[b, j, h, j % d] = 1, float16."""
    q = np.zeros((batch, sq, hq, d), np.float16)
    k = np.zeros((batch, sk, hkv, d), np.float16)
    v = np.zeros((batch, sk, hkv, d), np.float16)
    v[:, np.arange(sk), :, np.arange(sk) % d] = 1
    return q, k, v


def check_keep_mask(run, *, batch, sq, sk, hq, hkv, d, window, p, seed=SEED, numpy_too=True):
    """Read the keep-mask back from ``run(q, k, v, **options) -> (out, lse)`` (NumPy results) and hold it
    bit for bit to :func:`cuflash.dropout_mask` (and to the NumPy backend's zero pattern when ``numpy_too``).

    With q = k = 0 and v one-hot in ``j % d``, under a window no wider than ``d`` (so ``j % d`` is one-to-one on
    the keys a row sees), ``out[b, i, h, j % d]`` is ``keep[b, h, i, j] / (n_visible(i) (1 - p))``.
    """
    assert window[0] + window[1] + 1 <= d, "a row must see at most d keys"
    q, k, v = one_hot_problem(batch, sq, sk, hq, hkv, d)
    out, lse = run(q, k, v, window=window, dropout_p=p, seed=seed)

    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    vis = visible(i, j, sq, sk, window[0], window[1])                    # (Sq, Sk)
    col = np.broadcast_to(j % d, vis.shape)
    got = np.asarray(out).astype(np.float32).transpose(0, 2, 1, 3)        # (B, Hq, Sq, d)
    at = np.take_along_axis(got, np.broadcast_to(col, got.shape[:2] + col.shape), axis=-1)  # (B, Hq, Sq, Sk)
    read_back = at != 0
    expected = cuflash.dropout_mask((batch, hq, sq, sk), seed=seed, p=p)
    assert np.array_equal(read_back & vis, expected & vis), \
        f"{int(((read_back != expected) & vis).sum())} of {int(vis.sum()) * batch * hq} keep bits differ"
    # columns that no visible key maps to stay zero
    hit = np.zeros((sq, d), bool)
    np.logical_or.at(hit, (np.broadcast_to(i, vis.shape)[vis], col[vis]), True)
    assert np.all(got[..., ~hit] == 0)
    # kept values are 1 / (n_visible (1 - p)): the 1/(1-p) rescale folded into the final normalization
    n_vis = vis.sum(axis=1)  # rows before the band's start (Lk < Lq moves it right) see no key
    want = np.broadcast_to(1.0 / (np.maximum(n_vis, 1)[:, None] * (1.0 - p)), at.shape)
    kept = read_back & vis
    np.testing.assert_allclose(at[kept], want[kept], rtol=2 ** -10)
    # lse is that of the undropped scores: log(n_visible)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(np.asarray(lse), np.broadcast_to(np.log(n_vis), lse.shape), rtol=1e-6)
    if numpy_too:  # the NumPy backend reads the same bits back from the same inputs
        out_np = cuflash.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                   window=window, dropout_p=p, seed=seed, backend="numpy")
        np.testing.assert_array_equal(np.asarray(out).astype(np.float32) != 0, out_np != 0)


# ================================================================================================ backward dropout
def check_dv_keep_mask(run, *, batch, sq, sk, hq, hkv, d, window, p, seed=SEED):
    """Read the backward's keep-mask back from ``run(q, k, v, dout, **options) -> (dq, dk, dv)`` (NumPy results,
    forward included) and hold it bit for bit to :func:`cuflash.dropout_mask`.

    With q = k = 0, P is uniform over the keys a query sees and dV[j] = sum_i (P o Z)[i, j] dO[i] / (1-p).
    dO[b, i, h, :] is one-hot at column (i mod w) + w (h mod G), w = d / G for G query heads per kv head; under a
    window no wider than w each key is seen by at most one query of each residue, so dV[b, j, h // G, c] != 0
    exactly when key j is kept for that query of query head h: the mask element by element, per query head.
    """
    g = hq // hkv
    w = d // g
    assert window[0] + window[1] + 1 <= w, "a key must be seen by at most w queries"
    q = np.zeros((batch, sq, hq, d), np.float16)
    k = np.zeros((batch, sk, hkv, d), np.float16)
    v = np.random.default_rng(1).standard_normal((batch, sk, hkv, d)).astype(np.float16)
    i, j = np.arange(sq), np.arange(sk)
    dout = np.zeros((batch, sq, hq, d), np.float16)
    for h in range(hq):
        dout[:, i, h, i % w + w * (h % g)] = 1
    _, _, dv = run(q, k, v, dout, window=window, dropout_p=p, seed=seed)
    dv = np.asarray(dv)

    vis = visible(i[:, None], j[None, :], sq, sk, window[0], window[1])  # (Sq, Sk)
    keep = cuflash.dropout_mask((batch, hq, sq, sk), seed=seed, p=p) & vis
    expected = np.zeros(dv.shape, bool)
    bb, hh, ii, jj = np.nonzero(keep)
    cols = ii % w + w * (hh % g)
    expected[bb, jj, hh // g, cols] = True
    got = dv != 0
    assert np.array_equal(got, expected), \
        f"{int((got != expected).sum())} of {int(vis.sum()) * batch * hq} keep bits differ"
    # kept entries are 1 / (n_visible(i) (1 - p)): the 1/(1-p) applied once to dV
    n_vis = vis.sum(axis=1)
    np.testing.assert_allclose(dv[bb, jj, hh // g, cols].astype(np.float64), 1.0 / (n_vis[ii] * (1.0 - p)),
                               rtol=2 ** -9)
