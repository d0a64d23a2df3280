// cuflash — one tile of scores, S = Q_i K_j^T * scale * log2(e), masked (FA2 Algorithm 1, line 8).
//
// The forward and the backward's deterministic dQ pass both call this, so the backward recomputes exactly the
// forward's S (same mma accumulation order, one multiply per score) and P = exp2(S - L) carries the forward's
// rounding. The element mask runs on boundary tiles only (the split loop of FA2) and comes before the row max:
// a masked score must not raise m_i.
#pragma once

#include "mask.cuh"
#include "warp_gemm.cuh"

namespace cuflash {

// S *= scale * log2(e): one correctly rounded multiply per score. __fmul_rn is never contracted with the softmax's
// subtraction into an FMA (NVRTC contracts `S * c - m` by default; g++ for x86-64 has no FMA to contract into), so
// the forward, the dQ pass and the backward's S^T hold the same bits, on the GPU as in the emulator.
template <int kM, int kN>
__device__ __forceinline__ void scale_scores(float (&S)[kM][kN][4], float scale_log2) {
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int nj = 0; nj < kN; ++nj)
#pragma unroll
      for (int r = 0; r < 4; ++r) S[mi][nj][r] = __fmul_rn(S[mi][nj][r], scale_log2);
}

// `masked`: the tile needs the element rule (causal/window/seqlens edge, or a BlockMask that keeps it only partly);
// `cells.cells` is non-null only in the latter case. `row0` is the warp's first global row, `key0` the tile's first key.
template <class Traits>
__device__ __forceinline__ void score_tile(float (&S)[Traits::kMTiles][Traits::kNTilesS][4], const QFrags<Traits>& q,
                                           const typename Traits::T* sQ_warp, const typename Traits::T* sK, int lane,
                                           float scale_log2, bool masked, int row0, int key0, const Visibility vis,
                                           const BlockGrid cells) {
  gemm_qk<Traits>(S, q, sQ_warp, sK, lane);
  scale_scores(S, scale_log2);
  if (masked) apply_mask<Traits>(S, row0, key0, lane, vis, cells);
}

}  // namespace cuflash
