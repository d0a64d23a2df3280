"""The kernels' params struct (``kernels/params.cuh``) as a NumPy structured dtype, and its packing.

CuPy passes a size-1 NumPy array by value as a kernel argument (``cupy/cuda/function.pyx``:
``_pointer`` → ``CNumpyArray``; the CUDA backend hands it :func:`as_bytes`), and so does :mod:`cuflash.emulate`;
:data:`PARAMS` must therefore match the C++ layout byte for byte. :func:`layout_asserts` turns the dtype into C++
``static_assert``\\ s on ``sizeof``/``offsetof`` that every compilation of a kernel source carries
(:func:`cuflash.cuda.source.kernel_source`), so the two sides cannot drift apart silently.
"""
from __future__ import annotations

import numpy as np

_PTR, _I64, _I32, _U32, _F32 = np.uint64, np.int64, np.int32, np.uint32, np.float32


def _struct(fields, ctype: str) -> np.dtype:
    # align=True lays fields out as a C compiler does (each at a multiple of its alignment, the size a
    # multiple of the largest one); metadata names the C++ type for error messages and the asserts.
    return np.dtype(fields, align=True, metadata={"ctype": ctype})


TENSOR = _struct([("ptr", _PTR), ("batch_stride", _I64), ("row_stride", _I64), ("head_stride", _I64)],
                 "cuflash::TensorArg")
BLOCK_MASK = _struct([("tile_counts", _PTR), ("tile_lists", _PTR), ("tiles_batch_stride", _I64),
                      ("tiles_head_stride", _I64), ("list_len", _I32)], "cuflash::BlockMaskArg")
DROPOUT = _struct([("seed_lo", _U32), ("seed_hi", _U32), ("threshold", _U32), ("rescale", _F32)],
                  "cuflash::DropoutArg")
MOD_ARRAYS = MOD_SCALARS = 8  # kModArrays, kModScalars
MOD_ARRAY = _struct([("ptr", _PTR), ("stride", _I64, (4,))], "cuflash::ModArray")
MODS = _struct([("arrays", MOD_ARRAY, (MOD_ARRAYS,)), ("scalars", _F32, (MOD_SCALARS,)),
                ("iscalars", _I32, (MOD_SCALARS,)), ("dbias", _PTR), ("dbias_stride", _I64, (4,))],
               "cuflash::ModArgs")
#: the float64 kernels' scalars in float64 (scale, dropout's 1/(1-p)); zero for the others
WIDE = _struct([("scale", np.float64), ("rescale", np.float64)], "cuflash::WideArg")
#: a paged KV cache: block table (B, max_blocks) int32, its row stride, the page size (kernels/kv_tile.cuh)
PAGED = _struct([("block_table", _PTR), ("table_stride", _I64), ("page_size", _I32)], "cuflash::PagedArg")
#: split-KV workspaces (partial out, lse per split) and their per-split strides (kernels/combine.cuh)
SPLIT = _struct([("o_accum", _PTR), ("lse_accum", _PTR), ("o_split_stride", _I64), ("lse_split_stride", _I64),
                 ("num_splits", _I32)], "cuflash::SplitArg")
TENSORS = ("q", "k", "v", "o", "dout", "dq", "dk", "dv", "dq_accum")
PARAMS = _struct([*((name, TENSOR) for name in TENSORS),
                  ("lse", _PTR), ("lse_log2", _PTR), ("dsum", _PTR),
                  ("stats_batch_stride", _I64), ("stats_head_stride", _I64),
                  ("seqlens_q", _PTR), ("seqlens_k", _PTR), ("cu_seqlens_q", _PTR), ("cu_seqlens_k", _PTR),
                  ("seqlen_q", _I32), ("seqlen_k", _I32), ("head_dim", _I32), ("heads_per_kv", _I32),
                  ("scale", _F32), ("scale_log2", _F32), ("window_left", _I32), ("window_right", _I32),
                  ("mask", BLOCK_MASK), ("dropout", DROPOUT), ("mods", MODS), ("wide", WIDE),
                  ("paged", PAGED), ("split", SPLIT)],
                 "cuflash::Params")


def address(a) -> int:
    """Device address of a CuPy array (or of a NumPy array standing in for device memory); 0 for None."""
    if a is None:
        return 0
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)


def tensor(a) -> tuple:
    """A (batch, row, head, dim) array as a ``TensorArg`` value: address and element strides. A packed (total, head,
    dim) array of a ragged batch (varlen) has batch stride 0: the kernels add each sequence's first row instead."""
    if a is None:
        return (0, 0, 0, 0)
    if a.ndim == 3:
        return (address(a), 0, *(s // a.dtype.itemsize for s in a.strides[:2]))
    if a.ndim != 4:
        raise ValueError(f"a kernel tensor is (batch, row, head, dim) or packed (total, head, dim), got shape "
                         f"{a.shape}")
    return (address(a), *(s // a.dtype.itemsize for s in a.strides[:3]))


def pack(**values) -> np.ndarray:
    """A size-1 :data:`PARAMS` array: every field zero (null pointers) except ``values``.

    Arrays given for the tensor fields are packed with :func:`tensor`; for pointer fields, with
    :func:`address`. Nested structs take a tuple in field order. Unknown names raise ``KeyError``.
    """
    p = np.zeros(1, dtype=PARAMS)
    for name, value in values.items():
        kind = PARAMS.fields[name][0]
        if kind == TENSOR:
            value = tensor(value)
        elif kind == np.dtype(_PTR):
            value = address(value)
        p[name] = value
    return p


#: :data:`PARAMS` as plain bytes: what the CUDA backend hands CuPy (:func:`as_bytes`)
PARAMS_BYTES = np.dtype((np.void, PARAMS.itemsize))


def as_bytes(p: np.ndarray) -> np.ndarray:
    """A size-1 :data:`PARAMS` array viewed as plain bytes, for CuPy's launch.

    CuPy takes a by-value argument's address from ``__array_interface__``, whose ``descr`` NumPy builds by walking
    every field of a structured dtype, 95 for :data:`PARAMS`: 65 us a launch on a 2-core Xeon, 130-270 us on the
    H200 machine's host (``benchmarks.host_cost``; 1.4 us as plain bytes). The bytes are the same; the kernel's
    signature gives them their type.
    """
    return p.view(PARAMS_BYTES)


def _members(dtype: np.dtype, prefix: str = ""):
    """``(C++ member path, offset, dtype)`` of every field, nested structs and the first element of struct
    arrays included (the element size is asserted through the element struct's sizeof)."""
    for name in dtype.names:
        sub, offset = dtype.fields[name][:2]
        yield prefix + name, offset, sub
        base, path = (sub.subdtype[0], f"{prefix}{name}[0]") if sub.subdtype else (sub, prefix + name)
        if base.names:
            if sub.subdtype:
                yield path, offset, base
            for p, off, leaf in _members(base, path + "."):
                yield p, offset + off, leaf


def layout_asserts(dtype: np.dtype = PARAMS) -> str:
    """C++ ``static_assert``\\ s that the struct ``dtype`` describes has ``dtype``'s size and offsets.

    Sizes are checked by every compiler. Offsets need ``__builtin_offsetof``, which NVRTC lacks (no
    ``offsetof`` is a constant expression there), so they are checked where the host compiler builds
    the source: the CPU emulator (g++) and the compile check's host pass
    (:func:`cuflash.cuda.compile.check_host_layout`). Device and host agree on the layout of a kernel
    parameter type by CUDA's ABI; a GPU test also reads the offsets back from a kernel.
    """
    structs = {dtype.metadata["ctype"]: dtype}
    structs.update({sub.metadata["ctype"]: sub for _, _, sub in _members(dtype) if sub.names and sub.metadata})
    lines = [f'static_assert(sizeof({ctype}) == {d.itemsize}, "{ctype}: size differs from cuflash/cuda/params.py");'
             for ctype, d in structs.items()]
    lines.append("#ifndef __CUDACC_RTC__")
    ctype = dtype.metadata["ctype"]
    lines += [f'static_assert(__builtin_offsetof({ctype}, {path}) == {offset}, "{ctype}::{path}: offset differs '
              f'from cuflash/cuda/params.py");' for path, offset, _ in _members(dtype)]
    lines.append("#endif")
    return "\n".join(lines) + "\n"
