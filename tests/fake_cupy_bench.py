"""tests/fake_cupy.py's fake CuPy plus what the benchmark runner and ``gpu_session.sh``'s probes call.

The additions, all host-side: ``cupy.random.default_rng`` (draws on the host, then copies to fake device
memory), a memory pool that holds nothing (``total_bytes() == 0``: peak memory reads 0 in a dry run),
``cuda.Event`` / ``cuda.get_elapsed_time`` on ``time.perf_counter``, ``runtime.getDeviceProperties``,
``runtime.runtimeGetVersion`` / ``driverGetVersion`` and ``cuda.nvrtc.getVersion``, each reporting a fake
CUDA 13.0. Kernels still run through the CPU emulator, so the cuda backend's launches are real ones.

:func:`from_environment` reads ``FAKE_GPUS`` (comma-separated names of tests/fake_cupy.py's devices:
``H100``, ``A100``, ``RTX_4090``, ``T4``; empty: no device; default ``H100``) and ``FAKE_CUPY_MISSING``
(set: ``import cupy`` fails): ``tests/fake_gpu/cupy`` builds the dry run's ``cupy`` with it.
"""
from __future__ import annotations

import os
import sys
import time
import types

import numpy as np

import fake_cupy
import fake_nccl

FAKE_CUDA = 13000  # CUDA 13.0, as the runtime API spells versions


def make(gpus=(fake_cupy.H100,)) -> types.ModuleType:
    """A fake ``cupy`` (see the module docstring) with one device per :class:`fake_cupy.Gpu` in ``gpus``."""
    gpus = tuple(gpus)
    cp = fake_cupy.make(gpus)
    cp.random = _random(cp)
    pool = types.SimpleNamespace(free_all_blocks=lambda: None, total_bytes=lambda: 0, used_bytes=lambda: 0)
    cp.get_default_memory_pool = lambda: pool
    cp.cuda.Event, cp.cuda.get_elapsed_time = _Event, lambda start, end: (end.t - start.t) * 1e3
    runtime = cp.cuda.runtime
    runtime.getDeviceProperties = lambda i: {"name": gpus[i].name.encode(), "totalGlobalMem": 80 << 30,
                                             "multiProcessorCount": 132}
    runtime.runtimeGetVersion = runtime.driverGetVersion = lambda: FAKE_CUDA
    cp.cuda.nvrtc = types.ModuleType("cupy.cuda.nvrtc")
    cp.cuda.nvrtc.getVersion = lambda: (FAKE_CUDA // 1000, FAKE_CUDA % 1000 // 10)
    # CuPy's element-wise math (stack, exp, operators, ...) that cuflash.distributed and cuflash.merge use on device
    # arrays: without it the GPU suite's MPI test failed in every case on the fake GPU, not on a GPU
    fake_nccl.add_math(_Never(), cp)
    return cp


class _Never:
    """A ``pytest.MonkeyPatch`` that is never undone: the fake lives as long as the process."""

    def setattr(self, target, name, value, raising=True):
        setattr(target, name, value)


class _Event:
    def __init__(self, *args, **kw):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()  # the fake launches synchronously: host time is device time

    def synchronize(self):
        pass


def _random(cp) -> types.ModuleType:
    random = types.ModuleType("cupy.random")

    class Generator:
        def __init__(self, seed):
            self._rng = np.random.default_rng(seed)

        def standard_normal(self, size=None, dtype=np.float64):
            return cp.asarray(self._rng.standard_normal(size, dtype=dtype))

    random.default_rng = Generator
    return random


def modules(cp) -> dict:
    """``{module name: module}`` to put in ``sys.modules`` so that ``from cupy.cuda import nvrtc`` works."""
    return {"cupy": cp, "cupy.cuda": cp.cuda, "cupy.cuda.runtime": cp.cuda.runtime, "cupy.cuda.nvrtc": cp.cuda.nvrtc,
            "cupy.random": cp.random}


def from_environment() -> types.ModuleType:
    """The fake ``cupy`` that ``FAKE_GPUS`` / ``FAKE_CUPY_MISSING`` describe (see the module docstring)."""
    if os.environ.get("FAKE_CUPY_MISSING"):
        raise ImportError("No module named 'cupy' (FAKE_CUPY_MISSING is set)")
    names = [n.strip() for n in os.environ.get("FAKE_GPUS", "H100").split(",") if n.strip()]
    unknown = [n for n in names if not isinstance(getattr(fake_cupy, n, None), fake_cupy.Gpu)]
    if unknown:
        raise ValueError(f"FAKE_GPUS names unknown devices {unknown}; tests/fake_cupy.py has H100, A100, RTX_4090, T4")
    return make([getattr(fake_cupy, n) for n in names])


def install_from_environment():
    """Replace the module being imported as ``cupy`` (tests/fake_gpu/cupy) by the fake, in ``sys.modules``."""
    sys.modules.update(modules(from_environment()))
