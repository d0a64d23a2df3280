"""The ``cuda`` backend with float32 and float64 CuPy arrays, without a GPU: CuPy replaced by tests/fake_cupy.py,
the kernels of kernels/flash_*_wide.cu run by the CPU emulator (as tests/test_cuda_backend_fake.py does for the
16-bit kernels).

``attention(q64, k64, v64)`` on CuPy arrays just works: forward, backward (both dQ modes), ``attention_vjp`` with
dropout and a modifier (softcap: a float64 scalar operand), the arithmetic picked by ``precision`` (float32) and by
the device (float64: DMMA on an H100/A100, DFMA on an RTX 4090, which has no float64 tensor cores), lse in float64
for float64, the float64 scalars in Params::wide, warmup of the wide families, each result held to its mode's rule
(tests/wide_support.py). (Array modifiers need cupy.broadcast_to, which the fake lacks: the emulated tests cover
them.)
"""
import numpy as np
import pytest

import cuflash
from cuflash.backends import cuda
from cuflash.cuda import params, specs

import fake_cupy
import wide_support as ws
from cases import make_case
from test_cuda_backend_fake import cp, make_fake, modules, on_device, pytestmark  # noqa: F401  (fixtures, marks)


def gpu_forward(cp, dtype):
    def fn(q, k, v, **options):
        out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True,
                                     **on_device(cp, options))
        assert isinstance(out, cp.ndarray) and isinstance(lse, cp.ndarray)
        assert out.dtype == dtype and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
        return out.get(), lse.get()

    return fn


def gpu_backward(cp, deterministic):
    def fn(dout, q, k, v, out, lse, **options):
        grads = cuflash.attention_backward(*(cp.asarray(a) for a in (dout, q, k, v, out, lse)),
                                           deterministic=deterministic, **on_device(cp, options))
        assert all(isinstance(g, cp.ndarray) and g.dtype == q.dtype for g in grads)
        return tuple(g.get() for g in grads)

    return fn


def _case(dtype, precision, **options):
    case = make_case(2, 75, 90, 4, 2, 59, dtype, causal=True, seqlens_q=np.array([75, 40], np.int32),
                     seqlens_k=np.array([90, 61], np.int32), **options)
    case.dout = case.dout.astype(dtype)
    case.options["precision"] = precision
    return case


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype,precision", [(np.float32, "ieee"), (np.float32, "3xtf32"), (np.float32, "tf32"),
                                             (np.float64, "ieee")])
def test_forward_and_backward_on_cupy_arrays(cp, dtype, precision, deterministic):
    case = _case(dtype, precision)
    out, lse = ws.check_forward(gpu_forward(cp, dtype), case, precision)
    ws.check_backward(gpu_backward(cp, deterministic), case, out, lse, precision)
    math = specs.wide_math(np.dtype(dtype).name, precision, 90)
    atom = specs.MATHS[math][1]
    kernels = [launch.name for launch in cp._launches]
    assert kernels[0].startswith(f"cuflash::flash_fwd_wide_kernel<{atom}, 64,")
    assert kernels[1] == specs.helper_names(np.dtype(dtype).name)[0]
    assert kernels[2].startswith(f"cuflash::flash_bwd_wide_kernel<{atom}, 64,")
    assert kernels[3].startswith(f"cuflash::flash_bwd_wide_dq_kernel<{atom}, 64,") if deterministic else \
        kernels[3] == specs.helper_names(np.dtype(dtype).name)[1]


def test_float64_just_works_and_carries_float64_scalars(cp):
    """attention(q64, k64, v64) with no option: float64 out and lse, DMMA on an H100, the scale in Params::wide."""
    rng = np.random.default_rng(0)
    q, k, v = (cp.asarray(rng.standard_normal((2, 40, 3, 48))) for _ in range(3))
    out, lse = cuflash.attention(q, k, v, return_lse=True, scale=1 / 3)
    assert out.dtype == lse.dtype == np.float64
    launch = cp._launches[-1]
    assert "F64Dmma" in launch.name
    struct = next(a for a in launch.args if isinstance(a, np.ndarray) and a.dtype == params.PARAMS)
    assert struct["wide"]["scale"][0] == 1 / 3 and struct["wide"]["rescale"][0] == 1.0  # not rounded to float32
    ref = cuflash.reference.attention(q.get(), k.get(), v.get(), scale=1 / 3, compute_dtype=np.longdouble)
    base = cuflash.reference.attention(q.get(), k.get(), v.get(), scale=1 / 3)
    ws.close(out, ref, base, mult=2, eps=2.0 ** -52, magnitude=float(np.abs(ref).max()), name="out",
             mode=("float64", "ieee"))


def test_float64_runs_dfma_where_the_gpu_has_no_float64_tensor_cores(make_fake):
    cp = make_fake([fake_cupy.RTX_4090])
    case = _case(np.float64, "ieee")
    out, lse = ws.check_forward(gpu_forward(cp, np.float64), case)
    ws.check_backward(gpu_backward(cp, False), case, out, lse)
    assert all("F64Fma" in launch.name for launch in cp._launches if "wide_kernel" in launch.name)


def test_vjp_with_dropout_and_softcap_in_float64(cp):
    rng = np.random.default_rng(1)
    q, k, v, do = (cp.asarray(rng.standard_normal((1, 50, 2, 32))) for _ in range(4))
    out, vjp = cuflash.attention_vjp(q, k, v, causal=True, softcap=2.5, dropout_p=0.25)
    dq, dk, dv = vjp(do)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == np.float64
    mask = cuflash.dropout_mask((1, 2, 50, 50), seed=vjp.seed, p=0.25)
    opts = dict(causal=True, softcap=2.5, dropout_mask=mask, dropout_p=0.25)
    want = cuflash.reference.attention_backward(do.get(), q.get(), k.get(), v.get(), compute_dtype=np.longdouble,
                                                **opts)
    base = cuflash.reference.attention_backward(do.get(), q.get(), k.get(), v.get(), **opts)
    mags = cuflash.reference.term_magnitudes(q.get(), k.get(), v.get(), do.get(), **opts)
    for name, g, r, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want, base):
        ws.close(g, r, b, mult=3, eps=2.0 ** -52, magnitude=mags[name], name=name, mode=("float64", "ieee"))


def test_warmup_compiles_the_wide_families(cp):
    done = cuda.warmup(dtypes=("float32", "float64"), head_dims=(64,), backward=True, precision="3xtf32",
                       progress=False)
    f32 = [specs.select(f, "float32", 64, 227 * 1024, cc=90, math="3xtf32") for f in ("wfwd", "wbwd", "wdq")]
    f64 = [specs.select(f, "float64", 64, 227 * 1024, cc=90, math="dmma") for f in ("wfwd", "wbwd", "wdq")]
    assert done == [f32[0], (f32[1], f32[2]), f64[0], (f64[1], f64[2])]
    assert len(modules(cp)) == 4
    assert specs.helper_names("float64")[0] in modules(cp)[-1].name_expressions
