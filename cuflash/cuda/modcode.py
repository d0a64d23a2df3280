"""Score and mask modifiers as the kernels take them: a C++ struct compiled in, and its operands in Params::mods.

:func:`render` turns a call's :class:`cuflash.mods.Modifiers` into the struct that ``kernels/mods.cuh``
describes (``kScore``, ``kMask``, ``kDBias`` and the functions ``score``, ``dscore``, ``dbias``, ``mask``),
named after a digest of what it computes, so each distinct modifier compiles once per kernel family and
CuPy's cache keeps it. :func:`operands` packs the values: each (array, indexing) pair takes one
``ModArray`` slot with the element strides of its index variables, scalars take ``scalars`` (float) or
``iscalars`` (int, bool). Arrays travel as float32 / int32 / uint8, converted without ever expanding a
broadcast (a bias broadcast over batch and heads stays one small array with zero strides).
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


def slots(mods) -> Slots:
    """Slot assignment for every operand the modifiers read (limits: kernels/params.cuh)."""
    arrays, scalars, counts = {}, {}, {"scalars": 0, "iscalars": 0}
    exprs = [e for e in (mods.score, mods.mask) if e is not None]
    for op in sorted({o.name: o for e in exprs for o in e.operands}.values(), key=lambda o: o.name):
        if op.table:
            arrays[(op.name, "table")] = len(arrays)
        elif op.is_array:
            for index in op.indexings:
                arrays[(op.name, index)] = len(arrays)
        else:
            which = "scalars" if op.type == "float" else "iscalars"
            scalars[op.name] = (which, counts[which])
            counts[which] += 1
    if len(arrays) > params.MOD_ARRAYS or max(counts.values()) > params.MOD_SCALARS:
        raise ValueError(f"the CUDA kernels read at most {params.MOD_ARRAYS} array readings (an array read at two "
                         f"indexings counts twice) and {params.MOD_SCALARS} scalars of each kind in modifiers; this "
                         f"call has {len(arrays)} readings and {counts} scalars")
    return Slots(arrays, scalars)


def _reader(mods, s: Slots):
    types = {o.name: o.type for e in (mods.score, mods.mask) if e is not None for o in e.operands}

    def read(name, index):
        t = types[name]
        if index == "table":  # the ModArray itself (kernels/mods.cuh: dense_bit)
            return f"p.mods.arrays[{s.arrays[(name, index)]}]"
        if index is None:
            which, k = s.scalars[name]
            value = f"p.mods.{which}[{k}]"
        else:
            args = ["0", "0", "0", "0"]  # the value of each of b, h, q_idx, kv_idx the array is read at
            for i in index:
                if isinstance(i, tuple):
                    args[_AXES[i[0]]] = f"({i[0]} / {i[1]})"  # a block index (indices are never negative)
                elif i is not None:
                    args[_AXES[i]] = i
            value = f"mod_read<{_CTYPE[t]}>(p.mods.arrays[{s.arrays[(name, index)]}], {', '.join(args)})"
        return f"({value} != 0)" if t == "bool" else value

    return read


def render(mods, *, dbias: bool = False) -> tuple[str, str]:
    """``(struct name, C++ text)`` of the modifiers; ``dbias``: the backward accumulates the bias's gradient."""
    s = slots(mods)
    read = _reader(mods, s)
    score = mods.score.cpp(read) if mods.score is not None else "score"
    dscore = mods.dscore.cpp(read) if mods.score is not None else "1.0f"
    dbias_expr = mods.dbias.cpp(read) if dbias else "1.0f"
    mask = mods.mask.cpp(read) if mods.mask is not None else "true"
    body = (f"  static constexpr bool kScore = {str(mods.score is not None).lower()};\n"
            f"  static constexpr bool kMask = {str(mods.mask is not None).lower()};\n"
            f"  static constexpr bool kDBias = {str(dbias).lower()};\n"
            f"  __device__ static __forceinline__ float score(float score, {_VARS}) {{ return {score}; }}\n"
            f"  __device__ static __forceinline__ float dscore(float score, {_VARS}) {{ return {dscore}; }}\n"
            f"  __device__ static __forceinline__ float dbias(float score, {_VARS}) {{ return {dbias_expr}; }}\n"
            f"  __device__ static __forceinline__ bool mask({_VARS}) {{ return {mask}; }}\n")
    name = "Mods_" + hashlib.sha1(body.encode()).hexdigest()[:16]
    return f"cuflash::{name}", f"\nnamespace cuflash {{\nstruct {name} {{\n{body}}};\n}}  // namespace cuflash\n"


def _compact(a):
    """``a`` without its broadcast: one element along every zero-stride axis (a view), so converting it copies only
    what the caller stored."""
    return a[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for st, n in zip(a.strides, a.shape))]


def _device_array(xp, a, t: str):
    """``a`` on ``xp`` in the kernels' element type, and its element strides per axis (0 where it broadcasts)."""
    small = _compact(a)
    dt = np.dtype(_DEVICE_DTYPE[t])
    if t == "int" and small.size and (int(small.min()) < -2**31 or int(small.max()) >= 2**31):
        raise ValueError("integer modifier operands must fit in int32 on the CUDA kernels")
    if small.dtype == np.bool_:
        small = small.view(np.uint8)
    conv = xp.asarray(small).astype(dt, copy=False)
    strides = [0 if st == 0 and n > 1 else s // dt.itemsize for st, n, s in zip(a.strides, a.shape, conv.strides)]
    return conv, strides


def operands(mods, xp) -> tuple[tuple, tuple]:
    """``(ModArgs value without dbias, arrays it points to)`` for :func:`cuflash.cuda.params.pack`."""
    s = slots(mods)
    arrays = [(0, (0, 0, 0, 0))] * params.MOD_ARRAYS
    keep = []
    types = {o.name: o.type for e in (mods.score, mods.mask) if e is not None for o in e.operands}
    for (name, index), k in s.arrays.items():
        if index == "table":  # packed bits: raw bytes, row stride in stride[0]
            conv = xp.ascontiguousarray(xp.asarray(mods.values[name]))
            arrays[k] = (params.address(conv), (conv.strides[0], 0, 0, 0))
            keep.append(conv)
            continue
        conv, strides = _device_array(xp, mods.values[name], types[name])
        by_var = [0, 0, 0, 0]
        for axis, var in enumerate(index):
            if var is not None:
                by_var[_AXES[var[0] if isinstance(var, tuple) else var]] = strides[axis]
        arrays[k] = (params.address(conv), tuple(by_var))
        keep.append(conv)
    scalars = {"scalars": [0.0] * params.MOD_SCALARS, "iscalars": [0] * params.MOD_SCALARS}
    for name, (which, k) in s.scalars.items():
        scalars[which][k] = np.asarray(mods.values[name]).item()
    return (arrays, scalars["scalars"], scalars["iscalars"], 0, (0, 0, 0, 0)), tuple(keep)


def dbias_buffer(mods, xp):
    """The fp32 dbias accumulator in the bias's compact (B|1, H|1, Sq|1, Sk|1) shape, zeroed, and its element
    strides per (b, h, q_idx, kv_idx) (0 where the bias broadcasts: the kernels add those contributions up)."""
    bias = mods.values["cuflash_bias"]
    small = _compact(bias)
    acc = xp.zeros(small.shape, dtype=np.float32)
    strides = tuple(0 if n == 1 else s // 4 for n, s in zip(small.shape, acc.strides))
    return acc, strides
