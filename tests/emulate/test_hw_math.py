"""hw_math: the GPU's fp32 behaviour under CuPy's -ftz=true (denormals flushed, exp2f = ex2.approx.ftz.f32)."""
import numpy as np
import pytest

import cuflash.emulate as emu
from cuflash.backends import emulate as emulate_backend
from cuflash.problem import make_problem
from cuflash.testing import check_forward
from emu_helpers import spec

TINY = np.float32(1e-20)  # TINY * TINY = 1e-40: a float32 denormal
DENORMAL = np.float32(1e-39)
SPECIALS = np.array([0.0, -0.0, DENORMAL, -DENORMAL, -np.inf, np.inf, np.nan, -130.0, -149.5, -126.5], np.float32)


def _exp2_kernel(x, **kw):
    out = np.full(2 * x.size, -7, np.float32)
    emu.launch(spec("hardening_tests.cu", "exp2_kernel", (x, out, np.int32(x.size)), block=(64, 1, 1)), **kw)
    return out[:x.size], out[x.size:]


def _ulps(a, b):
    """Signed distance in units in the last place between positive normal float32 arrays."""
    return a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)


def _rounded_exp2(x):
    return np.exp2(x.astype(np.float64)).astype(np.float32)


def _normal_inputs(n=2000):
    return np.random.default_rng(0).uniform(-120, 120, n).astype(np.float32)


def test_exp2f_is_two_ulp_from_the_correctly_rounded_result():
    """PTX ISA 9.7.3.21: at most 2 ulp. The emulation is exactly 2 ulp off, up or down by the input bits."""
    x = _normal_inputs()
    exp2, _ = _exp2_kernel(x, hw_math=True)
    moved = _ulps(exp2, _rounded_exp2(x))
    assert set(np.abs(moved).tolist()) == {2}
    assert 0.4 < np.mean(moved > 0) < 0.6  # both directions, about equally often
    np.testing.assert_array_equal(_exp2_kernel(x, hw_math=True)[0], exp2)  # deterministic


def test_expf_intrinsic_is_ex2_of_the_scaled_input():
    x = np.random.default_rng(1).uniform(-80, 80, 1000).astype(np.float32)
    _, expf = _exp2_kernel(x, hw_math=True)
    scaled = x * np.float32(1.4426950408889634)  # rounded to fp32, as the GPU's fmul does
    assert set(np.abs(_ulps(expf, _rounded_exp2(scaled))).tolist()) == {2}


def test_exp2f_special_inputs_and_flushed_results():
    exp2, _ = _exp2_kernel(SPECIALS, hw_math=True)
    # +-0 and subnormal inputs (flushed to zero) give 1; -inf 0; +inf inf; NaN NaN; subnormal results +0.
    np.testing.assert_array_equal(exp2[:7], [1, 1, 1, 1, 0, np.inf, np.nan])
    np.testing.assert_array_equal(exp2[7:], 0)
    assert not np.signbit(exp2[7:]).any()


def test_without_hw_math_exp2f_is_the_host_function():
    x = np.concatenate([_normal_inputs(), SPECIALS])
    exp2, expf = _exp2_kernel(x, hw_math=False)
    finite = np.isfinite(x) & (x > -126)
    assert np.abs(_ulps(exp2[finite], _rounded_exp2(x[finite]))).max() <= 1
    assert exp2[-3] > 0 and exp2[-2] > 0  # 2^-130 and 2^-149.5 are denormals, not flushed
    in_range = finite & (np.abs(x) < 87)  # exp(x) a normal float32
    np.testing.assert_allclose(expf[in_range], np.exp(x[in_range].astype(np.float64)), rtol=3e-7)


def _ftz(**kw):
    n = 64
    a = np.full(n, TINY)
    a[1::2] = DENORMAL
    out = np.full(2 * n, -7, np.float32)
    emu.launch(spec("hardening_tests.cu", "ftz_kernel", (a, np.full(n, TINY), np.zeros(n, np.float32), out,
                                                        np.int32(n)), block=(32, 1, 1)), **kw)
    return out[0:n:2], out[n + 1::2]  # TINY * TINY (a denormal result), DENORMAL + 0 (a denormal operand)


def test_hw_math_flushes_denormals_and_restores_the_float_mode():
    product, total = _ftz(hw_math=True)
    np.testing.assert_array_equal(product, 0)
    np.testing.assert_array_equal(total, 0)
    product, total = _ftz(hw_math=False)  # the next launch (same thread or not) is IEEE again
    np.testing.assert_array_equal(product, TINY * TINY)
    np.testing.assert_array_equal(total, DENORMAL)
    assert TINY * TINY > 0  # and so is this thread


def test_hw_math_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUFLASH_EMULATE_HW_MATH", "1")
    assert (_ftz()[0] == 0).all()
    assert (_ftz(hw_math=False)[0] > 0).all()  # the argument wins
    monkeypatch.setenv("CUFLASH_EMULATE_HW_MATH", "0")
    assert (_ftz()[0] > 0).all()


def test_forward_attention_in_hw_math_mode_holds_the_accuracy_rule(monkeypatch):
    from cases import make_case

    case = make_case(2, 130, 150, 2, 1, 64, np.float16, causal=True)

    def forward(q, k, v, **options):
        return emulate_backend.forward(make_problem(q, k, v, **options))

    ieee_out, _ = forward(case.q, case.k, case.v, **case.options)
    monkeypatch.setenv("CUFLASH_EMULATE_HW_MATH", "1")
    hw_out, _ = check_forward(forward, case)
    assert not np.array_equal(hw_out, ieee_out)  # the mode reached the kernel's exp2f
