"""The "emulate" backend: the real CUDA kernels of ``kernels/`` run on the CPU by :mod:`cuflash.emulate`.

NumPy arrays in, NumPy arrays out. The launch descriptions are built by the same functions as for
the CUDA backend (:mod:`cuflash.cuda.launch`), with NumPy buffers standing in for device memory, so
what passes here is what CuPy launches. Test infrastructure: slow (each CUDA thread is a fiber), for
small shapes; the CPU product is the "numpy" backend.
"""
from __future__ import annotations

from .. import _env
from ..cuda import launch as launches
from ..cuda import specs
from ..problem import Problem

#: what this backend computes (checked once, by cuflash.backends.select)
DTYPES = tuple(specs.CTYPES) + tuple(specs.WIDE_CTYPES)  # float32/float64: kernels/flash_*_wide.cu
MAX_HEAD_DIM = specs.NATIVE_HEAD_DIMS[-1]
BF16_BITS = True
MODIFIERS = True  # score and mask modifiers compiled into the kernels (cuflash/cuda/modcode.py)
ARRAYS = "numpy"
#: ragged batches (cuflash.attention_varlen): the kernels read cu_seqlens themselves (forward_varlen,
#: backward_varlen). KV caches (cuflash.attention_with_kvcache, forward_kvcache): contiguous or paged (the K/V loads
#: go through the block table), split-KV with a combine kernel; the append of k_new/v_new is an array copy.
VARLEN = True
KVCACHE = True


def available():
    try:
        from .. import emulate
    except ImportError as exc:  # pragma: no cover - the test bed ships with the package
        return False, f"cuflash.emulate cannot be imported: {exc}"
    return emulate.available()


def _max_smem() -> int:
    """The shared-memory limit of the GPU being emulated (``CUFLASH_EMULATE_ARCH``): with :func:`_cc` it picks the
    tile table row."""
    return specs.SMEM_LIMIT[_env.get("CUFLASH_EMULATE_ARCH")]


def _cc() -> int:
    """The compute capability being emulated (``CUFLASH_EMULATE_ARCH``): it picks the float64 arithmetic and, with
    :func:`_max_smem`, the tile table row (an H100's own rows: ``specs.ARCH_TILES``)."""
    return _env.get("CUFLASH_EMULATE_ARCH")


def forward(problem: Problem, *, schedule=None, seed=None, spec=None):
    """``(out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) float32)`` through the emulated kernel.

    ``spec`` forces a :class:`~cuflash.cuda.specs.KernelSpec` (tests use it to cover every table row).
    """
    from .. import emulate

    fl = launches.forward_launch(problem, max_smem=_max_smem(), spec=spec, cc=_cc())
    if fl.launch is not None:
        emulate.launch(fl.launch, schedule=schedule, seed=seed)
    return fl.result()


def backward(problem: Problem, dout, out, lse, *, deterministic=False, dbias=False, schedule=None, seed=None,
             spec=None, dq_spec=None):
    """``(dq, dk, dv)`` through the emulated backward kernels (:func:`cuflash.cuda.launch.backward_launch`).

    ``deterministic`` selects the atomic-free dQ pass; ``spec``/``dq_spec`` force the bwd / dq specializations.
    """
    from .. import emulate

    bl = launches.backward_launch(problem, dout, out, lse, deterministic=deterministic, max_smem=_max_smem(),
                                  spec=spec, dq_spec=dq_spec, dbias=dbias, cc=_cc())
    for launch in bl.launches:
        emulate.launch(launch, schedule=schedule, seed=seed)
    return bl.result()


def forward_varlen(problem, *, schedule=None, seed=None, spec=None):
    """``(out (total_q, Hq, D), lse (Hq, total_q))`` of a :class:`~cuflash.problem.VarlenProblem` through the emulated
    forward kernel (:func:`cuflash.cuda.launch.forward_varlen_launch`)."""
    from .. import emulate

    fl = launches.forward_varlen_launch(problem, max_smem=_max_smem(), spec=spec, cc=_cc())
    if fl.launch is not None:
        emulate.launch(fl.launch, schedule=schedule, seed=seed)
    return fl.result()


def backward_varlen(problem, dout, out, lse, *, deterministic=False, schedule=None, seed=None, spec=None,
                    dq_spec=None):
    """``(dq, dk, dv)`` packed like ``q``, ``k``, ``v`` through the emulated backward kernels."""
    from .. import emulate

    bl = launches.backward_varlen_launch(problem, dout, out, lse, deterministic=deterministic, max_smem=_max_smem(),
                                         spec=spec, dq_spec=dq_spec, cc=_cc())
    for launch in bl.launches:
        emulate.launch(launch, schedule=schedule, seed=seed)
    return bl.result()


def forward_kvcache(problem, *, sm_count=108, schedule=None, seed=None, spec=None):
    """Append ``k_new``/``v_new`` into the caches (an array copy), then ``(out (B, Sq, Hq, D), lse (B, Hq, Sq))``
    through the emulated KV-cache forward (and split-KV combine) kernels. ``sm_count``: the SM count the
    ``num_splits=None`` heuristic assumes (108, an A100's)."""
    from .. import emulate
    from .numpy_ragged import append_kvcache

    sizes = dict(max_smem=_max_smem(), sm_count=sm_count, spec=spec, cc=_cc())
    launches.check_kvcache_launch(problem, **sizes)  # a refused call leaves the caches as they were: the launch
    emulate._check_environment()  # limits and every CUFLASH_EMULATE_* variable are checked before the append
    with append_kvcache(problem):  # undone if the kernels fail to compile or run
        kl = launches.forward_kvcache_launch(problem, **sizes)
        for launch in kl.launches:
            emulate.launch(launch, schedule=schedule, seed=seed)
    return kl.result()
