"""The float32/float64 CUDA kernels (kernels/flash_*_wide.cu) on a real GPU (CuPy): skipped cleanly without CuPy or
a usable GPU.

Each arithmetic the GPU runs (float32 with precision "ieee", "3xtf32", "tf32"; float64 on DMMA, or DFMA on GPUs
without float64 tensor cores), forward and backward, held to its mode's rules (tests/wide_support.py): hypothesis
over the shared strategies (head dims up to 256, awkward lengths, masks, GQA, seqlens, dropout), every table row,
every feature of the emulated tests, the RMS rule at seqlens of a few thousand, and bitwise determinism of repeated
runs (deterministic backward included). First run on an H100 on 2026-11-26 (README, "First GPU run").

The float64 checks compare against a long-double reference, which NumPy computes without BLAS: their sizes are kept
to a few hundred rows so that one device call holds them (the float32 ones go to thousands).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cuflash
from cuflash.cuda import specs
from cuflash.problem import make_problem
from cuflash.testing import attention_cases

import gpu_support  # noqa: E402
import wide_support as ws
from cases import make_case
from test_kernels_emulated_wide import as_mode, feature_cases, _with_float_operands

cp, pytestmark, _ = gpu_support.setup()

MODES = [("float32", "ieee"), ("float32", "3xtf32"), ("float32", "tf32"), ("float64", "ieee")]
IDS = ["f32-ieee", "f32-3xtf32", "f32-tf32", "f64"]


def _device(options):
    """The case's options with its arrays on the GPU, as the CUDA path requires (mod_arrays' values too)."""
    def on(x):
        return cp.asarray(x) if isinstance(x, np.ndarray) else x

    def moved(key, value):
        if key.startswith("seqlens"):
            return cp.asarray(value)
        if key == "mod_arrays":
            return {name: on(a) for name, a in value.items()}
        return on(value) if key in ("bias", "alibi_slopes") else value

    return {k: moved(k, v) for k, v in options.items()}


def on_gpu(q, k, v, **options):
    out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True, **_device(options))
    assert isinstance(out, cp.ndarray) and out.dtype == q.dtype
    assert lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    return cp.asnumpy(out), cp.asnumpy(lse)


def gpu_backward(deterministic=False):
    def fn(dout, q, k, v, out, lse, **options):
        grads = cuflash.attention_backward(*(cp.asarray(a) for a in (dout, q, k, v, out, lse)),
                                           deterministic=deterministic, **_device(options))
        return tuple(cp.asnumpy(g) for g in grads)

    return fn


def check(case, precision, deterministic=False):
    out, lse = ws.check_forward(on_gpu, case, precision)
    return ws.check_backward(gpu_backward(deterministic), case, out, lse, precision)


@pytest.mark.parametrize("dtype,precision", MODES, ids=IDS)
def test_hypothesis(dtype, precision):
    f64 = dtype == "float64"

    @settings(max_examples=25 if f64 else 60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(attention_cases(dtypes=(dtype,), max_seqlen=160 if f64 else 400, max_head_dim=256,
                           block_sizes=(16, 32, 64, 128), dropout=True))
    def run(case):
        case.options["precision"] = precision
        check(case, precision, deterministic=bool(case.q.shape[-1] % 2))

    run()


@pytest.mark.parametrize("name,case", feature_cases(), ids=[n for n, _ in feature_cases()])
@pytest.mark.parametrize("dtype,precision", MODES, ids=IDS)
def test_feature(name, case, dtype, precision):
    check(_with_float_operands(as_mode(case, dtype, precision)), precision)


@pytest.mark.parametrize("dtype,precision", MODES, ids=IDS)
def test_every_head_dim_and_long_awkward_lengths(dtype, precision):
    lengths = ((129, True), (257, False)) if dtype == "float64" else ((1023, True), (2000, False))
    for d in specs.NATIVE_HEAD_DIMS:
        for n, causal in lengths:
            check(as_mode(make_case(1, n, n + 37, 4, 2, d - 3, causal=causal), dtype, precision), precision)


@pytest.mark.parametrize("dtype,precision", MODES, ids=IDS)
def test_rms_accuracy_class(dtype, precision):
    sizes = [(384, 64), (512, 128)] if dtype == "float64" else [(2048, 64), (4096, 128)]
    for seed, (n, d) in enumerate(sizes):
        case = as_mode(make_case(1, n, n, 4, 2, d, seed=seed, causal=bool(seed)), dtype, precision)
        print(dtype, precision, n, d, ws.check_rms(on_gpu, gpu_backward(), case, precision))


@pytest.mark.parametrize("dtype,precision", MODES, ids=IDS)
def test_repeated_runs_are_bitwise_identical(dtype, precision):
    case = as_mode(make_case(2, 700, 900, 4, 2, 96, causal=True), dtype, precision)
    q, k, v, do = (cp.asarray(a) for a in (case.q, case.k, case.v, case.dout))
    runs = [cuflash.attention(q, k, v, return_lse=True, causal=True, precision=precision) for _ in range(3)]
    assert all(cp.array_equal(a, runs[0][0]) and cp.array_equal(b, runs[0][1]) for a, b in runs[1:])
    out, lse = runs[0]
    grads = [cuflash.attention_backward(do, q, k, v, out, lse, causal=True, precision=precision, deterministic=True)
             for _ in range(3)]
    assert all(cp.array_equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))


def test_float64_arithmetic_matches_the_device():
    """DMMA where the GPU has float64 tensor cores (sm_80, sm_90), DFMA elsewhere."""
    from cuflash.backends import cuda
    from cuflash.cuda import launch

    _, cc, _ = cuda._device()
    x = cp.zeros((1, 16, 1, 64))
    fl = launch.forward_launch(make_problem(x, x, x), cc=cc)
    assert ("F64Dmma" if cc in specs.DMMA_CCS else "F64Fma") in fl.launch.name_expression
