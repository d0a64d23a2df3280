"""Score and mask modifiers as the kernels take them: a C++ struct compiled in, and its operands in Params::mods.

:func:`render` turns a call's :class:`cuflash.mods.Modifiers` and its BlockMask into the struct that
``kernels/mods.cuh`` describes (``kScore``, ``kMask``, ``kDBias`` and the functions ``score``, ``dscore``,
``dbias``, ``mask``, ``rule``), named after a digest of what it computes: operands are numbered in the order
the expressions first read them, so two masks of the same structure (two ``BlockMask.document`` of different
ids, say) compile to the same struct, once per kernel family, and CuPy's cache keeps it. :func:`operands` packs
their values: each (array, indexing) pair takes one ``ModArray`` slot with the element strides of its index
variables, scalars take ``scalars`` (float) or ``iscalars`` (int, bool). Arrays travel as float32 / int32 /
uint8, converted without ever expanding a broadcast (a bias broadcast over batch and heads stays one small
array with zero strides), with a zero margin past the end of every axis indexed by q_idx or kv_idx
(:data:`MOD_MARGIN`: the kernels evaluate modifiers and mask rules on whole tiles).

The float64 kernels take the same modifiers in float64 (``real="double"``): the struct computes in double, float
arrays travel as float64, and float scalars, which ``ModArgs::scalars`` would round to float32, travel as
one-element float64 arrays read with zero strides (each takes a ``ModArray`` slot).
"""
from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from ..mods import Node, scalar_value
from ..problem.core import compact
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


def slots(p: Parts, real: str = "float") -> Slots:
    """Slot assignment for every operand (limits: kernels/params.cuh), in order of first reading; with
    ``real="double"`` float scalars take array slots ``(name, None)``."""
    reads: list = []
    for e in p.exprs:
        _reads(e.root, reads)
    arrays, scalars, types, counts = {}, {}, {}, {"scalars": 0, "iscalars": 0}
    for name, index, t in reads:
        types.setdefault(name, t)
        if index is None and real == "double" and t == "float":
            arrays.setdefault((name, None), len(arrays))
        elif index is None:
            if name not in scalars:
                which = "scalars" if t == "float" else "iscalars"
                scalars[name] = (which, counts[which])
                counts[which] += 1
        elif (name, index) not in arrays:
            arrays[(name, index)] = len(arrays)
    if len(arrays) > params.MOD_ARRAYS or max(counts.values()) > params.MOD_SCALARS:
        raise ValueError(f"the CUDA kernels read at most {params.MOD_ARRAYS} array readings (an array read at two "
                         f"indexings counts twice; in float64 a float scalar too) and {params.MOD_SCALARS} scalars of "
                         f"each kind in a call's masks and modifiers together; this call has {len(arrays)} readings "
                         f"({_by_argument(name for name, _ in arrays)}) and {counts} scalars (the NumPy backend has "
                         f"no such limit)")
    return Slots(arrays, scalars, types)


def _by_argument(names: Iterable[str]) -> str:
    """Operand names counted by the argument of the call they come from (its internal names are cuflash_*)."""
    fixed = {"cuflash_bias": "bias", "cuflash_alibi": "alibi_slopes", "cuflash_softcap": "softcap"}
    counts = collections.Counter(
        fixed.get(n) or ("block_mask" if n.startswith("cuflash_m") else f"mod_arrays[{n!r}]") for n in names)
    return ", ".join(f"{arg}: {n}" for arg, n in counts.items())


def _reader(s: Slots, real: str = "float"):
    ctype = dict(_CTYPE, float=real)

    def read(name, index):
        t = s.types[name]
        if index == "table":  # the ModArray itself (kernels/mods.cuh: dense_bit)
            return f"p.mods.arrays[{s.arrays[(name, index)]}]"
        if index is None and (name, None) not in s.arrays:
            which, k = s.scalars[name]
            value = f"p.mods.{which}[{k}]"
        else:
            args = ["0", "0", "0", "0"]  # the value of each of b, h, q_idx, kv_idx the array is read at
            for i in index or ():
                if isinstance(i, tuple):
                    args[_AXES[i[0]]] = f"({i[0]} / {i[1]})"  # a block index (indices are never negative)
                elif i is not None:
                    args[_AXES[i]] = i
            value = f"mod_read<{ctype[t]}>(p.mods.arrays[{s.arrays[(name, index)]}], {', '.join(args)})"
        return f"({value} != 0)" if t == "bool" else value

    return read


def render(mods, block_mask=None, *, dbias: bool = False, real: str = "float") -> tuple[str, str]:
    """``(struct name, C++ text)``; ``dbias``: the backward accumulates the bias's gradient; ``real``: "float"
    (16-bit and float32 kernels) or "double" (float64 kernels), the type of the score and of every float
    operation."""
    if real not in ("float", "double"):
        raise ValueError(f"real must be 'float' or 'double', got {real!r}")
    p = parts(mods, block_mask, dbias)
    read = _reader(slots(p, real), real)
    one = "1.0f" if real == "float" else "1.0"
    code = {name: (e.cpp(read, real) if e is not None else default) for name, e, default in (
        ("score", p.score, "score"), ("dscore", p.dscore, one), ("dbias", p.dbias, one),
        ("mask", p.mask, "true"), ("rule", p.rule, "true"))}
    body = (f"  static constexpr bool kScore = {str(p.score is not None).lower()};\n"
            f"  static constexpr bool kMask = {str(p.mask is not None).lower()};\n"
            f"  static constexpr bool kDBias = {str(dbias).lower()};\n"
            f"  __device__ static __forceinline__ {real} score({real} score, {_VARS}) {{ return {code['score']}; }}\n"
            f"  __device__ static __forceinline__ {real} dscore({real} score, {_VARS}) {{ return {code['dscore']}; }}\n"
            f"  __device__ static __forceinline__ {real} dbias({real} score, {_VARS}) {{ return {code['dbias']}; }}\n"
            f"  __device__ static __forceinline__ bool mask({_VARS}) {{ return {code['mask']}; }}\n"
            f"  __device__ static __forceinline__ bool rule({_VARS}) {{ return {code['rule']}; }}\n")
    name = "Mods_" + hashlib.sha1(body.encode()).hexdigest()[:16]
    return f"cuflash::{name}", f"\nnamespace cuflash {{\nstruct {name} {{\n{body}}};\n}}  // namespace cuflash\n"


#: zero elements appended to every q_idx / kv_idx axis of an array operand: the kernels evaluate a modifier or a
#: mask rule at every (i, j) of a boundary tile, up to a tile past the sequence's end (kernels/mods.cuh), so no read
#: may leave the array there. At least the largest block_m / block_n of the tile tables
#: (tests/test_kernels_emulated_wide.py).
MOD_MARGIN = 256


def _device_array(xp, a, t: str, real: str = "float", margin_axes=()):
    """``a`` on ``xp`` in the kernels' element type, and its element strides per axis (0 where it broadcasts).
    Each axis of ``margin_axes`` that does not broadcast gets :data:`MOD_MARGIN` zeros past its end."""
    # converting the compact view copies only what the caller stored; integers in int32: problem validation saw to it
    # (mods.Expr.check_int_range)
    small = compact(a)
    dt = np.dtype(np.float64 if (t == "float" and real == "double") else _DEVICE_DTYPE[t])
    if small.dtype == np.bool_:
        small = small.view(np.uint8)
    # contiguous: a view whose byte strides are no multiple of the element (a structured array's field) would be
    # read at the wrong elements through element strides
    conv = xp.ascontiguousarray(xp.asarray(small).astype(dt, copy=False))
    broadcast = [st == 0 and n > 1 for st, n in zip(a.strides, a.shape)]
    pad = [ax for ax in margin_axes if not broadcast[ax]]
    if pad:
        padded = xp.zeros(tuple(n + (MOD_MARGIN if ax in pad else 0) for ax, n in enumerate(conv.shape)), dtype=dt)
        padded[tuple(slice(0, n) for n in conv.shape)] = conv
        conv = padded
    strides = [0 if b else s // dt.itemsize for b, s in zip(broadcast, conv.strides)]
    return conv, strides


def _converted(block_mask, key, xp, make):
    """``make()``: an operand on the device, kept on the BlockMask when it is one of the mask's own (its states, its
    rule's arrays; :meth:`~cuflash.BlockMask.derived`), converted again on every call when it is the caller's
    (``mod_arrays``, which may change between calls)."""
    name = key[0] if isinstance(key, tuple) else key
    if block_mask is None or name not in block_mask.values:
        return make()
    return block_mask.derived(("operand", device_key(xp), key), make)


def device_key(xp):
    """Where and in which order ``xp``'s new arrays are made: NumPy (the emulator), or the current CuPy device and
    stream. Per stream, so that what is kept is copied and read in one stream's order (a copy from pageable host
    memory may still be in flight when CuPy returns) and goes back to that stream's memory pool only after its
    kernels, with no synchronization. The module too: a device array is valid only for the CuPy that made it (the
    tests' fakes)."""
    if xp is np:
        return xp, None, None
    return xp, xp.cuda.Device().id, xp.cuda.get_current_stream().ptr


def operands(mods, block_mask, xp, *, dbias: bool = False, real: str = "float") -> tuple[tuple, tuple]:
    """``(ModArgs value without dbias, arrays it points to)`` for :func:`cuflash.cuda.params.pack`; ``dbias`` and
    ``real`` as given to :func:`render` (the slots are the struct's)."""
    p = parts(mods, block_mask, dbias)
    s = slots(p, real)
    arrays = [(0, (0, 0, 0, 0))] * params.MOD_ARRAYS
    keep = []
    for (name, index), k in s.arrays.items():
        if index == "table":  # packed bits: raw bytes, row stride in stride[0]
            conv = _converted(block_mask, name, xp, lambda: xp.ascontiguousarray(xp.asarray(p.values[name])))
            arrays[k] = (params.address(conv), (conv.strides[0], 0, 0, 0))
            keep.append(conv)
            continue
        if index is None:  # a float scalar of the float64 kernels: one float64 element, read with zero strides
            conv = xp.asarray(np.asarray([scalar_value(p.values[name])], dtype=np.float64))
            arrays[k] = (params.address(conv), (0, 0, 0, 0))
            keep.append(conv)
            continue
        margin = [axis for axis, var in enumerate(index)
                  if (var[0] if isinstance(var, tuple) else var) in ("q_idx", "kv_idx")]
        conv, strides = _converted(block_mask, (name, s.types[name], real, tuple(margin)), xp,
                                   lambda: _device_array(xp, p.values[name], s.types[name], real, margin))
        by_var = [0, 0, 0, 0]
        for axis, var in enumerate(index):
            if var is not None:
                by_var[_AXES[var[0] if isinstance(var, tuple) else var]] = strides[axis]
        arrays[k] = (params.address(conv), tuple(by_var))
        keep.append(conv)
    scalars = {"scalars": [0.0] * params.MOD_SCALARS, "iscalars": [0] * params.MOD_SCALARS}
    for name, (which, k) in s.scalars.items():
        value = scalar_value(p.values[name])
        scalars[which][k] = value
    return (arrays, scalars["scalars"], scalars["iscalars"], 0, (0, 0, 0, 0)), tuple(keep)


def dbias_buffer(mods, xp, dtype=np.float32, extents=None):
    """The dbias accumulator (fp32; float64 for the float64 kernels), zeroed, and its element strides per (b, h,
    q_idx, kv_idx). In the bias's compact (B|1, H|1, Sq|1, Sk|1) shape, strides 0 where the bias broadcasts: the
    kernels add those contributions up by atomics, in no fixed order. With ``extents`` (the problem's (B, H, Sq,
    Sk): the deterministic backward), in that whole shape: each element is then added to once, to its zero, and
    :func:`dbias_sum` sums the broadcast axes in a fixed order."""
    acc = xp.zeros(mods.bias_compact if extents is None else extents, dtype=dtype)
    strides = tuple(0 if n == 1 else s // acc.itemsize for n, s in zip(acc.shape, acc.strides))
    return acc, strides


def dbias_sum(xp, acc, compact):
    """``acc`` summed to the ``compact`` shape (keeping its 1s) in a fixed order: along each broadcast axis in turn,
    halves added pairwise in place (``x[:h] += x[h:2h]``, then an odd last slice into the first), log2 of the extent
    elementwise launches whose result does not depend on any launch configuration (a library's reduction may change
    its order with the device or version). In place, then one compact copy: the result holds no view of ``acc``
    (naive attention's size), nor does an empty ``acc`` fail (zeros)."""
    if acc.size == 0:
        return xp.zeros(compact, dtype=acc.dtype)
    x = acc
    for axis, c in enumerate(compact):
        if c != 1:
            continue

        def part(a, b):
            return (slice(None),) * axis + (slice(a, b),)
        while x.shape[axis] > 1:
            n, half = x.shape[axis], x.shape[axis] // 2
            x[part(0, half)] += x[part(half, 2 * half)]
            if n % 2:
                x[part(0, 1)] += x[part(n - 1, n)]
            x = x[part(0, half)]
    return x.copy()
