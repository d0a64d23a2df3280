"""Rows past a sequence's length and infinite scores in the CUDA kernels, run on the CPU by cuflash.emulate.

- Padding is never read: a score modifier that is NaN in the rows past seqlens_q (a NaN bias there, a score_mod
  operand read at q_idx), or past the array's end (a modifier that is 0/0 on the zero margin), leaves out = 0 /
  lse = -inf in those rows and every gradient finite, as the NumPy backend and the float64 reference give
  (kernels/block_info.cuh and bwd_block_info.cuh, needs_mask: with a score modifier, a query tile holding such rows
  is a boundary tile, masked). Before, out held NaN there and the float32/float64 backward made every dK, dV NaN.
- An infinite score met after a score >= 128 (base 2) in an earlier-visited key tile gives lse = +inf, not NaN
  (kernels/softmax.cuh, wide_softmax.cuh: the rescale exp2(m_old - 0) overflowed and a zero share became 0 * inf).
"""
from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.testing import Case, check_backward, check_forward

from emulated_support import emulated, emulated_backward
from emulated_support import pytestmark as _emulated

# the NumPy backend's overflow / 0 * inf warnings of the infinite-score cases are expected
pytestmark = _emulated + [pytest.mark.filterwarnings("ignore::RuntimeWarning")]

WIDE = [np.float32, np.float64]
ALL = [np.float16, np.float32, np.float64]
ids = lambda dt: np.dtype(dt).name  # noqa: E731


def _arrays(rng, dt, b, sq, sk, d=32):
    q, dout = (rng.standard_normal((b, sq, 2, d)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, 2, d)).astype(dt) for _ in range(2))
    return q, k, v, dout


def _padding_case(dt, modifier):
    """Two sequences in a padded batch of 130 queries (a ragged last tile for every block_m), 100 keys; the
    modifier is NaN in every row past seqlens_q."""
    rng = np.random.default_rng(3)
    q, k, v, dout = _arrays(rng, dt, 2, 130, 100)
    lens_q = np.array([19, 77], np.int32)
    opts = {"seqlens_q": lens_q, "seqlens_k": np.array([100, 61], np.int32)}
    pad = np.arange(130)[None, :] >= lens_q[:, None]  # (b, sq)
    if modifier == "bias":
        bias = (0.5 * rng.standard_normal((2, 1, 130, 100))).astype(np.float32)
        bias[:, 0][pad] = np.nan
        opts["bias"] = bias
    else:  # a score_mod operand read at (b, q_idx)
        w = (0.5 * rng.standard_normal((2, 130))).astype(np.float32)
        w[pad] = np.nan
        opts.update(score_mod="score + w[b, q_idx]", mod_arrays={"w": w})
    return Case(q, k, v, dout, options=opts), pad


def _check_padding(out, lse, pad):
    rows = pad[:, :, None].repeat(2, axis=2)  # (b, sq, h)
    assert (np.asarray(out, np.float64)[rows] == 0).all(), "padding rows of out must be 0"
    assert np.isneginf(np.moveaxis(lse, 1, 2)[rows]).all(), "padding rows of lse must be -inf"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("modifier", ["bias", "score_mod"])
@pytest.mark.parametrize("dt", ALL, ids=ids)
def test_nan_modifier_in_padding_rows_is_never_read(dt, modifier, deterministic):
    case, pad = _padding_case(dt, modifier)
    out, lse = check_forward(emulated, case)
    _check_padding(out, lse, pad)
    np_out, np_lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, backend="numpy", **case.options)
    assert np.array_equal(np_out == 0, out == 0) and np.array_equal(np.isneginf(np_lse), np.isneginf(lse))
    # the backward from the kernel's own out / lse: dq, dk, dv (and dbias) finite and at the rule
    check_backward(emulated_backward(deterministic), case, out, lse)


@pytest.mark.parametrize("dt", ALL, ids=ids)
def test_modifier_nan_on_rows_past_the_array_is_never_read(dt):
    # No seqlens: 19 rows, the tail of the query tile lies past the array; Q rows there are zero-filled and the
    # operand's margin is 0, so score / w[q_idx] is 0 / 0 = NaN there.
    rng = np.random.default_rng(4)
    q, k, v, dout = _arrays(rng, dt, 1, 19, 70)
    w = (1.0 + rng.random(19)).astype(np.float32)
    case = Case(q, k, v, dout, options={"score_mod": "score / w[q_idx]", "mod_arrays": {"w": w}})
    out, lse = check_forward(emulated, case)
    check_backward(emulated_backward(), case, out, lse)


# ------------------------------------------------------------------------------------------------
# +inf after a large score: lse = +inf
# ------------------------------------------------------------------------------------------------
def _check_inf_row(got, want):
    (out, lse), (ref_out, ref_lse) = got, want
    assert np.isposinf(ref_lse).all() and np.isposinf(lse).all(), lse
    assert np.array_equal(np.isnan(out.astype(np.float64)), np.isnan(ref_out.astype(np.float64)))


@pytest.mark.parametrize("dt", ALL, ids=ids)
def test_infinite_score_after_a_large_one_gives_lse_inf(dt):
    # Key 0 (the first tile, visited last) scores +inf, key 129 (the last tile, visited first) 1000: m_old = 1000
    # (base 2: 1443) overflows exp2/exp, and the threads whose share of the row is 0 made 0 * inf = NaN.
    rng = np.random.default_rng(6)
    q, k, v, _ = _arrays(rng, dt, 1, 3, 130)
    w = np.zeros(130, np.float32)
    w[0], w[129] = np.inf, 1000.0
    opts = {"score_mod": "w[kv_idx]", "mod_arrays": {"w": w}}
    want = cuflash.attention(q, k, v, return_lse=True, backend="numpy", **opts)
    _check_inf_row(emulated(q, k, v, **opts), want)


def _infinite_key(dt, sq, large_at, d=32):
    """q, k, v of one head: key 0 scores +inf, key ``large_at`` 1000 (visited first: key tiles run last to first)."""
    q = np.ones((1, sq, 1, d), dt)
    k = np.zeros((1, 130, 1, d), dt)
    v = k + 1
    k[0, 0, 0, 0] = np.inf
    k[0, large_at, 0, :] = 1000 / np.sqrt(d)
    return q, k, v


@pytest.mark.parametrize("dt", ALL, ids=ids)
def test_infinite_score_after_a_large_one_without_modifier(dt):
    q, k, v = _infinite_key(dt, 2, 129)
    want = cuflash.attention(q, k, v, return_lse=True, backend="numpy")
    _check_inf_row(emulated(q, k, v), want)


@pytest.mark.parametrize("dt", [np.float16, np.float32], ids=ids)
def test_infinite_score_after_a_large_one_split_kv(dt):
    # The same inside one split of the KV-cache forward (flash-decoding), then merged by the combine kernel.
    q, k, v = _infinite_key(dt, 1, 100)
    lens = np.array([130], np.int32)
    want = cuflash.attention_with_kvcache(q, k.copy(), v.copy(), cache_seqlens=lens, return_lse=True, backend="numpy")
    for splits in (1, 2):
        got = cuflash.attention_with_kvcache(q, k.copy(), v.copy(), cache_seqlens=lens, num_splits=splits,
                                             return_lse=True, backend="emulate")
        _check_inf_row(got, want)
