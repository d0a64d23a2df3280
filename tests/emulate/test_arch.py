"""Emulated twins of kernels/arch.cuh against NumPy: mma.m16n8k16, ldmatrix, cp.async, pack2, red_add_f32x2, and the
wide kernels' mma.m8n8k4 .f64, mma.m16n8k8 .tf32 and cvt.rna.tf32.f32."""
from fractions import Fraction

import numpy as np
import pytest

import cuflash.emulate as emu
import tensor_core_model
from emu_helpers import from_bf16_bits, spec, to_bf16_bits

DTYPES = {"__half": (lambda x: x.astype(np.float16).view(np.uint16), lambda b: b.view(np.float16)),
          "__nv_bfloat16": (to_bf16_bits, from_bf16_bits)}


def _operands(rng, shape, dtype):
    """Random values exactly representable in `dtype`: the bits the kernel gets and their float64 values."""
    encode, decode = DTYPES[dtype]
    bits = encode(rng.standard_normal(shape).astype(np.float32))
    return bits, decode(bits).astype(np.float64)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("seed", range(3))
def test_mma_matches_matrix_product(dtype, seed):
    rng = np.random.default_rng(seed)
    a_bits, a = _operands(rng, (16, 16), dtype)
    b_bits, b = _operands(rng, (16, 8), dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    emu.launch(spec("arch_tests.cu", f"mma_from_global<{dtype}>", (a_bits, b_bits, c, d)))
    # Products of 11-bit (8-bit) significands are exact in fp32; only the 16 fp32 additions round.
    np.testing.assert_allclose(d, a @ b + c, rtol=1e-5, atol=1e-5)


def test_mma_distinguishes_every_fragment_position():
    """A = I and B = a permutation-free ramp: any misplaced element of A, B, C or D changes the result."""
    a_bits = np.eye(16, dtype=np.float16).view(np.uint16)
    b = np.arange(16 * 8, dtype=np.float16).reshape(16, 8)
    c = 1000 * np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    d = np.zeros((16, 8), np.float32)
    emu.launch(spec("arch_tests.cu", "mma_from_global<__half>", (a_bits, b.view(np.uint16), c, d)))
    np.testing.assert_array_equal(d, b.astype(np.float32) + c)


# ------------------------------------------------------------------------------------------------ float64 / tf32
def test_mma_f64_is_a_chain_of_fused_multiply_adds_in_k_order():
    """Bit for bit: each element is fma(a3, b3, fma(a2, b2, fma(a1, b1, fma(a0, b0, c)))), every fma rounded once
    to nearest even (computed here exactly with fractions, then rounded by float())."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((8, 4)), rng.standard_normal((4, 8))
    c = rng.standard_normal((8, 8)) * 1e-3
    d = np.full((8, 8), np.nan)
    emu.launch(spec("arch_tests.cu", "mma_f64_from_global", (a, b, c, d)))
    want = np.empty((8, 8))
    for i in range(8):
        for j in range(8):
            acc = float(c[i, j])
            for k in range(4):
                acc = float(Fraction(float(a[i, k])) * Fraction(float(b[k, j])) + Fraction(acc))
            want[i, j] = acc
    np.testing.assert_array_equal(d, want)


def test_mma_f64_distinguishes_every_fragment_position():
    a = np.zeros((8, 4))
    a[np.arange(4), np.arange(4)] = 1.0
    a[np.arange(4, 8), np.arange(4)] = 2.0
    b = np.arange(32, dtype=np.float64).reshape(4, 8)
    c = 1000 * np.arange(64, dtype=np.float64).reshape(8, 8)
    d = np.zeros((8, 8))
    emu.launch(spec("arch_tests.cu", "mma_f64_from_global", (a, b, c, d)))
    np.testing.assert_array_equal(d, a @ b + c)


def _tf32_rna(x):
    """cvt.rna.tf32.f32 defined on values: the nearer of the two 11-significant-bit neighbours, ties to the larger
    magnitude; infinities kept; a finite value rounding past the largest tf32 becomes infinity."""
    x = np.asarray(x, np.float32)
    out = np.empty(x.shape, np.float32)
    for idx, v in np.ndenumerate(x.astype(np.float64)):
        if not np.isfinite(v) or v == 0:
            out[idx] = v
            continue
        e = max(int(np.floor(np.log2(abs(v)))), -126)  # subnormals keep the minimum exponent's spacing
        ulp = 2.0 ** (e - 10)
        lo = np.floor(abs(v) / ulp) * ulp
        hi = lo + ulp
        m = hi if abs(v) - lo >= hi - abs(v) else lo
        out[idx] = np.float32(np.copysign(m, v)) if m < 2.0 ** 128 else np.copysign(np.inf, v)
    return out


def test_tf32_rounds_to_nearest_ties_away():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(300).astype(np.float32),
                        (rng.standard_normal(100) * 1e-38).astype(np.float32),  # subnormals
                        np.array([0.0, -0.0, 1.0, 1 + 2**-11, -(1 + 2**-11), 1 + 3 * 2**-11, 1 + 2**-11 + 2**-20,
                                  3.4028235e38, -3.4028235e38, np.inf, -np.inf], np.float32)])
    out = np.zeros(x.size, np.uint32)
    emu.launch(spec("arch_tests.cu", "tf32_kernel", (x, out, np.int32(x.size))))
    assert (out & 0x1FFF == 0).all()
    np.testing.assert_array_equal(out.view(np.float32), _tf32_rna(x))
    nan = np.array([np.nan], np.float32)
    got = np.zeros(1, np.uint32)
    emu.launch(spec("arch_tests.cu", "tf32_kernel", (nan, got, np.int32(1))))
    assert np.isnan(got.view(np.float32)).all()


@pytest.mark.parametrize("seed", range(2))
def test_mma_tf32_matches_tf32_products_summed_in_k_order(seed):
    """Inputs rounded by cvt.rna, products exact in fp32, the 8 products added to C in k order in fp32."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    emu.launch(spec("arch_tests.cu", "mma_tf32_from_global", (a, b, c, d)))
    np.testing.assert_array_equal(d, tensor_core_model.rn(a, b, c))


@pytest.mark.parametrize("seed", range(4))
def test_mma_tf32_in_hw_math_sums_as_the_tensor_core(seed):
    """hw_math: the 8 exact products and C truncated to 25 fraction bits of the largest exponent, the sum rounded
    toward zero (tests/tensor_core_model.py, rz), bit for bit what an H200 computed on these operands
    (tests/data/tf32_mma_h200.json); the last two rows tell it from round to nearest."""
    a, b, c = tensor_core_model.operands(seed)
    d = np.full((16, 8), np.nan, np.float32)
    emu.launch(spec("arch_tests.cu", "mma_tf32_from_global", (a, b, c, d)), hw_math=True)
    np.testing.assert_array_equal(d.view(np.uint32), tensor_core_model.measured()[seed].view(np.uint32))
    np.testing.assert_array_equal(d.view(np.uint32), tensor_core_model.rz(a, b, c).view(np.uint32))
    np.testing.assert_array_equal(d[14:], [[1] * 8, [-1] * 8])
    assert not np.array_equal(d, tensor_core_model.rn(a, b, c))


def test_the_fitted_model_alone_matches_the_gpu():
    """Of the models the GPU test scores, only the emulator's reproduces all 512 elements the H200 computed: the
    operands tell the fit from its neighbours (normalized products: 497; 26 fraction bits: 468)."""
    got = tensor_core_model.measured()
    assert sorted(got) == [0, 1, 2, 3]
    exact = [name for name, fn in tensor_core_model.MODELS.items()
             if all(np.array_equal(fn(*tensor_core_model.operands(s)).view(np.uint32), d.view(np.uint32))
                    for s, d in got.items())]
    assert exact == [tensor_core_model.EMULATOR]


def test_tensor_core_models_on_a_wide_grid_are_exact_sums_rounded_toward_zero():
    """tests/tensor_core_model.py, which the GPU test compares the hardware with: on a grid of 46 fraction bits nothing is
    truncated (9 terms of 2 x 11-bit products and C), so rz is the exact sum rounded toward zero once, and with
    ``c_apart`` the products' exact sum rounded so first, then added to C and rounded again."""
    from cuflash.reference import round_tf32

    def toward_zero(x):  # x a Fraction: the float32 of largest magnitude not above |x| (compared exactly)
        f = np.float32(float(x))
        return np.nextafter(f, np.float32(0)) if abs(Fraction(float(f))) > abs(x) else f

    a, b, c = tensor_core_model.operands(3)
    ta, tb = round_tf32(a).astype(np.float64), round_tf32(b).astype(np.float64)
    exact = [[(Fraction(float(c[i, j])), [Fraction(float(ta[i, k] * tb[k, j])) for k in range(8)])
              for j in range(8)] for i in range(16)]
    want = np.array([[toward_zero(cc + sum(p)) for cc, p in row] for row in exact], np.float32)
    apart = np.array([[toward_zero(cc + Fraction(float(toward_zero(sum(p))))) for cc, p in row] for row in exact],
                     np.float32)
    np.testing.assert_array_equal(tensor_core_model.rz(a, b, c, frac_bits=46), want)
    np.testing.assert_array_equal(tensor_core_model.rz(a, b, c, frac_bits=46, c_apart=True), apart)
    assert not np.array_equal(want, apart)  # the operands tell the two apart
    models = tensor_core_model.MODELS
    assert len({tuple(fn(a, b, c).view(np.uint32).ravel()) for fn in models.values()}) > len(models) // 2


def test_mma_tf32_distinguishes_every_fragment_position():
    a = np.zeros((16, 8), np.float32)
    a[np.arange(16), np.arange(16) % 8] = 1 + (np.arange(16) >= 8)
    b = np.arange(64, dtype=np.float32).reshape(8, 8)
    c = 1000 * np.arange(128, dtype=np.float32).reshape(16, 8)
    d = np.zeros((16, 8), np.float32)
    emu.launch(spec("arch_tests.cu", "mma_tf32_from_global", (a, b, c, d)))
    np.testing.assert_array_equal(d, a @ b + c)


def _ldmatrix_expected(src, nmat, trans):
    """The PTX ISA's ldmatrix distribution: lane l holds row l/4, columns 2(l%4) and 2(l%4)+1 of each matrix
    (with .trans, of the transposed matrix); register j comes from matrix j."""
    mats = src.reshape(4, 8, 8).astype(np.uint32)
    out = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        row, col = lane // 4, 2 * (lane % 4)
        for j in range(nmat):
            m = mats[j].T if trans else mats[j]
            out[lane, j] = m[row, col] | (m[row, col + 1] << 16)
    return out


@pytest.mark.parametrize("nmat,trans", [(1, 0), (2, 0), (4, 0), (2, 1), (4, 1)])
def test_ldmatrix_layout(nmat, trans):
    src = np.random.default_rng(nmat + 10 * trans).integers(0, 2**16, (32, 8), dtype=np.uint16)
    out = np.zeros((32, 4), np.uint32)
    emu.launch(spec("arch_tests.cu", "ldmatrix_kernel", (src, out, np.int32(nmat), np.int32(trans))))
    np.testing.assert_array_equal(out, _ldmatrix_expected(src, nmat, trans))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("b_is_kn", [0, 1])
def test_ldmatrix_feeds_mma(dtype, b_is_kn):
    """The forward kernel's pattern: ldmatrix.x4 for A, .x2 from [n][k] (K) or .x2.trans from [k][n] (V) for B."""
    rng = np.random.default_rng(b_is_kn)
    a_bits, a = _operands(rng, (16, 16), dtype)
    b_bits, b = _operands(rng, (16, 8), dtype)
    stored = b_bits if b_is_kn else np.ascontiguousarray(b_bits.T)
    d = np.full((16, 8), np.nan, np.float32)
    emu.launch(spec("arch_tests.cu", f"ldmatrix_mma<{dtype}>", (a_bits, stored, np.int32(b_is_kn), d)))
    np.testing.assert_allclose(d, a @ b, rtol=1e-5, atol=1e-5)


def _cp_async(mode, n=64, valid=None, block=8):
    src = np.arange(1, n + 1, dtype=np.float32)
    dst = np.zeros(n, np.float32)
    valid = n if valid is None else valid
    emu.launch(spec("arch_tests.cu", "cp_async_kernel", (src, dst, np.int32(n), np.int32(valid), np.int32(mode)),
                    block=(block, 1, 1), shared_bytes=4 * n))
    return src, dst


def test_cp_async_wait_all_delivers():
    src, dst = _cp_async(mode=0)
    np.testing.assert_array_equal(dst, src)


def test_cp_async_missing_wait_leaves_nan():
    _, dst = _cp_async(mode=1)
    assert np.isnan(dst).all()


def test_cp_async_wait_group_keeps_the_newest_groups_pending():
    src, dst = _cp_async(mode=2)
    np.testing.assert_array_equal(dst[:32], src[:32])
    assert np.isnan(dst[32:]).all()


def test_cp_async_uncommitted_copies_are_not_waited_for():
    src, dst = _cp_async(mode=3)
    np.testing.assert_array_equal(dst[:32], src[:32])
    assert np.isnan(dst[32:]).all()


def test_cp_async_false_predicate_zero_fills():
    src, dst = _cp_async(mode=0, valid=40)
    np.testing.assert_array_equal(dst[:40], src[:40])
    np.testing.assert_array_equal(dst[40:], 0)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_pack2_rounds_and_orders_halves(dtype):
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    out = np.zeros(32, np.uint32)
    emu.launch(spec("arch_tests.cu", f"pack2_kernel<{dtype}>", (x, out, np.int32(32))))
    bits = DTYPES[dtype][0](x).astype(np.uint32)
    np.testing.assert_array_equal(out, bits[0::2] | (bits[1::2] << 16))


def test_mma_fp16_decoder_is_exact_for_every_bit_pattern():
    """Subnormals, infinities and NaNs included: the emulated mma must see exactly the fp16 values."""
    out = np.zeros(65536, np.float32)
    emu.launch(spec("arch_tests.cu", "half_decode_kernel", (out,)))
    expected = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32)[~np.isnan(expected)],
                                  expected.view(np.uint32)[~np.isnan(expected)])
    assert np.isnan(out[np.isnan(expected)]).all()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_real_ptx_wrappers_compile_with_nvcc(arch, tmp_path):
    """The other half of arch.cuh: the test kernels use every wrapper, and ptxas checks the inline PTX."""
    import shutil
    import subprocess
    from pathlib import Path

    from cuflash.cuda.source import KERNELS_DIR

    nvcc = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin"))
    if not nvcc:
        pytest.skip("nvcc not found")
    src = Path(__file__).parent / "kernels" / "arch_tests.cu"
    proc = subprocess.run([nvcc, f"-arch={arch}", "-cubin", f"-I{KERNELS_DIR}", str(src), "-o",
                           str(tmp_path / "arch_tests.cubin")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5, 8])
def test_bank_conflicts_are_counted(chunks):
    """8 rows of 16 bytes, ``chunks`` 16-byte units apart, start in 8 / gcd(chunks, 8) of the 8 bank groups of a
    128-byte line: each request of 8 rows takes gcd(chunks, 8) wavefronts (odd row strides are conflict-free)."""
    src = np.arange(32 * 8, dtype=np.uint16)
    stats = emu.launch(spec("arch_tests.cu", "bank_kernel", (src, np.int32(8 * chunks))))
    assert stats.ldmatrix_requests == 4 and stats.cp_async_requests == 4
    assert stats.ldmatrix_wavefronts == stats.cp_async_wavefronts == 4 * np.gcd(chunks, 8)
    assert stats.conflict_free == (chunks % 2 == 1)


def test_red_add_f32x2_adds_both_and_checks_its_address():
    """The dQ workspace's reduction (red.global.add.v2.f32 on sm_90): 32 threads add (i, -i) into 4 pairs, and an
    address off the 8-byte grid is an error, as on the GPU."""
    from cuflash.emulate import EmulationError

    p = np.zeros(10, np.float32)
    emu.launch(spec("arch_tests.cu", "red_add_kernel", (p, np.int32(32), np.int32(0)), block=(32, 1, 1)))
    want = np.zeros(10, np.float32)
    for i in range(32):
        want[2 * (i % 4)] += i
        want[2 * (i % 4) + 1] -= i
    np.testing.assert_array_equal(p, want)
    with pytest.raises(EmulationError, match="not 8-byte aligned"):
        emu.launch(spec("arch_tests.cu", "red_add_kernel", (p, np.int32(1), np.int32(1)), block=(1, 1, 1)))
