"""The "emulate" backend: the real CUDA kernels of ``kernels/`` run on the CPU by :mod:`cuflash.emulate`.

NumPy arrays in, NumPy arrays out. The launch description is built by the same function as for the
CUDA backend (:func:`cuflash.kernels.forward_launch`), with NumPy buffers standing in for device
memory, so what passes here is what CuPy launches. Test infrastructure: slow (each CUDA thread is a
fiber), for small shapes; the CPU product is the "numpy" backend.
"""
from __future__ import annotations

import os

from .. import kernels
from ..problem import Problem

#: the GPU whose shared-memory limit picks the tile table row (default an A100/H100-class sm_80)
from ..emulate._arch import ARCH  # parsed by cuflash._env at each use, not at import

#: the kernels apply dropout forward (kernels/dropout.cuh) and backward (the same keep bits, regenerated)
supports_dropout = True
supports_dropout_backward = True


def available():
    try:
        from .. import emulate
    except ImportError as exc:  # pragma: no cover - the test bed ships with the package
        return False, f"cuflash.emulate cannot be imported: {exc}"
    return emulate.available()


def _check(problem: Problem):
    dtype = kernels.dtype_of(problem.q)
    if dtype not in kernels.SUPPORTED_DTYPES:
        raise TypeError(f"the CUDA kernels (and so backend='emulate') take float16 or bfloat16 inputs, got {dtype}")


def forward(problem: Problem, *, schedule=None, seed=None, spec=None):
    """``(out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) float32)`` through the emulated kernel.

    ``spec`` forces a :class:`~cuflash.kernels.KernelSpec` (tests use it to cover every table row).
    """
    from .. import emulate

    _check(problem)
    fl = kernels.forward_launch(problem, max_smem=kernels.SMEM_LIMIT[ARCH], spec=spec)
    if fl.spec is not None:
        emulate.launch(fl.spec, schedule=schedule, seed=seed)
    return fl.result()


def backward(problem: Problem, dout, out, lse, *, deterministic=False, schedule=None, seed=None, spec=None,
             dq_spec=None):
    """``(dq, dk, dv)`` through the emulated backward kernels (:func:`cuflash.kernels_bwd.backward_launch`).

    ``deterministic`` selects the atomic-free dQ pass; ``spec``/``dq_spec`` force the main / dq
    specializations (:class:`~cuflash.kernels_bwd.BwdSpec`, :class:`~cuflash.kernels_bwd.DqSpec`).
    """
    from .. import emulate, kernels_bwd

    _check(problem)
    bl = kernels_bwd.backward_launch(problem, dout, out, lse, deterministic=deterministic,
                                     max_smem=kernels.SMEM_LIMIT[ARCH], spec=spec, dq_spec=dq_spec)
    for launch in bl.launches:
        emulate.launch(launch, schedule=schedule, seed=seed)
    return bl.result()
