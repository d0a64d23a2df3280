// Emulated twins of the PTX wrappers in kernels/arch.cuh (CUFLASH_EMULATE builds only).
//
// mma and ldmatrix are warp-collective: every lane deposits its operands (or row address) at a warp
// rendezvous, the last lane to arrive computes the whole 16x8x16 product (or 8x8 matrices) once, and each lane
// takes its share, following the fragment layouts of the PTX ISA (mma.m16n8k16 .f16/.bf16, ldmatrix .m8n8.b16).
// Lane l has groupID g = l / 4 and threadID_in_group t = l % 4; a b32 register packs two b16 values, the lower
// column (or k) in the low half.
#pragma once
#ifndef CUFLASH_EMULATE_ARCH_EMULATED_H_
#define CUFLASH_EMULATE_ARCH_EMULATED_H_
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>

namespace cuflash {
namespace arch {
namespace emu {

using ::cuflash_emu::Fiber;

// fp16 -> fp32, exact, in a few integer operations (the toolkit's host conversion is exact but slow, and a
// 256 KiB table thrashes the cache): move exponent and mantissa into place and rebias; subnormals are
// renormalized by one float subtraction, Inf/NaN get the all-ones exponent.
// (optimize("O3") like mma_fn, its caller: GCC does not inline across differing optimization attributes.)
__attribute__((optimize("O3"))) inline float half_bits_to_float(uint16_t h) {
  const uint32_t exp_mask = 0x7c00u << 13;
  uint32_t o = uint32_t(h & 0x7fffu) << 13;
  uint32_t exp = o & exp_mask;
  o += (127 - 15) << 23;
  float f;
  if (exp == exp_mask) {
    o += (128 - 16) << 23;
    memcpy(&f, &o, 4);
  } else if (exp == 0) {
    o += 1u << 23;
    const uint32_t magic_bits = 113u << 23;
    float magic;
    memcpy(&f, &o, 4);
    memcpy(&magic, &magic_bits, 4);
    f -= magic;
  } else {
    memcpy(&f, &o, 4);
  }
  uint32_t u;
  memcpy(&u, &f, 4);
  u |= uint32_t(h & 0x8000u) << 16;
  memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline float to_float(uint16_t bits);
template <>
__attribute__((optimize("O3"))) inline float to_float<__half>(uint16_t bits) {
  return half_bits_to_float(bits);
}
template <>
__attribute__((optimize("O3"))) inline float to_float<__nv_bfloat16>(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;  // bf16 is the top half of an fp32
  float f;
  memcpy(&f, &u, 4);
  return f;
}

struct MmaIn {
  const uint32_t* a;
  const uint32_t* b;
  const float* c;
};

// Unpacks every lane's fragments into plain matrices, multiplies in fp32 (products of two 11- or 8-bit
// significands are exact in fp32), accumulates in k order, and scatters D back. C is read completely before D
// is written, so d may alias c as in mma(acc, a, b, acc).
// Half of an emulated forward pass is spent here, and the build is -O1 (no vectorizer): this one function asks
// for more. The j loop is innermost so SIMD lanes are output columns; each element still sums in k order.
template <typename T>
__attribute__((optimize("O3"))) void mma_fn(Fiber* const* lanes, uint32_t) {
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    auto* in = static_cast<const MmaIn*>(lanes[l]->win);
    int g = l >> 2, t = l & 3;
    for (int r = 0; r < 4; ++r) {  // a0:(g, 2t) a1:(g+8, 2t) a2:(g, 2t+8) a3:(g+8, 2t+8), two columns each
      int row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
      A[row][col] = to_float<T>(uint16_t(in->a[r] & 0xffff));
      A[row][col + 1] = to_float<T>(uint16_t(in->a[r] >> 16));
    }
    for (int r = 0; r < 2; ++r) {  // b0:(k=2t, n=g) b1:(k=2t+8, n=g), two k each
      int k = 2 * t + 8 * r;
      B[k][g] = to_float<T>(uint16_t(in->b[r] & 0xffff));
      B[k + 1][g] = to_float<T>(uint16_t(in->b[r] >> 16));
    }
    for (int r = 0; r < 4; ++r) C[g + 8 * (r >> 1)][2 * t + (r & 1)] = in->c[r];
  }
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < 16; ++k)
      for (int j = 0; j < 8; ++j) C[i][j] += A[i][k] * B[k][j];
  for (int l = 0; l < 32; ++l) {
    float* d = static_cast<float*>(lanes[l]->wout);
    int g = l >> 2, t = l & 3;
    for (int r = 0; r < 4; ++r) d[r] = C[g + 8 * (r >> 1)][2 * t + (r & 1)];
  }
}

// ---- float64 and tf32 (the wide kernels) ----
// mma.m8n8k4 .f64 (PTX ISA, "Matrix Fragments for mma.m8n8k4 with .f64 floating point type"; CUTLASS's
// SM80_8x8x4_F64F64F64F64_TN traits say the same): a0 = A[g][t], b0 = B[k = t][n = g], c0/c1 = C[g][2t], C[g][2t+1].
// The ISA gives each multiply-add the precision of an .f64 fused multiply-add, rounded to nearest even; the order
// of the four is not specified, and this emulation takes k order: d = fma(a3, b3, fma(a2, b2, fma(a1, b1,
// fma(a0, b0, c)))).
struct MmaF64In {
  double a, b;
  const double* c;
};

__attribute__((optimize("O3"))) inline void mma_f64_fn(Fiber* const* lanes, uint32_t) {
  double A[8][4], B[4][8], C[8][8];
  for (int l = 0; l < 32; ++l) {
    auto* in = static_cast<const MmaF64In*>(lanes[l]->win);
    int g = l >> 2, t = l & 3;
    A[g][t] = in->a;
    B[t][g] = in->b;
    C[g][2 * t] = in->c[0];
    C[g][2 * t + 1] = in->c[1];
  }
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) {
      double acc = C[i][j];
      for (int k = 0; k < 4; ++k) acc = std::fma(A[i][k], B[k][j], acc);
      C[i][j] = acc;
    }
  for (int l = 0; l < 32; ++l) {
    double* d = static_cast<double*>(lanes[l]->wout);
    int g = l >> 2, t = l & 3;
    d[0] = C[g][2 * t];
    d[1] = C[g][2 * t + 1];
  }
}

// tf32 as the tensor core reads a b32 register: sign, exponent and the top 10 mantissa bits (the low 13 bits are
// not part of a .tf32 operand; the kernels always pass cvt.rna results, whose low bits are zero anyway).
inline float tf32_operand(uint32_t bits) {
  bits &= 0xffffe000u;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// mma.m16n8k8 .tf32 (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32 rows; CUTLASS's
// SM80_16x8x8_F32TF32TF32F32_TN traits say the same): a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4],
// a3 = A[g+8][t+4]; b0 = B[k = t][n = g], b1 = B[t+4][g]; C/D as m16n8k16: c0,c1 = row g, c2,c3 = row g+8, columns
// 2t, 2t+1. Products of two 11-bit significands are exact in fp32; the ISA leaves the accumulation order and
// rounding unspecified ("at least single precision"). By default this emulation adds the 8 products to C in k
// order, rounding to fp32 after each addition (no FMA: x86-64 g++ does not contract without -mfma). Under hw_math
// it models the tensor core instead (tc_dot_rz): the first H100 run showed that 3xTF32, which accumulates many
// small corrections into one C, loses 20x the accuracy of naive fp32 there and not in the round-to-nearest
// emulation.
struct MmaTf32In {
  const uint32_t* a;
  const uint32_t* b;
  const float* c;
};

// One tensor-core dot product c + sum a[k] b[k], as fitted bit for bit to an H200's mma .tf32 (2026-11-27, the GPU
// test's 512 elements; tests/tensor_core_model.py, rz): the products are exact; each term is aligned to the largest
// exponent E among C's (ilogb c) and the products' (ilogb a + ilogb b: the product's significand left unnormalized in
// [1, 4)) and truncated toward zero to multiples of 2^(E - 25); the sum is normalized with round-toward-zero. Fasi,
// Higham, Mikaitis and Pranesh ("Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021) found the truncation
// and the final rounding on the A100; the width and the unnormalized exponents are the fit's. Every term is below
// 2^(E + 2), 2^27 units: 9 of them sum exactly in double, so only the last step rounds. (The products are formed in
// double, exact for tf32 operands; hw_math flushes subnormals anyway.)
// Non-finite terms take the plain sum (NaN and infinities propagate as IEEE). A product beyond FLT_MAX, finite in
// double, is a term like any other, and a sum beyond FLT_MAX rounds toward zero to FLT_MAX (the hardware's result
// there is not measured; the float products of the model before 2026-11-27 made it inf).
inline float tc_dot_rz(float c, const float* a, const float* b, int n) {
  constexpr int kFracBits = 25;
  double t[16];
  int e = c != 0 ? std::ilogb(c) : INT32_MIN;
  t[0] = c;
  bool finite = std::isfinite(c);
  for (int k = 0; k < n; ++k) {
    t[k + 1] = double(a[k]) * double(b[k]);
    finite = finite && std::isfinite(t[k + 1]);
    if (finite && t[k + 1] != 0) e = std::max(e, std::ilogb(a[k]) + std::ilogb(b[k]));  // ilogb(inf): INT_MAX
  }
  if (!finite) {
    double s = c;
    for (int j = 0; j < n; ++j) s += t[j + 1];
    return float(s);
  }
  if (e == INT32_MIN) return c;  // all zero (keeps the sign of c)
  double s = 0;
  for (int k = 0; k <= n; ++k) s += std::ldexp(std::trunc(std::ldexp(t[k], kFracBits - e)), e - kFracBits);
  float f = float(s);
  if (std::fabs(double(f)) > std::fabs(s)) f = std::nextafter(f, 0.0f);
  return f;
}

__attribute__((optimize("O3"))) inline void mma_tf32_fn(Fiber* const* lanes, uint32_t) {
  float A[16][8], B[8][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    auto* in = static_cast<const MmaTf32In*>(lanes[l]->win);
    int g = l >> 2, t = l & 3;
    A[g][t] = tf32_operand(in->a[0]);
    A[g + 8][t] = tf32_operand(in->a[1]);
    A[g][t + 4] = tf32_operand(in->a[2]);
    A[g + 8][t + 4] = tf32_operand(in->a[3]);
    B[t][g] = tf32_operand(in->b[0]);
    B[t + 4][g] = tf32_operand(in->b[1]);
    for (int r = 0; r < 4; ++r) C[g + 8 * (r >> 1)][2 * t + (r & 1)] = in->c[r];
  }
  if (::cuflash_emu::g.hw_math) {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 8; ++j) {
        float b[8];
        for (int k = 0; k < 8; ++k) b[k] = B[k][j];
        C[i][j] = tc_dot_rz(C[i][j], A[i], b, 8);
      }
  } else {
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 8; ++k)
        for (int j = 0; j < 8; ++j) C[i][j] += A[i][k] * B[k][j];
  }
  for (int l = 0; l < 32; ++l) {
    float* d = static_cast<float*>(lanes[l]->wout);
    int g = l >> 2, t = l & 3;
    for (int r = 0; r < 4; ++r) d[r] = C[g + 8 * (r >> 1)][2 * t + (r & 1)];
  }
}

inline void check_shared(const char* what, const void* p, size_t bytes, size_t align) {
  if (reinterpret_cast<uintptr_t>(p) % align)
    ::cuflash_emu::fail("%s: shared address %p is not %zu-byte aligned", what, p, align);
  if (!::cuflash_emu::in_shared(p, bytes))
    ::cuflash_emu::fail("%s: address %p (%zu bytes) is not in shared memory", what, p, bytes);
}

// Matrix m's row r comes from lane 8m + r; lane l receives row g, columns 2t and 2t+1 of each matrix (for .trans:
// column g, rows 2t and 2t+1, i.e. the same element positions of the transposed matrix).
template <int NMAT, bool TRANS>
void ldmatrix_fn(Fiber* const* lanes, uint32_t) {
  uint16_t M[NMAT][8][8];
  for (int m = 0; m < NMAT; ++m) {
    uintptr_t rows[8];
    for (int r = 0; r < 8; ++r) {
      memcpy(M[m][r], lanes[8 * m + r]->win, 16);
      rows[r] = reinterpret_cast<uintptr_t>(lanes[8 * m + r]->win);
    }
    ::cuflash_emu::count_wavefronts(0, rows, 8);
  }
  for (int l = 0; l < 32; ++l) {
    uint32_t* out = static_cast<uint32_t*>(lanes[l]->wout);
    int g = l >> 2, t = l & 3;
    for (int m = 0; m < NMAT; ++m) {
      uint16_t lo = TRANS ? M[m][2 * t][g] : M[m][g][2 * t];
      uint16_t hi = TRANS ? M[m][2 * t + 1][g] : M[m][g][2 * t + 1];
      out[m] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
  }
}

template <int NMAT, bool TRANS>
inline void ldmatrix(const char* what, uint32_t* r, const void* smem_row) {
  // Only the first 8*NMAT lanes' addresses are read, as in PTX.
  if (::cuflash_emu::g_cur->lane < 8u * NMAT) check_shared(what, smem_row, 16, 16);
  ::cuflash_emu::warp_collective(what, 0xffffffffu, &ldmatrix_fn<NMAT, TRANS>, smem_row, r, true);
}

}  // namespace emu

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                          const float (&c)[4]) {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value,
                "mma_16816 takes __half or __nv_bfloat16");
  emu::MmaIn in{a, b, c};
  ::cuflash_emu::warp_collective(std::is_same<T, __half>::value ? "mma.sync.m16n8k16.f16" : "mma.sync.m16n8k16.bf16",
                                 0xffffffffu, &emu::mma_fn<T>, &in, d, true);
}

__device__ __forceinline__ void mma_884_f64(double (&d)[2], double a, double b, const double (&c)[2]) {
  emu::MmaF64In in{a, b, c};
  ::cuflash_emu::warp_collective("mma.sync.m8n8k4.f64", 0xffffffffu, &emu::mma_f64_fn, &in, d, true);
}

__device__ __forceinline__ void mma_1688_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                              const float (&c)[4]) {
  emu::MmaTf32In in{a, b, c};
  ::cuflash_emu::warp_collective("mma.sync.m16n8k8.tf32", 0xffffffffu, &emu::mma_tf32_fn, &in, d, true);
}

// cvt.rna.tf32.f32 (PTX ISA, cvt: .rna = round to nearest, ties away from zero): add half a tf32 ulp to the
// magnitude bits and truncate to 10 mantissa bits. A carry out of the mantissa bumps the exponent (the largest
// finite values round to infinity: no .satfinite); infinities stay, NaN stays a (quiet) NaN.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x007fffffu) ? 0x7fffffffu : u;
  return (u + 0x1000u) & 0xffffe000u;
}

__device__ __forceinline__ void ldmatrix_x1(uint32_t (&r)[1], const void* smem_row) {
  emu::ldmatrix<1, false>("ldmatrix.x1", r, smem_row);
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) {
  emu::ldmatrix<2, false>("ldmatrix.x2", r, smem_row);
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  emu::ldmatrix<4, false>("ldmatrix.x4", r, smem_row);
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) {
  emu::ldmatrix<2, true>("ldmatrix.x2.trans", r, smem_row);
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  emu::ldmatrix<4, true>("ldmatrix.x4.trans", r, smem_row);
}

// The source is read at issue (the hardware reads it some time before the wait) and the destination holds NaN
// bytes until the wait that covers its group, so a missing or too-shallow wait shows up as NaN.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  emu::check_shared("cp.async", smem, 16, 16);
  if (pred && reinterpret_cast<uintptr_t>(gmem) % 16)
    ::cuflash_emu::fail("cp.async: global address %p is not 16-byte aligned", gmem);
  if (pred && ::cuflash_emu::in_shared(gmem, 1))
    ::cuflash_emu::fail("cp.async: source %p is in shared memory, not global", gmem);
  ::cuflash_emu::Fiber* f = ::cuflash_emu::g_cur;
  ::cuflash_emu::PendingCopy copy;
  copy.dst = smem;
  copy.group = f->committed + 1;  // the open (not yet committed) group
  if (pred)
    memcpy(copy.bytes, gmem, 16);
  else
    memset(copy.bytes, 0, 16);
  ::cuflash_emu::poison_bytes(smem, 16);
  f->copies.push_back(copy);
  f->copy_rows.push_back(reinterpret_cast<uintptr_t>(smem));
}

__device__ __forceinline__ void cp_async_commit() { ::cuflash_emu::g_cur->committed++; }

// Completes every committed group except the N most recent; copies not yet committed stay pending, as in PTX.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  static_assert(N >= 0, "cp.async.wait_group takes N >= 0");
  ::cuflash_emu::Fiber* f = ::cuflash_emu::g_cur;
  if (f->committed < unsigned(N)) return;
  unsigned last = f->committed - unsigned(N);
  size_t kept = 0;
  for (const ::cuflash_emu::PendingCopy& c : f->copies) {
    if (c.group <= last)
      memcpy(c.dst, c.bytes, 16);
    else
      f->copies[kept++] = c;
  }
  f->copies.resize(kept);
}

// One fiber runs at a time, so the two adds are atomic here; the checks are the vector reduction's: global memory,
// 8-byte aligned.
__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
  if (reinterpret_cast<uintptr_t>(p) % 8)
    ::cuflash_emu::fail("red.global.add.v2.f32: address %p is not 8-byte aligned", p);
  if (::cuflash_emu::in_shared(p, 8)) ::cuflash_emu::fail("red.global.add.v2.f32: address %p is in shared memory", p);
  p[0] += a;
  p[1] += b;
}

}  // namespace arch
}  // namespace cuflash

#endif  // CUFLASH_EMULATE_ARCH_EMULATED_H_
