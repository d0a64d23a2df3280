"""Ragged batches (varlen) in the CUDA kernels (SeqSpan in kernels/block_info.cuh), run on the CPU by cuflash.emulate.

- forward and backward (both dQ modes: atomics + convert, the deterministic dq kernel) of the 16-bit kernels, fp16 and
  bf16, and of the wide kernels (float32), against the float64 reference on the padded batch with seqlens (sequence b
  is batch entry b: b-dependent modifiers and dropout mean the same in both), at the project's rule: 2x (outputs) /
  3x (gradients) the naive same-dtype error plus the floor; GQA, causal, window, dropout, a modifier reading b and
  kv_idx, empty and length-1 sequences;
- sequence b of the packed result is bitwise batch entry b of the padded batch run through the same kernels (same
  tiles, same order): nothing of another sequence leaks in, and rows outside a sequence are never written;
- max_seqlen above the longest sequence (a larger grid) changes nothing, bitwise;
- a small hypothesis sweep over ragged batches, and the public API (attention_varlen, its backward and vjp) on
  backend="emulate".
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash.backends import emulate as emulate_backend
from cuflash.problem import check_varlen_backward, make_varlen_problem
from cuflash.testing import _input_dtype as _dtype, assert_attention_close

from emulated_support import pytestmark  # noqa: F401  (marks the module)
from test_varlen import Padded, pack, ragged

MODES = pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
LEN_Q = [5, 0, 33, 1, 20]
LEN_K = [7, 3, 18, 0, 41]


def run_varlen(q, k, v, dout, cq, ck, options, deterministic):
    """``(out, lse, (dq, dk, dv))`` of the emulated varlen kernels."""
    problem = make_varlen_problem(q, k, v, cq, ck, **options)
    out, lse = emulate_backend.forward_varlen(problem)
    d, o, l = check_varlen_backward(problem, dout, out, lse)
    return out, lse, emulate_backend.backward_varlen(problem, d, o, l, deterministic=deterministic)


def check_against_padded_reference(q, k, v, dout, cq, ck, options, deterministic, backward=True):
    out, lse, grads = run_varlen(q, k, v, dout, cq, ck, options, deterministic)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    padded = Padded(q, k, v, dout, cq, ck, options)
    mags = padded.magnitudes()
    for name, x, r, b in zip(("out", "lse"), (out, lse), padded.forward(np.float64), padded.forward(q.dtype)):
        assert_attention_close(x, r, b, mult=2, name=name, magnitude=mags[name])
    if backward:
        for name, g, r, b in zip(("dq", "dk", "dv"), grads, padded.backward(np.float64), padded.backward(q.dtype)):
            assert g.shape == {"dq": q, "dk": k, "dv": v}[name].shape
            assert_attention_close(g, r, b, mult=3, name=name, magnitude=mags[name])
    return out, lse, grads


FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (6, 3)},
    "dropout_causal": {"dropout_p": 0.3, "seed": 2024, "causal": True},
    "score_mod_b_kv": {"score_mod": "score + w[b] - 0.25 * u[kv_idx]", "causal": True},
    "alibi_softcap": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625], np.float32), "softcap": 5.0},
}


def _options(name, rng):
    options = dict(FEATURES[name])
    if "score_mod" in options:
        options["mod_arrays"] = {"w": rng.standard_normal(len(LEN_Q)).astype(np.float32),
                                 "u": rng.standard_normal(max(LEN_K)).astype(np.float32)}
    return options


@MODES
@pytest.mark.parametrize("name", sorted(FEATURES))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_kernels_match_the_padded_reference(dtype, name, deterministic):
    """GQA (4 query heads on 2 kv heads), head dim 24 (padded to 32 in the kernels), empty and length-1 sequences."""
    rng = np.random.default_rng(11)
    q, k, v, dout, cq, ck = ragged(rng, LEN_Q, LEN_K, 4, 2, 24, _dtype(dtype))
    check_against_padded_reference(q, k, v, dout, cq, ck, _options(name, rng), deterministic)


@MODES
@pytest.mark.parametrize("name", ["causal", "dropout_causal", "score_mod_b_kv"])
def test_wide_kernels_match_the_padded_reference(name, deterministic):
    rng = np.random.default_rng(12)
    q, k, v, dout, cq, ck = ragged(rng, LEN_Q, LEN_K, 4, 2, 16, np.float32)
    check_against_padded_reference(q, k, v, dout, cq, ck, _options(name, rng), deterministic)


def test_float64_kernels_match_the_padded_reference():
    rng = np.random.default_rng(13)
    q, k, v, dout, cq, ck = ragged(rng, [3, 0, 17], [9, 2, 17], 2, 1, 8, np.float64)
    check_against_padded_reference(q, k, v, dout, cq, ck, {"window": (4, None)}, True)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_each_sequence_is_bitwise_its_padded_batch_entry(dtype):
    """The same kernels on the padded batch (seqlens) and on the packed one: sequence b is batch entry b bit for bit
    (out, lse, and the deterministic mode's gradients), with dropout and a b-dependent modifier."""
    rng = np.random.default_rng(14)
    q, k, v, dout, cq, ck = ragged(rng, LEN_Q, LEN_K, 4, 2, 24, _dtype(dtype))
    options = dict(_options("score_mod_b_kv", rng), dropout_p=0.2, seed=77)
    out, lse, grads = run_varlen(q, k, v, dout, cq, ck, options, True)
    padded = Padded(q, k, v, dout, cq, ck, options)
    qp, kp, vp, dop = padded.arrays
    out_p, lse_p = cuflash.attention(qp, kp, vp, return_lse=True, backend="emulate", **padded.cuflash_options)
    np.testing.assert_array_equal(out, pack(out_p, cq))
    np.testing.assert_array_equal(lse, pack(lse_p, cq, axis=2))
    grads_p = cuflash.attention_backward(dop, qp, kp, vp, out_p, lse_p, backend="emulate", deterministic=True,
                                         **padded.cuflash_options)
    for g, gp, cu in zip(grads, grads_p, (cq, ck, ck)):
        np.testing.assert_array_equal(g, pack(gp, cu))


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
def test_precision_reaches_the_varlen_kernels(precision):
    """attention_varlen takes precision= as attention does (it had no such option): float32 sequences are bitwise
    the padded batch's entries under the same precision, forward and backward, and not IEEE's results."""
    rng = np.random.default_rng(16)
    q, k, v, dout, cq, ck = ragged(rng, LEN_Q, LEN_K, 4, 2, 16, np.float32)
    options = {"causal": True}
    out, lse = cuflash.attention_varlen(q, k, v, cq, ck, return_lse=True, backend="emulate", precision=precision,
                                        **options)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, backend="emulate", deterministic=True,
                                              precision=precision, **options)
    padded = Padded(q, k, v, dout, cq, ck, options)
    qp, kp, vp, dop = padded.arrays
    out_p, lse_p = cuflash.attention(qp, kp, vp, return_lse=True, backend="emulate", precision=precision,
                                     **padded.cuflash_options)
    np.testing.assert_array_equal(out, pack(out_p, cq))
    grads_p = cuflash.attention_backward(dop, qp, kp, vp, out_p, lse_p, backend="emulate", deterministic=True,
                                         precision=precision, **padded.cuflash_options)
    for g, gp, cu in zip(grads, grads_p, (cq, ck, ck)):
        np.testing.assert_array_equal(g, pack(gp, cu))
    assert not np.array_equal(out, cuflash.attention_varlen(q, k, v, cq, ck, backend="emulate", **options))


def test_max_seqlen_upper_bound_changes_nothing():
    """A grid sized by a larger max_seqlen: the extra blocks of every sequence write nothing."""
    rng = np.random.default_rng(15)
    q, k, v, dout, cq, ck = ragged(rng, LEN_Q, LEN_K, 2, 2, 16, np.float16)
    a = run_varlen(q, k, v, dout, cq, ck, {"causal": True}, True)
    b = run_varlen(q, k, v, dout, cq, ck, {"causal": True, "max_seqlen_q": 150, "max_seqlen_k": 200}, True)
    for x, y in zip((a[0], a[1], *a[2]), (b[0], b[1], *b[2])):
        np.testing.assert_array_equal(x, y)


def test_only_empty_sequences_and_no_keys():
    """No query, or no key anywhere: nothing is launched; out = 0, lse = -inf, zero gradients."""
    rng = np.random.default_rng(16)
    q, k, v, dout, cq, ck = ragged(rng, [3, 0, 2], [0, 0, 0], 2, 1, 8, np.float16)
    out, lse, grads = run_varlen(q, k, v, dout, cq, ck, {}, False)
    assert not out.any() and np.isneginf(lse).all() and not grads[0].any()
    q, k, v, dout, cq, ck = ragged(rng, [0, 0], [4, 1], 2, 1, 8, np.float16)
    out, lse, grads = run_varlen(q, k, v, dout, cq, ck, {}, False)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0) and not grads[1].any() and not grads[2].any()


@st.composite
def small_ragged(draw):
    dtype = _dtype(draw(st.sampled_from(["float16", "bfloat16", "float32"])))
    n = draw(st.integers(1, 4))
    length = st.one_of(st.sampled_from([0, 1, 16, 17]), st.integers(0, 40))
    len_q = [draw(length) for _ in range(n)]
    len_k = len_q if draw(st.booleans()) else [draw(length) for _ in range(n)]
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([8, 16, 20]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    options = {}
    if draw(st.booleans()):
        options["causal"] = True
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 20))
        options["window"] = (draw(side), draw(side))
    if draw(st.booleans()):  # the fixed cases' modifier (one compiled variant for the whole module)
        options["score_mod"] = FEATURES["score_mod_b_kv"]["score_mod"]
        options["mod_arrays"] = {"w": rng.standard_normal(n).astype(np.float32),
                                 "u": rng.standard_normal(max(max(len_k), 1)).astype(np.float32)}
    if draw(st.booleans()):
        options.update(dropout_p=0.25, seed=draw(st.integers(0, 2**64 - 1)))
    return ragged(rng, len_q, len_k, hq, hkv, d, dtype), options, draw(st.booleans())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_ragged())
def test_ragged_batches_match_the_padded_reference(case):
    (q, k, v, dout, cq, ck), options, deterministic = case
    check_against_padded_reference(q, k, v, dout, cq, ck, options, deterministic)


def test_public_api_on_emulate():
    """attention_varlen, attention_varlen_backward and attention_varlen_vjp take backend="emulate" and agree with the
    kernels' own calls (no select() refusal any more)."""
    rng = np.random.default_rng(17)
    q, k, v, dout, cq, ck = ragged(rng, [4, 9], [6, 2], 2, 1, 16, np.float16)
    out, lse = cuflash.attention_varlen(q, k, v, cq, ck, return_lse=True, causal=True, backend="emulate")
    want = run_varlen(q, k, v, dout, cq, ck, {"causal": True}, True)
    np.testing.assert_array_equal(out, want[0])
    np.testing.assert_array_equal(lse, want[1])
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=True, backend="emulate",
                                              deterministic=True)
    out_v, vjp = cuflash.attention_varlen_vjp(q, k, v, cq, ck, causal=True, backend="emulate", deterministic=True)
    np.testing.assert_array_equal(out_v, out)
    for g, w, gv in zip(grads, want[2], vjp(dout)):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(gv, w)
