// cuflash — one tile of scores, S = mod(Q_i K_j^T * scale) * log2(e), masked (FA2 Algorithm 1, line 8).
//
// The forward and the backward's deterministic dQ pass both call this, so the backward recomputes exactly the
// forward's S (same mma accumulation order, the same correctly rounded multiplies: mods.cuh) and P = exp2(S - L)
// carries the forward's rounding. The element mask runs on boundary tiles (the split loop of FA2) and, with a mask
// modifier, on every tile; it comes before the row max: a masked score must not raise m_i.
#pragma once

#include "mask.cuh"
#include "mods.cuh"
#include "warp_gemm.cuh"

namespace cuflash {

// `masked`: the tile needs the element rule (causal/window/seqlens edge, or the BlockMask's element test: `partial`).
// `row0` is the warp's first global row, `key0` the tile's first key. With kKeep, S0 receives the scaled scores
// before the score modifier (the backward's dQ pass needs them).
template <class Traits, class Mods, bool kKeep = false>
__device__ __forceinline__ void score_tile(float (&S)[Traits::kMTiles][Traits::kNTilesS][4],
                                           float (&S0)[Traits::kMTiles][Traits::kNTilesS][4], const QFrags<Traits>& q,
                                           const typename Traits::T* sQ_warp, const typename Traits::T* sK, int lane,
                                           bool masked, bool partial, int row0, int key0, const Visibility vis,
                                           const ScorePos& pos, const Params& p) {
  gemm_qk<Traits>(S, q, sQ_warp, sK, lane);
  modify_scores<Mods, false, kKeep>(S, S0, row0, key0, lane, pos, p);
  if (masked || partial || Mods::kMask) mask_scores<Mods, false>(S, row0, key0, lane, vis, partial, pos, p);
}

}  // namespace cuflash
