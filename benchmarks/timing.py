"""Timing (CUDA events on a GPU, ``perf_counter`` on the CPU) and peak-memory observation."""
from __future__ import annotations

import gc
import math
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np


@dataclass(frozen=True)
class Timing:
    """How long to measure: ``warmup`` calls after the first one (which also observes peak memory and
    pays for compilation), then samples until ``budget_s`` of timed time has passed (at least
    ``min_repeats``, at most ``max_repeats``)."""

    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 25
    budget_s: float = 0.25
    min_sample_ms: float = 1.0     # GPU: back-to-back calls per sample, so a sync does not dominate


TIMINGS = {"smoke": Timing(warmup=0, min_repeats=1, max_repeats=2, budget_s=0.0),
           "quick": Timing(warmup=0, min_repeats=3, max_repeats=9, budget_s=0.15),
           "full": Timing(warmup=1, min_repeats=3, max_repeats=15, budget_s=0.15)}


class Timer:
    """Timed samples of ``run`` (each sample: ``calls`` calls, then ``sync``), in ms per call.

    On CUDA the clock is a pair of CUDA events on the current CuPy stream around the timed
    function; the function ends with a device synchronization, so the end event also covers work
    that another library queued on its own streams.
    """

    def __init__(self, run: Callable, sync: Callable, *, device: str, calls: int = 1):
        self.run, self.sync, self.device, self.calls = run, sync, device, calls
        self.samples: list[float] = []
        # CUDA: the host's share (launches return before the GPU finishes): where it nears ``samples``, the GPU
        # waited on the host, and the time is the host's, not the kernels' (the short lengths of the GPU runs)
        self.host_samples: list[float] = []
        if device == "cuda":
            import cupy

            self._events = (cupy.cuda.Event(), cupy.cuda.Event())

    def timed(self):
        """The timed function: ``calls`` calls, then a synchronization. Records the host's time for the calls
        alone (before the synchronization) in ``host_samples``, ms per call."""
        result = None
        t0 = time.perf_counter()
        for _ in range(self.calls):
            result = self.run()
        self.host_samples.append((time.perf_counter() - t0) * 1e3 / self.calls)
        self.sync(result)

    def sample(self) -> float:
        """Run the timed function once; record and return its ms per call."""
        if self.device == "cuda":
            import cupy

            start, end = self._events
            start.record()
            self.timed()
            end.record()
            end.synchronize()
            ms = cupy.cuda.get_elapsed_time(start, end)
        else:
            t0 = time.perf_counter()
            self.timed()
            ms = (time.perf_counter() - t0) * 1e3
        self.samples.append(ms / self.calls)
        return ms / self.calls

    @property
    def median_ms(self) -> float:
        return float(np.median(self.samples))

    @property
    def host_median_ms(self) -> float:
        return float(np.median(self.host_samples))


def time_it(run: Callable, sync: Callable, *, device: str, timing: Timing) -> Timer:
    """Warm up, then sample until the budget is spent; returns the Timer (``median_ms``).

    On CUDA a first probe sample sets ``calls`` so that one sample lasts ``min_sample_ms``; the
    probe is not kept.
    """
    for _ in range(timing.warmup):
        sync(run())
    timer = Timer(run, sync, device=device)
    if device == "cuda":
        probe = timer.sample()
        timer.samples.clear()
        timer.host_samples.clear()
        timer.calls = max(1, min(50, math.ceil(timing.min_sample_ms / max(probe, 1e-3))))
    spent = 0.0
    while len(timer.samples) < timing.min_repeats or (
            spent < timing.budget_s * 1e3 and len(timer.samples) < timing.max_repeats):
        spent += timer.sample() * timer.calls
    return timer


def first_call_peak(run: Callable, sync: Callable, *, device: str, memory: Optional[str]) -> Optional[int]:
    """Run one (warm-up) call; return the extra bytes it allocated at its peak beyond what was live
    before it, or None where that cannot be observed (``memory`` None; PyTorch on the CPU, whose
    allocator tracemalloc does not see)."""
    if device == "cpu":
        if memory == "torch":
            sync(run())
            return None
        return _tracemalloc_peak(run)
    if memory is None:
        sync(run())
        return None
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    base = pool.total_bytes()
    torch_base = _torch_reset_peak() if memory == "torch" else 0
    sync(run())
    extra = pool.total_bytes() - base  # the pool only grows when no cached block fits: its high-water mark
    if memory == "torch":
        import torch

        extra += torch.cuda.max_memory_allocated() - torch_base
    return int(extra)


def _tracemalloc_peak(run: Callable) -> int:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = run()
        peak = tracemalloc.get_traced_memory()[1]
        del result
    finally:
        tracemalloc.stop()
    return int(peak - base)


def _torch_reset_peak() -> int:
    import torch

    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def release_memory(device: str, *, collect: bool = True):
    """Hand cached device memory back, so one library's cache cannot starve another. ``collect``
    also runs the garbage collector first (between cases; it costs tens of ms with torch loaded).
    On the CPU reference counting already frees a case's arrays."""
    if device != "cuda":
        return
    if collect:
        gc.collect()  # autograd graphs and JAX buffers can sit in reference cycles
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        import torch

        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says some library ran out of memory (each spells it its own way)."""
    text = f"{type(exc).__name__} {exc}".lower()
    return any(s in text for s in ("outofmemory", "out of memory", "resource_exhausted", "memoryerror"))
