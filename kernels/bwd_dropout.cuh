// cuflash — the backward's dropout keep bits, regenerated in registers (the forward's mask, never stored).
//
// The keep-mask of cuflash/dropout.py is indexed (batch, query head, QUERY row, KEY column): one Philox-4x32-10
// call gives the words of four adjacent keys 4c..4c+3 of one query. The deterministic dQ kernel holds S in the
// forward's orientation and uses dropout.cuh as the forward does. The main kernel holds S^T: a warp's fragments are
// 16 keys x 8*kNTiles queries, register r of n-tile nj of lane (g = lane/4, t = lane%4) is
//     key   key0 + g + 8*(r/2)          (fragment row)
//     query q0 + 8*nj + 2*t + r%2       (fragment column),
// so the four keys of one Philox call sit in four *different lanes* (g = 4a + w, w = 0..3: lanes 16a + 4w + t),
// each needing one word. Those four lanes need, per n-tile, exactly four calls — query 2t + e and key group
// 4a + 8h for e, h in {0, 1} — and each lane needs word w of all four. So lane w makes the call of its own register
// r = w (e = w%2, h = w/2), keeps the four keep bits (a nibble per n-tile), and a 4 x 4 transpose among the four
// lanes (three __shfl_xor_sync per tile for all n-tiles) hands every lane its bits: one Philox call per four
// elements, none wasted, as in the forward. The bits equal DropoutRng::keep's (same counter, word, threshold).
#pragma once

#include "philox.cuh"

namespace cuflash {

// Keep bits of a warp's S^T fragments (float[1][kNTiles][4], layout above): bit 4*nj + r is register r of n-tile
// nj. key0 (the warp's first key) must be a multiple of 4. batch: the flattened batch index; head: the QUERY head.
// Must be called by all 32 lanes of the warp (shuffles inside).
template <int kNTiles>
__device__ __forceinline__ unsigned int dropout_keep_bits_t(const DropoutRng& rng, int batch, int head, int key0,
                                                            int q0, int lane) {
  static_assert(4 * kNTiles <= 32, "keep bits of at most 64 query columns per warp (BwdSpec checks it)");
  const int t = lane & 3, w = (lane >> 2) & 3, a = lane >> 4;
  const int query = q0 + 2 * t + (w & 1);           // this lane's call: register r = w of the lanes (a, *, t)
  const int key = key0 + 4 * a + 8 * (w >> 1);      // first of the four keys of that call
  unsigned int mine = 0u;                           // nibble nj: keep bits of keys key..key+3 at query + 8*nj
#pragma unroll 1
  for (int nj = 0; nj < kNTiles; ++nj) {
    const Philox4 x = rng.words(batch, head, query + 8 * nj, key);
    const unsigned int nibble = (unsigned int)(x.x >= rng.threshold) | ((unsigned int)(x.y >= rng.threshold) << 1) |
                                ((unsigned int)(x.z >= rng.threshold) << 2) |
                                ((unsigned int)(x.w >= rng.threshold) << 3);
    mine |= nibble << (4 * nj);
  }
  // Transpose: register r of this lane is word w of the call made by lane w' = r of the group (lane ^ 4*(w ^ r)).
  // From the lane at distance 4*x (its w' = w ^ x, i.e. r = w ^ x) take bit w of every nibble.
  unsigned int bits = 0u;
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const unsigned int from = x == 0 ? mine : __shfl_xor_sync(0xffffffffu, mine, 4 * x);
    bits |= ((from >> w) & 0x11111111u) << (w ^ x);
  }
  return bits;
}

// Zeroes the entries of a warp's S^T-layout fragments whose keep bit (dropout_keep_bits_t) is 0.
template <int kNTiles>
__device__ __forceinline__ void apply_keep_bits_t(float (&F)[1][kNTiles][4], unsigned int bits) {
#pragma unroll
  for (int nj = 0; nj < kNTiles; ++nj)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      if (!((bits >> (4 * nj + r)) & 1u)) F[0][nj][r] = 0.f;
}

}  // namespace cuflash
