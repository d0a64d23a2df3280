"""What a backward needs of its forward: :class:`AttentionResidual`, and the :func:`fingerprint` that proves the
saved arrays unchanged since (PyTorch's autograd version counter, for arrays that have none).
"""
from __future__ import annotations

import functools
import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from .interop import Edge
from .options import Array, is_given
from .problem import array_module


@dataclass(frozen=True, eq=False, repr=False)
class AttentionResidual:
    """What :func:`attention_backward` needs of one forward call: ``attention(..., return_residual=True)``.

    It carries the forward's ``out`` and ``lse`` (in the caller's array type), every option of the forward
    (``options``; a drawn dropout seed filled in), references to ``q``, ``k``, ``v`` (no copies; nothing of
    size N²) and a fingerprint of ``q``, ``k``, ``v``, ``out``, ``lse`` and the array options taken after the forward:
    ``attention_backward(dout, residual)`` cannot be given options other than the forward's, and raises
    ``ValueError`` when one of those arrays was changed in place since (as PyTorch's autograd does). The name
    is JAX's (``jax.vjp``'s residuals, ``jax.nn.dot_product_attention(..., return_residual=True)``).

    Attributes
    ----------
    out : array
        The forward's result (the same object ``attention`` returned).
    lse : array, shape ``(..., heads, seqlen_q)``
        Its log-sum-exp, float32 (float64 for float64 input).
    options : mapping
        Every option of the forward (:data:`OPTIONS`), read-only; ``options["seed"]`` is the drawn seed.
    packed : {None, "qkv", "kv"}
        Which packed form the forward took (the backward returns ``dqkv`` or ``(dq, dkv)`` accordingly).
    backend : str or None
        The forward's ``backend`` argument, the backward's default.
    """

    out: Array
    lse: Array
    options: Mapping[str, Any]
    packed: Optional[str] = None
    backend: Optional[str] = None
    _saved: tuple[Any, ...] = field(default=(), repr=False)  # NumPy/CuPy q, k, v, out, lse (caller layout)
    _native_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    _prints: tuple[Any, ...] = field(default=(), repr=False)
    _edge: Optional[Edge] = field(default=None, repr=False)
    _watched: tuple[tuple[str, Any], ...] = field(default=(), repr=False)  # (name, array) of _prints (watched())

    def __repr__(self) -> str:
        def show(x: Any) -> str:
            if hasattr(x, "shape") and hasattr(x, "dtype"):
                return f"{type(x).__name__}{tuple(x.shape)} {x.dtype}"
            if isinstance(x, Mapping):  # mod_arrays: its arrays as shapes too (a 1000-element one printed 250 lines)
                return "{" + ", ".join(f"{k!r}: {show(v)}" for k, v in x.items()) + "}"
            return repr(x)

        options = {name: show(value) for name, value in self.options.items() if is_given(name, value)}
        return (f"AttentionResidual(out={show(self.out)}, lse={show(self.lse)}, options={{"
                + ", ".join(f"{k}: {v}" for k, v in options.items())
                + f"}}, packed={self.packed!r}, backend={self.backend!r})")

    def __getstate__(self) -> dict[str, Any]:
        """Pickle and deepcopy: the read-only option mappings travel as dicts (a ``mappingproxy`` does not pickle),
        read-only again once loaded (:meth:`__setstate__`). The saved arrays travel with them, so a loaded residual's
        backward checks their fingerprints as the original's does. A residual of a foreign library's arrays (torch,
        JAX, ...) keeps its call's edge, which pickles that library's namespace by name
        (:meth:`cuflash.interop.Edge.__getstate__`)."""
        state = dict(self.__dict__)
        for name in ("options", "_native_options"):
            state[name] = dict(state[name])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in ("options", "_native_options"):
            state[name] = MappingProxyType(dict(state[name]))
        self.__dict__.update(state)

    @property
    def seed(self) -> Optional[int]:
        """The dropout seed of the forward (drawn there when it was None), or None without dropout."""
        seed = self.options.get("seed")
        return None if seed is None else int(seed)

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` if ``q``, ``k``, ``v``, ``out`` or an array option (``bias``, ``seqlens_q``, a
        ``mod_arrays`` value, ...) changed since the forward."""
        for (name, _), now, before in zip(self._watched, fingerprints(a for _, a in self._watched), self._prints):
            if now != before:
                raise ValueError(f"{name} was modified in place after attention_vjp / attention(..., "
                                 f"return_residual=True): the gradients would be those of other values; pass a copy "
                                 f"to the in-place operation, or run the forward again")


def watched(arrays: Mapping[str, Any], options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """``(name, array)`` of everything a backward reads again that a caller could change in place: ``arrays`` and
    the NumPy/CuPy arrays among ``options`` (``mod_arrays``' values by key). A bias or an offset changed after the
    forward would give the gradients of another problem, against the forward's lse."""
    found = list(arrays.items())
    for name, value in options.items():
        if name == "mod_arrays" and isinstance(value, Mapping):
            found += [(f"mod_arrays[{key!r}]", a) for key, a in value.items() if _is_array(a)]
        elif name == "block_mask" and value is not None and hasattr(value, "states"):
            # read-only, but a caller may make them writeable again (BlockMask.derived allows it); the states are
            # among the values of most masks: each array once
            parts = {id(value.states): ("block_mask.states", value.states)}
            for key, a in value.values.items():
                if _is_array(a):
                    parts.setdefault(id(a), (f"block_mask.values[{key!r}]", a))
            found += parts.values()
        elif _is_array(value):
            found.append((name, value))
    return tuple(found)


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__")


_CHUNK = 1 << 20
_ROWS = 1024  # partial sums per chunk on the device (_chunk_sums)
_MIX = 0x9E3779B97F4A7C15  # odd: multiplying by it is invertible modulo 2**64
_WEIGHTS: dict[int, Any] = {}  # device id -> the weights of fingerprint(), on that device


def fingerprints(arrays: Iterable[Any]) -> tuple[tuple[Any, ...], ...]:
    """:func:`fingerprint` of each of ``arrays``, the NumPy ones side by side on the NumPy backend's worker threads
    (``zlib.crc32`` releases the GIL: a residual's q, k, v and out, 4 MiB each, took 6.6 ms one after the other on
    this 2-core machine, before the backward's own work could start)."""
    arrays = list(arrays)
    host = [a for a in arrays if isinstance(a, np.ndarray)]
    # below 1 MiB the threads' start (~0.1 ms) costs more than CRC-32 does
    if len(host) > 1 and sum(a.nbytes for a in host) >= 1 << 20:
        from .backends._blas import call_threads  # the running call's reading of CUFLASH_NUM_THREADS (api._one_call)

        threads = min(call_threads(), len(host))
    else:
        threads = 1
    if threads < 2:
        return tuple(fingerprint(a) for a in arrays)
    with ThreadPoolExecutor(threads) as pool:
        return tuple(pool.map(fingerprint, arrays))


def fingerprint(a: Any) -> tuple[Any, ...]:
    """Shape, dtype and a position-sensitive checksum of an array's bits in index order (not its strides: a copy's
    differ where a dimension is 1 or the array was a view, and a pickled or deep-copied residual refused its own
    unchanged arrays as modified; a stride set in place shows in the bits read): CRC-32 of a NumPy array's
    bytes (1.6 GB/s here); for a CuPy array, on its device, ``sum_i bits16[i] * w[i]`` modulo 2**64 over fixed
    pseudo-random odd weights ``w`` (``bits8`` where the byte count is odd), chunk sums of 1 Mi elements combined
    as ``total * MIX + chunk`` (so that chunks do not commute); up to five reduction kernels, whatever the size,
    and one read-back per array (:func:`_chunk_sums`).
    Integer arithmetic: a change ``delta`` of one element changes the sum by ``delta * w[i]``, never 0 modulo 2**64
    for an odd weight (a float64 sum lost a one-bit change below half an ulp of the total). Any change of values (an
    edit, a permutation) changes it, short of a deliberate collision."""
    xp = array_module(a, names=("array",))
    flat = xp.ascontiguousarray(a).reshape(-1).view(xp.uint8)
    total: int
    if xp is np:
        total = zlib.crc32(memoryview(flat))
    else:
        flat = flat if flat.size % 2 else flat.view(xp.uint16)
        key = a.device.id
        with xp.cuda.Device(key):  # the weights live on the array's device, whichever is current
            if key not in _WEIGHTS:
                odd = np.random.default_rng(0).integers(0, 2**63, _CHUNK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
                _WEIGHTS[key] = xp.asarray(odd)
            total = _fold(_chunk_sums(xp, flat, _WEIGHTS[key]))
    return tuple(a.shape), str(a.dtype), total


def _chunk_sums(xp: Any, flat: Any, w: Any) -> list[int]:
    """``sum_j flat[c * CHUNK + j] * w[j]`` modulo 2**64 for every chunk ``c`` (the last one possibly short), on the
    device, read back once. Rows of ``CHUNK / _ROWS`` elements are summed by the fused kernel, then each chunk's rows
    (sums modulo 2**64 are associative: the same result); the short chunk's whole rows likewise, and the rest of it
    (under one row) apart, the two added on the host. A reduction over 1 Mi elements per output gave CuPy one thread
    block per chunk (32 for a (32, 512, 32, 64) float16 array on 132 multiprocessors): 0.8 ms a fingerprint on the
    H200. (A loop over the chunks with CuPy's own operations before it launched 5 kernels a chunk: 2 ms.)"""
    rows = math.gcd(_ROWS, _CHUNK)
    inner = _CHUNK // rows
    whole = flat.size - flat.size % _CHUNK
    short = flat.size - whole
    in_rows = short - short % inner  # the short chunk's whole rows
    # slots: one per whole chunk, then the short chunk's rows and its rest (each 0 where there is none)
    sums = xp.zeros(whole // _CHUNK + 2 * (short > 0), xp.uint64)
    for start, size, n in ((0, whole, whole // _CHUNK), (whole, in_rows, 1)):
        if size:
            part = flat[start:start + size].reshape(n, -1, inner)
            partial = _weighted_sum(xp)(part, w[:part.shape[1] * inner].reshape(-1, inner), axis=2)
            slot = start // _CHUNK
            partial.sum(axis=1, dtype=xp.uint64, out=sums[slot:slot + n])
    if short > in_rows:
        rest = flat[whole + in_rows:].reshape(1, -1)
        _weighted_sum(xp)(rest, w[in_rows:short].reshape(1, -1), axis=1, out=sums[-1:])
    host: list[int] = sums.get().tolist()
    if short:  # the short chunk: its rows' sum and its rest's, added modulo 2**64
        host[-2:] = [(host[-2] + host[-1]) % 2**64]
    return host


def _fold(chunk_sums: list[int]) -> int:
    total = 0
    for s in chunk_sums:
        total = (total * _MIX + s) % 2**64
    return total


@functools.lru_cache(maxsize=None)
def _weighted_sum(xp: Any) -> Any:
    """The reduction ``y = sum_j x[j] * w[j]`` in uint64 (wrapping: arithmetic modulo 2**64), x of 8 or 16 bits,
    ``w`` broadcast along x's rows. The expression is valid C++ and NumPy alike (the tests' fake CuPy evaluates
    it)."""
    return xp.ReductionKernel("T x, uint64 w", "uint64 y", "w * x", "a + b", "y = a", "0", "cuflash_fingerprint",
                              reduce_type="unsigned long long")  # a C++ type name: CuPy typedefs it
