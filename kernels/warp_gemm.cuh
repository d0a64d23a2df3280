// cuflash — the two warp-level products of the forward kernel on tensor cores (mma.sync m16n8k16, fp32 accumulate).
//
// A warp multiplies its own kMTiles x 16 query rows; each B fragment (from K or V in shared memory) is loaded once
// and reused for all of the warp's m-tiles, which is what makes 32 rows per warp cheaper in shared-memory traffic
// than 16.
#pragma once

#include "tile.cuh"

namespace cuflash {

// Q fragments of the warp's rows, all k-steps (used when Traits::kQInRegs).
template <class Traits>
struct QFrags {
  uint32_t a[Traits::kQInRegs ? Traits::kMTiles : 1][Traits::kQInRegs ? Traits::kKStepsQK : 1][4];
};

template <class Traits>
__device__ __forceinline__ void load_q_frags(QFrags<Traits>& q, const typename Traits::T* sQ_warp, int lane) {
  if constexpr (Traits::kQInRegs) {
#pragma unroll
    for (int mi = 0; mi < Traits::kMTiles; ++mi) {
#pragma unroll
      for (int ks = 0; ks < Traits::kKStepsQK; ++ks) {
        load_a_frag<Traits>(q.a[mi][ks], sQ_warp + mi * 16 * Traits::kSmemStride, ks, lane);
      }
    }
  }
}

// S = Q_i K_j^T (Algorithm 1, line 8) for the warp's rows: S[mi][nj] is the 16 x 8 block of m-tile mi, keys 8nj..
template <class Traits>
__device__ __forceinline__ void gemm_qk(float (&S)[Traits::kMTiles][Traits::kNTilesS][4], const QFrags<Traits>& q,
                                        const typename Traits::T* sQ_warp, const typename Traits::T* sK, int lane) {
  using T = typename Traits::T;
#pragma unroll
  for (int mi = 0; mi < Traits::kMTiles; ++mi)
#pragma unroll
    for (int nj = 0; nj < Traits::kNTilesS; ++nj)
#pragma unroll
      for (int r = 0; r < 4; ++r) S[mi][nj][r] = 0.f;

#pragma unroll
  for (int ks = 0; ks < Traits::kKStepsQK; ++ks) {
    uint32_t a[Traits::kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < Traits::kMTiles; ++mi) {
      if constexpr (Traits::kQInRegs) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[mi][r] = q.a[mi][ks][r];
      } else {
        load_a_frag<Traits>(a[mi], sQ_warp + mi * 16 * Traits::kSmemStride, ks, lane);
      }
    }
#pragma unroll
    for (int np = 0; np < Traits::kNTilesS / 2; ++np) {
      uint32_t b[4];
      load_k_frags<Traits>(b, sK, 16 * np, ks, lane);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mi = 0; mi < Traits::kMTiles; ++mi) {
        arch::mma_16816<T>(S[mi][2 * np], a[mi], b0, S[mi][2 * np]);
        arch::mma_16816<T>(S[mi][2 * np + 1], a[mi], b1, S[mi][2 * np + 1]);
      }
    }
  }
}

// acc += P V_j (Algorithm 1, line 10). P never leaves registers: the C/D fragments of two adjacent n-tiles of S
// (keys 16kk..16kk+15) are exactly the A fragment of k-step kk once packed to 16-bit pairs:
//   a0 = row g, keys 2t,2t+1 (n-tile 2kk, regs 0,1)    a1 = row g+8 (n-tile 2kk, regs 2,3)
//   a2 = row g, keys 8+2t.. (n-tile 2kk+1, regs 0,1)   a3 = row g+8 (n-tile 2kk+1, regs 2,3)
template <class Traits>
__device__ __forceinline__ void gemm_pv(float (&acc)[Traits::kMTiles][Traits::kNTilesO][4],
                                        const float (&P)[Traits::kMTiles][Traits::kNTilesS][4],
                                        const typename Traits::T* sV, int lane) {
  using T = typename Traits::T;
#pragma unroll
  for (int kk = 0; kk < Traits::kKStepsPV; ++kk) {
    uint32_t a[Traits::kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < Traits::kMTiles; ++mi) {
      a[mi][0] = arch::pack2<T>(P[mi][2 * kk][0], P[mi][2 * kk][1]);
      a[mi][1] = arch::pack2<T>(P[mi][2 * kk][2], P[mi][2 * kk][3]);
      a[mi][2] = arch::pack2<T>(P[mi][2 * kk + 1][0], P[mi][2 * kk + 1][1]);
      a[mi][3] = arch::pack2<T>(P[mi][2 * kk + 1][2], P[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int np = 0; np < Traits::kNTilesO / 2; ++np) {
      uint32_t b[4];
      load_v_frags<Traits>(b, sV, kk, 16 * np, lane);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mi = 0; mi < Traits::kMTiles; ++mi) {
        arch::mma_16816<T>(acc[mi][2 * np], a[mi], b0, acc[mi][2 * np]);
        arch::mma_16816<T>(acc[mi][2 * np + 1], a[mi], b1, acc[mi][2 * np + 1]);
      }
    }
  }
}

}  // namespace cuflash
