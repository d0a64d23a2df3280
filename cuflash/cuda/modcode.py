"""Score and mask modifiers as the kernels take them: a C++ struct compiled in, and its operands in Params::mods.

:func:`render` turns a call's :class:`cuflash.mods.Modifiers` into the struct that ``kernels/mods.cuh``
describes (``kScore``, ``kMask``, ``kDBias`` and the functions ``score``, ``dscore``, ``dbias``, ``mask``),
named after a digest of what it computes, so each distinct modifier compiles once per kernel family and
CuPy's cache keeps it. :func:`operands` packs the values: each (array, indexing) pair takes one
``ModArray`` slot with the element strides of its index variables, scalars take ``scalars`` (float) or
``iscalars`` (int, bool). Arrays travel as float32 / int32 / uint8, converted without ever expanding a
broadcast (a bias broadcast over batch and heads stays one small array with zero strides), with a zero margin past
the end of every axis indexed by q_idx or kv_idx (:data:`MOD_MARGIN`: the kernels evaluate a score modifier on
whole tiles).

The float64 kernels take the same modifiers in float64 (``real="double"``): the struct computes in double, float
arrays travel as float64, and float scalars, which ``ModArgs::scalars`` would round to float32, travel as
one-element float64 arrays read with zero strides (each takes a ``ModArray`` slot).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from . import params

_VARS = "int b, int h, int q_idx, int kv_idx, int q_len, int kv_len, const Params& p"
_CTYPE = {"float": "float", "int": "int", "bool": "unsigned char"}
_DEVICE_DTYPE = {"float": np.float32, "int": np.int32, "bool": np.uint8}
_AXES = {"b": 0, "h": 1, "q_idx": 2, "kv_idx": 3}


@dataclass(frozen=True)
class Slots:
    """Where each operand travels: ``arrays[(name, indexing)]`` → ModArray slot, ``scalars[name]`` → (which
    scalar array, index)."""

    arrays: dict
    scalars: dict


def slots(mods, real: str = "float") -> Slots:
    """Slot assignment for every operand the modifiers read (limits: kernels/params.cuh); with ``real="double"``
    float scalars take array slots ``(name, None)``."""
    arrays, scalars, counts = {}, {}, {"scalars": 0, "iscalars": 0}
    exprs = [e for e in (mods.score, mods.mask) if e is not None]
    for op in sorted({o.name: o for e in exprs for o in e.operands}.values(), key=lambda o: o.name):
        if op.is_array:
            for index in op.indexings:
                arrays[(op.name, index)] = len(arrays)
        elif real == "double" and op.type == "float":
            arrays[(op.name, None)] = len(arrays)
        else:
            which = "scalars" if op.type == "float" else "iscalars"
            scalars[op.name] = (which, counts[which])
            counts[which] += 1
    if len(arrays) > params.MOD_ARRAYS or max(counts.values()) > params.MOD_SCALARS:
        raise ValueError(f"the CUDA kernels read at most {params.MOD_ARRAYS} array readings (an array read at two "
                         f"indexings counts twice) and {params.MOD_SCALARS} scalars of each kind in modifiers; this "
                         f"call has {len(arrays)} readings and {counts} scalars")
    return Slots(arrays, scalars)


def _reader(mods, s: Slots, real: str = "float"):
    types = {o.name: o.type for e in (mods.score, mods.mask) if e is not None for o in e.operands}
    ctype = dict(_CTYPE, float=real)

    def read(name, index):
        t = types[name]
        if index is None and (name, None) not in s.arrays:
            which, k = s.scalars[name]
            value = f"p.mods.{which}[{k}]"
        else:
            value = f"mod_read<{ctype[t]}>(p.mods.arrays[{s.arrays[(name, index)]}], b, h, q_idx, kv_idx)"
        return f"({value} != 0)" if t == "bool" else value

    return read


def render(mods, *, dbias: bool = False, real: str = "float") -> tuple[str, str]:
    """``(struct name, C++ text)`` of the modifiers; ``dbias``: the backward accumulates the bias's gradient;
    ``real``: "float" (16-bit and float32 kernels) or "double" (float64 kernels), the type of the score and of every
    float operation."""
    if real not in ("float", "double"):
        raise ValueError(f"real must be 'float' or 'double', got {real!r}")
    s = slots(mods, real)
    read = _reader(mods, s, real)
    one = "1.0f" if real == "float" else "1.0"
    score = mods.score.cpp(read, real) if mods.score is not None else "score"
    dscore = mods.dscore.cpp(read, real) if mods.score is not None else one
    dbias_expr = mods.dbias.cpp(read, real) if dbias else one
    mask = mods.mask.cpp(read, real) if mods.mask is not None else "true"
    body = (f"  static constexpr bool kScore = {str(mods.score is not None).lower()};\n"
            f"  static constexpr bool kMask = {str(mods.mask is not None).lower()};\n"
            f"  static constexpr bool kDBias = {str(dbias).lower()};\n"
            f"  __device__ static __forceinline__ {real} score({real} score, {_VARS}) {{ return {score}; }}\n"
            f"  __device__ static __forceinline__ {real} dscore({real} score, {_VARS}) {{ return {dscore}; }}\n"
            f"  __device__ static __forceinline__ {real} dbias({real} score, {_VARS}) {{ return {dbias_expr}; }}\n"
            f"  __device__ static __forceinline__ bool mask({_VARS}) {{ return {mask}; }}\n")
    name = "Mods_" + hashlib.sha1(body.encode()).hexdigest()[:16]
    return f"cuflash::{name}", f"\nnamespace cuflash {{\nstruct {name} {{\n{body}}};\n}}  // namespace cuflash\n"


def _compact(a):
    """``a`` without its broadcast: one element along every zero-stride axis (a view), so converting it copies only
    what the caller stored."""
    return a[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for st, n in zip(a.strides, a.shape))]


#: zero elements appended to every q_idx / kv_idx axis of an array operand: the kernels evaluate a score modifier at
#: every (i, j) of a boundary tile, up to a tile past the sequence's end (kernels/mods.cuh), so no read may leave the
#: array there. At least the largest block_m / block_n of the tile tables (tests/test_kernels_emulated_wide.py).
MOD_MARGIN = 256


def _device_array(xp, a, t: str, real: str = "float", margin_axes=()):
    """``a`` on ``xp`` in the kernels' element type, and its element strides per axis (0 where it broadcasts).
    Each axis of ``margin_axes`` that does not broadcast gets :data:`MOD_MARGIN` zeros past its end."""
    small = _compact(a)
    dt = np.dtype(np.float64 if (t == "float" and real == "double") else _DEVICE_DTYPE[t])
    if t == "int" and small.size and (int(small.min()) < -2**31 or int(small.max()) >= 2**31):
        raise ValueError("integer modifier operands must fit in int32 on the CUDA kernels")
    if small.dtype == np.bool_:
        small = small.view(np.uint8)
    conv = xp.asarray(small).astype(dt, copy=False)
    broadcast = [st == 0 and n > 1 for st, n in zip(a.strides, a.shape)]
    pad = [ax for ax in margin_axes if not broadcast[ax]]
    if pad:
        padded = xp.zeros(tuple(n + (MOD_MARGIN if ax in pad else 0) for ax, n in enumerate(conv.shape)), dtype=dt)
        padded[tuple(slice(0, n) for n in conv.shape)] = conv
        conv = padded
    strides = [0 if b else s // dt.itemsize for b, s in zip(broadcast, conv.strides)]
    return conv, strides


def operands(mods, xp, real: str = "float") -> tuple[tuple, tuple]:
    """``(ModArgs value without dbias, arrays it points to)`` for :func:`cuflash.cuda.params.pack` (``real`` as in
    :func:`render`)."""
    s = slots(mods, real)
    arrays = [(0, (0, 0, 0, 0))] * params.MOD_ARRAYS
    keep = []
    types = {o.name: o.type for e in (mods.score, mods.mask) if e is not None for o in e.operands}
    for (name, index), k in s.arrays.items():
        if index is None:  # a float scalar of the float64 kernels: one float64 element, read with zero strides
            conv = xp.asarray(np.asarray([np.asarray(mods.values[name]).item()], dtype=np.float64))
            arrays[k] = (params.address(conv), (0, 0, 0, 0))
            keep.append(conv)
            continue
        margin = [axis for axis, var in enumerate(index) if var in ("q_idx", "kv_idx")]
        conv, strides = _device_array(xp, mods.values[name], types[name], real, margin)
        by_var = [0, 0, 0, 0]
        for axis, var in enumerate(index):
            by_var[_AXES[var]] = strides[axis]
        arrays[k] = (params.address(conv), tuple(by_var))
        keep.append(conv)
    scalars = {"scalars": [0.0] * params.MOD_SCALARS, "iscalars": [0] * params.MOD_SCALARS}
    for name, (which, k) in s.scalars.items():
        scalars[which][k] = np.asarray(mods.values[name]).item()
    return (arrays, scalars["scalars"], scalars["iscalars"], 0, (0, 0, 0, 0)), tuple(keep)


def dbias_buffer(mods, xp, dtype=np.float32):
    """The dbias accumulator (fp32; float64 for the float64 kernels) in the bias's compact (B|1, H|1, Sq|1, Sk|1)
    shape, zeroed, and its element strides per (b, h, q_idx, kv_idx) (0 where the bias broadcasts: the kernels add
    those contributions up)."""
    bias = mods.values["cuflash_bias"]
    small = _compact(bias)
    acc = xp.zeros(small.shape, dtype=dtype)
    strides = tuple(0 if n == 1 else s // acc.itemsize for n, s in zip(small.shape, acc.strides))
    return acc, strides
