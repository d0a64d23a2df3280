"""Score and mask modifiers as the kernels take them: a C++ struct compiled in, and its operands in Params::mods.

:func:`render` turns a call's :class:`cuflash.mods.Modifiers` and its BlockMask into the struct that
``kernels/mods.cuh`` describes (``kScore``, ``kMask``, ``kDBias`` and the functions ``score``, ``dscore``,
``dbias``, ``mask``, ``rule``), named after a digest of what it computes: operands are numbered in the order
the expressions first read them, so two masks of the same structure (two ``BlockMask.document`` of different
ids, say) compile to the same struct, once per kernel family, and CuPy's cache keeps it. :func:`operands` packs
their values: each (array, indexing) pair takes one ``ModArray`` slot with the element strides of its index
variables, scalars take ``scalars`` (float) or ``iscalars`` (int, bool). Arrays travel as float32 / int32 /
uint8, converted without ever expanding a broadcast (a bias broadcast over batch and heads stays one small
array with zero strides).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..mods import Node
from . import params

_VARS = "int b, int h, int q_idx, int kv_idx, int q_len, int kv_len, const Params& p"
_CTYPE = {"float": "float", "int": "int", "bool": "unsigned char"}
_DEVICE_DTYPE = {"float": np.float32, "int": np.int32, "bool": np.uint8}
_AXES = {"b": 0, "h": 1, "q_idx": 2, "kv_idx": 3}


@dataclass(frozen=True)
class Parts:
    """What one launch compiles in: the expressions (None: absent) and every operand's value."""

    score: Optional[object]
    dscore: Optional[object]
    dbias: Optional[object]
    mask: Optional[object]
    rule: Optional[object]
    values: dict

    @property
    def exprs(self):
        return [e for e in (self.score, self.dscore, self.dbias, self.mask, self.rule) if e is not None]


def parts(mods, block_mask, dbias: bool = False) -> Parts:
    values = {**(mods.values if mods is not None else {}), **(block_mask.values if block_mask is not None else {})}
    score = mods.score if mods is not None else None
    return Parts(score, mods.dscore if score is not None else None, mods.dbias if dbias else None,
                 mods.mask if mods is not None else None, block_mask.member if block_mask is not None else None,
                 values)


@dataclass(frozen=True)
class Slots:
    """Where each operand travels: ``arrays[(name, indexing)]`` → ModArray slot, ``scalars[name]`` → (which
    scalar array, index); ``types[name]`` the operand's type."""

    arrays: dict
    scalars: dict
    types: dict


def _reads(n: Node, out: list):
    """Every operand read of a tree, in order of first appearance: ``(name, indexing or None, type)``."""
    if n.op == "array":
        out.append((n.value[0], n.value[1], n.type))
    elif n.op == "scalar":
        out.append((n.value, None, n.type))
    elif n.op == "bits":
        _reads(n.value[0], out)
        out.append((n.value[1], "table", "int"))
    for a in n.args:
        _reads(a, out)


def slots(p: Parts) -> Slots:
    """Slot assignment for every operand (limits: kernels/params.cuh), in order of first reading."""
    reads: list = []
    for e in p.exprs:
        _reads(e.root, reads)
    arrays, scalars, types, counts = {}, {}, {}, {"scalars": 0, "iscalars": 0}
    for name, index, t in reads:
        types.setdefault(name, t)
        if index is None:
            if name not in scalars:
                which = "scalars" if t == "float" else "iscalars"
                scalars[name] = (which, counts[which])
                counts[which] += 1
        elif (name, index) not in arrays:
            arrays[(name, index)] = len(arrays)
    if len(arrays) > params.MOD_ARRAYS or max(counts.values()) > params.MOD_SCALARS:
        raise ValueError(f"the CUDA kernels read at most {params.MOD_ARRAYS} array readings (an array read at two "
                         f"indexings counts twice) and {params.MOD_SCALARS} scalars of each kind in modifiers and "
                         f"masks; this call has {len(arrays)} readings and {counts} scalars")
    return Slots(arrays, scalars, types)


def _reader(s: Slots):
    def read(name, index):
        t = s.types[name]
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


def render(mods, block_mask=None, *, dbias: bool = False) -> tuple[str, str]:
    """``(struct name, C++ text)``; ``dbias``: the backward accumulates the bias's gradient."""
    p = parts(mods, block_mask, dbias)
    read = _reader(slots(p))
    code = {name: (e.cpp(read) if e is not None else default) for name, e, default in (
        ("score", p.score, "score"), ("dscore", p.dscore, "1.0f"), ("dbias", p.dbias, "1.0f"),
        ("mask", p.mask, "true"), ("rule", p.rule, "true"))}
    body = (f"  static constexpr bool kScore = {str(p.score is not None).lower()};\n"
            f"  static constexpr bool kMask = {str(p.mask is not None).lower()};\n"
            f"  static constexpr bool kDBias = {str(dbias).lower()};\n"
            f"  __device__ static __forceinline__ float score(float score, {_VARS}) {{ return {code['score']}; }}\n"
            f"  __device__ static __forceinline__ float dscore(float score, {_VARS}) {{ return {code['dscore']}; }}\n"
            f"  __device__ static __forceinline__ float dbias(float score, {_VARS}) {{ return {code['dbias']}; }}\n"
            f"  __device__ static __forceinline__ bool mask({_VARS}) {{ return {code['mask']}; }}\n"
            f"  __device__ static __forceinline__ bool rule({_VARS}) {{ return {code['rule']}; }}\n")
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


def operands(mods, block_mask, xp, *, dbias: bool = False) -> tuple[tuple, tuple]:
    """``(ModArgs value without dbias, arrays it points to)`` for :func:`cuflash.cuda.params.pack`; ``dbias`` as
    given to :func:`render` (the slots are the struct's)."""
    p = parts(mods, block_mask, dbias)
    s = slots(p)
    arrays = [(0, (0, 0, 0, 0))] * params.MOD_ARRAYS
    keep = []
    for (name, index), k in s.arrays.items():
        if index == "table":  # packed bits: raw bytes, row stride in stride[0]
            conv = xp.ascontiguousarray(xp.asarray(p.values[name]))
            arrays[k] = (params.address(conv), (conv.strides[0], 0, 0, 0))
            keep.append(conv)
            continue
        conv, strides = _device_array(xp, p.values[name], s.types[name])
        by_var = [0, 0, 0, 0]
        for axis, var in enumerate(index):
            if var is not None:
                by_var[_AXES[var[0] if isinstance(var, tuple) else var]] = strides[axis]
        arrays[k] = (params.address(conv), tuple(by_var))
        keep.append(conv)
    scalars = {"scalars": [0.0] * params.MOD_SCALARS, "iscalars": [0] * params.MOD_SCALARS}
    for name, (which, k) in s.scalars.items():
        scalars[which][k] = np.asarray(p.values[name]).item()
    return (arrays, scalars["scalars"], scalars["iscalars"], 0, (0, 0, 0, 0)), tuple(keep)


def dbias_buffer(mods, xp):
    """The fp32 dbias accumulator in the bias's compact (B|1, H|1, Sq|1, Sk|1) shape, zeroed, and its element
    strides per (b, h, q_idx, kv_idx) (0 where the bias broadcasts: the kernels add those contributions up)."""
    small = _compact(mods.values["cuflash_bias"])
    acc = xp.zeros(small.shape, dtype=np.float32)
    strides = tuple(0 if n == 1 else s // 4 for n, s in zip(small.shape, acc.strides))
    return acc, strides
