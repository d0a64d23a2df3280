"""Every bad input is rejected before any computation, with an error naming the argument."""
from __future__ import annotations

import math

import numpy as np
import pytest

import cuflash
from cuflash import BlockMask
from cuflash.backends import numpy as nb

B, SQ, SK, H, HKV, D = 2, 9, 11, 4, 2, 8


@pytest.fixture(autouse=True)
def no_computation(monkeypatch):
    """Reaching a backend at all means validation came too late."""
    def fail(*args, **kwargs):
        raise AssertionError("a backend was called: validation must happen before any computation")

    monkeypatch.setattr(nb, "forward", fail)
    monkeypatch.setattr(nb, "backward", fail)


def arrays(dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, SQ, H, D)).astype(dtype)
    k = rng.standard_normal((B, SK, HKV, D)).astype(dtype)
    v = rng.standard_normal((B, SK, HKV, D)).astype(dtype)
    return q, k, v


class FakeCupyArray:
    """Looks like a CuPy array to the module check (used only to test the mixture error)."""

    __module__ = "cupy._core.core"
    __cuda_array_interface__ = {}
    shape, ndim, dtype = (B, SK, HKV, D), 4, np.dtype(np.float32)


def _replace(**changes):
    q, k, v = arrays()
    args = dict(q=q, k=k, v=v)
    args.update(changes)
    return args


q0, k0, v0 = arrays()
grid_ok = np.ones((1, 1, math.ceil(SQ / 4), math.ceil(SK / 4)), dtype=bool)

# (id, keyword changes to q/k/v and options, exception types, regex naming the argument)
FORWARD_CASES = [
    ("q-ndim", dict(q=q0[0, :, 0]), ValueError, r"\bq\b"),
    ("k-ndim", dict(k=k0[0, :, 0]), ValueError, r"\bk\b"),
    ("v-ndim", dict(v=v0[0, 0]), ValueError, r"\bv\b"),
    ("ndim-differ", dict(q=q0[None]), ValueError, r"q, k, v"),
    ("batch-dims", dict(k=k0[:1], v=v0[:1]), ValueError, r"batch"),
    ("kv-seqlen", dict(v=v0[:, :-1]), ValueError, r"k and v"),
    ("kv-heads", dict(v=v0[:, :, :1]), ValueError, r"k and v"),
    ("head-dim", dict(k=k0[..., :-1], v=v0[..., :-1]), ValueError, r"head_dim"),
    ("head-dim-0", dict(q=q0[..., :0], k=k0[..., :0], v=v0[..., :0]), ValueError, r"head_dim"),
    ("heads-multiple", dict(q=q0[:, :, :3]), ValueError, r"heads"),
    ("mixed-dtypes", dict(k=k0.astype(np.float64)), TypeError, r"dtype"),
    ("mixed-f16", dict(v=v0.astype(np.float16)), TypeError, r"dtype"),
    ("int-dtype", dict(q=q0.astype(np.int32), k=k0.astype(np.int32), v=v0.astype(np.int32)), TypeError,
     r"floating"),
    ("bool-dtype", dict(q=q0 > 0, k=k0 > 0, v=v0 > 0), TypeError, r"floating"),
    ("complex-dtype", dict(q=q0.astype(np.complex64), k=k0.astype(np.complex64), v=v0.astype(np.complex64)),
     TypeError, r"floating"),
    ("q-list", dict(q=q0.tolist()), TypeError, r"\bq\b"),
    ("v-scalar", dict(v=1.0), TypeError, r"\bv\b"),
    ("k-none", dict(k=None), TypeError, r"\bk\b"),
    ("mixed-numpy-cupy", dict(k=FakeCupyArray()), TypeError, r"k is cupy"),
    ("scale-nan", dict(scale=float("nan")), ValueError, r"scale"),
    ("scale-inf", dict(scale=np.inf), ValueError, r"scale"),
    ("scale-neg-inf", dict(scale=np.float32(-np.inf)), ValueError, r"scale"),
    ("scale-past-float32", dict(scale=1e39), ValueError, r"scale must be .* finite in float32 \(the working "
                                                         r"precision of float32 inputs\), got 1e\+39"),
    ("scale-huge-int", dict(scale=10**400), ValueError, r"scale must be .* finite in float32 .*, got 1000"),
    ("softcap-past-float32", dict(softcap=1e39), ValueError, r"softcap must be a real > 0 or None and finite in "
                                                             r"float32"),
    ("dropout-huge-int", dict(dropout_p=10**400), ValueError, r"dropout_p must (lie in \[0, 1 - 2\*\*-32\]|be a float in \[0, 1\)), got 10+"),
    ("scale-bool", dict(scale=True), TypeError, r"scale"),
    ("scale-str", dict(scale="0.1"), TypeError, r"scale"),
    ("scale-complex", dict(scale=1j), TypeError, r"scale"),
    ("scale-array", dict(scale=np.array([0.5])), TypeError, r"scale"),
    ("causal-str", dict(causal="yes"), TypeError, r"causal"),
    ("window-neg-left", dict(window=(-1, 0)), ValueError, r"window"),
    ("window-neg-right", dict(window=(None, -2)), ValueError, r"window"),
    ("window-arity-1", dict(window=(3,)), ValueError, r"window"),
    ("window-arity-3", dict(window=(1, 2, 3)), ValueError, r"window"),
    ("window-int", dict(window=4), TypeError, r"window must be a pair"),
    ("window-float", dict(window=(1.5, 0)), TypeError, r"window"),
    ("window-bool", dict(window=(True, 0)), TypeError, r"window"),
    ("seqlens_q-too-long", dict(seqlens_q=np.array([SQ + 1, 1])), ValueError, r"seqlens_q"),
    ("seqlens_k-too-long", dict(seqlens_k=np.array([1, SK + 1])), ValueError, r"seqlens_k"),
    ("seqlens_q-negative", dict(seqlens_q=np.array([-1, 1])), ValueError, r"seqlens_q"),
    ("seqlens_k-shape", dict(seqlens_k=np.array([1, 2, 3])), ValueError, r"seqlens_k"),
    ("seqlens_q-2d", dict(seqlens_q=np.array([[1, 2]])), ValueError, r"seqlens_q"),
    ("seqlens_q-float", dict(seqlens_q=np.array([1.0, 2.0])), TypeError, r"seqlens_q"),
    ("seqlens_k-bool", dict(seqlens_k=np.array([True, False])), TypeError, r"seqlens_k"),
    ("seqlens_k-list", dict(seqlens_k=[3, 4]), TypeError, r"seqlens_k"),
    ("block_mask-array", dict(block_mask=grid_ok), TypeError, r"block_mask"),
    ("block_mask-q-blocks", dict(block_mask=BlockMask(grid_ok[:, :, :-1], block=(4, 4))), ValueError,
     r"block_mask"),
    ("block_mask-k-blocks", dict(block_mask=BlockMask(np.ones((1, 1, 3, 4), bool), block=(4, 4))), ValueError,
     r"block_mask"),
    ("block_mask-block-size", dict(block_mask=BlockMask(grid_ok, block=(8, 8))), ValueError, r"block_mask"),
    ("block_mask-lengths", dict(block_mask=BlockMask(grid_ok, block=(4, 4))), ValueError,
     r"block_mask was built for seqlen_q=12, seqlen_k=12"),
    ("block_mask-batch", dict(block_mask=BlockMask(np.ones((3, 1, 3, 3), bool), block=(4, 4), seqlen_q=SQ,
                                                   seqlen_k=SK)), ValueError, r"block_mask grid leading dims"),
    ("block_mask-heads", dict(block_mask=BlockMask(np.ones((1, 2, 3, 3), bool), block=(4, 4), seqlen_q=SQ,
                                                   seqlen_k=SK)), ValueError, r"block_mask grid leading dims"),
    ("backend-unknown", dict(backend="tpu"), ValueError, r"backend 'tpu'.*'numpy'"),
    ("backend-type", dict(backend=1), TypeError, r"backend"),
    ("backend-cuda-numpy", dict(backend="cuda"), (TypeError, RuntimeError), r"cuda.*numpy|numpy.*cuda"),
]


# every entry point with every case, but the reference with none of the backend cases (it takes no backend)
@pytest.mark.parametrize("entry, changes, exc, match", [
    pytest.param(entry, *c[1:], id=f"{entry}-{c[0]}")
    for entry in ("attention", "attention_backward", "attention_vjp", "reference") for c in FORWARD_CASES
    if not (entry == "reference" and "backend" in c[1])])
def test_bad_forward_arguments(entry, changes, exc, match):
    args = _replace(**{n: changes[n] for n in ("q", "k", "v") if n in changes})
    options = {n: x for n, x in changes.items() if n not in ("q", "k", "v")}
    q, k, v = args["q"], args["k"], args["v"]
    if entry == "reference":
        call = lambda: cuflash.reference.attention(q, k, v, **options)  # noqa: E731
    elif entry == "attention":
        call = lambda: cuflash.attention(q, k, v, **options)  # noqa: E731
    elif entry == "attention_vjp":
        call = lambda: cuflash.attention_vjp(q, k, v, **options)  # noqa: E731
    else:
        qq, kk, vv = arrays()
        lse = np.zeros((B, H, SQ), np.float32)
        call = lambda: cuflash.attention_backward(qq, q, k, v, qq, lse, **options)  # noqa: E731
    with pytest.raises(exc, match=match):
        call()


OPTION_CASES = [
    ("dropout_p-one", dict(dropout_p=1.0, seed=1), ValueError, r"dropout_p"),
    ("dropout_p-negative", dict(dropout_p=-0.1, seed=1), ValueError, r"dropout_p"),
    ("dropout_p-bool", dict(dropout_p=True, seed=1), TypeError, r"dropout_p"),
    ("dropout_p-str", dict(dropout_p="0.1", seed=1), TypeError, r"dropout_p"),
    ("seed-negative", dict(dropout_p=0.1, seed=-1), ValueError, r"seed"),
    ("seed-too-big", dict(dropout_p=0.1, seed=2**64), ValueError, r"seed"),
    ("seed-float", dict(dropout_p=0.1, seed=1.5), TypeError, r"seed must be an int in \[0, 2\*\*64\) or None, got "
     r"float"),
    ("seed-str", dict(dropout_p=0.1, seed="5"), TypeError, r"seed must be an int .* got str"),
    ("seed-bool", dict(dropout_p=0.1, seed=np.True_), TypeError, r"seed must be an int .* got bool"),
    ("dtype-name", dict(dtype="float16"), ValueError, r"dtype"),
    ("dtype-bf16-over-float32", dict(dtype="bfloat16"), TypeError, r"dtype='bfloat16'"),
]


@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in OPTION_CASES], ids=[c[0] for c in OPTION_CASES])
@pytest.mark.parametrize("entry", ["attention", "attention_backward", "attention_vjp"])
def test_bad_options(entry, changes, exc, match):
    q, k, v = arrays()
    if entry == "attention":
        call = lambda: cuflash.attention(q, k, v, **changes)  # noqa: E731
    elif entry == "attention_vjp":
        call = lambda: cuflash.attention_vjp(q, k, v, **changes)  # noqa: E731
    else:
        call = lambda: cuflash.attention_backward(q, q, k, v, q, np.zeros((B, H, SQ), np.float32),  # noqa: E731
                                                  **changes)
    with pytest.raises(exc, match=match):
        call()


def test_backward_dropout_needs_the_seed():
    q, k, v = arrays()
    with pytest.raises(ValueError, match="seed"):
        cuflash.attention_backward(q, q, k, v, q, np.zeros((B, H, SQ), np.float32), dropout_p=0.1)


def test_backward_deterministic_must_be_bool():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="deterministic"):
        cuflash.attention_backward(q, q, k, v, q, np.zeros((B, H, SQ), np.float32), deterministic="yes")


def test_valid_arguments_reach_the_backend():
    """The fixture really intercepts computation (so the tests above can fail)."""
    q, k, v = arrays()
    with pytest.raises(AssertionError, match="backend was called"):
        cuflash.attention(q, k, v, causal=True, window=(3, None), scale=np.float32(0.3),
                          seqlens_q=np.array([SQ, 0], dtype=np.uint8), seqlens_k=np.array([0, SK]),
                          block_mask=BlockMask(grid_ok, block=(4, 4), seqlen_q=SQ, seqlen_k=SK))


# ----------------------------------------------------------------------------- backward
def _backward_args():
    q, k, v = arrays()
    return dict(dout=q.copy(), q=q, k=k, v=v, out=q.copy(), lse=np.zeros((B, H, SQ), np.float32))


BACKWARD_CASES = [
    ("dout-shape", dict(dout=q0[:, :-1]), ValueError, r"\bdout\b"),
    ("dout-heads", dict(dout=q0[:, :, :2]), ValueError, r"\bdout\b"),
    ("dout-dtype", dict(dout=q0.astype(np.float64)), TypeError, r"\bdout\b"),
    ("dout-list", dict(dout=q0.tolist()), TypeError, r"\bdout\b"),
    ("out-shape", dict(out=q0[..., :-1]), ValueError, r"\bout\b"),
    ("out-dtype", dict(out=q0.astype(np.float16)), TypeError, r"\bout\b"),
    ("out-none", dict(out=None), TypeError, r"\bout\b"),
    ("lse-shape-layout", dict(lse=np.zeros((B, SQ, H), np.float32)), ValueError, r"\blse\b"),
    ("lse-shape-missing-batch", dict(lse=np.zeros((H, SQ), np.float32)), ValueError, r"\blse\b"),
    ("lse-int", dict(lse=np.zeros((B, H, SQ), np.int32)), TypeError, r"\blse\b"),
    ("lse-list", dict(lse=np.zeros((B, H, SQ)).tolist()), TypeError, r"\blse\b"),
    ("mixed-numpy-cupy", dict(lse=FakeCupyArray()), TypeError, r"lse is cupy"),
]


@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in BACKWARD_CASES], ids=[c[0] for c in BACKWARD_CASES])
def test_bad_backward_arguments(changes, exc, match):
    args = _backward_args()
    args.update(changes)
    with pytest.raises(exc, match=match):
        cuflash.attention_backward(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"])


@pytest.mark.parametrize("dtype, lse_dtype", [(np.float32, np.float16), (np.float64, np.float32),
                                              (np.float16, np.float16)])
def test_backward_lse_must_have_the_statistics_dtype(dtype, lse_dtype):
    q, k, v = arrays(dtype)
    with pytest.raises(TypeError, match=r"\blse\b"):
        cuflash.attention_backward(q, q, k, v, q, np.zeros((B, H, SQ), lse_dtype))


def test_backward_with_no_batch_dims_checks_lse():
    q, k, v = (x[0] for x in arrays())
    with pytest.raises(ValueError, match=r"\blse\b"):
        cuflash.attention_backward(q, q, k, v, q, np.zeros((1, H, SQ), np.float32))


def test_seqlens_without_batch_dims_must_be_0d():
    q, k, v = (x[0] for x in arrays())
    with pytest.raises(ValueError, match="seqlens_q"):
        cuflash.attention(q, k, v, seqlens_q=np.array([3]))
    with pytest.raises(AssertionError, match="backend was called"):  # a 0-d array is the right shape
        cuflash.attention(q, k, v, seqlens_q=np.array(3))


def test_vjp_rejects_return_lse():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="return_lse"):
        cuflash.attention_vjp(q, k, v, return_lse=True)


def test_unknown_option_is_a_type_error():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="windw"):
        cuflash.attention(q, k, v, windw=(1, 1))
    with pytest.raises(TypeError):
        cuflash.attention(q, k, v, True)  # options are keyword-only


def test_unknown_backend_lists_available():
    q, k, v = arrays()
    with pytest.raises(ValueError) as info:
        cuflash.attention(q, k, v, backend="NumPy")
    for name in ("numpy", "cuda", "emulate"):
        assert repr(name) in str(info.value)


def test_a_scale_past_float32_is_refused_without_a_warning_naming_the_inputs_dtype():
    """The check compared 1e39 with an np.float32 (a RuntimeWarning, an error under -W error, before the ValueError),
    and named bfloat16 bits "uint16 inputs"."""
    import warnings

    q = np.zeros((1, 4, 1, 8), np.uint16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for option in ("scale", "softcap"):
            with pytest.raises(ValueError, match=rf"{option} must be .* finite in float32 \(the working precision of "
                                                 r"bfloat16 inputs\)"):
                cuflash.attention(q, q, q, dtype="bfloat16", **{option: 1e39})
