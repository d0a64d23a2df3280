"""The hostile property (issue: hardening): for hostile values of every argument of ``cuflash.attention`` and
``cuflash.attention_backward`` -- huge, negative, NaN, wrongly typed, byte-swapped, subclassed, aliased, read-only
-- the call either raises a ``ValueError``/``TypeError`` that names the argument, before any backend runs, or
returns what the float64 reference computes from the same inputs; and it never changes its inputs.

Hypothesis draws a small valid problem, then one or two arguments to spoil and how.
"""
from __future__ import annotations

import re
import sys

import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

import cuflash
import cuflash.backends
from cuflash import reference
from cuflash.testing import assert_attention_close


class Tagged(np.ndarray):
    """A harmless ndarray subclass: must be read as the array it views."""


def _swapped(a):
    return a.astype(a.dtype.newbyteorder("S"))


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _strided(a):
    """The same values through a non-contiguous view (every other element of a buffer twice as long)."""
    wide = np.empty(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    wide[..., ::2] = a
    return wide[..., ::2]


def _with_nan(a):
    a = a.copy()
    a.reshape(-1)[a.size // 2] = np.nan
    return a


# How to spoil each argument: name -> (label, function of the valid problem giving the hostile value). Values that
# are valid spelled oddly (a subclass, a swapped byte order, a huge window) must compute; the rest must be refused.
ARRAY_SPOILERS = {
    "huge": lambda a: a * np.asarray(1e4, a.dtype),   # large, finite scores: the softmax must stay exact
    "nan": _with_nan,
    "inf": lambda a: np.where(np.arange(a.size).reshape(a.shape) == 0, np.inf, a).astype(a.dtype),
    "byte-swapped": _swapped,
    "subclass": lambda a: a.view(Tagged),
    "read-only": _read_only,
    "strided": _strided,
    "a list": lambda a: a.tolist(),
    "int": lambda a: a.astype(np.int32),
    "complex": lambda a: a.astype(np.complex64),
    "object": lambda a: a.astype(object),
    "4-d missing batch": lambda a: a[0],
    "one element short": lambda a: a[..., :-1],
    "masked": lambda a: np.ma.masked_array(a, mask=np.zeros(a.shape, bool)),
    "a scalar": lambda a: np.float32(1.0),
}

SCALAR_SPOILERS = {
    "causal": [2, "yes", None, np.array([True, False]), float("nan")],
    "scale": [float("nan"), float("inf"), -float("inf"), "0.5", 1j, np.array([0.5, 0.5]), 0.0, -0.25, 1e-30],
    "window": [(-1, 0), (0, -3), (float("nan"), 0), (1.5, 0), "3", (1, 2, 3), (None, sys.maxsize), (2**70, 2**70),
               (np.int64(-2**63), 0), 5, (True, 0)],
    "softcap": [float("nan"), -1.0, 0.0, float("inf"), "1", np.array([1.0, 2.0]), 1e30],
    "dropout_p": [float("nan"), -0.1, 1.0, 1.5, "0.1", np.inf],
    "seed": [-1, 2**70, 1.5, "1", np.array([1, 2])],
    "backend": ["gpu", 3, "NUMPY", ""],
    "layout": ["bhds", None, 3],
    "dtype": ["float8", 3, "int32"],
    "return_lse": ["no", 2],
    "score_mod": ["__import__('os')", "score +", 3, "score * undefined_name", "q.shape"],
    "mask_mod": ["kv_idx <= q_idx + ", 1.5, "open('x')"],
}


def _seqlens_spoilers(n, batch):
    return [np.full(batch, -1, np.int32), np.full(batch, n + 1, np.int32), np.full(batch, 2**40, np.int64),
            np.full(batch, 1.0, np.float32), np.zeros(batch + 1, np.int32), np.full(batch, 1, np.int32).tolist(),
            np.array(1, np.int32), _swapped(np.full(batch, n, np.int32)), np.full(batch, n, np.uint64)]


def _problem(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    batch, sq, sk = draw(st.integers(1, 2)), draw(st.integers(1, 24)), draw(st.integers(1, 24))
    hkv = draw(st.sampled_from([1, 2]))
    hq, d = hkv * draw(st.sampled_from([1, 2])), draw(st.sampled_from([8, 16]))
    q = rng.standard_normal((batch, sq, hq, d)).astype(np.float32)
    k = rng.standard_normal((batch, sk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((batch, sk, hkv, d)).astype(np.float32)
    return q, k, v


@st.composite
def hostile_calls(draw):
    """(arrays, options, what was spoiled)."""
    q, k, v = _problem(draw)
    arrays, options, spoiled = {"q": q, "k": k, "v": v}, {"causal": draw(st.booleans())}, []
    targets = ["q", "k", "v", "bias", "alibi_slopes", "seqlens_q", "seqlens_k", "out", "aliasing"]
    for target in draw(st.lists(st.sampled_from(targets + sorted(SCALAR_SPOILERS)), min_size=1, max_size=2,
                                unique=True)):
        if target in ("q", "k", "v"):
            how = draw(st.sampled_from(sorted(ARRAY_SPOILERS)))
            arrays[target] = ARRAY_SPOILERS[how](arrays[target])
        elif target == "bias":
            bias = np.random.default_rng(1).standard_normal((q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
            how = draw(st.sampled_from(sorted(ARRAY_SPOILERS)))
            options["bias"] = ARRAY_SPOILERS[how](bias.astype(np.float32))
        elif target == "alibi_slopes":
            how = draw(st.sampled_from(["nan", "byte-swapped", "a list", "int", "one element short", "huge",
                                        "read-only", "a scalar", "object"]))
            options["alibi_slopes"] = ARRAY_SPOILERS[how](np.linspace(0.1, 0.5, q.shape[2], dtype=np.float32))
        elif target in ("seqlens_q", "seqlens_k"):
            n = q.shape[1] if target == "seqlens_q" else k.shape[1]
            how = draw(st.sampled_from(range(9)))
            options[target] = _seqlens_spoilers(n, q.shape[0])[how]
        elif target == "out":
            how = draw(st.sampled_from(["q itself", "read-only", "wrong shape", "float64", "a list"]))
            like = np.empty((q.shape[0], q.shape[1], q.shape[2], v.shape[-1]), np.float32)
            options["out"] = {"q itself": arrays["q"], "read-only": _read_only(like), "wrong shape": like[:, :1],
                              "float64": like.astype(np.float64), "a list": like.tolist()}[how]
        elif target == "aliasing":
            how = draw(st.sampled_from(["k is q", "v is k", "q k v one buffer"]))
            if how == "k is q" and q.shape == k.shape:
                arrays["k"] = arrays["q"]
            elif how == "v is k":
                arrays["v"] = arrays["k"]
            elif q.shape == k.shape:
                buf = np.stack([q, k, v])
                arrays.update(q=buf[0], k=buf[1], v=buf[2])
        else:
            how = draw(st.sampled_from(range(len(SCALAR_SPOILERS[target]))))
            options[target] = SCALAR_SPOILERS[target][how]
            if target == "dropout_p":
                options.setdefault("seed", 7)
        spoiled.append((target, how))
    return arrays, options, spoiled


def _snapshot(value):
    if isinstance(value, np.ndarray) and value.dtype != object:
        return np.array(value, copy=True)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return None


def _unchanged(before, value):
    if before is None:
        return True
    if isinstance(before, dict):
        return all(_unchanged(before[k], value[k]) for k in before)
    return np.array_equal(before, value, equal_nan=np.issubdtype(before.dtype, np.inexact))


class _Spy:
    """Counts backend calls: a refused call must be refused before any of them."""

    def __init__(self, monkeypatch):
        self.calls = 0
        backend = cuflash.backends.get("numpy")
        for name in ("forward", "backward"):
            real = getattr(backend, name)
            monkeypatch.setattr(backend, name, self._counting(real))

    def _counting(self, real):
        def call(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        return call


def _names_the_argument(message, spoiled):
    names = {t for t, _ in spoiled}
    if "aliasing" in names:
        names |= {"q", "k", "v"}
    # seed is named with dropout_p and the reverse: they are one option spelled in two arguments.
    names |= {"seed" for t in names if t == "dropout_p"} | {"dropout_p" for t in names if t == "seed"}
    return any(re.search(rf"(?<![\w.]){name}(?!\w)", message) for name in names)


def _native(a):
    a = np.asarray(a)
    return a.astype(a.dtype.newbyteorder("="))


def _reference_inputs(arrays, options):
    opts = {key: (_native(val) if isinstance(val, np.ndarray) else val) for key, val in options.items()
            if key not in ("backend", "out", "return_lse", "layout", "dtype")}
    return [_native(arrays[n]) for n in "qkv"], opts


def _pad_last(a, width):
    return np.concatenate([a, np.zeros(a.shape[:-1] + (width - a.shape[-1],), a.dtype)], axis=-1)


def _same_head_dims(q, k, v, opts):
    """The reference takes one head dim; cuflash a value head dim of its own (head_dim_v), shorter or longer: zero
    columns give the same result (v's padded columns are sliced off; q and k padded leave every score as it was,
    with the scale of the real head dim)."""
    if v.shape[-1] < k.shape[-1]:
        v = _pad_last(v, k.shape[-1])
    elif v.shape[-1] > k.shape[-1]:
        if opts.get("scale") is None:
            opts = {**opts, "scale": 1.0 / np.sqrt(q.shape[-1])}
        q, k = _pad_last(q, v.shape[-1]), _pad_last(k, v.shape[-1])
    return q, k, v, opts


def _kind(x):
    """0 finite, 1 +inf, 2 -inf, 3 NaN, elementwise."""
    return np.select([np.isnan(x), np.isposinf(x), np.isneginf(x)], [3, 1, 2], 0)


def _magnitudes(arrays, opts):
    """reference.term_magnitudes of the inputs with their spoiled (non-finite) values zeroed: the terms of every
    finite result are finite (with them kept, the magnitudes were NaN and the floor fell back to max|ref|)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return reference.term_magnitudes(*(np.where(np.isfinite(a), a, 0).astype(a.dtype) for a in arrays), **opts)


def _assert_matches_reference(got, arrays, options, name):
    (q, k, v), opts = _reference_inputs(arrays, options)
    if opts.get("dropout_p"):
        shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        opts["dropout_mask"] = cuflash.dropout_mask(shape, seed=opts.pop("seed"), p=opts["dropout_p"])
    dv = v.shape[-1]
    q, k, v, opts = _same_head_dims(q, k, v, opts)
    ref, naive = (reference.attention(q, k, v, return_lse=True, compute_dtype=c, **opts) for c in (np.float64, q.dtype))
    ref, naive = ((o[..., :dv], lse) for o, lse in (ref, naive))
    # the floor at the terms' magnitudes times the condition of exp (as the backward's below): "huge" keys make
    # scores of 1e4, whose one rounding moves the weights of keys a few units apart by 1e-3 of themselves, and a
    # naive computation that happens to round the top two scores alike is no yardstick for that
    mags = _magnitudes((q, k, v), opts)
    for actual, want, base, what in zip(got, ref, naive, ("out", "lse")):
        actual = np.asarray(actual, np.float64)
        # NaN in, NaN out where the float64 reference has it (rows that read a NaN), and nowhere else; except where
        # the float64 and the same-dtype computations disagree: a weight that underflows to 0 in one precision and
        # not in the other (huge scores) times a NaN value. There either pattern is right.
        nan, unsure = np.isnan(want), np.isnan(want) != np.isnan(base)
        assert np.array_equal(np.isnan(actual) & ~unsure, nan & ~unsure), \
            f"{name}: NaN pattern of {what} differs from the reference"
        assert ((_kind(actual) == _kind(want)) | (_kind(actual) == _kind(base)))[unsure].all(), \
            f"{name}: {what} is finite, infinite or NaN where neither the reference nor the naive computation is"
        skip = nan | unsure
        assert_attention_close(np.where(skip, 0, actual), np.where(skip, 0, want), np.where(skip, 0, base),
                               mult=2, name=f"{name} {what}",
                               magnitude=mags[what] if np.isfinite(mags[what]) else None)  # a NaN slope, say


# Five times the profile's examples: a call takes about 2 ms.
@settings(deadline=None, max_examples=5 * settings.default.max_examples)
@given(call=hostile_calls())
def test_hostile_forward(call, monkeypatch_module):
    arrays, options, spoiled = call
    spy = monkeypatch_module
    spy.calls = 0
    before = {**{n: _snapshot(a) for n, a in arrays.items()}, **{n: _snapshot(o) for n, o in options.items()}}
    kwargs = {"backend": "numpy", "return_lse": True, **options}
    try:
        got = cuflash.attention(arrays["q"], arrays["k"], arrays["v"], **kwargs)
    except (ValueError, TypeError) as exc:
        event(f"refused: {type(exc).__name__}")
        assert spy.calls == 0, f"{spoiled}: refused after a backend ran: {exc}"
        assert _names_the_argument(str(exc), spoiled), f"{spoiled}: the error does not name " \
                                                                       f"the argument: {exc}"
    else:
        event("computed")
        assert isinstance(got, tuple) and len(got) == 2, f"{spoiled}: return_lse accepted as something else"
        _assert_matches_reference(got, arrays, options, repr(spoiled))
    for name, value in {**arrays, **options}.items():
        if name != "out":
            assert _unchanged(before[name], value), f"{spoiled}: the call changed {name}"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield _Spy(mp)


# out and lse are the forward's own results: spoiling their values asks about another function, so only their
# spelling (and invalid forms) is spoiled.
SAVED_SPOILERS = ("byte-swapped", "subclass", "read-only", "strided", "a list", "int", "object", "4-d missing batch",
                  "one element short", "masked", "a scalar")


@st.composite
def hostile_backward_calls(draw):
    """(arrays, options, spoiled, forward_refused): out/lse are the forward's on the spoiled q, k, v (stale ones
    would ask about another function), or on the valid ones where the forward refused the spoiled."""
    q, k, v = _problem(draw)
    arrays, options, spoiled = {"q": q, "k": k, "v": v}, {"causal": draw(st.booleans())}, []
    dout = np.random.default_rng(3).standard_normal(q.shape[:-1] + v.shape[-1:]).astype(np.float32)
    names = ["dout", "q", "k", "v", "out", "lse", "scale", "window", "softcap", "backend", "layout"]
    targets = draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))
    for target in targets:
        if target in ("q", "k", "v"):
            how = draw(st.sampled_from(sorted(ARRAY_SPOILERS)))
            arrays[target] = ARRAY_SPOILERS[how](arrays[target])
        elif target in SCALAR_SPOILERS:
            how = draw(st.sampled_from(range(len(SCALAR_SPOILERS[target]))))
            options[target] = SCALAR_SPOILERS[target][how]
        else:
            continue
        spoiled.append((target, how))
    try:
        out, lse = cuflash.attention(arrays["q"], arrays["k"], arrays["v"], return_lse=True, **options)
        forward_refused = False
        if arrays["v"] is not v or np.shape(out) != np.shape(dout):
            dout = np.random.default_rng(3).standard_normal(np.shape(out)).astype(np.float32)
    except (ValueError, TypeError):
        out, lse = cuflash.attention(q, k, v, return_lse=True, causal=options["causal"])
        forward_refused = True
    arrays.update(dout=dout, out=out, lse=lse)
    for target in targets:
        if target in ("dout", "out", "lse"):
            how = draw(st.sampled_from(sorted(ARRAY_SPOILERS) if target == "dout" else SAVED_SPOILERS))
            arrays[target] = ARRAY_SPOILERS[how](arrays[target])
            spoiled.append((target, how))
    return arrays, options, spoiled, forward_refused


def _assert_gradients_match_reference(grads, arrays, options, name):
    (q, k, v), opts = _reference_inputs(arrays, options)
    dout = _native(arrays["dout"])
    q, k, v, opts = _same_head_dims(q, k, v, opts)  # dq, dk, dv's own columns are those of the padded twin
    if dout.shape[-1] < v.shape[-1]:
        dout = _pad_last(dout, v.shape[-1])
    refs = reference.attention_backward(dout, q, k, v, **opts)
    bases = reference.attention_backward(dout, q, k, v, compute_dtype=q.dtype, **opts)
    mags = _magnitudes((q, k, v, dout), opts)
    for what, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bases):
        width = g.shape[-1]
        r, b, g = r[..., :width], b[..., :width], np.asarray(g, np.float64)
        nan = np.isnan(r)
        # as in the forward: where the float64 and the same-dtype computations disagree about NaN or infinity (a
        # weight that underflows to 0 in one precision and not in the other, huge scores, times an infinite value),
        # either one's is right; everywhere else the reference's, exactly
        unsure = _kind(r) != _kind(b)
        assert np.array_equal(np.isnan(g) & ~unsure, nan & ~unsure), \
            f"{name}: NaN pattern of {what} differs from the reference"
        assert ((_kind(g) == _kind(r)) | (_kind(g) == _kind(b)))[unsure].all(), \
            f"{name}: {what} is finite, infinite or NaN where neither the reference nor the naive computation is"
        skip = nan | unsure
        assert_attention_close(np.where(skip, 0, g), np.where(skip, 0, r), np.where(skip, 0, b), mult=3,
                               name=f"{name} {what}", magnitude=mags[what])


@settings(deadline=None, max_examples=5 * settings.default.max_examples)
@given(call=hostile_backward_calls())
def test_hostile_backward(call, monkeypatch_module):
    arrays, options, spoiled, forward_refused = call
    spy = monkeypatch_module
    spy.calls = 0
    before = {n: _snapshot(a) for n, a in {**arrays, **options}.items()}
    kwargs = {"backend": "numpy", **options}
    try:
        grads = cuflash.attention_backward(arrays["dout"], arrays["q"], arrays["k"], arrays["v"], arrays["out"],
                                           arrays["lse"], **kwargs)
    except (ValueError, TypeError) as exc:
        event(f"refused: {type(exc).__name__}")
        assert spy.calls == 0, f"{spoiled}: refused after a backend ran: {exc}"
        assert _names_the_argument(str(exc), spoiled), f"{spoiled}: the error does not name the argument: {exc}"
    else:
        event("computed")
        assert not forward_refused, f"{spoiled}: the backward accepted what the forward refused"
        _assert_gradients_match_reference(grads, arrays, options, repr(spoiled))
    for name, value in {**arrays, **options}.items():
        assert _unchanged(before[name], value), f"{spoiled}: the call changed {name}"
