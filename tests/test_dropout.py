"""Dropout: the keep-mask is one function of (seed, batch, head, row, col) on every backend."""
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cuflash
from cuflash import reference
from cuflash.dropout import philox4x32, threshold
from cuflash.cuda.launch import LaunchSpec
from cuflash.cuda.source import KERNELS_DIR
from cuflash.testing import attention_cases, check_backward, check_forward

# Known-answer vectors of Philox-4x32-10 published with Random123 (Salmon et al., SC'11).
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32(counter, key)) == expected


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bounds(p):
    mask = cuflash.dropout_mask((2, 3, 100, 300), seed=7, p=p)
    n = mask.size
    kept = mask.sum()
    sd = np.sqrt(n * p * (1 - p))
    assert abs(kept - n * (1 - p)) < 5 * sd  # 5 sigma: a wrong threshold or biased bits fails


def test_bits_are_uniform_per_word():
    # Each of the four Philox words serves one column class j % 4: all four must be unbiased.
    mask = cuflash.dropout_mask((1, 4, 256, 256), seed=123, p=0.5)
    for lane in range(4):
        col = mask[..., lane::4]
        assert abs(col.mean() - 0.5) < 5 * np.sqrt(0.25 / col.size)


def test_masks_differ_across_seeds_and_coordinates():
    a = cuflash.dropout_mask((2, 2, 64, 64), seed=1, p=0.5)
    b = cuflash.dropout_mask((2, 2, 64, 64), seed=2, p=0.5)
    assert 0.4 < (a != b).mean() < 0.6
    assert 0.4 < (a[0] != a[1]).mean() < 0.6   # batch enters the counter
    assert 0.4 < (a[:, 0] != a[:, 1]).mean() < 0.6  # head enters the counter


@settings(max_examples=50)
@given(st.integers(0, 2**64 - 1), st.floats(0.0, 0.99), st.integers(0, 2000), st.integers(1, 70), st.integers(0, 2))
def test_keep_mask_of_a_column_run_is_the_per_element_rule(seed, p, first, count, lead):
    """A tile's run of consecutive columns (each Philox block computed once for its four columns) gives the bits of
    the per-element rule: column j is word j & 3 of the block at counter (j >> 2, row, head, batch)."""
    from cuflash.dropout import _column_run, keep_mask

    rng = np.random.default_rng(first)
    b = rng.integers(0, 5, (2, 1, 1, 1))
    h = rng.integers(0, 9, (1, 3, 1, 1))
    i = rng.integers(0, 10**6, (1, 1, 4, 1))
    cols = np.arange(first, first + count).reshape((1,) * lead + (-1,))
    assert _column_run(cols) is not None
    fast = keep_mask(seed, p, b, h, i, cols)
    key = (seed & 0xFFFFFFFF, seed >> 32)
    bb, hh, ii, jj = np.broadcast_arrays(b, h, i, cols)
    words = np.stack(philox4x32((jj >> 2, ii, hh, bb), key), axis=-1)
    slow = np.take_along_axis(words, (jj & 3)[..., None], axis=-1)[..., 0] >= np.uint32(threshold(p))
    assert fast.shape == slow.shape and np.array_equal(fast, slow)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 15])
def test_keep_mask_in_chunks_of_rows_is_the_per_element_rule(monkeypatch, chunk):
    """The column run is made in chunks of rows (a few Philox blocks each, so the rounds' buffers stay in cache):
    every chunk size, a last chunk cut short among them, gives the bits of the per-element rule."""
    from cuflash import dropout

    monkeypatch.setattr(dropout, "_CHUNK", chunk)
    b, h = np.arange(2).reshape(2, 1, 1, 1), np.array([0, 3, 5]).reshape(1, 3, 1, 1)
    i, cols = np.arange(7, 20).reshape(1, 1, 13, 1), np.arange(5, 47).reshape(1, 1, 1, 42)
    fast = dropout.keep_mask(2**40 + 3, 0.3, b, h, i, cols)
    bb, hh, ii, jj = np.broadcast_arrays(b, h, i, cols)
    words = np.stack(philox4x32((jj >> 2, ii, hh, bb), (3, 2**8)), axis=-1)
    slow = np.take_along_axis(words, (jj & 3)[..., None], axis=-1)[..., 0] >= np.uint32(threshold(0.3))
    assert fast.shape == slow.shape == (2, 3, 13, 42) and np.array_equal(fast, slow)


def test_seed_is_drawn_returned_and_reproduces():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 40, 2, 16)) for _ in range(3))
    out, lse, seed = cuflash.attention(q, k, v, dropout_p=0.3, return_lse=True)
    assert isinstance(seed, int)
    again = cuflash.attention(q, k, v, dropout_p=0.3, seed=seed)
    assert np.array_equal(out, again)
    other = cuflash.attention(q, k, v, dropout_p=0.3, seed=seed + 1)
    assert not np.array_equal(out, other)
    out2, seed2 = cuflash.attention(q, k, v, dropout_p=0.3)
    assert seed2 != seed


def test_backward_requires_the_seed():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 1, 4)) for _ in range(3))
    out, lse, seed = cuflash.attention(q, k, v, dropout_p=0.2, return_lse=True)
    with pytest.raises(ValueError, match="seed"):
        cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, dropout_p=0.2)


@pytest.mark.parametrize("p, why", [
    (1 - 2.0 ** -33, "draws 32-bit random numbers"), (0.9999999999999999, "draws 32-bit random numbers"),
    (Fraction(10 ** 400 - 1, 10 ** 400), r"Fraction\(9{20}.*\.\.\. \(it is 1.0 as a float64\)"),
    (np.longdouble(1) - np.longdouble(2.0) ** -60, r"\(it is 1.0 as a float64\)")])
def test_a_p_the_32_bit_keep_mask_cannot_draw_is_refused_saying_why(p, why):
    """Past 1 - 2**-32 the threshold p 2**32 is clamped: an element was still kept with probability 2**-32 and
    scaled by 1/(1 - p), so E[out] was 2**32 (1 - p) times the undropped output (2e6 at 0.9999999999999999). A p
    in [0, 1) that rounds to 1.0 was told it did not lie in [0, 1), with its 800-character repr."""
    with pytest.raises(ValueError, match=rf"p must lie in \[0, 1 - 2\*\*-32\], got .*{why}"):
        cuflash.dropout_mask((1, 1, 2, 2), seed=1, p=p)
    q = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(ValueError, match="dropout_p must lie in"):
        cuflash.attention(q, q, q, dropout_p=p, seed=1)
    assert cuflash.dropout_mask((1, 1, 64, 64), seed=1, p=1 - 2.0 ** -32).sum() <= 1  # the largest p: allowed


@pytest.mark.parametrize("p, exc, match", [
    (np.array([0.1, 0.2]), TypeError, "dropout_p must be a float in"), ("0.1", TypeError, "dropout_p must be a float"),
    (float("nan"), ValueError, r"dropout_p must lie in \[0, 1 - 2\*\*-32\], got nan"), (1.5, ValueError, "must lie in")])
def test_the_backward_names_a_bad_dropout_p_as_the_forward_does(p, exc, match):
    """The keyword backward asked for a seed (or tested an array's truth) before it checked dropout_p itself."""
    q = np.zeros((1, 4, 1, 8), np.float32)
    lse = np.zeros((1, 1, 4), np.float32)
    with pytest.raises(exc, match=match):
        cuflash.attention_backward(q, q, q, q, q, lse, dropout_p=p)
    cu = np.array([0, 4], np.int32)
    with pytest.raises(exc, match=match):
        cuflash.attention_varlen_backward(q[0], q[0], q[0], q[0], q[0], lse[0], cu, cu, dropout_p=p)


@pytest.mark.parametrize("shape", [(0, 2, 3, 4), (2, 0, 3, 4), (2, 2, 0, 4), (2, 2, 3, 0), (3, 0, 2, 3, 4)])
def test_dropout_mask_of_an_empty_shape(shape):
    """Zero-size shapes are shapes (attention takes them with dropout): the Philox run reshaped with -1 there."""
    mask = cuflash.dropout_mask(shape, seed=1, p=0.5)
    assert mask.shape == shape and mask.dtype == np.bool_


@pytest.mark.parametrize("p", [np.float16(0.1), np.float32(0.1)])
def test_the_reference_takes_a_numpy_scalar_p_as_its_value(p):
    """1 - p was computed in p's own precision (float16: 2.4e-4 off the float64 reference's own answer)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 6, 2, 8)) for _ in range(3))
    mask = cuflash.dropout_mask((1, 2, 6, 6), seed=3, p=float(p))
    np.testing.assert_array_equal(reference.attention(q, k, v, dropout_p=p, dropout_mask=mask),
                                  reference.attention(q, k, v, dropout_p=float(p), dropout_mask=mask))


def test_vjp_keeps_the_drawn_seed():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 20, 2, 8)) for _ in range(3))
    out, vjp = cuflash.attention_vjp(q, k, v, dropout_p=0.4, causal=True)
    mask = cuflash.dropout_mask((2, 20, 20), seed=vjp.seed, p=0.4)
    ref = reference.attention(q, k, v, causal=True, dropout_mask=mask, dropout_p=0.4)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    dq, dk, dv = vjp(np.ones_like(out))
    rdq, rdk, rdv = reference.attention_backward(np.ones_like(out), q, k, v, causal=True,
                                                 dropout_mask=mask, dropout_p=0.4)
    for a, b in ((dq, rdq), (dk, rdk), (dv, rdv)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@settings(max_examples=30)
@given(attention_cases(dtypes=("float32", "float64"), max_seqlen=96, dropout=True))
def test_numpy_backend_with_dropout_matches_reference(case):
    if not case.options.get("dropout_p"):
        case.options.update(dropout_p=0.25, seed=99)
    out, lse = check_forward(lambda *a, **kw: cuflash.attention(*a, return_lse=True, **kw), case)
    check_backward(cuflash.attention_backward, case, out, lse)


_PHILOX_KERNEL = r"""
extern "C" __global__ void dropout_bits(unsigned int seed_lo, unsigned int seed_hi, unsigned int threshold,
                                        int heads, int rows, int cols, unsigned char* keep) {
  const cuflash::DropoutRng rng{seed_lo, seed_hi, threshold};
  const int b = blockIdx.y, h = blockIdx.x;
  for (int i = 0; i < rows; ++i)
    for (int j = 2 * threadIdx.x; j < cols; j += 2 * blockDim.x) {
      bool k0, k1;
      rng.keep_pair(b, h, i, j, k0, k1);
      const long long base = (((long long)b * heads + h) * rows + i) * cols + j;
      keep[base] = k0;
      if (j + 1 < cols) keep[base + 1] = k1;
      if (rng.keep(b, h, i, j) != k0) keep[base] = 2;  // the single-element path must agree
    }
}
"""


@pytest.mark.emulate
@pytest.mark.parametrize("seed,p", [(0, 0.5), (2**64 - 1, 0.1), (0x0123456789ABCDEF, 0.9)])
def test_kernel_philox_is_bit_equal_to_python(seed, p):
    from cuflash import emulate

    ok, why = emulate.available()
    if not ok:
        pytest.skip(f"CPU emulation unavailable: {why}")
    batch, heads, rows, cols = 2, 3, 5, 37
    keep = np.full((batch, heads, rows, cols), 7, dtype=np.uint8)
    source = (KERNELS_DIR / "philox.cuh").read_text() + _PHILOX_KERNEL
    args = (np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32), np.uint32(threshold(p)),
            np.int32(heads), np.int32(rows), np.int32(cols), keep)
    emulate.launch(LaunchSpec(source, "dropout_bits", (heads, batch, 1), (8, 1, 1), 0, args))
    expected = cuflash.dropout_mask((batch, heads, rows, cols), seed=seed, p=p)
    assert np.array_equal(keep, expected.astype(np.uint8))
