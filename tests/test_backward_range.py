"""The NumPy backend's backward near the ends of the range: V, dO, Q or K near the dtype's largest value, where
intermediates of FA2's Algorithm 2 (dP = dO V^T, dP - D, the sums of dS Q and dS K before the scale) would overflow
although the gradients fit (cuflash.backends.numpy._GradShifts)."""

import math
import warnings

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash.backends import numpy as nb
from cuflash.testing import Case, check_backward

DTYPES = ("float32", "bfloat16", "float64")


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _largest(dt):
    return float(ml_dtypes.finfo(dt).max) if dt.name == "bfloat16" else float(np.finfo(dt).max)


def _check(q, k, v, do, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the naive baseline of check_backward overflows
        with np.errstate(all="ignore"):
            out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
            grads = check_backward(cuflash.attention_backward, Case(q, k, v, do, options=options), out, lse)
    for g in grads[:3]:
        assert np.isfinite(np.asarray(g, np.float64)).all()
    return grads


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("which", ["v", "dout"])
def test_v_or_dout_near_largest(name, which):
    """P = (0.75, 0.25) over two keys; V (or dO) at 0.9 of the largest: dP - D = -1.35 max overflowed to inf/NaN
    dq, dk, although dS = P (dP - D) and the gradients fit."""
    dt = _dtype(name)
    big = 0.9 * _largest(dt)
    a = 0.0 if name != "float64" else 0.5  # float64: no zero key (the rule's float64 magnitudes would be inf * 0)
    q = np.ones((1, 1, 1, 1), dt)
    k = np.array([a, a - math.log(3.0)], dt).reshape(1, 2, 1, 1)
    v = np.array([1.0, -1.0], np.float64).reshape(1, 2, 1, 1)
    do = np.ones((1, 1, 1, 1), np.float64)
    if which == "v":
        v = v * big
    else:
        do = do * big
    _check(q, k, v.astype(dt), do.astype(dt), scale=1.0)


@pytest.mark.parametrize("name", DTYPES)
def test_q_near_largest_small_scale(name):
    """Q at 0.9 of the largest, scale 1/max: sum_i dS_ij Q_i overflowed before the scale (inf dk)."""
    dt = _dtype(name)
    big = _largest(dt)
    q = np.full((1, 4, 1, 1), 0.9 * big, dt)
    k = np.array([0.0, -math.log(3.0) / 0.9], dt).reshape(1, 2, 1, 1)
    v = np.array([1.0, -1.0], dt).reshape(1, 2, 1, 1)
    do = np.full((1, 4, 1, 1), 4.0, dt)
    _check(q, k, v, do, scale=1.0 / big)


@pytest.mark.parametrize("name", DTYPES)
def test_k_near_largest_small_scale(name):
    """K at 0.9 of the largest, scale 1/max: sum_j dS_ij K_j overflowed before the scale (inf dq)."""
    dt = _dtype(name)
    big = _largest(dt)
    q = np.full((1, 1, 1, 1), math.log(3.0) / 1.8, dt)
    k = np.array([0.9 * big, -0.9 * big], dt).reshape(1, 2, 1, 1)
    v = np.array([1.0, -1.0], dt).reshape(1, 2, 1, 1)
    do = np.full((1, 1, 1, 1), 4.0, dt)
    _check(q, k, v, do, scale=1.0 / big)


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"dropout_p": 0.25, "seed": 3}])
def test_random_v_near_largest(name, options):
    """Random problems (GQA, head dim 16) with V at up to half the largest."""
    dt = _dtype(name)
    rng = np.random.default_rng(4)
    q, k, do = (rng.standard_normal(s).astype(dt) for s in ((1, 40, 4, 16), (1, 33, 2, 16), (1, 40, 4, 16)))
    v = (rng.standard_normal((1, 33, 2, 16)) * (_largest(dt) / 8)).astype(dt)
    _check(q, k, v, do, **options)


def _spy_shifts(monkeypatch):
    """The ``(ec, eq, ek)`` of every backward call's nb._GradShifts, in a list: which path ran."""
    seen = []
    real = nb._GradShifts.__call__

    def spy(self):
        got = real(self)
        seen.append(tuple(got))
        return got

    monkeypatch.setattr(nb._GradShifts, "__call__", spy)
    return seen


@pytest.mark.parametrize("options", [{}, {"causal": True, "dropout_p": 0.3, "seed": 7}])
def test_shifted_is_the_unshifted_scaled(options, monkeypatch):
    """The shifts are exact: dO = 2^100 x N(0, 1) against V ~ 2^24 takes them (float32), dO = N(0, 1) does not, and
    the gradients of the first are 2^100 times those of the second, bitwise, whatever the thread count."""
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 50, 4, 8)).astype(np.float32), rng.standard_normal((2, 70, 2, 8)).astype(np.float32)
    v = (rng.standard_normal((2, 70, 2, 8)) * 2.0 ** 24).astype(np.float32)
    do = rng.standard_normal((2, 50, 4, 8)).astype(np.float32)
    bias = rng.standard_normal((4, 1, 70)).astype(np.float32)
    opts = dict(options, bias=bias)
    shifts = _spy_shifts(monkeypatch)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    small = cuflash.attention_backward(do, q, k, v, out, lse, return_dbias=True, **opts)
    assert shifts and not any(any(s) for s in shifts), f"dO = N(0, 1) took the shifts {shifts}"
    for threads in ("1", "2"):
        monkeypatch.setenv("CUFLASH_NUM_THREADS", threads)
        shifts.clear()
        big = cuflash.attention_backward(np.ldexp(do, 100), q, k, v, out, lse, return_dbias=True, **opts)
        assert shifts and all(s[0] > 0 for s in shifts), f"dO = 2^100 N(0, 1) took no shift of dP: {shifts}"
        for s, b in zip(small, big):
            assert np.isfinite(b).all()
            assert np.array_equal(np.ldexp(s, 100), b)
    _check(q, k, v, np.ldexp(do, 100), **options)


@pytest.mark.parametrize("padded", ["v", "both"])
def test_huge_padding_leaves_the_sequences_alone(padded):
    """Padding past ``seqlens_q``/``seqlens_k`` is never read: 3e38 there (V's keys, or those and dO's rows) set the
    shifts of every sequence, pushing dS = P (dP - D) of V ~ 2^-116 into the subnormals (dP = dO V^T 2^-ec: up to
    100x the naive error), or to nothing (both: ec = 137). The NumPy backend now zero-fills a padding that holds
    anything else, as the kernels do on load (tests/test_unseen_values.py: its bits are those of zero padding)."""
    rng = np.random.default_rng(5)
    q, k, do = (rng.standard_normal(s).astype(np.float32) for s in ((2, 50, 2, 16), (2, 70, 1, 16), (2, 50, 2, 16)))
    v = np.ldexp(rng.standard_normal((2, 70, 1, 16)), -116).astype(np.float32)
    seqlens_q, seqlens_k = np.array([30, 50], np.int32), np.array([40, 70], np.int32)
    if padded in ("v", "both"):
        v[0, 40:] = 3e38
    if padded == "both":
        do[0, 30:] = 3e38
    _check(q, k, v, do, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
