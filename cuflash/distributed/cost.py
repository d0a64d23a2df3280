"""The ring's communication against its computation: when is the transfer of the next K/V block hidden?

A model, not a measurement. Per ring step, each rank sends one K/V block to its neighbour while it attends its
``n`` local queries to the ``m`` keys of the block it holds (Liu et al. 2023, section 3, make the same count):

* bytes sent per step: ``2·B·m·Hkv·D·b`` (K and V in the input dtype, ``b`` bytes per element); the backward
  also sends the block's dK and dV accumulators, ``2·B·m·Hkv·D·4`` (float32; for float64 inputs float64, 8
  bytes);
* FLOPs per step: ``4·B·Hq·n·m·D·f`` for the forward (``Q Kᵀ`` and ``P V``, two FLOPs per multiply-add), ``2.5×``
  that for the backward (``Q Kᵀ`` recomputed, ``dV``, ``dP``, ``dQ``, ``dK``: FA2's count), where ``f`` is the
  fraction of the block the rank must compute: 1 without a mask; under a causal mask 1/2 on every rank and step
  with ``layout="zigzag"``, but 1 on the busiest rank with ``layout="contiguous"`` (the last rank sees every earlier
  block whole, and the ring moves at its pace);
* the step's transfer is hidden when ``latency + bytes / bandwidth <= FLOPs / throughput``. With ``n = m`` (self
  attention, equal slices) both sides grow with ``n``, FLOPs quadratically, so there is a local sequence length
  above which communication is free: ``n* ≈ F/W · b·(Hkv/Hq) / (2f)`` for throughput ``F`` and bandwidth ``W``
  (``F/W`` for bfloat16 multi-head attention without a mask, the paper's "block size >= F/B"), slightly more with
  latency (:func:`min_local_seqlen` solves the quadratic).

``python -m cuflash.distributed`` prints :func:`table`, the README's table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..problem import check_flags
from .layout import check_layout

#: Assumed per-GPU, one-direction bandwidths (bytes/s) and per-message latencies (s) of common interconnects. They
#: are round datasheet-level numbers for the model, not measurements.
INTERCONNECTS = {
    "NVLink 4 (H100 SXM, NVSwitch)": (450e9, 5e-6),
    "InfiniBand NDR 400 Gb/s (1 HCA per GPU)": (50e9, 5e-6),
    "InfiniBand HDR 200 Gb/s": (25e9, 5e-6),
    "Ethernet 100 GbE (RoCE)": (12.5e9, 10e-6),
    "Ethernet 25 GbE (TCP)": (3.125e9, 30e-6),
}
#: Assumed sustained attention throughputs (FLOP/s): about half the dense bf16 peak of an H100 SXM for the GPU rows
#: (FA2-class kernels reach 50-70%), and a CPU node running the NumPy backend in float32.
THROUGHPUTS = {"H100 SXM, bf16 (~50% of 989 TFLOP/s)": 495e12, "CPU node, fp32 NumPy (~1 TFLOP/s)": 1e12}

_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_BWD_FLOPS = 2.5  # FA2: five matrix products in the backward against two in the forward


@dataclass(frozen=True)
class RingStep:
    """One ring step on the busiest rank: what is sent, what is computed, and whether the transfer is hidden."""

    bytes_sent: int
    flops: float
    comm_s: float
    compute_s: float

    @property
    def hidden(self) -> bool:
        """The transfer takes no longer than the computation it runs beside."""
        return self.comm_s <= self.compute_s

    @property
    def step_s(self) -> float:
        """The step's time when transfer and computation overlap perfectly."""
        return max(self.comm_s, self.compute_s)


def _check(op, layout, dtype, **numbers):
    """``numbers``: name -> (value, bound, whether it must be an int, whether the bound itself is allowed); a rate of
    0 or below would divide by zero or never end min_local_seqlen's search. A value of the wrong type (a bool, read
    as 0 or 1; a float where a count is an int; a str) is a TypeError, one of the right type out of range a
    ValueError, as everywhere in cuflash."""
    for name, (value, low, integral, *inclusive) in numbers.items():
        kinds = (int, np.integer) if integral else (int, float, np.integer, np.floating)
        closed = bool(inclusive and inclusive[0])
        what = "an int" if integral else "a finite number"
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, kinds):
            raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
        if not (value >= low if closed else value > low):  # nan included
            raise ValueError(f"{name} must be {what} {'>=' if closed else '>'} {low}, got {value!r}")
        if not _finite(value):
            raise ValueError(f"{name} must be finite (within float's range: the model computes in floats), got "
                             f"{value!r}")
    if not isinstance(op, str):
        raise TypeError(f"op must be a str, 'fwd' or 'bwd', got {type(op).__name__} {op!r}")
    if op not in ("fwd", "bwd"):
        raise ValueError(f"op must be 'fwd' or 'bwd', got {op!r}")
    check_layout(layout)  # the sharding, as ring_attention's (its message for an axis order such as "bshd")
    if not isinstance(dtype, (str, np.dtype, type)):  # None, which NumPy reads as float64, included
        raise TypeError(f"dtype must be a dtype, a scalar type or a name, one of {', '.join(_BYTES)}, got "
                        f"{type(dtype).__name__} {dtype!r}")
    if _dtype_name(dtype) not in _BYTES:
        raise ValueError(f"dtype must be one of {', '.join(_BYTES)}, got {dtype!r}")


def _finite(value) -> bool:
    """math.isfinite, with an int beyond float's range (which it raises OverflowError on) not finite as a rate."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _dtype_name(dtype) -> str:
    """``"float16"`` for "float16", np.float16 or np.dtype("float16"); bfloat16 by name (ml_dtypes' too)."""
    if str(dtype) in _BYTES:
        return str(dtype)
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def busy_fraction(causal: bool, layout: str) -> float:
    """Fraction of a K/V block the busiest rank computes per step (see the module docstring)."""
    return 0.5 if causal and layout == "zigzag" else 1.0


def ring_step(seqlen_local, *, heads, head_dim, heads_kv=None, batch=1, dtype="bfloat16", causal=False,
              layout="zigzag", op="fwd", flops_per_s, bytes_per_s, latency_s=0.0) -> RingStep:
    """The model of one ring step with ``seqlen_local`` queries and keys per rank.

    Parameters
    ----------
    seqlen_local : int
        Local sequence length ``n = m`` (the whole sequence over the number of ranks).
    heads, head_dim : int
    heads_kv : int, optional
        Key/value heads (grouped-query attention sends fewer bytes); default ``heads``.
    batch : int
    dtype : {"float16", "bfloat16", "float32", "float64"}
    causal : bool
    layout : {"zigzag", "contiguous"}
    op : {"fwd", "bwd"}
    flops_per_s, bytes_per_s : float
        Sustained attention throughput of a rank, and its one-direction link bandwidth to the next rank.
    latency_s : float
        Per-message latency.

    Returns
    -------
    RingStep
    """
    hkv = heads if heads_kv is None else heads_kv
    check_flags(causal=causal)  # a string such as "no" was read as causal
    _check(op, layout, dtype, seqlen_local=(seqlen_local, 0, True), heads=(heads, 0, True), heads_kv=(hkv, 0, True),
           head_dim=(head_dim, 0, True), batch=(batch, 0, True), flops_per_s=(flops_per_s, 0, False),
           bytes_per_s=(bytes_per_s, 0, False), latency_s=(latency_s, 0, False, True))
    if heads % hkv:
        raise ValueError(f"heads ({heads}) must be a multiple of heads_kv ({hkv}): query heads share key/value heads")
    n = int(seqlen_local)
    name = _dtype_name(dtype)
    # the backward also sends the dK, dV accumulators: float32, float64 for float64 inputs (ring.py)
    elem = _BYTES[name] + ((8 if name == "float64" else 4) if op == "bwd" else 0)
    sent = 2 * batch * n * hkv * head_dim * elem
    flops = 4.0 * batch * heads * n * n * head_dim * busy_fraction(causal, layout) * (_BWD_FLOPS if op == "bwd" else 1)
    try:
        comm_s = latency_s + sent / bytes_per_s
    except OverflowError:  # sent is an exact int: past float's range it cannot divide (a bare OverflowError before)
        raise ValueError(f"the sizes give about 10^{len(str(sent)) - 1} bytes a step, past float's range: the model "
                         f"computes in floats") from None
    if not math.isfinite(flops):  # inf FLOPs over any rate is inf seconds: every transfer would read as hidden
        raise ValueError(f"the sizes give more than 1.8e308 FLOPs a step, past float's range: the model computes in "
                         f"floats")
    return RingStep(sent, flops, comm_s, flops / flops_per_s)


def min_local_seqlen(*, heads, head_dim, heads_kv=None, batch=1, dtype="bfloat16", causal=False, layout="zigzag",
                     op="fwd", flops_per_s, bytes_per_s, latency_s=0.0) -> int:
    """The smallest local sequence length whose K/V transfer is hidden behind the step's computation.

    Solves ``a·n² >= c·n + latency`` with ``a`` the seconds of computation per ``n²`` and ``c`` the seconds of
    transfer per ``n`` (see :func:`ring_step` for the parameters).
    """
    _check(op, layout, dtype, latency_s=(latency_s, 0, False, True))
    one = ring_step(1, heads=heads, head_dim=head_dim, heads_kv=heads_kv, batch=batch, dtype=dtype, causal=causal,
                    layout=layout, op=op, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s)
    a, c = one.compute_s, one.comm_s
    n = (c + math.sqrt(c * c + 4 * a * latency_s)) / (2 * a)
    if not math.isfinite(n):  # rates at the ends of float's range (flops_per_s 1e308 with bytes_per_s 1e-300)
        raise ValueError(f"these rates give a local length of {n}: past what the model computes in floats (a step's "
                         f"seconds of transfer per key {c:.3g}, of computation per key squared {a:.3g})")
    def hidden(m: int) -> bool:
        return ring_step(m, heads=heads, head_dim=head_dim, heads_kv=heads_kv, batch=batch, dtype=dtype,
                         causal=causal, layout=layout, op=op, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s,
                         latency_s=latency_s).hidden

    # A guard against the rounding of the closed form: the first hidden length from its ceiling on, found in steps
    # that double, then by bisection. Steps of 1 took ~10^17 of them where the answer is ~10^31 (a float's spacing
    # there is ~10^16: every length within it gives the same step).
    lo, hi, step = max(1, math.ceil(n - 1e-9)) - 1, max(1, math.ceil(n - 1e-9)), 1
    while not hidden(hi):
        lo, hi, step = hi, hi + step, 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi


def table(*, heads=32, heads_kv=8, head_dim=128, dtype="bfloat16") -> str:
    """Markdown table of :func:`min_local_seqlen` for the assumed interconnects and throughputs (a model)."""
    cols = [("fwd", False, heads, "fwd, no mask, MHA"), ("fwd", True, heads, "fwd, causal zigzag, MHA"),
            ("fwd", True, heads_kv, f"fwd, causal zigzag, GQA {heads}/{heads_kv}"),
            ("bwd", True, heads_kv, f"bwd, causal zigzag, GQA {heads}/{heads_kv}")]
    lines = ["| interconnect (assumed GB/s, latency) | compute (assumed) | " + " | ".join(c[3] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for link, (bw, lat) in INTERCONNECTS.items():
        for name, flops in THROUGHPUTS.items():
            if "NVLink" in link and "H100" not in name:
                continue  # NVLink joins GPUs only
            cells = [min_local_seqlen(heads=heads, head_dim=head_dim, heads_kv=hkv, dtype=dtype if "H100" in name
                                      else "float32", causal=causal, op=op, flops_per_s=flops, bytes_per_s=bw,
                                      latency_s=lat) for op, causal, hkv, _ in cols]
            lines.append(f"| {link} ({bw / 1e9:g}, {lat * 1e6:g} µs) | {name} | "
                         + " | ".join(f"{c:,}" for c in cells) + " |")
    return "\n".join(lines)
