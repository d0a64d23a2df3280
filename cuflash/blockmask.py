"""Element-exact masks with a block structure: skipping at block cost (FlexAttention's BlockMask, FA1 Algorithm 5).

A :class:`BlockMask` keeps two things:

- the state of every (query block, key block): **skipped** (no element kept: never computed),
  **full** (every element kept: no element test) or **partial** (elements tested one by one);
- the element rule of its partial blocks: an expression of the modifier language
  (:mod:`cuflash.mods`: ``b, h, q_idx, kv_idx`` and operand arrays), compiled into the kernels,
  evaluated vectorized by the NumPy backend and the reference.

Every named constructor means exactly its name: ``causal``, ``sliding_window``, ``document``,
``prefix_lm``, ``from_dense`` (packed bits for partial blocks only), ``from_mask_mod`` (any mask
expression, classified block by block once). ``from_blocks`` (and ``BlockMask(grid)``) is FA1's
block-sparse attention, whole blocks on or off; ``global_local`` and ``strided`` are defined in
blocks (their parameters count blocks) and are block-sparse too. Masks combine with ``&`` and ``|``.
The grid has shape ``(batch|1, heads|1, ceil(Sq/block_q), ceil(Sk/block_k))``, ``batch`` the product
of the batch dimensions. Alignment: a BlockMask is built for its own ``seqlen_q``/``seqlen_k`` (causal
and windows bottom-right at those lengths); per-sequence lengths (``seqlens_q/k``) cut rows and keys
but do not move a BlockMask's diagonal (``causal=``/``window=`` do follow them).
"""
from __future__ import annotations

import numbers
import uuid
from collections import OrderedDict
import zlib
from typing import Optional

import numpy as np

from . import mods
# problem imports this module only inside make_problem: these come in at its top without a cycle
from .problem.core import _check_fits_working, _check_mod_arrays, check_int

DEFAULT_BLOCK = (128, 128)
#: entries BlockMask.derived keeps per mask (tile lists and operands per device, stream and tile size): enough for a
#: forward and backward on a few streams, bounded for a caller that makes a stream per call
_DERIVED_LIMIT = 32
SKIP, PARTIAL, FULL = 0, 1, 2
_GRID_FORM = "a boolean array (nq, nk), (heads|1, nq, nk) or (batch|1, heads|1, nq, nk)"


def _prefix() -> str:
    """Operand names unique to one mask, across processes too: masks built in forked workers, or pickled, meet in
    ``&`` and ``|``, whose operands must not overwrite each other's (a per-process counter gave both the same)."""
    return f"cuflash_m{uuid.uuid4().hex}_"


#: the length of every :func:`_prefix` (a mask's operand names are the prefix and the caller's name)
_PREFIX_LEN = len(_prefix())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _is_int(x) -> bool:
    """An int of Python or NumPy; not a bool (``True`` is an Integral, and a block of True meant 1 by accident)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_block(block):
    form = "a pair (block_q, block_k) of positive ints"
    # a wrong type (not a pair, or a float / bool / array inside it) is a TypeError, a wrong value a ValueError,
    # as everywhere in cuflash
    if not isinstance(block, (tuple, list)) or not all(_is_int(b) for b in block):
        raise TypeError(f"block must be {form}, got {block!r}")
    if len(block) != 2 or not all(b > 0 for b in block):
        raise ValueError(f"block must be {form}, got {block!r}")
    return check_int(block[0], "block[0]", 1), check_int(block[1], "block[1]", 1)


def _host_array(a, name, form):
    """``np.asarray(a)``, refusing a masked array (its mask would be dropped) and a nested list of ragged lengths
    (NumPy's own error named neither the argument nor its expected ``form``)."""
    if isinstance(a, np.ma.MaskedArray):
        raise TypeError(f"{name} is a numpy.ma.MaskedArray: its mask would be ignored; pass a plain array "
                        f"(e.g. a.filled(...))")
    try:
        return np.asarray(a)
    except ValueError as e:  # NumPy: "setting an array element with a sequence ... inhomogeneous shape"
        raise ValueError(f"{name} must be {form}, got a sequence NumPy makes no array of (nested lists of "
                         f"different lengths?): {e}") from None


def _check_working_dtype(dtype):
    """``dtype`` of :meth:`BlockMask.keep` / :meth:`BlockMask.to_dense`, refused unless it is a working precision:
    the rule's floats are computed in it, and in an int, bool, float16 or complex dtype they gave other elements
    (``keep`` at int32 truncates a fractional bound), silently."""
    if dtype is None:
        return
    form = "float32 or float64 (the working precision of the problem) or None"
    try:
        name = np.dtype(dtype).name
    except (TypeError, ValueError):  # NumPy's "data type 'bfloat16' not understood" named no argument
        raise TypeError(f"dtype must be {form}, got {dtype!r}") from None
    if name not in ("float32", "float64"):
        raise TypeError(f"dtype must be {form}, got {name}")


def _frozen(a):
    a.setflags(write=False)
    return a


def _lengths(seqlen_q, seqlen_k):
    sq = check_int(seqlen_q, "seqlen_q")
    return sq, sq if seqlen_k is None else check_int(seqlen_k, "seqlen_k")


def _same(x, y) -> bool:
    """Whether two operands of one name hold the same values (the same array, or a copy of it)."""
    x, y = np.asarray(x), np.asarray(y)
    return x is y or (x.shape == y.shape and x.dtype == y.dtype
                      and np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))


class BlockMask:
    """A mask of (query, key) pairs with a block structure; see the module docstring.

    ``BlockMask(grid, block=..., seqlen_q=..., seqlen_k=...)`` with a boolean ``grid`` of shape
    ``(nq, nk)``, ``(heads|1, nq, nk)`` or ``(batch|1, heads|1, nq, nk)`` is FA1's block-sparse mask
    (:meth:`from_blocks`): a True block keeps all of its elements.

    Attributes
    ----------
    states : int8 array ``(batch|1, heads|1, nq, nk)``
        0 skipped, 1 partial, 2 full.
    block : (int, int)
    seqlen_q, seqlen_k : int
    member : cuflash.mods.Expr
        Whether element ``(b, h, q_idx, kv_idx)`` is kept (reads the states and the rule's operands).
    values : dict
        The operands ``member`` reads (host arrays; names unique to this mask).
    """

    #: the index variables (``b``, ``h``) a from_mask_mod rule reads but was classified at 0 only (built for 1)
    _pinned = frozenset()
    #: a combination's CRC of the states it computed from its parts (see :meth:`_check_states`); None otherwise
    _states_crc: Optional[int] = None

    def __init__(self, grid, *, block=DEFAULT_BLOCK, seqlen_q=None, seqlen_k=None):
        grid = _host_array(grid, "grid", _GRID_FORM)
        if grid.dtype != np.bool_:
            raise TypeError(f"grid must be {_GRID_FORM}, got dtype {grid.dtype}")
        self._init(np.where(grid, FULL, SKIP).astype(np.int8), block, seqlen_q, seqlen_k, None, {})

    def _init(self, states, block, seqlen_q, seqlen_k, rule: Optional[mods.Expr], values: dict,
              member: Optional[mods.Expr] = None):
        if not 2 <= states.ndim <= 4:
            raise ValueError(f"grid must be {_GRID_FORM}, got shape {states.shape}")
        self.states = np.array(states.reshape((1,) * (4 - states.ndim) + states.shape), dtype=np.int8)
        self.states.setflags(write=False)  # the mask is a value: the caller's array is copied, and this one frozen
        self.block = _check_block(block)
        nq, nk = self.states.shape[2:]
        self.seqlen_q = nq * self.block[0] if seqlen_q is None else check_int(seqlen_q, "seqlen_q")
        self.seqlen_k = nk * self.block[1] if seqlen_k is None else check_int(seqlen_k, "seqlen_k")
        if _cdiv(self.seqlen_q, self.block[0]) != nq or _cdiv(self.seqlen_k, self.block[1]) != nk:
            raise ValueError(f"grid {self.states.shape[2:]} does not cover seqlen_q={self.seqlen_q}, "
                             f"seqlen_k={self.seqlen_k} in blocks of {self.block}")
        # the mask is a value: its operand arrays are its own (from_mask_mod copies the caller's) and read-only,
        # which lets derived() trust what it kept without reading them again
        values = {n: _frozen(v) if isinstance(v, np.ndarray) else v for n, v in values.items()}
        if member is None:
            grid_name = _prefix() + "states"
            values = {**values, grid_name: self.states}
            member = mods.grid_member(grid_name, self.states.shape, self.block, rule)
        self.member, self.values = member, values

    def derived(self, key, make):
        """``make()`` for ``key``, computed on the first call with this mask and kept on it: what every call with the
        mask derives again (the kernels' tile lists, device copies of its operands). FlexAttention's pattern:
        ``create_block_mask`` once, attention many times (the H100 run spent about 2 ms a call re-deriving them). A
        mask is a value: its states and operands are read-only copies, and while they stay read-only an entry is used
        as it is. Whoever makes one writeable (``setflags(write=True)``) makes every later call check a CRC of them
        against the entry's and derive it again on a change; an array changed and made read-only again in between
        two calls is not seen (build a new mask instead)."""
        self._check_states()
        memo = self.__dict__.setdefault("_derived", OrderedDict())
        arrays = [self.states] + [v for v in self.values.values() if isinstance(v, np.ndarray)]
        checksum = None if not any(a.flags.writeable for a in arrays) else self._checksum()
        entry = memo.pop(key, None)
        if entry is None or entry[0] != checksum:
            entry = (checksum, make())
        memo[key] = entry  # most recently used last; the oldest go beyond _DERIVED_LIMIT (a stream per call)
        while len(memo) > _DERIVED_LIMIT:
            memo.popitem(last=False)
        return entry[1]

    def __getstate__(self) -> dict:
        """Pickle and deepcopy without :meth:`derived`'s entries: they hold device arrays and array modules, and a
        copy derives its own."""
        return {name: value for name, value in self.__dict__.items() if name != "_derived"}

    def __setstate__(self, state: dict) -> None:
        """A copy is a value too: its arrays read-only again (pickle and deepcopy make them writeable, which made the
        copy changeable in place and every :meth:`derived` call of it check a CRC of all its operands)."""
        self.__dict__.update(state)
        _frozen(self.states)
        for value in self.values.values():
            if isinstance(value, np.ndarray):
                _frozen(value)

    def _check_states(self) -> None:
        """A combination's element rule is its parts' (their operands copied when combined), and its states are
        computed from them once, so states made writeable and edited would keep other elements in the tile schedule
        than in :meth:`to_dense` and the reference. Every use refuses them then (while they are writeable: a CRC)."""
        if self._states_crc is not None and self.states.flags.writeable and \
                zlib.crc32(np.ascontiguousarray(self.states).view(np.uint8)) != self._states_crc:
            raise ValueError("this mask's states were changed in place, but a combination (m1 & m2, m1 | m2, "
                             "columns()) keeps its parts' elements: build a new mask (e.g. BlockMask(grid) & rule) "
                             "instead")

    def _checksum(self) -> tuple:
        parts = [zlib.crc32(np.ascontiguousarray(self.states).view(np.uint8))]
        for name, value in sorted(self.values.items()):
            if isinstance(value, np.ndarray):
                data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
                parts.append((name, value.dtype.str, value.shape, zlib.crc32(data)))
            else:
                parts.append((name, repr(value)))
        return tuple(parts)

    @classmethod
    def _make(cls, states, block, seqlen_q, seqlen_k, rule=None, values=None, member=None) -> "BlockMask":
        mask = cls.__new__(cls)
        mask._init(states, block, seqlen_q, seqlen_k, rule, values or {}, member)
        return mask

    # ---------------------------------------------------------------- block-sparse (FA1 Algorithm 5)
    @classmethod
    def from_blocks(cls, grid, *, block=DEFAULT_BLOCK, seqlen_q=None, seqlen_k=None):
        """FA1's block-sparse attention: a True block keeps all of its elements, a False one none."""
        return cls(grid, block=block, seqlen_q=seqlen_q, seqlen_k=seqlen_k)

    from_grid = from_blocks  # the name of earlier versions

    @classmethod
    def global_local(cls, seqlen_q, seqlen_k=None, *, global_blocks=1, local_blocks=1, block=DEFAULT_BLOCK):
        """BigBird/Longformer style, in blocks: the first ``global_blocks`` query and key blocks are dense, and
        every query block sees the key blocks within ``local_blocks`` of its diagonal."""
        sq, sk = _lengths(seqlen_q, seqlen_k)
        g = check_int(global_blocks, "global_blocks")
        w = check_int(local_blocks, "local_blocks")
        qi, kj = cls._block_indices(sq, sk, block)
        return cls((np.abs(qi - kj) <= w) | (qi < g) | (kj < g), block=block, seqlen_q=sq, seqlen_k=sk)

    @classmethod
    def strided(cls, seqlen_q, seqlen_k=None, *, stride, local_blocks=0, block=DEFAULT_BLOCK):
        """Sparse-Transformer style, in blocks: query block ``i`` sees key block ``j`` when
        ``i % stride == j % stride``, plus the band ``|i - j| <= local_blocks``."""
        sq, sk = _lengths(seqlen_q, seqlen_k)
        stride = check_int(stride, "stride", 1)
        w = check_int(local_blocks, "local_blocks")
        qi, kj = cls._block_indices(sq, sk, block)
        return cls((qi % stride == kj % stride) | (np.abs(qi - kj) <= w), block=block, seqlen_q=sq, seqlen_k=sk)

    @staticmethod
    def _block_indices(sq, sk, block):
        bq, bk = _check_block(block)
        return np.arange(_cdiv(sq, bq))[:, None], np.arange(_cdiv(sk, bk))[None, :]

    # ---------------------------------------------------------------- element-exact
    @classmethod
    def causal(cls, seqlen_q, seqlen_k=None, *, block=DEFAULT_BLOCK):
        """Causal, aligned bottom-right at the mask's lengths: ``kv_idx <= q_idx + seqlen_k - seqlen_q``."""
        return cls.sliding_window(seqlen_q, seqlen_k, window=(None, 0), block=block)

    @classmethod
    def sliding_window(cls, seqlen_q, seqlen_k=None, *, window, block=DEFAULT_BLOCK):
        """The band ``q_idx + off - left <= kv_idx <= q_idx + off + right``, ``off = seqlen_k - seqlen_q``
        (``None`` an unbounded side): exactly ``attention(window=...)`` at these lengths."""
        from .tiling import Schedule

        sq, sk = _lengths(seqlen_q, seqlen_k)
        if not isinstance(window, (tuple, list)):
            raise TypeError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
        if len(window) != 2:
            raise ValueError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
        left, right = (None if w is None else min(check_int(w, f"window {side}"), sq + sk)
                       for side, w in zip(("left", "right"), window))
        bq, bk = _check_block(block)
        sched = Schedule(sq, sk, bq, bk, left=left, right=right)
        states = np.where(sched.full_grid(), FULL, np.where(sched.kept_grid(), PARTIAL, SKIP)).astype(np.int8)
        conds, values = [], {}
        name = _prefix()
        # as kv_idx - q_idx: with lengths below 2**30 that difference fits the kernels' 32-bit int, q_idx + hi may
        # not (a right bound near seqlen_q + seqlen_k wrapped to negative and hid every key of the row)
        if left is not None:
            values[name + "lo"] = sk - sq - left
            conds.append(f"kv_idx - q_idx >= {name}lo")
        if right is not None:
            values[name + "hi"] = sk - sq + right
            conds.append(f"kv_idx - q_idx <= {name}hi")
        rule = mods.parse(" and ".join(conds) or "True", kind="mask", arrays=values, internal=True)
        return cls._make(states, (bq, bk), sq, sk, rule, values)

    @classmethod
    def prefix_lm(cls, seqlen, prefix_len, *, block=DEFAULT_BLOCK):
        """Prefix-LM: the first ``prefix_len`` keys are seen by every query (bidirectional prefix), the rest
        causally: ``kv_idx < prefix_len or kv_idx <= q_idx``."""
        n = check_int(seqlen, "seqlen")
        p = min(check_int(prefix_len, "prefix_len"), n)
        return cls.causal(n, block=block) | cls.sliding_window(n, window=(None, None), block=block).columns(0, p)

    def columns(self, start: int, stop: int) -> "BlockMask":
        """This mask restricted to the key columns ``[start, stop)`` (element-exact)."""
        # clamped to seqlen_k, which keeps the same columns: the kernels take the bounds as int32 (2**40 was an
        # OverflowError from their parameter packing, naming neither)
        a, b = (min(check_int(x, name), self.seqlen_k) for x, name in ((start, "start"), (stop, "stop")))
        bk = self.block[1]
        col = np.arange(_cdiv(self.seqlen_k, bk))
        lo, hi = col * bk, np.minimum((col + 1) * bk, self.seqlen_k)
        inside = (lo >= a) & (hi <= b)
        touch = (hi > a) & (lo < b)
        cut = np.where(inside, FULL, np.where(touch, PARTIAL, SKIP)).astype(np.int8)
        name = _prefix()
        values = {name + "a": a, name + "b": b}
        rule = mods.parse(f"{name}a <= kv_idx < {name}b", kind="mask", arrays=values, internal=True)
        cols = self._make(np.broadcast_to(cut, self.states.shape[2:]), self.block, self.seqlen_q, self.seqlen_k,
                          rule, values)
        return self & cols

    @classmethod
    def document(cls, doc_ids_q, doc_ids_k=None, *, block=DEFAULT_BLOCK):
        """Packed sequences: a query attends only to keys of the same document id
        (``doc_q[q_idx] == doc_k[kv_idx]``, per batch row when the ids are ``(batch, seqlen)``). Combine with
        ``BlockMask.causal`` by ``&``. Blocks whose id ranges cannot meet are skipped; blocks of one and the
        same id are full (sorted ids, as packing gives, make almost every block one or the other)."""
        dq = cls._ids(doc_ids_q, "doc_ids_q")
        dk = dq if doc_ids_k is None else cls._ids(doc_ids_k, "doc_ids_k")
        if dq.shape[0] != dk.shape[0]:
            raise ValueError(f"doc_ids_q and doc_ids_k must have the same batch, got {dq.shape} and {dk.shape}")
        bq, bk = _check_block(block)
        (q_lo, q_hi), (k_lo, k_hi) = cls._ranges(dq, bq), cls._ranges(dk, bk)
        meet = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
        same = (q_lo == q_hi)[:, :, None] & (k_lo == k_hi)[:, None, :] & (q_lo[:, :, None] == k_lo[:, None, :])
        states = np.where(same, FULL, np.where(meet, PARTIAL, SKIP)).astype(np.int8)[:, None]
        name = _prefix()
        batch = dq.shape[0] != 1  # a batch of 0 too: its (empty) rows are indexed by b, as a batch of many
        values = {name + "q": dq if batch else dq[0], name + "k": dk if batch else dk[0]}
        index = "b, " if batch else ""
        rule = mods.parse(f"{name}q[{index}q_idx] == {name}k[{index}kv_idx]", kind="mask", arrays=values,
                          internal=True)
        return cls._make(states, (bq, bk), dq.shape[1], dk.shape[1], rule, values)

    @staticmethod
    def _ids(ids, name):
        form = "an integer array (seqlen,) or (batch, seqlen)"
        ids = _host_array(ids, name, form)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{name} must be {form}, got dtype {ids.dtype}")
        if ids.ndim not in (1, 2):
            raise ValueError(f"{name} must be {form}, got shape {ids.shape}")
        if ids.size and (ids.min() < -2**31 or ids.max() >= 2**31):
            raise ValueError(f"{name} must fit in int32")
        return np.array(ids.reshape((1,) * (2 - ids.ndim) + ids.shape), dtype=np.int32)

    @staticmethod
    def _ranges(ids, b):
        """Per batch row and block of ``b`` positions, the min and max id (the tail block padded by repetition)."""
        n = ids.shape[1]
        pad = np.pad(ids, ((0, 0), (0, _cdiv(n, b) * b - n)), mode="edge") if n and len(ids) else ids
        blocks = pad.reshape(ids.shape[0], _cdiv(n, b), b)  # -1 was ambiguous for a batch of 0 (NumPy's error)
        return blocks.min(axis=-1), blocks.max(axis=-1)

    @staticmethod
    def _dense_states(mask, bq: int, bk: int):
        """FULL/PARTIAL/SKIP of every (bq, bk) block of a boolean ``(batch, heads, Sq, Sk)`` mask, from each block's
        count of True against its area inside the sequences: column sums of a band of query blocks, summed per key
        block (memory O(batch * heads * Sk), no padded copy)."""
        sq, sk = mask.shape[-2:]
        nq, nk = _cdiv(sq, bq), _cdiv(sk, bk)
        states = np.empty(mask.shape[:2] + (nq, nk), dtype=np.int8)
        cols = np.minimum(bk, sk - np.arange(nk) * bk)
        for i in range(nq):
            rows = mask[..., i * bq:(i + 1) * bq, :]
            count = np.add.reduceat(rows.sum(axis=-2, dtype=np.int64), np.arange(nk) * bk, axis=-1) if sk else \
                np.zeros(mask.shape[:2] + (0,), np.int64)
            area = rows.shape[-2] * cols
            states[:, :, i] = np.where(count == area, FULL, np.where(count > 0, PARTIAL, SKIP))
        return states

    @classmethod
    def from_dense(cls, mask, *, block=DEFAULT_BLOCK):
        """Any boolean mask ``(batch|1, heads|1, Sq, Sk)`` (or 2-D / 3-D), exactly: all-True blocks are full,
        all-False ones skipped, and only the partial blocks keep their elements, as packed bits
        (memory O(partial blocks × block area / 8), never a copy of the dense mask)."""
        form = "a boolean array (Sq, Sk), (heads|1, Sq, Sk) or (batch|1, heads|1, Sq, Sk)"
        mask = _host_array(mask, "mask", form)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be {form}, got dtype {mask.dtype}")
        if not 2 <= mask.ndim <= 4:
            raise ValueError(f"mask must be {form}, got shape {mask.shape}")
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        bq, bk = _check_block(block)
        if bq * bk >= 2 ** 31:  # the kernels index a block's bits in 32 bits (kernels/mods.cuh: dense_bit)
            raise ValueError(f"block {(bq, bk)} of a dense mask must hold fewer than 2**31 elements, got {bq * bk}")
        sq, sk = mask.shape[-2:]
        nq, nk = _cdiv(sq, bq), _cdiv(sk, bk)
        states = cls._dense_states(mask, bq, bk)
        partial = states == PARTIAL
        if not partial.any():  # whole blocks only: the states say everything
            return cls._make(states, (bq, bk), sq, sk)
        slot = np.full(states.shape, -1, dtype=np.int32)
        slot[partial] = np.arange(int(partial.sum()), dtype=np.int32)
        bits = np.empty((int(partial.sum()), _cdiv(bq * bk, 8)), dtype=np.uint8)
        for i in range(nq):  # one band of query blocks at a time: a padded copy of a band, never of the mask
            band = partial[:, :, i]
            if band.any():
                padded = np.zeros(mask.shape[:2] + (bq, nk * bk), dtype=bool)
                rows = mask[..., i * bq:(i + 1) * bq, :]
                padded[..., :rows.shape[-2], :sk] = rows
                blocks = padded.reshape(mask.shape[:2] + (bq, nk, bk)).transpose(0, 1, 3, 2, 4)[band]
                bits[slot[:, :, i][band]] = np.packbits(blocks.reshape(-1, bq * bk), axis=-1, bitorder="little")
        name = _prefix()
        values = {name + "slot": slot, name + "bits": bits}
        rule = mods.dense_bits(name + "slot", name + "bits", slot.shape, (bq, bk))
        return cls._make(states, (bq, bk), sq, sk, rule, values)

    @classmethod
    def from_mask_mod(cls, mask_mod: str, *, seqlen_q, seqlen_k=None, batch=1, heads=1, mod_arrays=None,
                      block=DEFAULT_BLOCK):
        """Any mask expression of the modifier language (see ``attention(mask_mod=...)``), classified block by
        block once (FlexAttention's ``create_block_mask``): O(Sq·Sk) evaluations now, in query-block chunks,
        then skipped blocks cost nothing and full ones no element test. ``batch``/``heads``: 1 when the mask
        does not read ``b``/``h`` (the grid then broadcasts), else the problem's flattened batch / heads (a mask
        that reads ``b``/``h`` built for 1 is refused by a problem with more).

        ``q_len``/``kv_len`` in the rule are this mask's own ``seqlen_q``/``seqlen_k``, fixed when it is built
        (not each sequence's ``seqlens_q``/``seqlens_k`` as in ``mask_mod=``): a BlockMask is aligned at its own
        lengths, and every backend, the kernels included, reads these numbers.

        Floats in the rule are computed in the working precision of the problem's inputs (float32, float64 for
        float64 inputs), which the mask does not know: a block is full or skipped only when it is so in float32
        and in float64 alike, else partial (its elements are then tested in the working precision)."""
        sq, sk = _lengths(seqlen_q, seqlen_k)
        batch, heads = check_int(batch, "batch", 1), check_int(heads, "heads", 1)
        arrays = {n: v if isinstance(v, numbers.Number) else np.array(v)  # copies: a caller's later change must not
                  for n, v in _check_mod_arrays(mod_arrays, np).items()}  # reach the mask
        rule = mods.parse(mask_mod, kind="mask", arrays=arrays, what="mask_mod")
        unused = sorted(set(arrays) - {o.name for o in rule.operands})
        if unused:
            raise ValueError(f"mod_arrays {unused} are not read by mask_mod")
        rule.check_against(arrays, {"b": batch, "h": heads, "q_idx": sq, "kv_idx": sk}, "mask_mod")
        name = _prefix()  # the operands' names unique to this mask (masks combine)
        rule = rule.renamed({n: name + n for n in arrays})
        values = {name + n: v for n, v in arrays.items()}
        # q_len, kv_len: this mask's lengths, as int operands (one compiled rule for every length)
        lengths = {"q_len": sq, "kv_len": sk}
        rule = rule.bound({v: name + v for v in lengths})
        read = {o.name for o in rule.operands}
        values.update({name + v: n for v, n in lengths.items() if name + v in read})
        bq, bk = _check_block(block)
        nq, nk = _cdiv(sq, bq), _cdiv(sk, bk)
        states = np.zeros((batch, heads, nq, nk), dtype=np.int8)
        env = dict(b=np.arange(batch).reshape(-1, 1, 1, 1), h=np.arange(heads).reshape(1, -1, 1, 1),
                   kv_idx=np.arange(sk).reshape(1, 1, 1, -1))
        precisions = (np.float32, np.float64) if rule.uses_float else (np.float64,)
        starts = np.arange(nk) * bk  # each key block's first column (all below sk)
        for i in range(nq):
            rows = np.arange(i * bq, min((i + 1) * bq, sq))
            area = rows.size * np.minimum(bk, sk - starts)
            full, some = True, False
            for dtype in precisions:
                keep = np.broadcast_to(rule.evaluate(dict(env, q_idx=rows.reshape(1, 1, -1, 1)), values, dtype),
                                       (batch, heads, rows.size, sk))
                # kept elements per key block, the last one cut at sk (a copy padded to nk * bk took memory in
                # proportion to the block: 32 GiB for 12 keys in blocks of 2**33)
                cnt = np.add.reduceat(keep, starts, axis=-1, dtype=np.int64).sum(axis=2) if sk else \
                    np.zeros((batch, heads, nk), np.int64)
                full, some = full & (cnt == area), some | (cnt > 0)
            states[:, :, i] = np.where(full, FULL, np.where(some, PARTIAL, SKIP))
        mask = cls._make(states, (bq, bk), sq, sk, rule, values)
        mask._pinned = frozenset(v for v, n in (("b", batch), ("h", heads)) if n == 1 and rule.reads(v))
        return mask

    # ---------------------------------------------------------------- combining
    def _combine(self, other: "BlockMask", op: str) -> "BlockMask":
        if not isinstance(other, BlockMask):
            return NotImplemented
        if (self.block, self.seqlen_q, self.seqlen_k) != (other.block, other.seqlen_q, other.seqlen_k):
            raise ValueError(f"masks combine only at the same block and lengths, got {self.block} "
                             f"{self.seqlen_q}x{self.seqlen_k} and {other.block} {other.seqlen_q}x{other.seqlen_k}")
        try:
            a, b = np.broadcast_arrays(self.states, other.states)
        except ValueError:
            raise ValueError(f"mask grids {self.states.shape} and {other.states.shape} do not broadcast") from None
        if op == "and":
            states = np.where((a == SKIP) | (b == SKIP), SKIP, np.where((a == FULL) & (b == FULL), FULL, PARTIAL))
        else:
            states = np.where((a == FULL) | (b == FULL), FULL, np.where((a == SKIP) & (b == SKIP), SKIP, PARTIAL))
        member = mods.combine(op, self.member, other.member)
        clash = [n for n in self.values.keys() & other.values.keys() if not _same(self.values[n], other.values[n])]
        if clash:  # unique names (_prefix): only a hand-made mask; a copy or an unpickled mask holds the same values
            raise ValueError(f"the masks name different operands alike ({', '.join(sorted(clash))}): build them anew")
        # the parts' operands copied: the combined states are computed here, once, so the rule must not follow a part
        # whose arrays are made writeable and changed later (the grid kept a block the rule then dropped, and the
        # backends disagreed with each other by tile size)
        values = {n: _frozen(v.copy()) if isinstance(v, np.ndarray) else v
                  for n, v in {**self.values, **other.values}.items()}
        mask = self._make(states.astype(np.int8), self.block, self.seqlen_q, self.seqlen_k, values=values,
                          member=member)
        mask._pinned = self._pinned | other._pinned
        mask._states_crc = zlib.crc32(mask.states.view(np.uint8))
        return mask

    def __and__(self, other):
        return self._combine(other, "and")

    def __or__(self, other):
        return self._combine(other, "or")

    # ---------------------------------------------------------------- properties
    @property
    def shape(self):
        return self.states.shape

    @property
    def grid(self):
        """Boolean ``(batch|1, heads|1, nq, nk)``: blocks that keep some element (not skipped); read-only."""
        return _frozen(self.states != SKIP)

    @property
    def full(self):
        """Boolean grid of blocks that keep every element; read-only."""
        return _frozen(self.states == FULL)

    @property
    def density(self) -> float:
        """Fraction of blocks computed (not skipped): FA1's sparsity ``s`` (Proposition 4)."""
        return float(self.grid.mean()) if self.states.size else 0.0

    def keep(self, b, h, q_idx, kv_idx, *, dtype=None):
        """Whether elements are kept, vectorized over broadcastable index arrays.

        ``dtype``: the working precision of the problem (float32 for float16/bfloat16/float32 inputs, float64 for
        float64 inputs), in which the rule's floats are computed, as every backend does. None: a rule without
        floats as it is; one with floats must give the same elements in float32 and float64, else ValueError
        (pass the problem's working precision)."""
        _check_working_dtype(dtype)
        return self._keep(dtype=dtype, **self._indices(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx))

    def _keep(self, b, h, q_idx, kv_idx, dtype=None):
        """:meth:`keep` of integer index arrays known to lie in the mask: the tile schedule's own, once per partial
        tile, where :meth:`keep`'s checks of a caller's indices would be work done again."""
        self._check_states()
        env = dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, q_len=self.seqlen_q, kv_len=self.seqlen_k)
        if dtype is not None:
            return np.asarray(self.member.evaluate(env, self.values, dtype), dtype=bool)
        keep = np.asarray(self.member.evaluate(env, self.values, np.float64), dtype=bool)
        if self.member.uses_float and \
                not np.array_equal(keep, np.asarray(self.member.evaluate(env, self.values, np.float32), dtype=bool)):
            raise ValueError("this mask's rule keeps other elements in float32 than in float64: pass dtype=, the "
                             "working precision of the problem (float32 for float16/bfloat16/float32 inputs, float64 "
                             "for float64 inputs)")
        return keep

    def _indices(self, **given):
        """The element indices of :meth:`keep` as integer arrays, refused (``TypeError``/``ValueError`` naming the
        index) unless they lie in the mask: a grid or operand lookup would otherwise raise NumPy's IndexError, or
        wrap a negative index silently to the last block. ``b``/``h`` may be any index >= 0 where the grid
        broadcasts along them and the rule does not read them."""
        gb, gh = self.states.shape[:2]
        ends = dict(b=gb if gb > 1 or "b" in self._pinned else None, h=gh if gh > 1 or "h" in self._pinned else None,
                    q_idx=self.seqlen_q, kv_idx=self.seqlen_k)
        out = {}
        for name, x in given.items():
            a = _host_array(x, name, "an int or an integer array")
            if a.dtype.kind not in "iu":
                raise TypeError(f"{name} must be integers (an int or an integer array), got dtype {a.dtype}")
            end = ends[name]
            if a.size and (a.min() < 0 or (end is not None and a.max() >= end)):
                bound = f"[0, {end})" if end is not None else ">= 0"
                raise ValueError(f"{name} must lie in {bound} for this mask, got values from {a.min()} to {a.max()}")
            out[name] = a
        return out

    def to_dense(self, seqlen_q=None, seqlen_k=None, *, dtype=None):
        """The element mask ``(batch|1, heads|1, Sq, Sk)`` (O(N²): for references and tests) of the first
        ``seqlen_q`` x ``seqlen_k`` elements (default: all of them); ``dtype``: the working precision of the rule's
        floats (see :meth:`keep`)."""
        sq = self.seqlen_q if seqlen_q is None else check_int(seqlen_q, "seqlen_q")
        sk = self.seqlen_k if seqlen_k is None else check_int(seqlen_k, "seqlen_k")
        if sq > self.seqlen_q or sk > self.seqlen_k:
            raise ValueError(f"to_dense: seqlen_q, seqlen_k = {sq}, {sk} exceed this mask's {self.seqlen_q}, "
                             f"{self.seqlen_k}")
        gb, gh = self.states.shape[:2]
        return np.broadcast_to(self.keep(np.arange(gb).reshape(-1, 1, 1, 1), np.arange(gh).reshape(1, -1, 1, 1),
                                         np.arange(sq).reshape(1, 1, -1, 1), np.arange(sk).reshape(1, 1, 1, -1),
                                         dtype=dtype), (gb, gh, sq, sk))

    def check_operands(self, dtype) -> None:
        """Refuse a float operand (``from_mask_mod``'s ``mod_arrays``, or a literal of its rule: ``q_idx * 1e39`` was
        inf in float32, and the mask kept 225 of 256 elements where it meant 136) beyond the working precision of
        inputs of ``dtype``, as ``attention(mask_mod=...)`` refuses it
        (:func:`cuflash.problem.core._check_fits_working`): the blocks were classified in float32 and float64 alike,
        but a partial block's elements are tested in the problem's precision, where 1e300 turns into inf and every
        element was dropped, silently."""
        for key, value in sorted(self.values.items()):
            if isinstance(value, (numbers.Real, np.ndarray)):
                _check_fits_working(value, f"block_mask's mod_arrays[{key[_PREFIX_LEN:]!r}]", dtype)
        for c in () if self.member is None else self.member.float_constants:  # the rule's own literals likewise
            _check_fits_working(c, f"block_mask's rule's constant {c!r}", dtype)

    def check_fits(self, batch, heads, seqlen_q, seqlen_k, *, sizes="q, k have"):
        """Raise ``ValueError`` unless this mask matches a problem of the given sizes; ``sizes``: what the message
        says the lengths are (an attention call's ``q`` and ``k``, or :func:`cuflash.io_cost`'s arguments)."""
        b, h = self.states.shape[:2]
        if (seqlen_q, seqlen_k) != (self.seqlen_q, self.seqlen_k):
            raise ValueError(f"block_mask was built for seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}, but "
                             f"{sizes} {seqlen_q}, {seqlen_k}")
        if b not in (1, batch) or h not in (1, heads):
            raise ValueError(f"block_mask grid leading dims must be (1 or batch={batch}, 1 or heads={heads}), "
                             f"got ({b}, {h})")
        # a from_mask_mod rule that reads b (h) built for batch=1 (heads=1) was classified at b = 0 (h = 0) only, and
        # its grid broadcasts (NumPy and the reference then evaluated it at b = 0 everywhere, the kernels at each b)
        for var, size, what in (("b", batch, "batch"), ("h", heads, "heads")):
            if var in self._pinned and size != 1:
                raise ValueError(f"block_mask's rule reads {var} but was built for {what}=1; this problem has "
                                 f"{what} {size}: build it with {what}={size}")

    # ---------------------------------------------------------------- display
    def __repr__(self):
        b, h, nq, nk = self.states.shape
        head = (f"BlockMask(shape={self.states.shape}, block={self.block}, seqlen_q={self.seqlen_q}, "
                f"seqlen_k={self.seqlen_k}, density={self.density:.3f})")
        if nq > 32 or nk > 32 or self.states.size == 0:  # no block to draw (an empty batch: states[0, 0] raised)
            return head
        rows = ["".join("·▒█"[x] for x in row) for row in self.states[0, 0]]
        note = "" if b == h == 1 else "  (batch 0, head 0)"
        return head + note + "  █ full  ▒ partial  · skipped\n" + "\n".join("  " + r for r in rows)
