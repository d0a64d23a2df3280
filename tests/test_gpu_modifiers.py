"""Score and mask modifiers and element-exact BlockMasks in the CUDA kernels on a real GPU (CuPy): skipped cleanly
without CuPy or a usable GPU.

The cases of tests/test_modifiers.py (bias with dbias, ALiBi, softcap, score_mod, mask_mod, everything at once,
document/prefix-LM/dense-bit/combined BlockMasks), which the emulated kernels pass in CI, here on the hardware:
forward and backward (dbias included), both dQ modes, float16 and bfloat16, at head_dim 40 (padded to 64) and 128
(on sm_90 the backward's modified row, specs.ARCH_PLAIN_ONLY), against the float64 reference with the usual rules;
then a sharded property over the shared strategy's modifiers. Until 2026-11-27 the GPU suite drew element-exact
BlockMasks only: no score or mask modifier, bias, ALiBi, softcap or dbias had run in a kernel on a GPU.
"""
import numpy as np
import pytest

import cuflash
from cuflash.testing import Case, attention_cases, check_backward, check_forward

from cases import assert_bitwise_equal_runs, bf16, hostile_modifier_cases, host, make_case, modifier_cases

import gpu_support  # noqa: E402

cp, pytestmark, DTYPES = gpu_support.setup()
CASES = modifier_cases()
HOSTILE = hostile_modifier_cases()


def on_gpu(options):
    """The case's options with its arrays on the device, as a CuPy user passes them (the kernels read bias, ALiBi
    slopes and mod_arrays in place: a NumPy array there is a TypeError); a BlockMask stays as it is."""
    def move(x):
        return cp.asarray(x) if isinstance(x, np.ndarray) else x

    return {k: ({n: move(a) for n, a in v.items()} if k == "mod_arrays" else move(v)) for k, v in options.items()}


def gpu_forward(q, k, v, **options):
    out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True, **on_gpu(options))
    assert isinstance(out, cp.ndarray) and out.dtype == q.dtype
    return host(out), host(lse)


def gpu_backward(deterministic):
    def fn(dout, q, k, v, out, lse, **options):
        grads = cuflash.attention_backward(*(cp.asarray(a) for a in (dout, q, k, v, out, lse)),
                                           deterministic=deterministic, **on_gpu(options))
        return tuple(host(g) for g in grads)

    return fn


def check(case, deterministic=False):
    out, lse = check_forward(gpu_forward, case)
    check_backward(gpu_backward(deterministic), case, out, lse)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("d", [40, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_modifier(name, dtype, d, deterministic):
    check(make_case(2, 75, 75, 4, 2, d, bf16() if dtype == "bfloat16" else np.float16, **CASES[name]), deterministic)


@gpu_support.sharded(attention_cases(dtypes=DTYPES, max_seqlen=300, max_head_dim=256, modifiers=True),
                     max_examples=60, shards=4)
def test_hypothesis_modifiers(case):
    check(case, deterministic=bool(case.q.shape[-1] % 2))


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_modifier(name):
    """tests/test_modifiers.py's hostile modifiers in the float32 kernels (the emulator passes them in CI): the
    language's integer edges (x % 0, INT_MIN % -1, a product wrapping in the padding rows: a trap on a CPU, undefined
    on a GPU before kernels/mods.cuh guarded them) and float literals rounded to float32 once, or past its range."""
    options = HOSTILE[name]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 2, 32)).astype(np.float32) for _ in range(3))
    with np.errstate(all="ignore"):
        ref = cuflash.reference.attention(q, k, v, **options)
    if np.isnan(ref).any():
        np.testing.assert_array_equal(np.isnan(gpu_forward(q, k, v, **options)[0]), np.isnan(ref))
    else:
        check_forward(gpu_forward, Case(q, k, v, q, options))


@pytest.mark.parametrize("bias_shape", [(300,), (4, 1, 300), (1, 300, 300)], ids=["per-key", "per-head-key", "shared"])
def test_deterministic_dbias_of_a_broadcast_bias_is_bitwise_reproducible(bias_shape):
    """A bias that broadcasts over batch, heads or rows sums dbias over them: atomics by default, in a fixed order
    with deterministic=True, so three runs give the same bits for dQ, dK, dV and dbias (the emulator runs its blocks
    one after another, so only a GPU can show this)."""
    case = make_case(2, 300, 300, 4, 2, 64, np.float16, causal=True, seed=3)
    bias = cp.asarray(np.random.default_rng(4).standard_normal(bias_shape).astype(np.float32))
    q, k, v, dout = (cp.asarray(a) for a in (case.q, case.k, case.v, case.dout))
    out, lse = cuflash.attention(q, k, v, bias=bias, causal=True, return_lse=True)
    runs = [cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias, causal=True, deterministic=True,
                                       return_dbias=True) for _ in range(3)]
    assert runs[0][3].shape == bias.shape and runs[0][3].dtype == bias.dtype
    assert_bitwise_equal_runs(runs)
