"""Testing helpers for attention implementations: hypothesis strategies and a tolerance rule.

Users can fuzz their own attention code with them::

    from hypothesis import given
    from cuflash.testing import attention_cases, check_forward

    @given(attention_cases(dtypes=("float16",)))
    def test_mine(case):
        check_forward(my_attention, case)   # my_attention(q, k, v, **case.options) -> (out, lse)

The rule (:func:`assert_attention_close`): an implementation's error against the float64
reference may be at most ``mult`` times the error of the naive computation in the input dtype
(the reference run with ``compute_dtype`` = input dtype), plus a floor of two roundings at the magnitude
of the terms summed, times the condition of ``exp`` in roundings of the arithmetic
(:func:`cuflash.reference.term_magnitudes`). ``mult`` is 2 for ``out``/``lse`` and 3 for gradients. float64
inputs are held against a long-double reference (:func:`check_forward`, :func:`check_backward`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from . import reference
from ._fp import ignore_fp_errors
from .blockmask import BlockMask
from .options import OPTIONS
from .problem import FLOAT_DTYPES, _is_cupy, check_flags
from .reference import rounding  # the rule's unit, public here too

#: Sequence lengths that catch off-by-one tiles: 1, primes, one past and one short of a tile.
AWKWARD_LENGTHS = (1, 2, 3, 17, 31, 33, 63, 64, 65, 100, 113, 127, 128, 129, 203, 255, 256, 257)


def _input_dtype(dtype, what="dtype"):
    """The dtype of ``dtype`` if it is one the library takes as input (float16, bfloat16, float32, float64), else a
    TypeError naming ``what``: ``np.dtype(None)`` is float64 and ``np.dtype("bfloat16")`` needs ml_dtypes imported
    first, so neither is left to NumPy; an integer or bool dtype would have the strategy cast normal samples to it."""
    bad = TypeError(f"{what} must be one of {', '.join(FLOAT_DTYPES)} (a name, NumPy type or dtype; bfloat16 by "
                    f"name or as ml_dtypes.bfloat16), got {dtype!r}")
    if dtype is None or isinstance(dtype, (bool, np.bool_)):
        raise bad
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        raise bad from None
    if dt.name not in FLOAT_DTYPES:
        raise bad
    return dt


def _int(x, what, least):
    """``x`` as an int of at least ``least`` (TypeError / ValueError naming ``what``); bools are refused."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(x).__name__} {x!r}")
    if x < least:
        raise ValueError(f"{what} must be at least {least}, got {x}")
    return int(x)


def _ints(xs, what):
    """A non-empty tuple of positive ints (a string would be drawn from letter by letter; 0 would be drawn)."""
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
        raise TypeError(f"{what} must be a non-empty tuple of positive ints, got {xs!r}")
    xs = tuple(xs)
    if not xs:
        raise ValueError(f"{what} must be a non-empty tuple of positive ints, got ()")
    return tuple(_int(x, f"{what}[{i}]", 1) for i, x in enumerate(xs))


@dataclass
class Case:
    """One drawn attention problem: arrays plus the keyword options of :func:`cuflash.attention`."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    options: dict = field(default_factory=dict)

    def __repr__(self):
        opts = {k: (v if not isinstance(v, np.ndarray) else v.tolist()) for k, v in self.options.items()}
        return (f"Case(q={self.q.shape}, k={self.k.shape}, dtype={self.q.dtype}, options={opts})")


#: score modifiers the strategy draws (``w``: a float per key; ``s``: a float per head), each with a different shape
#: of derivative: affine, saturating, piecewise, per-position.
SCORE_MODS = ("score * 0.7 + w[kv_idx]", "2.0 * tanh(score / 2.0)", "where(q_idx >= kv_idx, score, score - 1.5)",
              "score - s[h] * abs(q_idx - kv_idx)", "max(score, -2.0) + 0.1 * min(score, 0.5)")
#: mask modifiers the strategy draws (``doc``: an int per key and query; ``keep``: a bool per key)
MASK_MODS = ("(q_idx + kv_idx) % 3 != 1", "keep[kv_idx] or kv_idx == 0", "doc_q[q_idx] == doc_k[kv_idx]",
             "kv_idx <= q_idx + b")


def _modifier_options(draw, st, rng, batch, hq, sq, sk):
    """bias / alibi_slopes / softcap / score_mod / mask_mod options (each present or not) with their operands."""
    opts, arrays = {}, {}
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(hq, sq, sk), (sq, sk), batch + (hq, 1, sk), (1, sq, 1), (sk,)]))
        opts["bias"] = rng.standard_normal(shape).astype(np.float32)
    if draw(st.booleans()):
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, hq).astype(np.float32)
    if draw(st.booleans()):
        opts["softcap"] = draw(st.sampled_from([1.0, 5.0, 30.0]))
    if draw(st.booleans()):
        opts["score_mod"] = text = draw(st.sampled_from(SCORE_MODS))
        if "w[" in text:
            arrays["w"] = rng.standard_normal(sk).astype(np.float32)
        if "s[" in text:
            arrays["s"] = rng.uniform(0, 0.3, hq).astype(np.float32)
    if draw(st.booleans()):
        opts["mask_mod"] = text = draw(st.sampled_from(MASK_MODS))
        if "keep[" in text:
            arrays["keep"] = rng.random(sk) < 0.7
        if "doc_q[" in text:
            docs = np.sort(rng.integers(0, 4, max(sq, sk)))
            arrays["doc_q"], arrays["doc_k"] = docs[-sq:], docs[-sk:]
    if arrays:
        opts["mod_arrays"] = arrays
    return opts


def _block_mask(draw, st, rng, batch, hq, sq, sk, block_sizes):
    """A BlockMask of one of the constructors (element-exact ones and FA1's whole blocks)."""
    bq, bk = draw(st.sampled_from(block_sizes)), draw(st.sampled_from(block_sizes))
    kind = draw(st.sampled_from(["blocks", "causal", "window", "document", "dense", "prefix"]))
    if kind == "causal":
        return BlockMask.causal(sq, sk, block=(bq, bk))
    if kind == "window":
        return BlockMask.sliding_window(sq, sk, window=(draw(st.integers(0, sq)), draw(st.integers(0, 8))),
                                        block=(bq, bk))
    if kind == "document" and sq == sk:
        return BlockMask.document(np.sort(rng.integers(0, 3, sq)), block=(bq, bk))
    if kind == "prefix" and sq == sk:
        return BlockMask.prefix_lm(sq, draw(st.integers(0, sq)), block=(bq, bk))
    nb = int(np.prod(batch))
    lead = (draw(st.sampled_from([1, nb])), draw(st.sampled_from([1, hq])))
    if kind == "dense":
        return BlockMask.from_dense(rng.random(lead + (sq, sk)) < draw(st.floats(0.2, 1.0)), block=(bq, bk))
    grid = rng.random(lead + (-(-sq // bq), -(-sk // bk))) < draw(st.floats(0.2, 1.0))
    return BlockMask(grid, block=(bq, bk), seqlen_q=sq, seqlen_k=sk)


def attention_cases(*, dtypes=("float32",), max_seqlen=160, head_dims=None, max_head_dim=80,
                    max_batch_dims=2, gqa=True, causal=True, window=True, seqlens=True,
                    block_mask=True, block_sizes=(16, 32, 64), scale=True, dropout=False, modifiers=False):
    """Hypothesis strategy of :class:`Case`: awkward lengths, Sq ≠ Sk both ways, GQA/MQA,
    causal, windows, per-sequence lengths, BlockMasks (whole blocks, causal, sliding window, document, dense,
    prefix-LM), any number of batch dimensions;
    with ``modifiers``, bias (of several broadcast shapes), ALiBi, softcap, score and mask modifiers.

    Parameters
    ----------
    dtypes : non-empty sequence of dtype names or NumPy dtypes
        The input dtypes drawn from (float16, bfloat16, float32, float64).
    max_seqlen : int >= 1
        The largest ``seqlen_q`` and ``seqlen_k`` drawn.
    head_dims : sequence of ints, optional
        The head dims drawn from; None draws one in ``[1, max_head_dim]``.
    max_head_dim : int >= 1
        The largest head dim drawn where ``head_dims`` is None.
    max_batch_dims : int >= 0
        The most batch dimensions drawn.
    gqa, causal, window, seqlens, block_mask, scale : bool
        Whether to draw grouped-query heads, ``causal=``, ``window=``, ``seqlens_q``/``seqlens_k``,
        ``block_mask=`` (of the sizes in ``block_sizes``) and a ``scale=`` other than the default.
    block_sizes : sequence of ints >= 1
        The BlockMask block sizes drawn from.
    dropout : bool
        Whether to draw ``dropout_p`` (with a ``seed``); off by default.
    modifiers : bool
        Whether to draw the score and mask modifiers above; off by default.
    """
    from hypothesis import strategies as st

    # Every argument is checked here, when the strategy is built, not when a draw first meets it (block size 0 was a
    # ZeroDivisionError deep in a draw; head dim 0 and int/bool/complex dtypes silently built cases of no meaning).
    form = "a non-empty tuple of dtype names, e.g. ('float16',)"
    if isinstance(dtypes, (str, bytes)) or not hasattr(dtypes, "__iter__"):
        raise TypeError(f"dtypes must be {form}, got {dtypes!r}")
    dtypes = tuple(dtypes)  # once: a generator checked by a tuple of its own was empty when the dtypes were drawn
    if not dtypes:
        raise TypeError(f"dtypes must be {form}, got ()")
    dtypes = tuple(_input_dtype(dt, f"dtypes[{i}]") for i, dt in enumerate(dtypes))
    max_seqlen = _int(max_seqlen, "max_seqlen", 1)
    head_dims = None if head_dims is None else _ints(head_dims, "head_dims")
    max_head_dim = _int(max_head_dim, "max_head_dim", 1)
    max_batch_dims = _int(max_batch_dims, "max_batch_dims", 0)
    block_sizes = _ints(block_sizes, "block_sizes")
    check_flags(gqa=gqa, causal=causal, window=window, seqlens=seqlens, block_mask=block_mask, scale=scale,
                dropout=dropout, modifiers=modifiers)

    @st.composite
    def cases(draw):
        dtype = draw(st.sampled_from(dtypes))
        lengths = st.one_of(st.sampled_from([x for x in AWKWARD_LENGTHS if x <= max_seqlen]),
                            st.integers(1, max_seqlen))
        sq, sk = draw(lengths), draw(lengths)
        d = draw(st.sampled_from(head_dims)) if head_dims is not None else draw(st.integers(1, max_head_dim))
        hkv = draw(st.integers(1, 3))
        hq = hkv * (draw(st.sampled_from([1, 2, 4])) if gqa else 1)
        batch = tuple(draw(st.lists(st.integers(1, 3), max_size=max_batch_dims)))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        with np.errstate(under="ignore"):  # float16's rounding of a normal draw may be a subnormal
            arrays = [rng.standard_normal(batch + shape).astype(dtype)
                      for shape in ((sq, hq, d), (sk, hkv, d), (sk, hkv, d), (sq, hq, d))]
        opts = {}
        if causal and draw(st.booleans()):
            opts["causal"] = True
        if window and draw(st.booleans()):
            side = st.one_of(st.none(), st.integers(0, max(sq, sk)))
            opts["window"] = (draw(side), draw(side))
        if scale and draw(st.booleans()):
            opts["scale"] = draw(st.floats(0.05, 2.0))
        if seqlens and draw(st.booleans()):
            opts["seqlens_q"] = rng.integers(0, sq + 1, size=batch).astype(np.int32)
            opts["seqlens_k"] = rng.integers(0, sk + 1, size=batch).astype(np.int32)
        if block_mask and draw(st.booleans()):
            opts["block_mask"] = _block_mask(draw, st, rng, batch, hq, sq, sk, block_sizes)
        if modifiers:
            opts.update(_modifier_options(draw, st, rng, batch, hq, sq, sk))
        if dropout and draw(st.booleans()):
            opts["dropout_p"] = draw(st.sampled_from([0.1, 0.5, 0.9]))
            opts["seed"] = draw(st.integers(0, 2**64 - 1))
        return Case(*arrays, options=opts)

    return cases()


@ignore_fp_errors  # its roundings of the reference to the result's dtype under- and overflow as a rule
def assert_attention_close(actual, ref64, baseline, *, mult=2.0, name="out", magnitude=None):
    """Assert ``max|actual − ref64| <= mult · max|baseline − ref64| + floor``.

    ``baseline`` is the naive computation in the input dtype; its dtype sets the floor: two
    roundings at ``magnitude``, the size of the terms the result is summed from
    (:func:`cuflash.reference.term_magnitudes`; default the largest ``|ref64|``), so cases where
    the naive computation happens to be exact, or results that cancel to ~0, do not demand the
    impossible. ``-inf`` entries (rows that see no key) must match exactly; NaN never passes. Where the exact result
    is past the range of ``actual``'s dtype (80000 in float16), its infinity is the correctly rounded answer and
    passes (a finite value there is held to the bound). Where the naive
    computation itself is not finite (a float16 score or row sum that overflows) it sets no bound: those elements
    are held to the bound of the others (an infinite naive error would pass anything). The maxima are over the
    whole tensor: one badly conditioned row widens the bound of every row (split such a case to judge rows apart).
    ``mult`` must be finite and positive, ``magnitude`` finite and non-negative (or None): an infinite one would
    pass anything, a NaN fail everything. Explicit checks, not ``assert``: they hold under ``python -O`` too.
    """
    mult = _real_number(mult, "mult", positive=True)
    magnitude = None if magnitude is None else _real_number(magnitude, "magnitude", positive=False)
    actual = _real_array(actual, "actual", name)
    result_dtype = actual.dtype
    ref64 = _real_array(ref64, "ref64", name)
    baseline = _real_array(baseline, "baseline", name, floating=True)
    floor_u = rounding(baseline.dtype)
    wide = np.longdouble if ref64.dtype == np.longdouble else np.float64  # see reference_dtype
    actual = actual.astype(wide)
    baseline = baseline.astype(wide)
    ref64 = ref64.astype(wide)
    _require(actual.shape == ref64.shape, f"{name}: shape {actual.shape} != reference {ref64.shape}")
    if baseline.shape != ref64.shape:  # the caller's mistake, not the implementation's: indexing it was an IndexError
        raise ValueError(f"{name}: baseline shape {baseline.shape} != reference {ref64.shape} (the naive computation "
                         f"of the same problem in the input dtype)")
    _require(not np.isnan(ref64).any(), f"{name}: the reference holds NaN, so nothing can be judged against it "
                                        f"(a NaN among the inputs it reads?)")
    _require(not np.isnan(actual).any(), f"{name}: NaN in the result")
    inf_ref = np.isinf(ref64)
    if result_dtype.kind == "f" or result_dtype.name == "bfloat16":
        rounded = ref64.astype(result_dtype).astype(wide)  # the reference in the result's dtype
        past = ~inf_ref & np.isinf(rounded) & (actual == rounded)  # overflowed as a correctly rounded result does
    else:
        past = np.zeros(ref64.shape, bool)
    _require(np.array_equal(np.isinf(actual) & ~past, inf_ref) and np.array_equal(actual[inf_ref], ref64[inf_ref]),
             f"{name}: infinite entries differ from the reference (rows that see no key must be -inf; a result "
             f"past the dtype's range may be its infinity)")
    fin = ~inf_ref & ~past
    if not fin.any():
        return
    err = np.abs(actual[fin] - ref64[fin]).max()
    naive = np.abs(baseline[fin] - ref64[fin])
    base = naive[np.isfinite(naive)].max(initial=0.0)
    floor = 2 * floor_u * (np.abs(ref64[fin]).max() if magnitude is None else magnitude)
    _require(err <= mult * base + floor,
             f"{name}: max error {err:.3e} exceeds {mult:g}x the naive same-dtype error {base:.3e} + floor {floor:.3e}")


def _host(x):
    """``x`` as a NumPy array: CuPy arrays (and other CUDA Array Interface objects, through CuPy) copied to the host.
    CuPy is told by its module, as everywhere in the package: ``hasattr(x, "get")`` took a dict for one."""
    if _is_cupy(x):
        return x.get()
    if not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__"):
        from .interop import _cupy

        return _cupy("an array").asarray(x).get()
    return np.asarray(x)


def _real_array(x, what, name, floating=False):
    """``x`` on the host if it is a real array (floating point, bfloat16 included, or else for ``floating=False``
    integer), else a TypeError that says what was expected."""
    a = _host(x)
    dt = a.dtype
    if dt.kind == "f" or dt.name == "bfloat16" or (not floating and dt.kind in "iu"):
        return a
    want = "a floating-point array (its dtype sets the floor)" if floating else "a real (float or integer) array"
    got = f"dtype {dt}" if isinstance(x, np.ndarray) or _is_cupy(x) else f"{type(x).__name__} (dtype {dt})"
    why = ": a complex part would be dropped" if dt.kind == "c" else ""
    raise TypeError(f"{what} must be {want} ({name}), got {got}{why}")


def _real_number(x, what, positive):
    """``x`` as a finite float, > 0 (``positive``) or >= 0: an infinite ``mult`` or ``magnitude`` passes anything, a
    NaN fails everything, a negative one makes a negative bound."""
    if isinstance(x, (bool, np.bool_)) or np.ndim(x) != 0 or np.asarray(x).dtype.kind not in "fiu":
        raise TypeError(f"{what} must be a real number, got {type(x).__name__} {x!r}")
    value = np.longdouble(x)  # a magnitude past float64's largest (V near 1e308, term_magnitudes) is finite here
    if not np.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{what} must be finite and {'> 0' if positive else '>= 0'}, got {x!r}")
    return value


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _element_dtype(case: Case):
    """The inputs' element type: bfloat16 for uint16 bits with ``dtype="bfloat16"`` (the form CuPy without bfloat16
    takes, and cuflash documents), else q's dtype."""
    return _input_dtype("bfloat16", "dtype") if case.options.get("dtype") == "bfloat16" else np.dtype(case.q.dtype)


def _elements(x, case: Case):
    """A result of ``case`` as values: uint16 bits with ``dtype="bfloat16"`` viewed as bfloat16 (on the host)."""
    if case.options.get("dtype") != "bfloat16":
        return x
    x = _host(x)
    return x.view(_element_dtype(case)) if getattr(x, "dtype", None) == np.uint16 else x


def _check_case_options(case: Case) -> None:
    """Options a check cannot take, refused before ``fn`` runs: the reference raised "unexpected keyword argument
    'backend'" or "multiple values for return_lse", and dropout without a seed "fn must return (out, lse), got 3
    values" (the drawn seed)."""
    calls = sorted(set(case.options) - set(OPTIONS))  # the problem's options are cuflash.options.OPTIONS
    if calls:
        verb, them = ("is", "it") if len(calls) == 1 else ("are", "them")
        raise ValueError(f"Case.options hold the problem's options ({', '.join(OPTIONS)}); {', '.join(calls)} {verb} "
                         f"not among them: bind {them} to the function checked (functools.partial(cuflash.attention, "
                         f"return_lse=True, backend='numpy'))")
    if case.options.get("dropout_p") and case.options.get("seed") is None:
        raise ValueError("a Case with dropout_p > 0 needs options['seed']: the reference draws its keep-mask from it, "
                         "as the function checked does")


def _reference_options(case: Case):
    """The case's options for the reference: dropout becomes an explicit keep-mask."""
    opts = dict(case.options)
    opts.pop("precision", None)  # the baseline's business (_baseline_dtype): the reference is exact whatever it is
    p, seed = opts.pop("dropout_p", 0.0), opts.pop("seed", None)
    if p:
        from .dropout import dropout_mask

        heads, seq = (-3, -2) if opts.get("layout") == "bhsd" else (-2, -3)  # the axes of the case's layout
        shape = case.q.shape[:-3] + (case.q.shape[heads], case.q.shape[seq], case.k.shape[seq])
        return opts, dict(dropout_mask=dropout_mask(shape, seed=seed, p=p), dropout_p=p)
    return opts, {}


def _baseline_dtype(case: Case, element):
    """The naive computation's ``compute_dtype``: the inputs' element dtype, or the naive TF32 computation
    (:data:`cuflash.reference.TF32`) for ``precision="tf32"``, whose products round their inputs to TF32: the float32
    baseline failed the naive TF32 computation itself (error 5.6e-4 against a bound of 1.3e-5)."""
    return reference.TF32 if case.options.get("precision") == "tf32" else element


def _check_dtypes(results, element, names):
    """Each result in the inputs' dtype (an implementation that returned float64 for float16 inputs passed)."""
    for name, x in zip(names, results):
        _require(np.dtype(x.dtype) == np.dtype(element), f"{name}: dtype {x.dtype}, expected the inputs' {element}")


def reference_dtype(dtype):
    """The reference's ``compute_dtype`` for inputs of ``dtype``: float64, or ``np.longdouble`` for float64 inputs
    (otherwise the naive float64 computation would be the reference itself, its error 0, and the floor the rule).
    ``dtype``: one the library takes (float16, bfloat16, float32, float64), else TypeError."""
    return np.longdouble if _input_dtype(dtype) == np.float64 else np.float64


def _copy(x):
    """A copy of a NumPy/CuPy array (same type), of a dict of them (``mod_arrays``), else ``x`` itself."""
    if isinstance(x, np.ndarray) or _is_cupy(x):
        return x.copy()
    if isinstance(x, Mapping):  # options may hold any mapping (mod_arrays)
        return {key: _copy(value) for key, value in x.items()}
    return x


def _snapshot(case: Case) -> Case:
    """The case with every array copied: the reference and the naive baseline are computed from these, so a ``fn``
    that writes into its inputs cannot move them (``q *= s`` with ``scale=s`` passed with a true error of 0.92)."""
    return Case(*(_copy(x) for x in (case.q, case.k, case.v, case.dout)), options=_copy(case.options))


def _same(now, before) -> bool:
    """Bit for bit: a value comparison would take -0.0 for 0.0 and one NaN for another, and knows no bfloat16."""
    now, before = _host(now), _host(before)
    if now.shape != before.shape or now.dtype != before.dtype:  # ``q.shape = ...`` reshapes in place
        return False
    if not now.dtype.hasobject and now.dtype.itemsize in (1, 2, 4, 8):
        bits = np.dtype(f"u{now.dtype.itemsize}")
        return bool(np.array_equal(now.view(bits), before.view(bits)))
    return bool(np.array_equal(now, before, equal_nan=now.dtype.kind in "fc"))


def _changed(name, now, before):
    """The names of the arrays (recursing into dicts) of ``now`` that differ from their copy in ``before``."""
    if isinstance(before, dict):  # a _copy: every mapping became a dict
        if not isinstance(now, Mapping) or now.keys() != before.keys():
            yield name
            return
        for key in before:
            yield from _changed(f"{name}[{key!r}]", now[key], before[key])
    elif (isinstance(before, np.ndarray) or _is_cupy(before)) and not _same(now, before):
        yield name


def _require_unmodified(now: dict, before: dict) -> None:
    for name in now:
        for changed in _changed(name, now[name], before[name]):
            _require(False, f"fn modified {changed} in place: the reference is computed from copies taken before "
                            f"the call, but the caller's arrays are changed (fn must not write into its inputs)")


def _arrays(case: Case) -> dict:
    return dict(q=case.q, k=case.k, v=case.v, dout=case.dout, options=case.options)


def _finite(magnitude):
    """A term magnitude, or None (the result's own largest value) where it overflowed even in long double (inputs
    near float64's largest): an infinite one would make a floor that passes anything."""
    return magnitude if np.isfinite(magnitude) else None


def _values(result) -> str:
    return f"{len(result)} values" if isinstance(result, (tuple, list)) else f"{type(result).__name__}, not a tuple"


def check_forward(fn, case: Case):
    """Hold ``fn(q, k, v, **options) -> (out, lse)`` to the rule against the float64 reference (longdouble for
    float64 inputs). ``fn`` must not modify its inputs (AssertionError naming the array)."""
    _check_case_options(case)
    before = _snapshot(case)
    result = fn(case.q, case.k, case.v, **case.options)
    _require_unmodified(_arrays(case), _arrays(before))
    _require(isinstance(result, (tuple, list)) and len(result) == 2,
             f"fn must return (out, lse), got {_values(result)}: the lse is checked too (e.g. "
             f"functools.partial(cuflash.attention, return_lse=True))")
    out, lse = result
    out = _elements(out, before)
    opts, drop = _reference_options(before)
    element = _element_dtype(before)
    ref, ref_lse = reference.attention(before.q, before.k, before.v, return_lse=True,
                                       compute_dtype=reference_dtype(element), **opts, **drop)
    _check_dtypes((out,), element, ("out",))
    lse_dtype = np.dtype(lse.dtype)
    _require(lse_dtype.kind == "f" and lse_dtype.itemsize >= 4,
             f"lse: dtype {lse.dtype}, expected float32 or float64 (the statistics' precision, not the inputs')")
    base, base_lse = reference.attention(before.q, before.k, before.v, return_lse=True,
                                         compute_dtype=_baseline_dtype(before, element), **opts, **drop)
    mags = reference.term_magnitudes(before.q, before.k, before.v, **opts, **drop)
    assert_attention_close(out, ref, base, mult=2, name="out", magnitude=_finite(mags["out"]))
    assert_attention_close(lse, ref_lse, base_lse, mult=2, name="lse", magnitude=_finite(mags["lse"]))
    return out, lse


def check_backward(fn, case: Case, out, lse, *, dbias=None):
    """Hold ``fn(dout, q, k, v, out, lse, **options) -> (dq, dk, dv)`` to the rule (mult 3).

    ``dbias`` (default: when the case has a ``bias``): ``fn`` is called with ``return_dbias=True`` and its
    fourth result held to the rule too (the naive baseline rounded to the bias's dtype, as the result is, where that
    is the coarser one: a float32 bias of float16 inputs keeps float16's floor, the precision dbias is computed in).
    ``fn`` must not modify its inputs, ``out`` and ``lse`` included (AssertionError naming the array)."""
    dbias = "bias" in case.options if dbias is None else dbias
    extra = {"return_dbias": True} if dbias else {}
    _check_case_options(case)
    before = _snapshot(case)
    saved = dict(out=_copy(out), lse=_copy(lse))
    grads = fn(case.dout, case.q, case.k, case.v, out, lse, **case.options, **extra)
    _require_unmodified(dict(_arrays(case), out=out, lse=lse), dict(_arrays(before), **saved))
    want = 4 if dbias else 3
    _require(isinstance(grads, (tuple, list)) and len(grads) == want,
             f"fn must return {'(dq, dk, dv, dbias)' if dbias else '(dq, dk, dv)'}, got {_values(grads)}: a "
             f"gradient left out would go unchecked")
    grads = tuple(_elements(g, before) for g in grads[:3]) + tuple(grads[3:])
    opts, drop = _reference_options(before)
    element = _element_dtype(before)
    refs = reference.attention_backward(before.dout, before.q, before.k, before.v,
                                        compute_dtype=reference_dtype(element), **opts, **drop, **extra)
    _check_dtypes(grads[:3], element, ("dq", "dk", "dv"))
    bases = reference.attention_backward(before.dout, before.q, before.k, before.v,
                                         compute_dtype=_baseline_dtype(before, element), **opts, **drop, **extra)
    if dbias:
        bias = before.options["bias"]
        bias_dtype = bias.dtype if hasattr(bias, "dtype") else np.asarray(bias).dtype  # CuPy's: no implicit copy
        _check_dtypes(grads[3:], bias_dtype, ("dbias",))
        if rounding(bias_dtype) > rounding(bases[3].dtype):
            with np.errstate(over="ignore", under="ignore"):
                bases = bases[:3] + (np.asarray(bases[3]).astype(bias_dtype),)
    mags = reference.term_magnitudes(before.q, before.k, before.v, before.dout, **opts, **drop)
    for name, g, r, b in zip(("dq", "dk", "dv", "dbias"), grads, refs, bases):
        assert_attention_close(g, r, b, mult=3, name=name, magnitude=_finite(mags[name]))
    return grads
