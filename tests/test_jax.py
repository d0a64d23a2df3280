"""cuflash.jax (issue: a JAX adapter): jit, grad and vmap on CPU JAX, against jax.nn.dot_product_attention (with
its top-left causal alignment handled), the float64 reference by the 2x/3x rule, and finite differences; both
ways in (``buffer_callback``, the default, and ``pure_callback``); trace-time errors; and the GPU branch of the
callback (XLA's device and stream) with the fake CuPy.

JAX is a test dependency (``.[test]``); this module is skipped only where it is not installed at all.
"""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (it comes with the test extra: pip install '.[test]')")
jnp = pytest.importorskip("jax.numpy")

import cuflash  # noqa: E402
import cuflash.jax as cj  # noqa: E402
from cuflash import reference  # noqa: E402
from cuflash.testing import (Case, assert_attention_close, check_backward,  # noqa: E402
                             reference_dtype)

import fake_cupy  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_cpu")  # CPU JAX here, on a machine with a GPU too


@pytest.fixture(params=["buffer", "pure"])
def callback(request, monkeypatch):
    """Both ways into cuflash: XLA's buffers (jax.experimental.buffer_callback) and host arrays (pure_callback)."""
    if request.param == "buffer" and cj._buffer_callback is None:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    monkeypatch.setattr(cj, "CALLBACK", request.param)
    return request.param


def _arrays(shape_q, shape_k, dtype=np.float32, seed=0, dv=None):
    rng = np.random.default_rng(seed)
    shape_v = shape_k if dv is None else shape_k[:-1] + (dv,)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_v).astype(dtype)
    return q, k, v


def _bottom_right_mask(sq, sk):
    """cuflash's causal rule as a boolean (1, 1, Sq, Sk) mask for jax.nn.dot_product_attention."""
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    return jnp.asarray((j <= i + (sk - sq))[None, None])


# ------------------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("sq,sk,hq,hkv,causal", [(33, 33, 4, 2, True), (17, 40, 2, 2, True), (40, 17, 2, 1, True),
                                                 (20, 31, 4, 4, False)])
def test_forward_matches_dot_product_attention_under_jit(callback, sq, sk, hq, hkv, causal):
    q, k, v = (jnp.asarray(a) for a in _arrays((2, sq, hq, 16), (2, sk, hkv, 16)))
    got = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=causal))(q, k, v)
    assert isinstance(got, jax.Array) and got.shape == q.shape and got.dtype == q.dtype
    if causal and sq == sk:
        want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    elif causal:  # JAX aligns causal top-left; cuflash (like FlashAttention-2) bottom-right: an explicit mask
        want = jax.nn.dot_product_attention(q, k, v, mask=_bottom_right_mask(sq, sk))
        top_left = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        assert float(jnp.abs(got - top_left).max()) > 0.1  # the alignments really differ here
    else:
        want = jax.nn.dot_product_attention(q, k, v)
    sees = np.arange(sq) + (sk - sq) >= 0 if causal else np.ones(sq, bool)  # rows that see at least one key
    # against the float64 reference: at most 2x the error of JAX's own float32 attention (+ the rule's floor)
    ref = reference.attention(*(np.asarray(a) for a in (q, k, v)), causal=causal)
    assert_attention_close(np.asarray(got)[:, sees], ref[:, sees], np.asarray(want)[:, sees])
    assert not np.asarray(got)[:, ~sees].any()  # a row that sees no key is 0 in cuflash (JAX averages v there)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_forward_and_gradients_against_the_float64_reference(callback, dtype):
    """The 2x/3x same-dtype rule of cuflash.testing on out and the gradients, through jit(vjp(cuflash.jax.attention)).
    The adapter returns out alone (its lse stays a residual of the vjp), so no lse of it is checked here."""
    np_dtype = np.dtype(jnp.dtype(dtype))
    q, k, v = _arrays((2, 37, 4, 32), (2, 29, 2, 32), np_dtype, seed=1)
    dout = np.random.default_rng(2).standard_normal(q.shape).astype(np_dtype)
    case = Case(q, k, v, dout, {"causal": True, "window": (9, None)})

    @jax.jit
    def run(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: cj.attention(q, k, v, causal=True, window=(9, None)), q, k, v)
        return out, vjp(dout)

    out, grads = run(*(jnp.asarray(a) for a in (q, k, v, dout)))
    out = np.asarray(out)
    opts = case.options
    ref = reference.attention(q, k, v, compute_dtype=reference_dtype(np_dtype), **opts)
    base = reference.attention(q, k, v, compute_dtype=np_dtype, **opts)
    assert_attention_close(out, ref, base, name="out", magnitude=reference.term_magnitudes(q, k, v, **opts)["out"])
    # the gradients' fn ignores out and lse (the vjp holds its own): no lse to hand it
    check_backward(lambda *a, **o: tuple(np.asarray(g) for g in grads), case, out, None)


def test_gradients_match_jax_autodiff_of_dot_product_attention(callback):
    q, k, v = (jnp.asarray(a) for a in _arrays((2, 24, 4, 16), (2, 24, 2, 16), seed=3))
    w = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape).astype(np.float32))

    def loss(fn):  # linear in the output, so that dout = w exactly for both and for the float64 reference
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    ours = jax.jit(jax.grad(loss(lambda q, k, v: cj.attention(q, k, v, causal=True)), argnums=(0, 1, 2)))(q, k, v)
    theirs = jax.grad(loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
                      argnums=(0, 1, 2))(q, k, v)
    refs = reference.attention_backward(*(np.asarray(a) for a in (w, q, k, v)), causal=True)
    # at most 3x the error of JAX's own float32 autodiff against the float64 gradients (+ the rule's floor)
    for a, b, r, name in zip(ours, theirs, refs, ("dq", "dk", "dv")):
        assert a.shape == b.shape
        assert_attention_close(np.asarray(a), r, np.asarray(b), mult=3, name=name)


def test_gradients_match_finite_differences_in_float64():
    """Central differences of a scalar loss along random directions, in float64 (JAX's x64 mode, cuflash's
    float64 NumPy path): agreement to ~1e-9 relative, far below any wrong-gradient error."""
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(a) for a in _arrays((1, 13, 2, 8), (1, 19, 1, 8), np.float64, seed=5, dv=6))
        w = jnp.asarray(np.random.default_rng(6).standard_normal(q.shape[:-1] + (6,)))

        def loss(q, k, v):
            return jnp.sum(cj.attention(q, k, v, causal=True, window=(7, 2)) * w)

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        rng = np.random.default_rng(7)
        for i, x in enumerate((q, k, v)):
            direction = jnp.asarray(rng.standard_normal(x.shape))
            eps = 1e-5
            shifted = [list((q, k, v)), list((q, k, v))]
            shifted[0][i] = x + eps * direction
            shifted[1][i] = x - eps * direction
            numeric = (loss(*shifted[0]) - loss(*shifted[1])) / (2 * eps)
            analytic = jnp.sum(grads[i] * direction)
            assert abs(float(numeric - analytic)) <= 1e-7 * (1 + abs(float(analytic))), (i, numeric, analytic)


# ------------------------------------------------------------------------------------------------ vmap
def test_vmap_over_a_new_axis_and_of_the_gradient(callback):
    q, k, v = (jnp.asarray(a) for a in _arrays((3, 2, 21, 2, 8), (3, 2, 15, 2, 8), seed=8))
    fn = jax.jit(jax.vmap(lambda q, k, v: cj.attention(q, k, v, causal=True)))
    assert np.array_equal(np.asarray(fn(q, k, v)), cuflash.attention(*map(np.asarray, (q, k, v)), causal=True))
    # only q mapped: k, v are broadcast (no broadcasting inside cuflash itself)
    one = jax.vmap(lambda q: cj.attention(q, k[0], v[0]))(q)
    for i in range(3):
        assert np.array_equal(np.asarray(one[i]), cuflash.attention(*map(np.asarray, (q[i], k[0], v[0]))))
    grads = jax.vmap(jax.grad(lambda q, k, v: jnp.sum(cj.attention(q, k, v) ** 2), argnums=(0, 1, 2)))(q, k, v)
    for i in range(3):
        alone = jax.grad(lambda q, k, v: jnp.sum(cj.attention(q, k, v) ** 2), argnums=(0, 1, 2))(q[i], k[i], v[i])
        for g, h in zip(grads, alone):
            assert np.array_equal(np.asarray(g[i]), np.asarray(h))


def test_under_vmap_a_modifiers_b_counts_the_flattened_batch(callback):
    """As documented: the mapped axis joins the batch, so ``b`` is the flattened (mapped x own) index; the result
    is cuflash.attention's over that whole batch, not f per slice (it silently differed from f(x[i]) before the
    docstring said so)."""
    x = jnp.asarray(_arrays((3, 2, 6, 2, 4), (3, 2, 6, 2, 4), seed=5)[0])
    mask = "b == 0 or kv_idx <= q_idx"
    got = jax.vmap(lambda a: cj.attention(a, a, a, mask_mod=mask))(x)
    assert np.array_equal(np.asarray(got), cuflash.attention(*(np.asarray(x),) * 3, mask_mod=mask))


def test_under_vmap_dropout_and_per_batch_slopes_are_per_slice(callback):
    """The dropout mask and per-batch ALiBi slopes are keyed by the batch index: folded into one call, slice i drew
    another mask than f(x[i]) (error 2.56) and (B, H) slopes did not fit the folded batch (an error inside the
    callback). They run slice by slice now: vmap(f)(x)[i] == f(x[i]), forward and gradient."""
    x = jnp.asarray(_arrays((3, 2, 6, 2, 4), (3, 2, 6, 2, 4), seed=6)[0])
    slopes = np.array([[0.5, 0.25], [1.0, 2.0]], np.float32)  # (batch 2, heads 2)
    for options in (dict(dropout_p=0.5, seed=1), dict(alibi_slopes=slopes)):
        f = lambda a: cj.attention(a, a, a, **options)  # noqa: E731
        loss = lambda a: jnp.sum(f(a) ** 2)  # noqa: E731
        mapped, grads = jax.vmap(f)(x), jax.vmap(jax.grad(loss))(x)
        for i in range(3):
            assert np.array_equal(np.asarray(mapped[i]), np.asarray(f(x[i]))), options
            assert np.array_equal(np.asarray(grads[i]), np.asarray(jax.grad(loss)(x[i]))), options


def test_calls_outside_jit_reuse_their_functions_and_callbacks(callback):
    """JAX caches compiled callbacks by the callable's identity: a new one at every call outside jit compiled again
    each time (20 ms a call instead of 1) and kept every copy (1.4 MB a call). One configuration, one function and
    one callback per direction; an option or a host array of other values is another configuration."""
    q, k, v = (jnp.asarray(a) for a in _arrays((1, 16, 2, 8), (1, 16, 2, 8), seed=9))
    cj._Call._made.clear()
    for _ in range(3):
        cj.attention(q, k, v, causal=True)
        jax.grad(lambda q: jnp.sum(cj.attention(q, k, v, causal=True)))(q)
    (call,) = cj._Call._made.values()
    assert len(call._functions) == 1 and len(call._callbacks) == 2  # forward and backward
    cj.attention(q, k, v, causal=False)
    slopes = np.ones(2, np.float32)
    cj.attention(q, k, v, alibi_slopes=slopes)
    slopes[0] = 2.0  # changed in place: another configuration, not the first one's values
    changed = cj.attention(q, k, v, alibi_slopes=slopes)
    assert len(cj._Call._made) == 4
    assert np.array_equal(np.asarray(changed), cuflash.attention(*map(np.asarray, (q, k, v)), alibi_slopes=slopes))


def test_a_host_array_changed_after_a_call_does_not_reach_a_later_call_with_its_old_values(callback):
    """Configurations are kept by the values of their host arrays, and kept a reference to the caller's array: a later
    call with an equal array found that configuration, which computed with the first array as changed since."""
    q, k, v = (jnp.asarray(a) for a in _arrays((1, 16, 2, 8), (1, 16, 2, 8), seed=9))
    slopes, weights = np.array([0.5, 0.25], np.float32), np.linspace(-1, 1, 16).astype(np.float32)
    cases = [lambda a: dict(alibi_slopes=a, causal=True),
             lambda a: dict(score_mod="score + w[kv_idx]", mod_arrays={"w": a})]
    for options, values in zip(cases, (slopes, weights)):
        mine = values.copy()
        cj.attention(q, k, v, **options(mine))
        mine *= 8  # the caller's array, changed in place after the call
        got = cj.attention(q, k, v, **options(values.copy()))
        want = cuflash.attention(*map(np.asarray, (q, k, v)), **options(values))
        assert np.array_equal(np.asarray(got), want), options(values)


def test_a_torch_tensor_jax_cannot_take_is_refused_naming_it():
    """A tensor that requires grad gave torch's RuntimeError from inside jnp.asarray, naming no argument."""
    torch = pytest.importorskip("torch")
    q = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(TypeError, match="k cannot become a jax.Array"):
        cj.attention(q, torch.zeros(1, 4, 1, 8, requires_grad=True), q)


def test_a_lazily_negated_torch_tensor_is_refused_naming_it():
    torch = pytest.importorskip("torch")
    q = torch._neg_view(torch.from_numpy(_arrays((1, 4, 1, 8), (1, 4, 1, 8))[0]))
    assert q.is_neg()
    with pytest.raises(TypeError, match=r"q: this torch tensor is negated lazily .* pass q.resolve_neg\(\)"):
        cj.attention(q, q.resolve_neg(), q.resolve_neg())


# ------------------------------------------------------------------------------------------------ options
def test_layout_dv_seqlens_and_dropout_match_the_numpy_call(callback):
    """Options go through unchanged: each result equals cuflash.attention's on the same NumPy arrays, bitwise."""
    q, k, v = _arrays((2, 11, 2, 16), (2, 14, 1, 16), seed=9, dv=24)
    sq, sk = np.array([11, 5], np.int32), np.array([14, 3], np.int32)
    opts = dict(causal=True, dropout_p=0.3, seed=1234)
    got = jax.jit(lambda q, k, v, sq, sk: cj.attention(q, k, v, seqlens_q=sq, seqlens_k=sk, **opts))(
        *(jnp.asarray(a) for a in (q, k, v, sq, sk)))
    assert np.array_equal(np.asarray(got), cuflash.attention(q, k, v, seqlens_q=sq, seqlens_k=sk, **opts))
    qt, kt, vt = (np.swapaxes(a, 1, 2) for a in (q, k, v))  # (B, H, S, D)
    got = jax.jit(lambda q, k, v: cj.attention(q, k, v, layout="bhsd", **opts))(*(jnp.asarray(a) for a in (qt, kt, vt)))
    assert got.shape == (2, 2, 11, 24)
    assert np.array_equal(np.asarray(got), cuflash.attention(qt, kt, vt, layout="bhsd", **opts))
    dout = np.ones((2, 11, 2, 24), np.float32)
    grads = jax.grad(lambda q, k, v: jnp.sum(cj.attention(q, k, v, **opts)), argnums=(0, 1, 2))(
        *(jnp.asarray(a) for a in (q, k, v)))
    out, residual = cuflash.attention(q, k, v, return_residual=True, **opts)
    for g, h in zip(grads, cuflash.attention_backward(dout, residual)):
        assert np.array_equal(np.asarray(g), h)


@pytest.mark.emulate
def test_bias_is_traced_and_differentiated():
    """bias may be a traced, differentiated argument: its gradient is cuflash's dbias (here on the emulated
    CUDA kernels, the backends that compute modifiers today), under jit and under vmap of an unbatched bias."""
    from cuflash import emulate

    ok, why = emulate.available()
    if not ok:
        pytest.skip(f"CPU emulation unavailable: {why}")
    q, k, v = _arrays((2, 17, 2, 16), (2, 17, 2, 16), np.float16, seed=10)
    dout = np.random.default_rng(11).standard_normal(q.shape).astype(np.float16)
    bias = np.random.default_rng(12).standard_normal((2, 17, 17)).astype(np.float32)  # (heads, Sq, Sk)

    def loss(bias, q):
        out = cj.attention(q, k, v, bias=bias, backend="emulate")
        return jnp.sum(out.astype(jnp.float32) * dout.astype(np.float32))

    dbias = jax.jit(jax.grad(loss))(jnp.asarray(bias), jnp.asarray(q))
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    want = reference.attention_backward(dout, q, k, v, bias=bias, return_dbias=True)[3]
    base = reference.attention_backward(dout, q, k, v, bias=bias, return_dbias=True, compute_dtype=np.float16)[3]
    from cuflash.testing import assert_attention_close

    # (the floor at the default magnitude, max |dbias|: reference.term_magnitudes fails on a bias-only modifier,
    # an IndexError in cuflash/reference.py reported to its owner)
    assert_attention_close(np.asarray(dbias), want, base, mult=3, name="dbias")
    stacked = jnp.stack([jnp.asarray(q)] * 3)
    per = jax.vmap(jax.grad(loss), in_axes=(None, 0))(jnp.asarray(bias), stacked)
    assert per.shape == (3,) + bias.shape
    assert all(np.array_equal(np.asarray(per[i]), np.asarray(dbias)) for i in range(3))


# ------------------------------------------------------------------------------------------------ errors
def test_errors_are_raised_when_tracing_with_cuflash_messages():
    q, k, v = (jnp.asarray(a) for a in _arrays((1, 8, 2, 8), (1, 9, 2, 8)))
    fn = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=True))
    with pytest.raises(ValueError, match=r"heads of q \(3\) must be a multiple of heads of k/v \(2\)"):
        fn(jnp.concatenate([q, q[:, :, :1]], axis=2), k, v)
    with pytest.raises(ValueError, match="window"):
        cj.attention(q, k, v, window=(-1, 0))
    with pytest.raises(ValueError, match="explicit seed"):
        cj.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="alibi_slopes must be a concrete array"):
        jax.jit(lambda s: cj.attention(q, k, v, alibi_slopes=s))(jnp.ones(2))
    with pytest.raises(TypeError, match="q must be a jax.Array"):
        cj.attention(q.tolist(), k, v)
    with pytest.raises(ValueError, match="layout must be"):
        cj.attention(q, k, v, layout="sbhd")


@pytest.mark.parametrize("name,value", [("causal", True), ("scale", 0.5), ("softcap", 30.0), ("dropout_p", 0.1),
                                        ("seed", 3), ("window", (4, 0)), ("deterministic", True)])
def test_a_traced_static_option_is_refused_saying_it_must_be_static(name, value):
    """A traced causal was "causal must be a bool, got DynamicJaxprTracer": the option's name, not what to do."""
    q, k, v = (jnp.asarray(a) for a in _arrays((1, 8, 2, 8), (1, 8, 2, 8)))
    extra = dict(seed=1) if name == "dropout_p" else {}

    def call(x):
        given = (x, 0) if name == "window" else x
        return cj.attention(q, k, v, **{name: given}, **extra)

    traced = jnp.asarray(value[0] if name == "window" else value)
    with pytest.raises(TypeError, match=rf"^{name} must be static, a Python value fixed when the function is traced, "
                                        r"got a traced value: pass it through jax.jit's static_argnames"):
        jax.jit(call)(traced)


def _numpy_error(q, k, v, **options):
    """The error cuflash.attention raises for these options on the same arrays as NumPy arrays."""
    with pytest.raises(Exception) as info:
        cuflash.attention(*(np.asarray(a) for a in (q, k, v)), **options)
    return info.value


@pytest.mark.parametrize("options,x64", [
    (dict(backend="bogus"), False), (dict(backend=3), False), (dict(backend="cuda"), False),
    (dict(seqlens_q=np.array([7, 3], np.int32)), False), (dict(seqlens_k=np.array([-1, 3], np.int32)), False),
    (dict(seqlens_q=np.array([2 ** 40, 3])), True)])
def test_backend_and_concrete_seqlens_are_checked_when_tracing(callback, monkeypatch, options, x64):
    """backend and the values of seqlens were checked only inside the callback: a JaxRuntimeError 'INTERNAL: ...'
    with a traceback in its message, where the docstring promises trace-time errors. Now it is cuflash.attention's
    own error (same type, same message), eagerly and under jit, raised before any callback runs."""
    if options.get("backend") == "cuda" and cuflash.backends.status()["cuda"][0]:
        pytest.skip("the cuda backend is available here")
    with jax.enable_x64(x64):  # 2**40 passes JAX's cast to int32 only with x64 (without, a TypeError says so)
        q, k, v = (jnp.asarray(a) for a in _arrays((2, 6, 2, 8), (2, 6, 2, 8)))
        want = _numpy_error(q, k, v, **options)

        def no_callback(*args, **kwargs):
            raise AssertionError("the callback ran: the error was not raised when tracing")

        monkeypatch.setattr(cj.api, "attention", no_callback)
        for run in (lambda: cj.attention(q, k, v, **options),
                    lambda: jax.jit(lambda q: cj.attention(q, k, v, **options))(q)):
            with pytest.raises(type(want)) as got:
                run()
            assert str(got.value) == str(want)


def test_on_a_gpu_the_backend_name_is_checked_but_numpy_stand_ins_do_not_refuse_cuda(monkeypatch):
    """Where the callback gets CuPy arrays, the trace-time stand-ins (NumPy) cannot judge what a backend takes:
    the name and availability are checked, and an available 'cuda' is not refused for the stand-ins' NumPy."""
    monkeypatch.setattr(cj, "_host_arrays", lambda: False)
    q = jnp.zeros((1, 4, 1, 8), jnp.float32)
    trace = lambda backend: jax.eval_shape(lambda q: cj.attention(q, q, q, backend=backend), q)  # noqa: E731
    with pytest.raises(TypeError, match="backend must be a string"):
        trace(3)
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        trace("bogus")
    real_get = cuflash.backends.get
    monkeypatch.setattr(cuflash.backends, "get", lambda name: real_get("numpy") if name == "cuda" else real_get(name))
    assert trace("cuda").shape == q.shape


def test_the_backends_head_dim_limit_counts_the_padded_head_dim(monkeypatch):
    """v's head dim larger than q's: at run time q and k are padded to it, which the backend's MAX_HEAD_DIM judges;
    the trace-time stand-ins are padded alike (not v cut to q's), so the limit is reported when tracing. (Where JAX
    has a GPU, a traced q may run there, and the stand-ins judge the backend's name only: the callback's host
    arrays are assumed, as on a CPU-only JAX.)"""
    from cuflash.backends import emulate

    monkeypatch.setattr(cj, "_host_arrays", lambda: True)

    if not emulate.available()[0]:
        pytest.skip("CPU emulation unavailable")
    q, k, v = (jnp.asarray(a) for a in _arrays((1, 4, 1, 8), (1, 4, 1, 8), np.float16, dv=emulate.MAX_HEAD_DIM + 8))
    want = _numpy_error(q, k, v, backend="emulate")
    with pytest.raises(ValueError, match="head_dim must be at most") as got:
        jax.eval_shape(lambda q, k, v: cj.attention(q, k, v, backend="emulate"), q, k, v)
    assert str(got.value) == str(want)


# ------------------------------------------------------------------------------------------------ the GPU branch
class _Buffer:
    """What XLA hands a buffer_callback on a GPU: DLPack device (kDLCUDA, id), over fake device memory."""

    def __init__(self, arr):
        self.arr = arr
        self.streams = []

    def __dlpack_device__(self):
        return 2, self.arr.device.id

    def __dlpack__(self, *, stream=None, **kwargs):
        self.streams.append(stream)
        return self.arr


def test_gpu_buffers_become_cupy_arrays_on_xlas_device_and_stream(monkeypatch):
    """On a GPU the callback reads XLA's buffers as CuPy arrays without copies, under the buffers' device, with
    XLA's stream current (so cuflash's kernels are ordered with XLA's work), through the CUDA stream protocol."""
    cp = fake_cupy.install(monkeypatch, fake_cupy.make([fake_cupy.H100, fake_cupy.A100]))
    made = []

    def from_external(obj):
        version, ptr = obj.__cuda_stream__()
        stream = cp.cuda.Stream()
        stream.ptr = ptr
        made.append((version, ptr))
        return stream

    monkeypatch.setattr(cp.cuda.Stream, "from_external", staticmethod(from_external), raising=False)

    def from_dlpack(x, **kwargs):
        assert cp.cuda.Device().id == x.__dlpack_device__()[1]
        return x.__dlpack__(stream=cp.cuda.get_current_stream().ptr)

    cp.from_dlpack = from_dlpack
    with cp.cuda.Device(1):
        buffers = [_Buffer(cp.zeros((2, 3), np.float16)) for _ in range(3)]
    ctx = type("Ctx", (), {"stream": 0xABC})()
    with cj._device_arrays(ctx, buffers) as arrays:
        assert [a is b.arr for a, b in zip(arrays, buffers)] == [True] * 3
        assert cp.cuda.Device().id == 1 and cp.cuda.get_current_stream().ptr == 0xABC
    assert made == [(0, 0xABC)] and all(b.streams == [0xABC] for b in buffers)
    assert cp.cuda.Device().id == 0


def test_docstring_documents_every_parameter():
    import inspect
    import re

    doc = cj.attention.__doc__
    params = doc.split("Parameters")[1].split("Returns")[0]
    documented = {n.strip() for line in params.splitlines() if (m := re.match(r"^ {4}([A-Za-z_][\w, ]*) :", line))
                  for n in m.group(1).split(",")}
    assert set(inspect.signature(cj.attention).parameters) <= documented


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="the cast this guards against happens only without x64")
def test_what_jax_would_cast_or_drop_is_refused():
    """Without x64 JAX turns int64 into int32 and float64 into float32: seqlens 2**32 + 3 became 3, a float64 q
    ran in float32. Integers whose values survive pass; masked and non-array options are refused as by
    cuflash.attention."""
    q, k, v = (jnp.asarray(x) for x in _arrays((2, 6, 2, 8), (2, 6, 2, 8)))
    with pytest.raises(TypeError, match="seqlens_q has dtype int64, which JAX would turn into int32"):
        cj.attention(q, k, v, seqlens_q=np.array([2 ** 32 + 3, 6], np.int64))
    with pytest.raises(TypeError, match="q has dtype float64, which JAX would turn into float32"):
        cj.attention(np.asarray(q, np.float64), k, v)
    fine = cj.attention(q, k, v, seqlens_q=np.array([3, 6], np.int64))  # int64 values that fit: accepted
    np.testing.assert_array_equal(np.asarray(fine), np.asarray(cj.attention(q, k, v, seqlens_q=np.array(
        [3, 6], np.int32))))
    with pytest.raises(TypeError, match="alibi_slopes is a numpy.ma.MaskedArray"):
        cj.attention(q, k, v, alibi_slopes=np.ma.masked_array(np.array([0.1, 0.2], np.float32), mask=[1, 0]))
    with pytest.raises(TypeError, match="alibi_slopes must be an array"):
        cj.attention(q, k, v, alibi_slopes=[0.1, 0.2])


def test_grad_of_grad_says_first_derivatives_only():
    """The gradient's forward and backward are host callbacks: grad of grad ended in JAX's "callbacks do not support
    JVP. Please use jax.custom_jvp", advice a user of cuflash cannot act on."""
    q = jnp.ones((1, 8, 2, 8))

    def loss(q):
        return jnp.sum(cj.attention(q, q, q, causal=True) ** 2)

    assert jnp.isfinite(jax.grad(loss)(q)).all()  # first order as before
    for second in (jax.grad(lambda q: jnp.sum(jax.grad(loss)(q))), jax.hessian(loss)):
        with pytest.raises(NotImplementedError, match="cuflash.jax gives first derivatives only"):
            second(q)


def test_a_deleted_jax_array_is_named():
    """A deleted JAX array (donated, or delete()d) reached cuflash.attention as "q: object of type 'NoneType' has no
    len()", from JAX's own DLPack device query."""
    q = jnp.ones((1, 8, 2, 8))
    k = jnp.ones((1, 8, 2, 8))
    q.delete()
    with pytest.raises(ValueError, match="q: this jaxlib array has been deleted"):
        cuflash.attention(q, k, k)


def test_cuflash_jax_names_a_deleted_array_and_a_non_native_byte_order():
    """cuflash.jax passed a deleted array on to JAX, whose RuntimeError named no argument, and refused a big-endian
    NumPy array with "pass a jax.Array or a plain NumPy array" (it was one); jit-traced arrays still pass."""
    q = jnp.ones((1, 8, 2, 8))
    k = jnp.ones((1, 8, 2, 8))
    gone = jnp.ones((1, 8, 2, 8))
    gone.delete()
    with pytest.raises(ValueError, match=r"v: this jax(lib)? array has been deleted"):
        cuflash.jax.attention(q, k, gone)
    big = np.ones((1, 8, 2, 8), ">f4")
    with pytest.raises(TypeError, match=r"q is a NumPy array of non-native byte order \(>f4\), which JAX does not "
                                        r"take: pass q.astype\(q.dtype.newbyteorder\('='\)\)"):
        cuflash.jax.attention(big, k, k)
    np.testing.assert_array_equal(np.asarray(jax.jit(cuflash.jax.attention)(q, k, k)),
                                  np.asarray(cuflash.jax.attention(q, k, k)))


def test_cuflash_attention_under_jit_points_to_cuflash_jax():
    """cuflash.attention inside jax.jit meets tracers, not arrays: the TypeError named the tracer's type only."""
    q = jnp.ones((1, 8, 2, 8))
    with pytest.raises(TypeError, match="got DynamicJaxprTracer; under jax.jit, jax.grad or jax.vmap use "
                                        "cuflash.jax.attention"):
        jax.jit(lambda q: cuflash.attention(q, q, q))(q)


@pytest.mark.parametrize("values", [(16777217, 16777217.0), (0.0, -0.0)])
def test_a_number_equal_to_an_earlier_calls_is_not_taken_for_it(values):
    """Static options are cached by configuration; a mod_arrays number was keyed by Python equality, so 16777217.0
    after 16777217 (an int32 in the expression, a float rounded to float32 there) or -0.0 after 0.0 (1 / c) reused
    the earlier configuration and computed with the earlier number. Keyed by type and exact value now."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 1, 4)).astype(np.float32) for _ in range(3))
    expr = "score + (c - 16777216) * kv_idx" if values[0] else "where(1.0 / c > 0.0, score, score - 2.0 * kv_idx)"
    for c in values:
        want = cuflash.attention(q, k, v, score_mod=expr, mod_arrays={"c": c})
        got = cj.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), score_mod=expr, mod_arrays={"c": c})
        np.testing.assert_array_equal(np.asarray(got), want)
