"""The CUDA forward kernel (kernels/flash_fwd.cu), run unchanged on the CPU by cuflash.emulate.

Held to the float64 reference with the same-dtype rule (cuflash.testing), on small shapes: every
mask feature, every specialization of the tile table, the golden vectors, a hypothesis sweep, and
the device visibility rule (kernels/mask.cuh) against its Python twin (cuflash.problem.visible).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cuflash
from cuflash import emulate, reference
from cuflash.backends import emulate as emulate_backend
from cuflash.cuda import launch as launches
from cuflash.cuda import specs
from cuflash.cuda.launch import LaunchSpec
from cuflash.cuda.source import KERNELS_DIR, inline_includes
from cuflash.problem import key_range, make_problem, visible
from cuflash.testing import Case, assert_attention_close, attention_cases

from golden import golden_cases
from cases import bf16, check_forward, feature_cases, make_case

from emulated_support import (DTYPES, check_infinite_scores, check_rows_that_miss_the_key, emulated,  # noqa: F401
                               infinite_key_case, pytestmark)


def _dtype(d):
    return bf16() if d == "bfloat16" else np.dtype(d)



# ------------------------------------------------------------------------------------------------
# Every feature, fp16 and bf16
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,case", feature_cases(), ids=[n for n, _ in feature_cases()])
def test_feature(name, case, dtype):
    dt = _dtype(dtype)
    case.q, case.k, case.v = (a.astype(dt) for a in (case.q, case.k, case.v))
    out, lse = check_forward(emulated, case)
    assert out.dtype == dt and out.shape == case.q.shape
    assert lse.dtype == np.float32


@pytest.mark.parametrize("name,case,gold_out,gold_lse", golden_cases())
def test_golden(name, case, gold_out, gold_lse):
    out, lse = emulated(case.q, case.k, case.v, **case.options)
    base, base_lse = reference.attention(case.q, case.k, case.v, return_lse=True, compute_dtype=case.q.dtype,
                                         **case.options)
    assert_attention_close(out, gold_out, base, name="out")
    assert_attention_close(lse, gold_lse, base_lse, name="lse")


@pytest.mark.parametrize("spec", specs.all_specs(("fwd",)), ids=lambda s: s.name_expression.split("<")[1][:-1])
def test_every_table_specialization(spec):
    """Each tile-table row (incl. the 99 KB-GPU rows) on a ragged causal GQA problem with seqlens."""
    if spec.dtype == "bfloat16" and not isinstance(DTYPES[1], str):
        pytest.skip("ml_dtypes not installed")
    dt = _dtype(spec.dtype)
    d = spec.head_dim - 5 if spec.head_dim > 32 else spec.head_dim  # odd dims ride on the native one
    case = make_case(2, 2 * spec.block_m + 3, spec.block_m + 2 * spec.block_n + 1, 2, 1, d, dt, causal=True,
                     seqlens_q=np.array([2 * spec.block_m + 3, spec.block_m - 1], np.int32),
                     seqlens_k=np.array([spec.block_n + 7, spec.block_m + 2 * spec.block_n + 1], np.int32))
    check_forward(lambda q, k, v, **o: emulate_backend.forward(make_problem(q, k, v, **o), spec=spec), case)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(attention_cases(dtypes=("float16", "bfloat16") if isinstance(DTYPES[1], str) else ("float16",),
                       max_seqlen=200, max_head_dim=136, block_sizes=(16, 32, 64, 128)))
def test_hypothesis(case):
    check_forward(emulated, case)


# ------------------------------------------------------------------------------------------------
# Fully masked rows, memory layouts, schedules
# ------------------------------------------------------------------------------------------------
def test_fully_masked_rows_give_zero_and_neg_inf():
    # Window (2, 0) on Sq = Sk = 130: key tiles are visited last-first, so rows < 62 see only -inf scores in the
    # first tile (m = -inf, the -inf - (-inf) guard) and their keys later; rows past seqlens_q and a sequence with
    # no keys at all must give out = 0, lse = -inf exactly.
    case = make_case(2, 130, 130, 1, 1, 64, np.float16, window=(2, 0),
                     seqlens_q=np.array([90, 130], np.int32), seqlens_k=np.array([130, 0], np.int32))
    out, lse = check_forward(emulated, case)
    assert np.isfinite(lse[0, :, :90]).all() and np.all(out[0, :90] != 0)
    assert np.all(out[0, 90:] == 0) and np.all(np.isneginf(lse[0, :, 90:]))
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))


def test_strided_inputs_are_read_in_place_and_misaligned_ones_copied():
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((2, 96, 3, 4, 64)).astype(np.float16)   # a fused (B, S, 3, H, D) projection
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    problem = make_problem(q, k, v, causal=True)
    fl = launches.forward_launch(problem)
    assert fl.launch.keep[0] is problem.q and fl.launch.keep[1] is problem.k  # no copies: strides are params
    check_forward(emulated, make_case(1, 1, 1, 1, 1, 1))  # smallest problem: one query, one key, head_dim 1
    check_forward(emulated, Case(q, k, v, q, {"causal": True}))
    flat = rng.standard_normal(2 * 50 * 2 * 64 + 1).astype(np.float16)
    mis = flat[1:].reshape(2, 50, 2, 64)  # 2-byte offset: cp.async needs 16-byte alignment, so this is copied
    assert launches.forward_launch(make_problem(mis, mis, mis)).launch.keep[0] is not mis
    check_forward(emulated, Case(mis, mis, mis, mis, {}))


def test_sliding_window_block_mask_at_the_longest_lengths():
    """BlockMask.sliding_window's element test in the kernels' 32-bit int at seqlen_k = 2**30 - 1 with an unbounded
    right side (clamped to seqlen_q + seqlen_k): written as q_idx + hi, it wrapped to negative and hid every key of
    128 of these rows. Keys broadcast (stride 0): every score is 0, so row i's lse is log(its count of keys)."""
    from cuflash import BlockMask

    sq, sk = 256, 2 ** 30 - 1
    mask = BlockMask.sliding_window(sq, sk, window=(0, 2 ** 40))
    q = np.zeros((1, sq, 1, 8), np.float16)
    kv = np.broadcast_to(np.zeros((1, 1, 1, 8), np.float16), (1, sk, 1, 8))
    fl = launches.forward_launch(make_problem(q, kv, kv, block_mask=mask))
    emulate.launch(fl.launch)
    lse = np.asarray(fl.lse)[0, 0]
    want = np.log(sq - np.arange(sq))  # row i sees keys i + sk - sq .. sk - 1
    assert_attention_close(lse, want, want.astype(np.float16))


def test_schedules_give_bitwise_identical_results():
    # Threads run forward, reversed and shuffled between barriers: a missing __syncthreads or cp.async wait
    # would show as a difference (the emulator fills pending cp.async destinations and fresh smem with NaN).
    case = make_case(1, 150, 170, 2, 1, 64, np.float16, causal=True)
    problem = make_problem(case.q, case.k, case.v, causal=True)
    runs = [emulate_backend.forward(problem, schedule=s, seed=7) for s in ("forward", "reverse", "random")]
    for out, lse in runs[1:]:
        assert np.array_equal(out.view(np.uint16), runs[0][0].view(np.uint16))
        assert np.array_equal(lse, runs[0][1])


def test_unsupported_dtype_and_dropout():
    # float32/float64 run the wide kernels (tests/test_kernels_emulated_wide.py); integers are refused up front
    q = np.zeros((1, 4, 1, 32), np.int32)
    with pytest.raises(TypeError, match="must be floating point"):
        cuflash.attention(q, q, q, backend="emulate")


# ------------------------------------------------------------------------------------------------
# kernels/mask.cuh against cuflash.problem.visible
# ------------------------------------------------------------------------------------------------
_RULE_KERNEL = r"""
__global__ void mask_rule_kernel(unsigned char* vis, int* ranges, unsigned char* interior, int sq, int sk,
                                 int len_q, int len_k, int left, int right, int bm, int bn) {
  const cuflash::Visibility rule = cuflash::Visibility::make(len_q, len_k, left, right);
  for (int i = 0; i < sq; ++i)
    for (int j = 0; j < sk; ++j) vis[i * sk + j] = rule(i, j);
  const int n_m = (sq + bm - 1) / bm, n_n = (sk + bn - 1) / bn;
  for (int m = 0; m < n_m; ++m) {
    ranges[2 * m] = rule.key_begin(m * bm);
    ranges[2 * m + 1] = rule.key_end(m * bm, m * bm + bm);
    for (int n = 0; n < n_n; ++n) interior[m * n_n + n] = rule.all_visible(m * bm, m * bm + bm, n * bn, n * bn + bn);
  }
}
"""

_RULES = [  # sq, sk, len_q, len_k, left, right
    (40, 40, 40, 40, None, None), (40, 40, 40, 40, None, 0), (30, 50, 30, 50, None, 0), (50, 30, 50, 30, None, 0),
    (50, 30, 41, 17, None, 0), (45, 45, 45, 45, 7, 3), (45, 60, 33, 60, 0, 0), (60, 45, 60, 45, 5, None),
    (33, 33, 0, 33, None, None), (33, 33, 33, 0, None, 0), (64, 64, 64, 64, 200, 300), (37, 70, 20, 9, 2, 1),
]


@pytest.mark.parametrize("sq,sk,len_q,len_k,left,right", _RULES)
def test_mask_cuh_matches_python_rule(sq, sk, len_q, len_k, left, right):
    bm, bn = 16, 8
    n_m, n_n = -(-sq // bm), -(-sk // bn)
    vis = np.zeros((sq, sk), np.uint8)
    ranges = np.zeros((n_m, 2), np.int32)
    interior = np.zeros((n_m, n_n), np.uint8)
    unb = launches.UNBOUNDED
    spec = LaunchSpec(inline_includes(KERNELS_DIR / "mask.cuh") + _RULE_KERNEL, "mask_rule_kernel", (1, 1, 1), (1, 1, 1), 0,
                      (vis, ranges, interior, *map(np.int32, (sq, sk, len_q, len_k, unb if left is None else left,
                                                              unb if right is None else right, bm, bn))))
    emulate.launch(spec)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    want = visible(i, j, len_q, len_k, left, right)
    assert np.array_equal(vis.astype(bool), want)
    for m in range(n_m):
        i0, i1 = m * bm, (m + 1) * bm
        lo, hi = key_range(i0, i1, len_q, len_k, left, right)
        begin, end = ranges[m]
        assert (end > begin) == (hi > lo), (m, ranges[m], (lo, hi))
        if hi > lo:
            assert (begin, end) == (lo, hi)
        rows = np.arange(i0, min(i1, len_q))
        for n in range(n_n):
            cols = np.arange(n * bn, (n + 1) * bn)  # may run past sk: those keys are not visible
            full = bool(visible(rows[:, None], cols[None, :], len_q, len_k, left, right).all()) if rows.size else True
            assert bool(interior[m, n]) == full, (m, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_infinite_score_gives_lse_inf_as_the_reference(dtype):
    q, k, v = infinite_key_case(_dtype(dtype))
    check_infinite_scores(*emulated(q, k, v, causal=True), q, k, v)


def test_nan_key_poisons_exactly_the_rows_that_see_it():
    # IEEE propagation, as in the NumPy backend: a NaN score makes its row's out and lse NaN (not the
    # "sees no key" 0 / -inf), and rows that do not see the key stay exact (held to the rule, not only finite).
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 70, 2, 64)).astype(np.float16) for _ in range(3))
    k[0, 33, 1, 7] = np.nan
    out, lse = emulated(q, k, v, causal=True)
    ref_out, ref_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)  # numpy backend
    assert np.isnan(lse[0, 1, 33:]).all() and np.isnan(out[0, 33:, 1]).all()
    assert np.isfinite(lse[0, 1, :33]).all() and np.isfinite(out[0, :33, 1]).all()
    assert np.isfinite(lse[0, 0]).all() and np.isfinite(out[0, :, 0]).all()  # the other kv head never sees it
    assert np.array_equal(np.isnan(lse), np.isnan(ref_lse)) and np.array_equal(np.isnan(out), np.isnan(ref_out))
    check_rows_that_miss_the_key(out, lse, q, k, v)
