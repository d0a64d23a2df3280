// cuflash — compile-time shape of one forward kernel specialization.
//
// Everything that changes generated code is here and derives from five template parameters
// (element type, head_dim, tile rows/cols, warps); everything else (lengths, strides, masks, scale) is a
// runtime argument, so one specialization serves every mask feature (see flash_fwd.cu).
#pragma once

#include "arch.cuh"

namespace cuflash {

// FA2 work partitioning (FA2 Sec. 3.3, "work partitioning between warps"): a thread block owns kBlockM query rows,
// split across its warps so that each warp owns kRowsPerWarp *whole* rows. Softmax statistics of a row then
// live in one warp (in the 4 lanes of one quad) and never go through shared memory.
template <typename T_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct FwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;  // padded (native) head dim: 32, 64, 96, 128, 192 or 256
  static constexpr int kBlockM = kBlockM_;    // query rows per thread block (B_r in the paper)
  static constexpr int kBlockN = kBlockN_;    // key rows per K/V tile (B_c in the paper)
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;

  // Tensor-core tile: mma.sync m16n8k16. A warp covers its rows in 16-row m-tiles.
  static constexpr int kRowsPerWarp = kBlockM / kWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;   // m-tiles per warp (1 or 2)
  static constexpr int kNTilesS = kBlockN / 8;        // n-tiles of S = Q K^T (8 keys each)
  static constexpr int kNTilesO = kHeadDim / 8;       // n-tiles of O = P V (8 head-dim columns each)
  static constexpr int kKStepsQK = kHeadDim / 16;     // k-steps of Q K^T (over head_dim)
  static constexpr int kKStepsPV = kBlockN / 16;      // k-steps of P V (over keys)

  static_assert(kRowsPerWarp * kWarps == kBlockM && kRowsPerWarp % 16 == 0, "each warp owns whole 16-row m-tiles");
  static_assert(kMTiles >= 1 && kMTiles <= 2, "at most 32 rows per warp (register budget)");
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head_dim: multiple of 16, at most 256");
  static_assert(kBlockN % 16 == 0, "key tile: multiple of 16 (k-steps of P V; pairs of n-tiles for ldmatrix.x4)");

  // Q fragments stay in registers for the whole key loop when they are cheap (kMTiles*kHeadDim/4 registers per
  // thread); otherwise each k-step re-reads them from shared memory with ldmatrix, like FA2 for large head dims.
  static constexpr bool kQInRegs = kMTiles * kHeadDim <= 64;

  // ---- shared memory: Q [kBlockM][kSmemStride], K [kBlockN][kSmemStride], V [kBlockN][kSmemStride] ----
  // Rows are padded by 8 elements (16 bytes). ldmatrix reads 8 rows x 16 bytes per 8x8 matrix; an unpadded row of
  // 2*kHeadDim bytes (a multiple of 64 or 128) would put those 8 rows in the same banks (up to 8-way conflicts).
  // With a stride of 2*kHeadDim+16 bytes = (kHeadDim/8 + 1) 16-byte chunks, an odd number for every kHeadDim that
  // is a multiple of 16, 8 consecutive rows start in 8 distinct 16-byte bank groups: conflict-free ldmatrix (and
  // conflict-free 16-byte cp.async stores, 8 lanes per row). Cost: 16 bytes per row, 3-6% of the tile.
  static constexpr int kSmemStride = kHeadDim + 8;  // elements
  static_assert(((kSmemStride * 2 / 16) & 1) == 1, "padded row must be an odd number of 16-byte chunks");
  static constexpr int kSmemQ = kBlockM * kSmemStride;
  static constexpr int kSmemKV = kBlockN * kSmemStride;
  static constexpr int kSmemBytes = (kSmemQ + 2 * kSmemKV) * int(sizeof(T));

  // ---- gmem -> smem copies: 16-byte cp.async chunks of 8 elements ----
  static constexpr int kChunksPerRow = kHeadDim / 8;
};

}  // namespace cuflash
