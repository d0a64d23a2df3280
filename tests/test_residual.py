"""The misuse-proof backward (issue: an API that cannot be misused): ``attention(..., return_residual=True)``
returns ``(out, residual)``, and ``attention_backward(dout, residual)`` takes the forward's arrays and options from
it, so that they cannot mismatch; an in-place change since the forward is detected; ``attention_vjp`` is built on
it. The keyword form stays, and its hazard (options only passed to the backward) is shown here for what it is."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import cuflash
from cuflash import BlockMask, reference
from cuflash.api import DEFAULTS, OPTIONS, AttentionResidual
from cuflash.testing import Case, check_backward


def _arrays(shape_q=(2, 23, 4, 16), shape_k=(2, 31, 2, 16), seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k).astype(dtype)
    dout = rng.standard_normal(shape_q).astype(dtype)
    return q, k, v, dout


OPTION_SETS = {
    "causal": dict(causal=True),
    "window-scale": dict(window=(4, 1), scale=0.2),
    "seqlens-blockmask": dict(seqlens_q=np.array([23, 9], np.int32), seqlens_k=np.array([31, 12], np.int32),
                              block_mask=BlockMask.sliding_window(23, 31, window=(16, 0), block=(8, 8))),
    "dropout-seed": dict(causal=True, dropout_p=0.3, seed=77),
}


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_residual_backward_is_the_keyword_backward_with_the_forwards_options(name):
    q, k, v, dout = _arrays()
    options = OPTION_SETS[name]
    out, residual = cuflash.attention(q, k, v, return_residual=True, **options)
    assert isinstance(residual, AttentionResidual) and residual.out is out
    assert all(residual.options[key] is value for key, value in options.items())
    assert set(residual.options) == set(OPTIONS)
    grads = cuflash.attention_backward(dout, residual)
    want = cuflash.attention_backward(dout, q, k, v, out, residual.lse, **options)
    for g, w in zip(grads, want):
        assert np.array_equal(g, w)
    check_backward(lambda *a, **o: grads, Case(q, k, v, dout, dict(options)), out, residual.lse)


def test_a_drawn_seed_is_kept_in_the_residual():
    q, k, v, dout = _arrays()
    result = cuflash.attention(q, k, v, dropout_p=0.5, return_residual=True)
    assert len(result) == 2  # (out, residual): the drawn seed lives in the residual, not in the tuple
    out, residual = result
    assert isinstance(residual.seed, int) and residual.options["seed"] == residual.seed
    assert np.array_equal(out, cuflash.attention(q, k, v, dropout_p=0.5, seed=residual.seed))
    grads = cuflash.attention_backward(dout, residual)
    check_backward(lambda *a, **o: grads, Case(q, k, v, dout, dict(dropout_p=0.5, seed=residual.seed)), out,
                   residual.lse)


@pytest.mark.parametrize("name", [n for n in OPTIONS])
def test_an_option_passed_with_a_residual_is_a_type_error(name):
    """The issue's misuse: ``causal=True`` only for the backward. With a residual every option comes from the
    forward; giving one again (whatever its value, the default too: ``causal=False`` on a causal residual was
    silently dropped) is refused, naming it."""
    q, k, v, dout = _arrays()
    _, residual = cuflash.attention(q, k, v, return_residual=True)
    value = {"causal": True, "scale": 0.5, "window": (2, 2), "block_mask": BlockMask.causal(23, 31, block=(8, 8)),
             "seqlens_q": np.array([1, 2]), "seqlens_k": np.array([1, 2]), "bias": np.zeros((4, 23, 31), np.float32),
             "alibi_slopes": np.ones(4, np.float32), "softcap": 5.0, "score_mod": "score", "mask_mod": "q_idx >= 0",
             "mod_arrays": {"x": 1.0}, "dropout_p": 0.1, "seed": 3, "dtype": "bfloat16", "layout": "bhsd",
             "precision": "tf32"}[name]
    assert value is not DEFAULTS[name]
    for given in (value, DEFAULTS[name]):
        with pytest.raises(TypeError, match=rf"takes the forward's options from the residual; {name} given as well"):
            cuflash.attention_backward(dout, residual, **{name: given})


def test_arrays_passed_with_a_residual_are_refused():
    q, k, v, dout = _arrays()
    out, residual = cuflash.attention(q, k, v, return_residual=True)
    with pytest.raises(TypeError, match="takes no k, v, out, lse: the residual holds them"):
        cuflash.attention_backward(dout, residual, k, v)
    with pytest.raises(TypeError, match=r"dqkv= is not a buffer of a residual of attention \(its buffers: dq, dk"):
        cuflash.attention_backward(dout, residual, dqkv=np.empty((2, 23, 3, 4, 16), np.float32))
    with pytest.raises(ValueError, match="dout must have q's shape"):
        cuflash.attention_backward(dout[:, :-1], residual)


def test_the_keyword_form_cannot_see_a_mismatch_and_the_residual_form_refuses_it():
    """Why the residual exists: the keyword form with ``causal=True`` only in the backward returns gradients of a
    function that was never computed (far from the reference's), silently; the residual form raises."""
    q, k, v, dout = _arrays(shape_k=(2, 23, 2, 16))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    wrong = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    right = reference.attention_backward(dout, q, k, v)
    assert np.abs(wrong[0] - right[0]).max() > 0.1
    _, residual = cuflash.attention(q, k, v, return_residual=True)
    with pytest.raises(TypeError, match="causal given as well"):
        cuflash.attention_backward(dout, residual, causal=True)
    assert "the options must be exactly the forward's" in " ".join(cuflash.attention_backward.__doc__.split())


@pytest.mark.parametrize("changed", ["q", "k", "v", "out"])
def test_in_place_changes_after_the_forward_are_detected(changed):
    q, k, v, dout = _arrays()
    out, residual = cuflash.attention(q, k, v, causal=True, return_residual=True)
    first = cuflash.attention_backward(dout, residual)
    assert all(np.array_equal(a, b) for a, b in zip(first, cuflash.attention_backward(dout, residual)))
    arrays = dict(q=q, k=k, v=v, out=out)
    arrays[changed][1, 3] = arrays[changed][1, 4]
    with pytest.raises(ValueError, match=f"{changed} was modified in place after attention_vjp / attention"):
        cuflash.attention_backward(dout, residual)


@pytest.mark.parametrize("changed", ["bias", "seqlens_k", "mod_arrays['shift']"])
def test_in_place_changes_of_array_options_are_detected(changed):
    """The backward reads the forward's array options again: one changed in place since would give the gradients
    of another problem against the forward's lse."""
    q, k, v, dout = _arrays()
    b, sq, h, _ = q.shape
    rng = np.random.default_rng(5)
    options = dict(bias=rng.standard_normal((h, sq, k.shape[1])).astype(q.dtype),
                   seqlens_k=np.full(b, k.shape[1] - 2, np.int32),
                   score_mod="score + shift[h]", mod_arrays={"shift": np.linspace(0, 1, h).astype(np.float32)})
    out, residual = cuflash.attention(q, k, v, return_residual=True, **options)
    first = cuflash.attention_backward(dout, residual)
    assert all(np.array_equal(a, b) for a, b in zip(first, cuflash.attention_backward(dout, residual)))
    arrays = dict(bias=options["bias"], seqlens_k=options["seqlens_k"], **{"mod_arrays['shift']":
                                                                             options["mod_arrays"]["shift"]})
    arrays[changed][0] += 1
    with pytest.raises(ValueError, match=rf"{re.escape(changed)} was modified in place after attention_vjp"):
        cuflash.attention_backward(dout, residual)


def test_the_callers_window_list_and_mod_arrays_dict_changed_later_change_nothing():
    """The residual keeps the options' containers as the forward saw them: a caller reusing its window list or its
    mod_arrays dict for another call (not an in-place change of an array: that is detected) must not send the
    backward another problem's options against the forward's lse (it did: the list itself was kept)."""
    q, k, v, dout = _arrays()
    window, mod_arrays = [4, 0], {"shift": 0.5}
    opts = dict(window=(4, 0), score_mod="score * shift", mod_arrays={"shift": 0.5})
    out, vjp = cuflash.attention_vjp(q, k, v, window=window, score_mod="score * shift", mod_arrays=mod_arrays)
    window[0], mod_arrays["shift"] = 100, 3.0
    assert vjp.residual.options["window"] == (4, 0) and vjp.residual.options["mod_arrays"] == {"shift": 0.5}
    want = cuflash.attention_backward(dout, q, k, v, out, cuflash.attention(q, k, v, return_lse=True, **opts)[1],
                                      **opts)
    for got, w in zip(vjp(dout), want):
        np.testing.assert_array_equal(got, w)


def test_return_lse_and_return_residual_are_exclusive():
    q, k, v, _ = _arrays()
    with pytest.raises(TypeError, match="return_lse and return_residual are exclusive"):
        cuflash.attention(q, k, v, return_lse=True, return_residual=True)
    with pytest.raises(TypeError, match="return_residual must be a bool"):
        cuflash.attention(q, k, v, return_residual="yes")


def test_the_residual_is_frozen_small_and_holds_references():
    q, k, v, _ = _arrays()
    out, residual = cuflash.attention(q, k, v, causal=True, window=(3, None), return_residual=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        residual.out = q
    with pytest.raises(TypeError):
        residual.options["causal"] = False  # a read-only mapping
    text = repr(residual)
    assert len(text) < 300 and "causal: True" in text and "window: (3, None)" in text
    assert "ndarray(2, 23, 4, 16)" in text
    saved = residual._saved
    assert saved[0] is q and saved[1] is k and saved[2] is v and saved[3] is out  # references: no copies
    assert sum(a.nbytes for a in saved) == q.nbytes + k.nbytes + v.nbytes + out.nbytes + residual.lse.nbytes


def test_attention_vjp_is_built_on_the_residual():
    q, k, v, dout = _arrays()
    out, vjp = cuflash.attention_vjp(q, k, v, causal=True, dropout_p=0.2, deterministic=True)
    assert isinstance(vjp.residual, AttentionResidual) and vjp.seed == vjp.residual.seed is not None
    for g, w in zip(vjp(dout), cuflash.attention_backward(dout, vjp.residual)):
        assert np.array_equal(g, w)
    with pytest.raises(TypeError, match="attention_vjp does not take return_residual"):
        cuflash.attention_vjp(q, k, v, return_residual=True)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cuflash.attention_vjp(q, k, v, deterministic=1)


def test_vjp_forms_name_themselves_for_an_unknown_keyword():
    """An unknown keyword (one of the backward's, a typo) is the vjp function's error, not that of the forward it
    passes its options to ("attention() got an unexpected keyword argument": a function the caller never called)."""
    q, k, v, _ = _arrays()
    with pytest.raises(TypeError, match=r"^attention_vjp\(\) got an unexpected keyword argument 'return_dbias' "
                                        r"\(it takes causal, scale, .*, backend, deterministic\)$"):
        cuflash.attention_vjp(q, k, v, return_dbias=True)
    packed = np.ascontiguousarray(q[0])
    cu = np.array([0, packed.shape[0]], np.int32)
    with pytest.raises(TypeError, match=r"^attention_varlen_vjp\(\) got an unexpected keyword argument 'casual' "
                                        r"\(it takes max_seqlen_q, max_seqlen_k, causal, "):
        cuflash.attention_varlen_vjp(packed, packed, packed, cu, cu, casual=True)


def test_repr_shows_mod_arrays_as_shapes():
    """A residual's repr showed a 1000 x 1000 bias as its shape but printed a 1000-element mod_arrays array whole
    (250 lines): the arrays inside the mapping are shapes now too."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1000, 1, 4)).astype(np.float32) for _ in range(3))
    _, residual = cuflash.attention(q, k, v, score_mod="score + w[kv_idx]", mod_arrays={"w": np.zeros(1000)},
                                    return_residual=True)
    assert "mod_arrays: {'w': ndarray(1000,) float64}" in repr(residual) and len(repr(residual)) < 400
