"""Shared-memory bank conflicts of every kernel specialization, counted by the CPU emulator.

A GPU is needed to time a kernel, not to see its shared-memory addresses: the emulator counts, for
every ldmatrix (per 8x8 matrix) and every quarter-warp of 16-byte cp.async stores, how many
wavefronts the 32 banks need (``cuflash.emulate.BankStats``). The padded row strides of
kernel_traits.cuh / bwd_traits.cuh and the row order of tile.cuh's load_tile are meant to make
every one of them conflict-free; this holds them to it on one query tile and two key tiles (the
addresses do not depend on masks or values). fp16 only: bf16 specializations address the same bytes.
"""
import numpy as np
import pytest

from cuflash import emulate
from cuflash.cuda import launch as launches
from cuflash.cuda import specs
from cuflash.problem import make_problem

from emulated_support import pytestmark  # noqa: F401  (pytestmark marks the module)

FWD = [s for s in specs.all_specs(("fwd",)) if s.dtype == "float16"]
BWD = [s for s in specs.all_specs(("bwd", "dq")) if s.dtype == "float16"]


def _ids(spec):
    return spec.family + "<" + spec.name_expression.split("<")[1]


def _problem(block_m, block_n, head_dim):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, block_m, 1, head_dim)).astype(np.float16)
    k = rng.standard_normal((1, 2 * block_n, 1, head_dim)).astype(np.float16)
    return make_problem(q, k, k), q


def _assert_conflict_free(stats, name):
    assert stats.ldmatrix_requests > 0 and stats.cp_async_requests > 0, f"{name}: no shared-memory traffic seen"
    assert stats.conflict_free, f"{name}: {stats}"


@pytest.mark.parametrize("spec", FWD, ids=_ids)
def test_forward_is_conflict_free(spec):
    problem, _ = _problem(spec.block_m, spec.block_n, spec.head_dim)
    fl = launches.forward_launch(problem, max_smem=specs.SMEM_LIMIT[90], spec=spec)
    _assert_conflict_free(emulate.launch(fl.launch), spec.name_expression)


@pytest.mark.parametrize("spec", BWD, ids=_ids)
def test_backward_is_conflict_free(spec):
    problem, q = _problem(2 * spec.block_m, spec.block_n, spec.head_dim)
    lse = np.zeros((1, 1, q.shape[1]), np.float32)
    which = dict(spec=spec) if spec.family == "bwd" else dict(dq_spec=spec, deterministic=True)
    bl = launches.backward_launch(problem, q, np.zeros_like(q), lse, max_smem=specs.SMEM_LIMIT[90], **which)
    kernel = [launch for launch in bl.launches if launch.name_expression == spec.name_expression]
    assert len(kernel) == 1
    _assert_conflict_free(emulate.launch(kernel[0]), spec.name_expression)
