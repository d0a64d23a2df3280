// cuflash — the backward's warp-level pieces beyond the forward's gemm_qk / gemm_pv (warp_gemm.cuh): fragments
// to and from shared memory in the transposed layouts, the dQ product with fp32 atomics, and fp32 <-> T helpers.
#pragma once

#include "tile.cuh"
#include "warp_gemm.cuh"

namespace cuflash {

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Stores the C fragments of a warp's 16 x (8*kNTiles) tile, rounded to T, into a row-major smem tile of row stride
// kStrideS: register pair (0,1) is row lane/4, pair (2,3) row lane/4 + 8, columns 8*nj + 2*(lane%4) + {0,1}.
template <typename T, int kNTiles, int kStrideS>
__device__ __forceinline__ void store_frags_smem(T* tile16, const float (&F)[1][kNTiles][4], int lane) {
  T* row = tile16 + (lane >> 2) * kStrideS + 2 * (lane & 3);
#pragma unroll
  for (int nj = 0; nj < kNTiles; ++nj) {
    *reinterpret_cast<uint32_t*>(row + 8 * nj) = arch::pack2<T>(F[0][nj][0], F[0][nj][1]);
    *reinterpret_cast<uint32_t*>(row + 8 * kStrideS + 8 * nj) = arch::pack2<T>(F[0][nj][2], F[0][nj][3]);
  }
}

// acc += A B for one warp: A (16 rows x 16*kKSteps) row-major in smem with row stride kStrideA (P^T or dS^T of the
// warp's 16 keys, all query columns), B (16*kKSteps rows x 8*kNTiles columns) row-major in smem with the traits'
// stride (dO or Q from the warp's first head-dim column on), read with ldmatrix .trans like V in the forward.
template <class Traits, int kKSteps, int kNTiles, int kStrideA>
__device__ __forceinline__ void gemm_smem_a(float (&acc)[1][kNTiles][4], const typename Traits::T* sA16,
                                            const typename Traits::T* sB, int lane) {
  static_assert(kNTiles % 2 == 0, "pairs of n-tiles");
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    uint32_t a[4];
    arch::ldmatrix_x4(a, sA16 + (lane & 15) * kStrideA + kk * 16 + (lane >> 4) * 8);
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      load_v_frags<Traits>(b, sB, kk, 16 * np, lane);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      arch::mma_16816<typename Traits::T>(acc[0][2 * np], a, b0, acc[0][2 * np]);
      arch::mma_16816<typename Traits::T>(acc[0][2 * np + 1], a, b1, acc[0][2 * np + 1]);
    }
  }
}

// dQ_i += dS K_j (unscaled) for a kBlockM x kHeadDim query tile, added to the fp32 workspace with atomics.
// dS^T is in smem as [key][query] (row stride kStrideS): the A operand dS[query][key] is read with ldmatrix .trans;
// K [key][d] is the B operand read with .trans as well (like V in the forward). The warps take (16-row m-tile,
// 32-column chunk) units in turn; each unit is 16 fp32 registers, so this phase adds little register pressure.
// Rows >= rows_valid and columns >= cols_valid are not written.
template <class Tr>
__device__ __forceinline__ void dq_atomic(float* dq_tile, long long row_stride, int rows_valid, int cols_valid,
                                          const typename Tr::T* sdS, const typename Tr::T* sK, int warp, int lane) {
  using T = typename Tr::T;
  constexpr int kMTiles = Tr::kBlockM / 16;
  constexpr int kUnits = kMTiles * (Tr::kHeadDim / 32);
  // A runtime loop on purpose: unrolling it lets the scheduler interleave units and costs ~10-30 registers, which
  // the dK/dV accumulators cannot spare (measured with ptxas -v).
#pragma unroll 1
  for (int u = warp; u < kUnits; u += Tr::kWarps) {
    const int mt = u % kMTiles;
    const int d0 = (u / kMTiles) * 32;
    float acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[nt][r] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
      // matrices (keys 0-7, queries 0-7) = a0, (keys 0-7, queries 8-15) = a1, (keys 8-15, queries 0-7) = a2,
      // (keys 8-15, queries 8-15) = a3; .trans hands lane l the pair A[l/4][2(l%4)..] of each.
      uint32_t a[4];
      arch::ldmatrix_x4_trans(a, sdS + (kk * 16 + (lane & 7) + ((lane >> 4) << 3)) * Tr::kStrideS + mt * 16 +
                                     (((lane >> 3) & 1) << 3));
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        load_v_frags<typename Tr::SdP>(b, sK, kk, d0 + 16 * np, lane);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        arch::mma_16816<T>(acc[2 * np], a, b0, acc[2 * np]);
        arch::mma_16816<T>(acc[2 * np + 1], a, b1, acc[2 * np + 1]);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 16 + (lane >> 2) + 8 * half;
      if (r < rows_valid) {
        float* dst = dq_tile + r * row_stride;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int col = d0 + 8 * nt + 2 * (lane & 3);
          if (col < cols_valid) {  // cols_valid is a multiple of 8; col is even and the workspace's strides are
                                   // multiples of its padded head dim: 8-byte aligned
            arch::red_add_f32x2(dst + col, acc[nt][2 * half], acc[nt][2 * half + 1]);
          }
        }
      }
    }
  }
}

// Writes a warp's 16 x (8*kNTiles) accumulator tile times `scale`, rounded to T, to gmem rows [0, 16) of a tile
// starting at `gmem` (column offset included). Rows >= rows_valid and columns >= cols_valid are not written.
template <typename T, int kNTiles>
__device__ __forceinline__ void store_acc_tile(T* gmem, long long row_stride, int rows_valid, int cols_valid,
                                               const float (&acc)[1][kNTiles][4], float scale, int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = (lane >> 2) + 8 * half;
    if (r < rows_valid) {
      T* dst = gmem + r * row_stride;
#pragma unroll
      for (int nd = 0; nd < kNTiles; ++nd) {
        const int col = nd * 8 + 2 * (lane & 3);
        if (col < cols_valid) {
          *reinterpret_cast<uint32_t*>(dst + col) =
              arch::pack2<T>(acc[0][nd][2 * half] * scale, acc[0][nd][2 * half + 1] * scale);
        }
      }
    }
  }
}

}  // namespace cuflash
