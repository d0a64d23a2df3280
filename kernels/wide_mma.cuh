// cuflash::wide — the warp-level products of the float32/float64 kernels: one accumulator layout, four arithmetics.
//
// Accumulators (S, P, O, dK, dV, dQ) are "C fragments": a warp's tile is a grid of kTM x 8 blocks (kTM = 16 or 8
// rows, 8 columns) and in each block lane l (g = l / 4, t = l % 4) holds kR = kTM / 4 elements,
//     element r:  row g + 8 * (r / 2),  column 2t + r % 2.
// For kTM = 16 this is the C layout of mma.m16n8k8 (PTX ISA "Matrix Fragments for mma.m16n8k8", c0..c3; the same
// as m16n8k16's, which the 16-bit kernels use), for kTM = 8 that of mma.m8n8k4 .f64 ("Matrix Fragments for
// mma.m8n8k4 with .f64 floating point type", c0, c1; CUTLASS's SM80_8x8_Row). A row therefore lives in the 4 lanes
// of one quad whatever the arithmetic, so the online softmax, the masks, the modifiers and dropout (wide_scores.cuh,
// wide_softmax.cuh) are written once, for every arithmetic:
//
//   F64Dmma   float64, mma.sync.m8n8k4.f64 (kTM 8, k-step 4): A a0 = A[g][t], B b0 = B[k = t][n = g]
//             (PTX ISA as above; CUTLASS SM80_8x8x4_F64F64F64F64_TN: ALayout = BLayout = SM80_8x4).
//   F32Tf32   float32 rounded to tf32 (cvt.rna), mma.sync.m16n8k8.tf32 (kTM 16, k-step 8): a0 = A[g][t],
//             a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]; b0 = B[t][g], b1 = B[t+4][g] (PTX ISA "Matrix Fragments
//             for mma.m16n8k8", .tf32; CUTLASS SM80_16x8x8_F32TF32TF32F32_TN, ALayout strides (16,1),(8,64)).
//   F32Tf32x3 the same instruction three times per product, CUTLASS's 3xTF32 (OpMultiplyAddFastF32): x = big + small
//             with big = tf32(x), small = tf32(x - big) (x - big is exact in fp32); A B ~ As Bb + Ab Bs + Ab Bb, the
//             small terms first, As Bs (~2^-22 relative) dropped; the products sum apart (kSumApart: warp_gemm).
//             Near-float32 accuracy (measured: README, Precision).
//   F32Fma /  float32 / float64 FFMA/DFMA, no tensor core: each lane computes its own C elements, k-steps of one
//   F64Fma    16-byte vector of A's row and B's column (4 floats; float64: one double, see below), fma in k order.
//             Their kTM is 16 / 8 (the layouts of the tensor-core paths of the same element type).
//
// Operands come from shared memory through accessors (RowMajor / ColMajor: X(i, j)), so one product serves every
// orientation the kernels need (Q K^T, P V, dS^T Q, dS K, ...). The second product of the forward, P V, takes A = P
// straight from the C fragments on the tensor-core paths: a C block's 8 columns are the k of one product if k is
// permuted (the same permutation on B): k index t <-> column 2t and t + 4 <-> 2t + 1 (tf32, one k-step per block);
// for f64, step s in {0, 1} takes column 2t + s as k index t. The FMA paths, whose lanes need whole rows of P,
// stage P through shared memory instead (kRegA = false).
#pragma once

#include "wide_math.cuh"

namespace cuflash {
namespace wide {

// ---- shared-memory accessors ----

// N consecutive elements (N * sizeof(T) = 16 or 8 bytes, src aligned to that) in one vector load.
template <typename T, int N>
__device__ __forceinline__ void load_vec(T (&o)[N], const T* src) {
  static_assert(N * sizeof(T) == 16 || N * sizeof(T) == 8 || N == 1, "16- or 8-byte vectors");
  if constexpr (N * sizeof(T) == 16 && sizeof(T) == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    o[0] = v.x, o[1] = v.y, o[2] = v.z, o[3] = v.w;
  } else if constexpr (N * sizeof(T) == 16 && sizeof(T) == 8) {
    const double2 v = *reinterpret_cast<const double2*>(src);
    o[0] = v.x, o[1] = v.y;
  } else if constexpr (N == 2 && sizeof(T) == 4) {
    const float2 v = *reinterpret_cast<const float2*>(src);
    o[0] = v.x, o[1] = v.y;
  } else {
    o[0] = src[0];
  }
}

// X(i, j) = p[i * kLd + j]: contiguous along j.
template <typename T, int kLd>
struct RowMajor {
  const T* p;
  static constexpr bool kContigJ = true;
  __device__ __forceinline__ T operator()(int i, int j) const { return p[i * kLd + j]; }
  // N consecutive elements along the contiguous axis, from (i, j)
  template <int N>
  __device__ __forceinline__ void vec(T (&o)[N], int i, int j) const {
    load_vec<T, N>(o, p + i * kLd + j);
  }
};

// X(i, j) = p[j * kLd + i]: contiguous along i.
template <typename T, int kLd>
struct ColMajor {
  const T* p;
  static constexpr bool kContigJ = false;
  __device__ __forceinline__ T operator()(int i, int j) const { return p[j * kLd + i]; }
  template <int N>
  __device__ __forceinline__ void vec(T (&o)[N], int i, int j) const {
    load_vec<T, N>(o, p + j * kLd + i);
  }
};

// ---- the arithmetics ----
// Each has: T; kTM, kR (C fragment rows and elements per lane), kK (k per step); fragments A, B; load_a(a, X, i0,
// k0, lane) (rows i0.. of the block, k0..), load_b(b, X, k0, n0, lane) (k0.., columns n0..n0+7); mma(c, a, b)
// (c += a b); and, where kRegA, kRegSteps, a_from_c(a, c, s) and load_b_perm(b, X, key0, s, n0, lane) for A taken
// from the C block of columns key0..key0+7.

struct F64Dmma {
  using T = double;
  static constexpr int kTM = 8, kR = 2, kK = 4;
  static constexpr bool kRegA = true, kSumApart = false;
  static constexpr int kRegSteps = 2;
  struct A {
    double x;
  };
  struct B {
    double x;
  };
  template <class X>
  __device__ static __forceinline__ void load_a(A& a, const X& m, int i0, int k0, int lane) {
    a.x = m(i0 + (lane >> 2), k0 + (lane & 3));
  }
  template <class X>
  __device__ static __forceinline__ void load_b(B& b, const X& m, int k0, int n0, int lane) {
    b.x = m(k0 + (lane & 3), n0 + (lane >> 2));
  }
  __device__ static __forceinline__ void mma(double (&c)[kR], const A& a, const B& b) {
    arch::mma_884_f64(c, a.x, b.x, c);
  }
  __device__ static __forceinline__ void a_from_c(A& a, const double (&c)[kR], int s) { a.x = c[s]; }
  template <class X>
  __device__ static __forceinline__ void load_b_perm(B& b, const X& m, int key0, int s, int n0, int lane) {
    b.x = m(key0 + 2 * (lane & 3) + s, n0 + (lane >> 2));
  }
};

template <bool kThree>
struct F32Tf32Base {
  using T = float;
  static constexpr int kTM = 16, kR = 4, kK = 8;
  static constexpr bool kRegA = true, kSumApart = kThree;
  static constexpr int kRegSteps = 1;
  struct A {
    uint32_t big[4], small[kThree ? 4 : 1];
  };
  struct B {
    uint32_t big[2], small[kThree ? 2 : 1];
  };
  // x = big + small (3xTF32) or big alone; small = tf32(x - big), x - big exact.
  __device__ static __forceinline__ void split(float x, uint32_t& big, uint32_t* small) {
    big = arch::to_tf32(x);
    if constexpr (kThree) *small = arch::to_tf32(x - __uint_as_float(big));
  }
  template <class X>
  __device__ static __forceinline__ void load_a(A& a, const X& m, int i0, int k0, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const float v[4] = {m(i0 + g, k0 + t), m(i0 + g + 8, k0 + t), m(i0 + g, k0 + t + 4), m(i0 + g + 8, k0 + t + 4)};
#pragma unroll
    for (int r = 0; r < 4; ++r) split(v[r], a.big[r], &a.small[kThree ? r : 0]);
  }
  template <class X>
  __device__ static __forceinline__ void load_b(B& b, const X& m, int k0, int n0, int lane) {
    const int g = lane >> 2, t = lane & 3;
    split(m(k0 + t, n0 + g), b.big[0], &b.small[0]);
    split(m(k0 + t + 4, n0 + g), b.big[1], &b.small[kThree ? 1 : 0]);
  }
  // c += a b, inside the tensor core (3xTF32: the small terms first; warp_gemm on summing apart)
  __device__ static __forceinline__ void mma(float (&c)[kR], const A& a, const B& b) {
    if constexpr (kThree) {
      const uint32_t as[4] = {a.small[0], a.small[1], a.small[2], a.small[3]};
      const uint32_t bs[2] = {b.small[0], b.small[1]};
      arch::mma_1688_tf32(c, as, b.big, c);
      arch::mma_1688_tf32(c, a.big, bs, c);
    }
    arch::mma_1688_tf32(c, a.big, b.big, c);
  }
  // The C block (row g: c0 = column 2t, c1 = 2t + 1; row g + 8: c2, c3) as A: k index t <-> column 2t, t + 4 <-> 2t + 1.
  __device__ static __forceinline__ void a_from_c(A& a, const float (&c)[kR], int) {
    split(c[0], a.big[0], &a.small[0]);
    split(c[2], a.big[1], &a.small[kThree ? 1 : 0]);
    split(c[1], a.big[2], &a.small[kThree ? 2 : 0]);
    split(c[3], a.big[3], &a.small[kThree ? 3 : 0]);
  }
  template <class X>
  __device__ static __forceinline__ void load_b_perm(B& b, const X& m, int key0, int, int n0, int lane) {
    const int g = lane >> 2, t = lane & 3;
    split(m(key0 + 2 * t, n0 + g), b.big[0], &b.small[0]);
    split(m(key0 + 2 * t + 1, n0 + g), b.big[1], &b.small[kThree ? 1 : 0]);
  }
};
using F32Tf32 = F32Tf32Base<false>;
using F32Tf32x3 = F32Tf32Base<true>;

template <typename T_, int kTM_, int kK_>
struct FmaAtom {
  using T = T_;
  static constexpr int kTM = kTM_, kR = kTM_ / 4, kK = kK_;
  static constexpr bool kRegA = false, kSumApart = false;
  static constexpr int kRegSteps = 1;
  struct A {
    T x[kR / 2][kK];  // rows g + 8h, k0 .. k0 + kK - 1
  };
  struct B {
    T x[kK][2];  // k0 .., columns 2t, 2t + 1
  };
  template <class X>
  __device__ static __forceinline__ void load_a(A& a, const X& m, int i0, int k0, int lane) {
#pragma unroll
    for (int h = 0; h < kR / 2; ++h) {
      const int i = i0 + (lane >> 2) + 8 * h;
      if constexpr (X::kContigJ) {
        m.template vec<kK>(a.x[h], i, k0);
      } else {
#pragma unroll
        for (int k = 0; k < kK; ++k) a.x[h][k] = m(i, k0 + k);
      }
    }
  }
  template <class X>
  __device__ static __forceinline__ void load_b(B& b, const X& m, int k0, int n0, int lane) {
    const int n = n0 + 2 * (lane & 3);
    if constexpr (X::kContigJ) {  // B[k][n] rows: the two columns of each k in one vector
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        T v[2];
        m.template vec<2>(v, k0 + k, n);
        b.x[k][0] = v[0], b.x[k][1] = v[1];
      }
    } else {  // B[n][k] rows (K read as B of Q K^T): kK k of one column in one vector
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        T v[kK];
        m.template vec<kK>(v, k0, n + e);
#pragma unroll
        for (int k = 0; k < kK; ++k) b.x[k][e] = v[k];
      }
    }
  }
  __device__ static __forceinline__ void mma(T (&c)[kR], const A& a, const B& b) {
#pragma unroll
    for (int r = 0; r < kR; ++r)
#pragma unroll
      for (int k = 0; k < kK; ++k) c[r] = Real<T>::fma(a.x[r >> 1][k], b.x[k][r & 1], c[r]);
  }
};
// float32: k-steps of one 16-byte vector (4 floats). float64: of one double (8-byte loads): DFMA runs only on GPUs
// without float64 tensor cores, where float64 arithmetic (1/64 of float32's rate) hides any load cost, and the
// smaller fragments kept the head_dim-256 dQ pass with a modifier from spilling (compile check).
using F32Fma = FmaAtom<float, 16, 4>;
using F64Fma = FmaAtom<double, 8, 1>;

// ---- warp products ----

// Sums apart (M::kSumApart, 3xTF32): the tensor core rounds its sum toward zero (Fasi, Higham, Mikaitis and Pranesh,
// "Numerical behavior of NVIDIA tensor cores", 2021), losing up to an ulp of C per mma when C is its addend. Over a
// long accumulation (O over every key, dK/dV over every query, S over head_dim) that bias grows with the length:
// 3xTF32's forward RMS error was 20x naive float32's at N = 2048 on an H100. So warp_gemm sums each k-step's three
// products from zero and adds them to C with a round-to-nearest FADD, as Ootomo and Yokota ("Recovering single
// precision accuracy from Tensor Cores while surpassing the FP32 theoretical peak performance", 2022) accumulate
// outside the tensor core: the bias is then an ulp of one step's sum. Its k loop is not unrolled, so that one step's
// partial sums are in flight at a time (unrolled, ptxas overlapped them and spilled). P V (warp_gemm_regs_a) sums a
// tile's keys inside the tensor core and adds each tile apart (per step it spilled). Accumulators of kApartRegs
// registers or more (O and dQ at head_dim 192 and 256) still sum inside the mma: apart, they spilled 8-56 bytes.
constexpr int kApartRegs = 96;

// c += s, round to nearest (an IEEE add, never fused into an FMA or a tensor-core addend)
template <class M>
__device__ __forceinline__ void add_rn(typename M::T (&c)[M::kR], const typename M::T (&s)[M::kR]) {
#pragma unroll
  for (int r = 0; r < M::kR; ++r) c[r] = Real<typename M::T>::add(c[r], s[r]);
}

// C[kMT][kNT] += A B over k in [0, kKTotal): A rows 0 .. kMT * kTM - 1 (the warp's), B columns 0 .. 8 * kNT - 1.
// Each C element sums its products in k order, whatever the loop order. Two orders, picked by the size of C
// (measured with the compile check) and by summing apart (above):
//   k outer (two k-steps per iteration): each B fragment loaded once per k-step and used for every m-tile; the
//     accumulators are indexed by (mi, nj) only, so k need not be unrolled (a head_dim of 256 in k-steps of 4 would
//     be 64 copies of the body);
//   when C alone takes 128 registers or more (head_dim 256, and 192 on the FMA paths), or the products sum apart:
//     columns outer, k inner, A reloaded per column block. With k outer, ptxas hoisted the B loads of all 32 column
//     blocks of a k-step and spilled under the 240-register budget.
template <class M, int kMT, int kNT, int kKTotal, class XA, class XB>
__device__ __forceinline__ void warp_gemm(typename M::T (&C)[kMT][kNT][M::kR], const XA& A, const XB& B, int lane) {
  static_assert(kKTotal % M::kK == 0, "k must be a multiple of the arithmetic's k-step");
  constexpr bool kBigC = kMT * kNT * M::kR * int(sizeof(typename M::T)) / 4 >= 128;
  constexpr bool kApart = M::kSumApart && kMT * kNT * M::kR < kApartRegs;
  if constexpr (!kBigC && !kApart) {
#pragma unroll 2
    for (int k0 = 0; k0 < kKTotal; k0 += M::kK) {
      typename M::A a[kMT];
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) M::load_a(a[mi], A, mi * M::kTM, k0, lane);
#pragma unroll
      for (int nj = 0; nj < kNT; ++nj) {
        typename M::B b;
        M::load_b(b, B, k0, 8 * nj, lane);
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) M::mma(C[mi][nj], a[mi], b);
      }
    }
  } else {  // big C, or summing apart: columns outer, k inner and not unrolled (one step in flight at a time)
#pragma unroll
    for (int nj = 0; nj < kNT; ++nj) {
#pragma unroll 1
      for (int k0 = 0; k0 < kKTotal; k0 += M::kK) {
        typename M::B b;
        M::load_b(b, B, k0, 8 * nj, lane);
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) {
          typename M::A a;
          M::load_a(a, A, mi * M::kTM, k0, lane);
          if constexpr (kApart) {
            float step[M::kR] = {};
            M::mma(step, a, b);
            add_rn<M>(C[mi][nj], step);
          } else {
            M::mma(C[mi][nj], a, b);
          }
        }
      }
    }
  }
}

// C[kMT][kNT] += A B with the tile's product summed apart: A B from zero over its kKTotal terms, then added to C,
// one rounding per element. For the accumulators that run over the whole sequence (FA2 Algorithm 2 lines 16 and
// 21: dV_j += P^T dO_i, dK_j += dS^T Q_i over every query tile). Summed into C directly, each element of dK and
// dV is one chain of FMAs over every query the key sees (4096 at N = 2048 with two query heads per KV head), and
// its rounding error grows with the chain: float32 dK and dV came out at 2.6-2.7x the naive float32 RMS error
// (emulated, N = 2048), where BLAS adds blocks of a few hundred terms. Apart, a chain is one tile (kKTotal terms)
// plus one addition per tile. Costs a tile of kMT * kNT * kR registers while it runs.
template <class M, int kMT, int kNT, int kKTotal, class XA, class XB>
__device__ __forceinline__ void warp_gemm_add(typename M::T (&C)[kMT][kNT][M::kR], const XA& A, const XB& B,
                                              int lane) {
  using T = typename M::T;
  T tile[kMT][kNT][M::kR];
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int nj = 0; nj < kNT; ++nj)
#pragma unroll
      for (int r = 0; r < M::kR; ++r) tile[mi][nj][r] = T(0);
  warp_gemm<M, kMT, kNT, kKTotal>(tile, A, B, lane);
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int nj = 0; nj < kNT; ++nj) add_rn<M>(C[mi][nj], tile[mi][nj]);
}

// C[kMT][kNTC] += P V with P = the C fragments [kMT][kNTP] of the warp's rows (keys 0 .. 8 * kNTP - 1), V[key][n]
// read through X (tensor-core arithmetics: kRegA). P's A fragments are converted once. Loop order (measured with the
// compile check): keys outer, output columns inner in general; for the 16-row layouts at head_dim 256 (32 output
// blocks, 128 accumulator registers) output columns outer, so that each B fragment is used as soon as it is loaded
// (the other order kept many in flight and spilled 32 bytes for 3xTF32; for float64 it is the other way round).
template <class M, int kMT, int kNTP, int kNTC, class XB>
__device__ __forceinline__ void warp_gemm_regs_a(typename M::T (&C)[kMT][kNTC][M::kR],
                                                 const typename M::T (&P)[kMT][kNTP][M::kR], const XB& V, int lane) {
  static_assert(M::kRegA, "the FMA arithmetics stage A through shared memory");
  typename M::A a[kNTP][M::kRegSteps][kMT];
#pragma unroll
  for (int nj = 0; nj < kNTP; ++nj)
#pragma unroll
    for (int s = 0; s < M::kRegSteps; ++s)
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) M::a_from_c(a[nj][s][mi], P[mi][nj], s);
  auto step = [&](int nd, int nj, int s) {
    typename M::B b;
    M::load_b_perm(b, V, 8 * nj, s, 8 * nd, lane);
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) M::mma(C[mi][nd], a[nj][s][mi], b);
  };
  if constexpr (M::kSumApart && kMT * kNTC * M::kR < kApartRegs) {
    static_assert(M::kRegSteps == 1, "summing apart takes one k-step per C block (the tf32 layouts)");
    // output columns outer; the tile's keys summed inside the tensor core from zero, then added to C round-to-nearest
    // (per key step, as warp_gemm does, the unrolled steps' partial sums overlapped and spilled)
#pragma unroll
    for (int nd = 0; nd < kNTC; ++nd) {
      float sum[kMT][M::kR] = {};
#pragma unroll
      for (int nj = 0; nj < kNTP; ++nj) {
        typename M::B b;
        M::load_b_perm(b, V, 8 * nj, 0, 8 * nd, lane);
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) M::mma(sum[mi], a[nj][0][mi], b);
      }
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) add_rn<M>(C[mi][nd], sum[mi]);
    }
  } else if constexpr (M::kTM == 16 && kNTC >= 32) {
#pragma unroll
    for (int nd = 0; nd < kNTC; ++nd)
#pragma unroll
      for (int nj = 0; nj < kNTP; ++nj)
#pragma unroll
        for (int s = 0; s < M::kRegSteps; ++s) step(nd, nj, s);
  } else {
#pragma unroll
    for (int nj = 0; nj < kNTP; ++nj)
#pragma unroll
      for (int s = 0; s < M::kRegSteps; ++s)
#pragma unroll
        for (int nd = 0; nd < kNTC; ++nd) step(nd, nj, s);
  }
}

// Writes C fragments [kMT][kNT] (a warp's kMT * kTM rows) into a row-major shared tile of row stride kLd.
template <class M, int kMT, int kNT, int kLd>
__device__ __forceinline__ void store_frags(typename M::T* tile, const typename M::T (&C)[kMT][kNT][M::kR],
                                            int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int nj = 0; nj < kNT; ++nj)
#pragma unroll
      for (int r = 0; r < M::kR; ++r)
        tile[(M::kTM * mi + g + 8 * (r >> 1)) * kLd + 8 * nj + 2 * t + (r & 1)] = C[mi][nj][r];
}

// acc += P V for any arithmetic: from registers (tensor cores) or through the warp's rows of a shared staging tile
// (FMA paths; `stage` holds the warp's kMT * kTM rows, row stride kLdP). The caller guarantees the warp is done
// reading `stage` from the previous call (a __syncthreads or __syncwarp in between).
template <class M, int kMT, int kNTP, int kNTC, int kLdP, class XB>
__device__ __forceinline__ void warp_gemm_pv(typename M::T (&C)[kMT][kNTC][M::kR],
                                             const typename M::T (&P)[kMT][kNTP][M::kR], typename M::T* stage,
                                             const XB& V, int lane) {
  if constexpr (M::kRegA) {
    warp_gemm_regs_a<M, kMT, kNTP, kNTC>(C, P, V, lane);
  } else {
    store_frags<M, kMT, kNTP, kLdP>(stage, P, lane);
    __syncwarp();
    // float32: the tile's keys summed apart (warp_gemm_add: O's chain over every key lost accuracy with the
    // length), where a second accumulator fits: not for O at head_dim 192 and 256 (96 and 128 registers). float64
    // sums in its chain: apart, head_dim 128 spilled 40 bytes with a modifier on sm_80.
    if constexpr (sizeof(typename M::T) == 4 && kMT * kNTC * M::kR < kApartRegs) {
      warp_gemm_add<M, kMT, kNTC, 8 * kNTP>(C, RowMajor<typename M::T, kLdP>{stage}, V, lane);
    } else {
      warp_gemm<M, kMT, kNTC, 8 * kNTP>(C, RowMajor<typename M::T, kLdP>{stage}, V, lane);
    }
  }
}

}  // namespace wide
}  // namespace cuflash
