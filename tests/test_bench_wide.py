"""The float32/float64 benchmark figure ("wide", benchmarks/cases.py) without a GPU: its cases, the naive baselines
in the same accuracy class (cupy-naive's backward, the compute types), the records' precision label, the targets'
report, and one cuflash measurement per arithmetic on the fake GPU (kernels on the CPU emulator)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from benchmarks import cases, impls, report
from cuflash import emulate
from cuflash.testing import Case, check_backward

needs_emulator = pytest.mark.skipif(not emulate.available()[0], reason=f"CPU emulation unavailable: "
                                                                       f"{emulate.available()[1]}")


def test_wide_figure_cases():
    full = [c for c in cases.suite("cuda", "full") if c.figure == "wide"]
    assert {(c.dtype, c.precision) for c in full} == set(cases.WIDE_MODES)
    assert {c.seqlen_q for c in full} == {1024, 2048, 4096, 8192, 16384} and {c.op for c in full} == {"fwd", "bwd"}
    assert all(c.batch * c.seqlen_q == 16384 and c.heads * c.head_dim == 2048 and not c.causal for c in full)
    assert all(c.impls == ("cuflash", "cupy-naive", "torch-math") for c in full)
    quick = [c for c in cases.suite("cuda", "quick") if c.figure == "wide"]
    assert {c.seqlen_q for c in quick} == {1024, 4096} and {c.op for c in quick} == {"fwd"}
    assert not [c for m in cases.MODES for c in cases.suite("cpu", m) if c.figure == "wide"]  # a GPU figure
    assert "precision=3xtf32" in next(c for c in full if c.precision == "3xtf32").label()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_naive_backward_is_the_gradient(dtype):
    """cupy-naive's backward (standard attention's, FA1 Algorithm 3, from the saved P and O), on NumPy arrays."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((2, 33, 3, 16)).astype(dtype) for _ in range(4))
    scale = 1 / np.sqrt(16)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    got = impls.standard_attention_backward(q, k, v, do, p.astype(dtype), out.astype(dtype))
    assert all(g.dtype == dtype and g.shape == x.shape for g, x in zip(got, (q, k, v)))
    # the rule: 3x the naive same-dtype computation's error (float64: against the long-double reference)
    check_backward(lambda *a, **o: got, Case(q, k, v, do, {}), None, None)


def test_records_carry_the_precision_and_the_targets_are_reported():
    class T:  # a timer's surface
        median_ms, host_median_ms, samples, calls = 2.0, 0.5, [1], 1

    rec = [("wide", report.Record.of(cases.Case("wide", "cuda", "fwd", dt, 1, 32, n, n, 64, precision=pr), impl, T(),
                                     None, None))
           for dt, pr in cases.WIDE_MODES for n in (1024, 4096) for impl in ("cuflash", "cupy-naive")]
    assert {r.dtype for _, r in rec} == {"float32", "float32:3xtf32", "float32:tf32", "float64"}
    rec[-2][1].tflops = 40.0  # float64 cuflash at seqlen 4096
    text = "\n".join(report.wide_targets(report.RunResult(records=rec)))
    assert "float64 fwd at seqlen 4096: 40.0 TFLOP/s = 60% of 67 (target >= 50%: met)" in text
    assert "float32:tf32 fwd: cuflash / cupy-naive <= 1.00x over seqlens [1024, 4096] (target < 1 at every " \
           "seqlen: not met)" in text


def test_compute_types_of_the_accuracy_classes():
    pytest.importorskip("cupy._core._routines_linalg", reason="CuPy not installed")
    from cupy._core import _routines_linalg as linalg

    assert impls.cublas_compute_type("float32", "tf32") == linalg.COMPUTE_TYPE_TF32
    assert impls.cublas_compute_type("float32", "3xtf32") == impls.cublas_compute_type("float32", "ieee") == \
        linalg.COMPUTE_TYPE_FP32
    assert impls.cublas_compute_type("float64", "ieee") == linalg.COMPUTE_TYPE_DEFAULT


@needs_emulator
@pytest.mark.parametrize("dtype,precision,atom", [("float32", "ieee", "F32Fma"), ("float32", "3xtf32", "F32Tf32x3"),
                                                  ("float32", "tf32", "F32Tf32"), ("float64", "ieee", "F64Dmma")])
def test_wide_case_measures_cuflash_on_the_fake_gpu(monkeypatch, request, dtype, precision, atom):
    import fake_cupy_bench
    from benchmarks import inputs, run, timing
    from cuflash.backends import cuda

    cp = fake_cupy_bench.make()
    for name, module in fake_cupy_bench.modules(cp).items():
        monkeypatch.setitem(sys.modules, name, module)
    cuda._memoized.cache_clear()
    request.addfinalizer(cuda._memoized.cache_clear)
    case = cases.Case("wide", "cuda", "fwd", dtype, 1, 2, 128, 128, 32, precision=precision)
    record = run.measure(case, impls.IMPLS["cuflash"], inputs.make_inputs(case), timing=timing.TIMINGS["smoke"])
    assert record.ms > 0 and record.dtype == (dtype if precision == "ieee" else f"{dtype}:{precision}")
    assert {launch.name.split("<")[1].split(",")[0] for launch in cp._launches} == {f"cuflash::wide::{atom}"}
