"""Backward-kernel helpers shared by the emulated and the GPU backward tests: the 3x same-dtype rule for
(dq, dk, dv), with a bfloat16 fallback while cuflash.testing cannot handle bfloat16 (see fwd_cases)."""
from __future__ import annotations

import numpy as np

from cuflash import reference, testing
from cuflash.testing import Case

from fwd_cases import bf16


def _bf16_rule_works() -> bool:
    try:
        testing.rounding(bf16())
    except ValueError:
        return False
    x = np.ones((1, 2, 1, 2), dtype=bf16())
    return reference.attention(x, x, x, compute_dtype=x.dtype).dtype == x.dtype


def host(x):
    return np.asarray(x.get() if hasattr(x, "get") else x)


def check_backward(fn, case: Case, out, lse):
    """cuflash.testing.check_backward: ``fn(dout, q, k, v, out, lse, **options) -> (dq, dk, dv)`` within 3x the
    naive same-dtype error plus two roundings at the term magnitude. For bfloat16, while cuflash.testing cannot
    handle it (rounding() calls np.finfo on bfloat16, and the naive bfloat16 reference runs its matmuls in
    float32), the same rule with the bfloat16 constants: the naive baseline rounded to bfloat16 once, the floor
    2 * 2**-7 * magnitude. Returns the gradients as host arrays."""
    if case.q.dtype.name != "bfloat16" or _bf16_rule_works():
        return tuple(host(g) for g in testing.check_backward(fn, case, out, lse))
    grads = tuple(host(g) for g in fn(case.dout, case.q, case.k, case.v, out, lse, **case.options))
    refs = reference.attention_backward(case.dout, case.q, case.k, case.v, **case.options)
    bases = reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=case.q.dtype,
                                         **case.options)
    mags = reference.term_magnitudes(case.q, case.k, case.v, case.dout, **case.options)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bases):
        g = g.astype(np.float64)
        assert g.shape == r.shape and not np.isnan(g).any(), name
        err = np.abs(g - r).max(initial=0.0)
        base = np.abs(np.asarray(b).astype(bf16()).astype(np.float64) - r).max(initial=0.0)
        floor = 2 * 2.0 ** -7 * mags[name]
        assert err <= 3 * base + floor, f"{name}: max error {err:.3e} > 3 x {base:.3e} + {floor:.3e} (bf16)"
    return grads


def assert_bitwise_equal_runs(runs):
    """Every run's (dq, dk, dv) has the same bits as the first run's."""
    for r in runs[1:]:
        for a, b in zip(r, runs[0]):
            assert np.array_equal(host(a).view(np.uint16), host(b).view(np.uint16))


def check_golden_grads(grads, case: Case, name: str):
    """Gradients of the fp16-rounded golden inputs against the golden float64 gradients (of the unrounded
    inputs): within 3x the naive same-dtype error against the same golden, plus two fp16 roundings at the
    term magnitude."""
    from golden import GoldenVector

    z = GoldenVector(name).arrays
    bases = reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=case.q.dtype,
                                         **case.options)
    mags = reference.term_magnitudes(case.q, case.k, case.v, case.dout, **case.options)
    for gname, g, b in zip(("dq", "dk", "dv"), grads, bases):
        gold = z[gname]
        base_err = np.abs(np.asarray(b, np.float64) - gold).max(initial=0.0)
        err = np.abs(np.asarray(host(g), np.float64) - gold).max(initial=0.0)
        assert err <= 3 * base_err + 2 * 2.0 ** -10 * mags[gname], (gname, err, base_err, case.options)
