// cuflash — attention dropout on P fragments in registers (the keep-mask of cuflash/dropout.py, no mask in memory).
//
// P is held as mma m16n8k16 C/D fragments of one warp: register r of n-tile nj in m-tile mi holds row
// row0 + 16*mi + lane/4 + 8*(r/2) and column col0 + 8*nj + 2*(lane%4) + r%2 (the layout of mask.cuh's apply_mask).
//
// One Philox-4x32-10 call gives the words of four adjacent columns 4c..4c+3 of one row. Within an 8-column n-tile,
// lanes t and t^1 of a quad (t = lane%4) hold columns 2t,2t+1 and 2(t^1),2(t^1)+1: the same four-column group, for
// the same two rows (g and g+8). So instead of each lane calling Philox for both rows (DropoutRng::keep_pair) and
// discarding half of each result, the even lane computes row g and the odd lane row g+8, and each hands the other
// the two keep bits of the partner's columns: one Philox call per four elements instead of per two, and one
// __shfl_xor_sync per tile for all of them. The bits are exactly DropoutRng::keep's (same counter, word and
// threshold); the tests compare the kernel's zero pattern with cuflash.dropout_mask.
//
// The bits do not depend on the scores, so they are made in two steps: dropout_keep_bits (Philox, at the top of the
// key loop, where S is not live and the generator's integer work overlaps the wait for the K tile) and
// apply_keep_bits (after the softmax update: zero the dropped P). Two registers per thread carry them in between.
#pragma once

#include "philox.cuh"

namespace cuflash {

// Keep bits of this lane's P elements of one tile: bit 2*(mi*kNTiles+nj)+e of bits[half] is the element of row
// row0 + 16*mi + lane/4 + 8*half, column col0 + 8*nj + 2*(lane%4) + e. batch: the flattened batch index, head: the
// query head. Must be called by all 32 lanes of the warp (a shuffle inside). col0 must be a multiple of 4.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void dropout_keep_bits(unsigned int (&bits)[2], const DropoutRng& rng, int batch,
                                                  int head, int row0, int col0, int lane) {
  static_assert(2 * kMTiles * kNTiles <= 32, "a tile's keep bits of one row half must fit 32 bits");
  const int odd = lane & 1;  // this lane computes row g + 8*odd of each (mi, nj)
  const int row_mine = row0 + (lane >> 2) + 8 * odd;
  const int col_lane = col0 + 2 * (lane & 3);
  unsigned int own = 0u, give = 0u;  // this lane's columns / the partner's columns, of row g + 8*odd
#pragma unroll
  for (int i = 0; i < kMTiles * kNTiles; ++i) {
    const int mi = i / kNTiles, nj = i % kNTiles;
    const Philox4 w = rng.words(batch, head, row_mine + 16 * mi, col_lane + 8 * nj);
    // words 0,1 hold the even lane's columns, words 2,3 the odd lane's
    const unsigned int even_bits = (unsigned int)(w.x >= rng.threshold) | ((unsigned int)(w.y >= rng.threshold) << 1);
    const unsigned int odd_bits = (unsigned int)(w.z >= rng.threshold) | ((unsigned int)(w.w >= rng.threshold) << 1);
    own |= (odd ? odd_bits : even_bits) << (2 * i);
    give |= (odd ? even_bits : odd_bits) << (2 * i);
  }
  const unsigned int got = __shfl_xor_sync(0xffffffffu, give, 1);  // the partner's row, this lane's columns
  bits[0] = odd ? got : own;
  bits[1] = odd ? own : got;
}

// Zeroes the entries of P whose keep bit (dropout_keep_bits) is 0. The 1/(1-p) rescale is left to the caller, which
// folds it into its per-row normalization.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_keep_bits(float (&P)[kMTiles][kNTiles][4], const unsigned int (&bits)[2]) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int nj = 0; nj < kNTiles; ++nj) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (!((bits[r >> 1] >> (2 * (mi * kNTiles + nj) + (r & 1))) & 1u)) P[mi][nj][r] = 0.f;
      }
    }
  }
}

}  // namespace cuflash
