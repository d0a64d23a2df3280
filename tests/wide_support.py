"""The accuracy rules of the float32/float64 kernels (kernels/flash_*_wide.cu), shared by the emulated and the GPU
tests: for each (dtype, precision) the naive computation whose error sets the tolerance ("baseline"), the reference
both are measured against, and the bounds.

                       baseline (naive, same arithmetic)         reference    max rule     RMS rule
    float32 "ieee"     float32                                   float64      2x / 3x      2x
    float32 "3xtf32"   float32                                   float64      2x / 3x      2.5x
    float32 "tf32"     TF32: the inputs of every matrix product  float64      2x / 3x      2x
                       rounded to TF32, exact products summed
                       in float32 (reference.TF32)
    float64            float64                                   long double  2x / 3x      2x
                                                                 (x86-64: 64-bit significands; against the
                                                                 float64 reference the naive float64
                                                                 computation has no error to compare with)

The max rule is the project's (cuflash.testing): max |error| <= 2x (outputs, lse) / 3x (gradients) the naive max
error, plus a floor of two roundings of the baseline's arithmetic at the magnitude of the terms summed. For
float32 and float64 inputs that floor is larger than the naive error itself on most small problems (it carries the
softmax's condition number), so every mode also has an RMS rule, on problems of a few hundred rows where rounding
dominates and the RMS error is a stable statistic: RMS error over all finite entries <= the bound x the naive RMS
error, no floor. Emulated, the RMS ratios lie within ieee 0.8-1.45 (with the GPU's approximate exp2f, hw_math, too),
3xtf32 0.5-1.3 (CUTLASS's split keeps 22 of the 24 significand bits of each operand and drops the small x small
product; each k-step's products summed apart, kernels/wide_mma.cuh, which is a blocked summation; 0.5-1.5 with
hw_math's tensor-core sums rounded toward zero), tf32 0.4-1.4, float64 1.0-1.6 (FA2's recomputation of P from the saved lse rounds a little more than the
naive softmax); README "Precision" has the measured table.

Every max-rule check records (mode, quantity, error, naive error, floor) in ``MEASURED`` (:func:`summary`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cuflash import reference, testing
from cuflash.testing import Case


@dataclass(frozen=True)
class Rule:
    baseline: object   # compute_dtype of the naive computation
    ref: object        # compute_dtype of the reference
    rms: float         # the RMS rule's bound
    eps: float         # one rounding of the baseline's arithmetic (the floor's unit)
    mult_out: float = 2.0
    mult_grad: float = 3.0


RULES = {
    ("float32", "ieee"): Rule(np.float32, np.float64, 2.0, 2.0 ** -23),
    ("float32", "3xtf32"): Rule(np.float32, np.float64, 2.5, 2.0 ** -23),
    ("float32", "tf32"): Rule(reference.TF32, np.float64, 2.0, 2.0 ** -23),
    ("float64", "ieee"): Rule(np.float64, np.longdouble, 2.0, 2.0 ** -52),
}

#: (mode, quantity, error, naive error) of every check run in this process
MEASURED: list = []


def host(x):
    return np.asarray(x.get() if hasattr(x, "get") else x)


def _reference_options(case: Case):
    opts, drop = testing._reference_options(case)
    opts.pop("precision", None)
    return opts, drop


def close(actual, ref, base, *, mult, eps, magnitude, name, mode):
    """``max|actual - ref| <= mult * max|base - ref| + 2 * eps * magnitude``, in long double (so that a long-double
    reference is not rounded to float64 first); -inf entries must match exactly, NaN never passes."""
    actual = host(actual).astype(np.longdouble)
    ref = np.asarray(ref).astype(np.longdouble)
    base = np.asarray(base).astype(np.longdouble)
    assert actual.shape == ref.shape, f"{name}: shape {actual.shape} != reference {ref.shape}"
    assert not np.isnan(actual).any(), f"{name}: NaN in the result"
    inf = np.isinf(ref)
    assert np.array_equal(np.isinf(actual), inf) and np.array_equal(actual[inf], ref[inf]), \
        f"{name}: infinite entries differ from the reference"
    fin = ~inf
    if not fin.any():
        return
    err = float(np.abs(actual[fin] - ref[fin]).max())
    base_err = float(np.nan_to_num(np.abs(base[fin] - ref[fin]), nan=np.inf).max())
    floor = 2 * eps * magnitude
    MEASURED.append((mode, name, err, base_err, floor))
    assert err <= mult * base_err + floor, (
        f"{mode} {name}: max error {err:.3e} exceeds {mult}x the naive error {base_err:.3e} + floor {floor:.3e}")


def mode_of(case: Case, precision: str) -> tuple:
    return (case.q.dtype.name, precision)


def check_forward(fn, case: Case, precision: str = "ieee"):
    """``fn(q, k, v, **options) -> (out, lse)`` held to the mode's rule for outputs."""
    mode = mode_of(case, precision)
    rule = RULES[mode]
    out, lse = fn(case.q, case.k, case.v, **case.options)
    opts, drop = _reference_options(case)
    ref, ref_lse = reference.attention(case.q, case.k, case.v, return_lse=True, compute_dtype=rule.ref, **opts, **drop)
    base, base_lse = reference.attention(case.q, case.k, case.v, return_lse=True, compute_dtype=rule.baseline,
                                         **opts, **drop)
    mags = reference.term_magnitudes(case.q, case.k, case.v, **opts, **drop)
    close(out, ref, base, mult=rule.mult_out, eps=rule.eps, magnitude=mags["out"], name="out", mode=mode)
    close(lse, ref_lse, base_lse, mult=rule.mult_out, eps=rule.eps, magnitude=mags["lse"], name="lse", mode=mode)
    return out, lse


def check_backward(fn, case: Case, out, lse, precision: str = "ieee"):
    """``fn(dout, q, k, v, out, lse, **options) -> (dq, dk, dv)`` held to the mode's rule for gradients."""
    mode = mode_of(case, precision)
    rule = RULES[mode]
    grads = fn(case.dout, case.q, case.k, case.v, out, lse, **case.options)
    opts, drop = _reference_options(case)
    refs = reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=rule.ref, **opts, **drop)
    bases = reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=rule.baseline,
                                         **opts, **drop)
    mags = reference.term_magnitudes(case.q, case.k, case.v, case.dout, **opts, **drop)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bases):
        close(g, r, b, mult=rule.mult_grad, eps=rule.eps, magnitude=mags[name], name=name, mode=mode)
    return tuple(host(g) for g in grads)


def rms_error(actual, ref) -> float:
    """Root mean square of ``actual - ref`` over the reference's finite entries, in long double."""
    a, r = host(actual).astype(np.longdouble), np.asarray(ref).astype(np.longdouble)
    fin = np.isfinite(r)
    return float(np.sqrt(np.mean((a[fin] - r[fin]) ** 2))) if fin.any() else 0.0


def check_rms(fwd, bwd, case: Case, precision: str = "ieee", strict: bool = True) -> dict:
    """The RMS rule for out, lse, dq, dk, dv of ``case`` (no dropout): ``fwd(q, k, v, **options) -> (out, lse)``,
    ``bwd(dout, q, k, v, out, lse, **options) -> grads``. Returns {quantity: RMS error / naive RMS error}."""
    rule = RULES[mode_of(case, precision)]
    out, lse = fwd(case.q, case.k, case.v, **case.options)
    grads = bwd(case.dout, case.q, case.k, case.v, out, lse, **case.options)
    opts, _ = _reference_options(case)
    ref = reference.attention(case.q, case.k, case.v, return_lse=True, compute_dtype=rule.ref, **opts)
    base = reference.attention(case.q, case.k, case.v, return_lse=True, compute_dtype=rule.baseline, **opts)
    ref += reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=rule.ref, **opts)
    base += reference.attention_backward(case.dout, case.q, case.k, case.v, compute_dtype=rule.baseline, **opts)
    ratios = {}
    for name, a, r, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref, base):
        err, naive = rms_error(a, r), rms_error(b, r)
        ratios[name] = err / naive
        assert not strict or err <= rule.rms * naive, (f"{mode_of(case, precision)} {name}: RMS error {err:.3e} exceeds "
                                         f"{rule.rms}x the naive RMS error {naive:.3e}")
    return ratios


def summary() -> dict:
    """Per (mode, "out" | "grad"): the largest ratio error / naive error among the checks whose naive error is above
    the floor (where the ratio means something), the median of those ratios, their count, and the largest error
    relative to the floor among the others."""
    groups: dict = {}
    for mode, name, err, base, floor in MEASURED:
        groups.setdefault((mode, "out" if name in ("out", "lse") else "grad"), []).append((err, base, floor))
    out = {}
    for key, rows in groups.items():
        ratios = [e / b for e, b, f in rows if b > f]
        small = [e / f for e, b, f in rows if b <= f and f > 0]
        out[key] = dict(max_ratio=max(ratios, default=0.0), median_ratio=float(np.median(ratios)) if ratios else 0.0,
                        n=len(ratios), below_floor=len(small), max_err_over_floor=max(small, default=0.0))
    return out
