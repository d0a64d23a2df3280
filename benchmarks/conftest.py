"""pytest-benchmark suite of cuflash: ``python -m pytest benchmarks/`` (not part of the test run).

Every case is a :class:`benchmarks.cases.Case` measured by the same code as ``python -m benchmarks.run``:
the first call (warm-up: compilation, caches) observes peak memory, further warm-up calls follow,
then pytest-benchmark times rounds of the runner's timed function — on a GPU, with CUDA events
around calls that end by synchronizing the device. ``extra_info`` carries the
:class:`benchmarks.report.Record` (median ms from the event timer, TFLOP/s, GB/s, peak bytes, io_cost bytes).

GPU cases carry ``@pytest.mark.gpu`` and skip cleanly without CuPy and a GPU; a baseline that is
not importable (PyTorch, JAX) or does not support a case skips with the reason.
"""
from __future__ import annotations

from dataclasses import asdict

import pytest

from benchmarks.environment import gpu_available
from benchmarks.impls import IMPLS, Skip, applicable, model_io_bytes
from benchmarks.inputs import make_inputs
from benchmarks.report import Record
from benchmarks.timing import Timer, first_call_peak, is_oom, release_memory


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and CuPy (skipped cleanly otherwise)")


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU with CuPy here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_case(benchmark, case, impl_name: str, *, rounds: int, warmup: int = 1):
    """Measure ``impl_name`` on ``case`` with pytest-benchmark; skip with the reason when it cannot run."""
    impl = IMPLS[impl_name]
    why = applicable(impl, case)
    if why:
        pytest.skip(why)
    try:
        impl.check(case.device)
        run, sync = impl.build(case, make_inputs(case))
        peak = first_call_peak(run, sync, device=case.device, memory=impl.memory)
    except Skip as exc:
        pytest.skip(str(exc))
    except Exception as exc:  # noqa: BLE001
        if is_oom(exc):
            pytest.skip(f"out of memory: {exc}")
        raise
    for _ in range(warmup):
        sync(run())
    timer = Timer(run, sync, device=case.device)
    benchmark.pedantic(timer.sample, rounds=rounds, iterations=1, warmup_rounds=0)
    record = Record.of(case, impl_name, timer, peak, model_io_bytes(case, impl))
    benchmark.extra_info.update(asdict(record))
    benchmark.extra_info["timer"] = "cuda-events" if case.device == "cuda" else "perf_counter"
    release_memory(case.device)
    return record
