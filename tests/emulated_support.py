"""What the emulated kernel test modules share: the skip mark, the dtypes, and the calls that run
the forward and backward kernels through ``backend="emulate"``."""
import numpy as np
import pytest

import cuflash
from cuflash import emulate, reference, testing
from cuflash.backends import emulate as emulate_backend
from cuflash.problem import check_backward as flatten_backward
from cuflash.problem import make_problem

_ok, _why = emulate.available()
pytestmark = [pytest.mark.emulate, pytest.mark.skipif(not _ok, reason=f"CPU emulation unavailable: {_why}")]

try:
    import ml_dtypes  # noqa: F401

    DTYPES = [np.float16, "bfloat16"]
except ImportError:  # bf16 NumPy arrays need ml_dtypes (a test extra)
    DTYPES = [np.float16, pytest.param("bfloat16", marks=pytest.mark.skip(reason="ml_dtypes not installed"))]


def emulated(q, k, v, **options):
    """``(out, lse)`` of the forward kernel run on the CPU."""
    return cuflash.attention(q, k, v, return_lse=True, backend="emulate", **options)


def forward(case):
    """``(out, lse)`` of the emulated forward kernel for a :class:`cuflash.testing.Case`."""
    return emulated(case.q, case.k, case.v, **case.options)


def emulated_backward(deterministic=False, **kw):
    """``fn(dout, q, k, v, out, lse, **options) -> (dq, dk, dv)`` through the emulated backward kernels;
    ``kw`` (spec, dq_spec, schedule, ...) goes to the emulate backend."""

    def fn(dout, q, k, v, out, lse, return_dbias=False, **options):
        problem = make_problem(q, k, v, **options)
        d, o, l = flatten_backward(problem, dout, out, lse)
        grads = emulate_backend.backward(problem, d, o, l, deterministic=deterministic, dbias=return_dbias, **kw)
        result = tuple(problem.unflatten(g, a.shape[1:]) for g, a in zip(grads, (problem.q, problem.k, problem.v)))
        if not return_dbias:
            return result
        with np.errstate(over="ignore"):  # in the bias's dtype, as attention_backward returns it
            return result + (grads[3].reshape(problem.mods.bias_shape).astype(np.asarray(options["bias"]).dtype),)

    return fn


def kernel_grads(case, deterministic, schedule=None, seed=None, **kw):
    """``(dq, dk, dv)`` of ``case`` from the emulated forward then backward kernels; ``kw`` as in
    :func:`emulated_backward` (spec, dq_spec)."""
    problem = make_problem(case.q, case.k, case.v, **case.options)
    out, lse = emulate_backend.forward(problem)
    d, o, l = flatten_backward(problem, case.dout, out, lse)
    return emulate_backend.backward(problem, d, o, l, deterministic=deterministic, schedule=schedule, seed=seed,
                                    **kw)


def infinite_key_case(dtype):
    """q, k, v of ``dtype`` with one +inf element in a key."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 70, 2, 64)).astype(dtype) for _ in range(3))
    k[0, 33, 1, 7] = np.inf  # rows with q[..., 7] > 0 score +inf there, rows with q[..., 7] < 0 score -inf
    return q, k, v


def check_infinite_scores(out, lse, q, k, v):
    """An infinite score follows the float64 reference: +inf gives lse = +inf and a NaN row (inf / inf), not the
    inf - inf = NaN lse; -inf is a masked score (finite results, held to the rule)."""
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    sees = (np.arange(70) >= 33) & (q[0, :, 1, 7] > 0)
    assert sees.any() and (~sees[33:]).any()
    assert np.array_equal(np.isposinf(lse[0, 1]), sees) and np.array_equal(np.isposinf(ref_lse[0, 1]), sees)
    assert np.array_equal(np.isnan(lse), np.isnan(ref_lse)) and np.array_equal(np.isnan(out), np.isnan(ref_out))
    finite = np.isfinite(ref_lse)
    assert np.isfinite(lse[finite]).all() and np.isfinite(out[0, ~sees, 1]).all()
    check_rows_that_miss_the_key(out, lse, q, k, v)


def check_rows_that_miss_the_key(out, lse, q, k, v):
    """The rows of a causal problem whose key 33 of kv head 1 holds a non-finite element (``infinite_key_case``) and
    that the reference keeps finite (rows that do not see the key, or score it -inf) are held to the rule. They are
    the rows of a clean problem that hides that key from the head: its reference equals the poisoned one there bit
    for bit, and gives the naive baseline and the term magnitudes (which the non-finite key would make infinite)."""
    k0 = k.copy()
    k0[0, 33, 1, 7] = 0
    hidden = dict(causal=True, mask_mod="h != 1 or kv_idx != 33")
    wide = testing.reference_dtype(q.dtype)  # long double for float64 inputs
    with np.errstate(all="ignore"):
        poisoned = reference.attention(q, k, v, causal=True, return_lse=True, compute_dtype=wide)
    clean = reference.attention(q, k0, v, return_lse=True, compute_dtype=wide, **hidden)
    base = reference.attention(q, k0, v, return_lse=True, compute_dtype=q.dtype, **hidden)
    mags = reference.term_magnitudes(q, k0, v, **hidden)
    rows = np.isfinite(poisoned[1])  # (1, H, Sq)
    assert rows.any()
    for name, x, p, c, b in zip(("out", "lse"), (out, lse), poisoned, clean, base):
        fin = rows if name == "lse" else np.broadcast_to(rows.transpose(0, 2, 1)[..., None], x.shape)
        assert np.array_equal(p[fin], c[fin]), f"reference {name}: the key reached a row that does not see it"
        testing.assert_attention_close(x[fin], c[fin], b[fin], name=name, magnitude=mags[name])
