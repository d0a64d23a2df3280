// cuflash::wide — compile-time shape of the float32/float64 kernels (kernels/flash_fwd_wide.cu, flash_bwd_wide.cu).
//
// Everything derives from the arithmetic M (wide_mma.cuh: element type, fragment rows kTM) and four tile numbers;
// cuflash/cuda/specs.py computes the same shared-memory sizes (the compile check holds the two equal).
//
// Shared tiles hold head_dim columns in rows of kLd = head_dim + 4 elements. The tensor-core paths read a tile
// "K-contiguous" (A[g][t] or B[n = g][k = t]: lanes g = 0..7, t = 0..3): element (row g, column t) lies at word
// g * kLd + t (float) or 2 * (g * kLd + t) (double), and with kLd = 4 mod 32 (float) / 4 mod 16 (double, whose
// 64-bit loads serve a half-warp per wavefront) the 32 lanes hit 32 distinct banks. The forward's V is read the
// other way (B[k = key][n = d] with keys 2t, 2t+1 and columns g: P's permuted k): for float kLd = 4 mod 32 suits
// that too, for double it would put keys 0 and 4 in the same banks (2-way), so the float64 V tile has rows of
// head_dim + 2 (= 2 mod 16: keys 2t -> banks 8t + 2g, distinct). The backward reads its tiles both ways and
// keeps head_dim + 4 (a 2-way conflict on float64's transposed reads; noted, not yet measured on a GPU).
#pragma once

#include "wide_mma.cuh"

// The register budget of the float32/float64 main kernels. ptxas' allocation is greedy: at head dims >= 192 it took
// all 255 registers for scheduling freedom without needing them (0 spills at 240), which leaves no headroom for
// another compiler version; __maxnreg__ caps it per kernel (CUDA >= 12.4; it cannot be combined with
// __launch_bounds__, and a block never exceeds 256 threads <= 65536 / 240). With a score modifier compiled in (a
// user's expression, whose cost no table can foresee) the budget is the whole 255: the compile check holds those
// specializations to no spills only, as it does the 16-bit ones (the 240 budget spilled 12-20 bytes in two of them
// with the representative modifier). Older compilers get
// __launch_bounds__(threads, 1): one resident block per SM, all the tables' shared memory allows anyway (a bare
// __launch_bounds__(threads) made ptxas aim at 3 blocks of 128 threads, cap the float64 kernels at 168 registers and
// spill). The emulator ignores both.
#define CUFLASH_WIDE_MAX_REGISTERS 240
#if defined(CUFLASH_EMULATE)
#define CUFLASH_WIDE_BOUNDS(threads)
#elif defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ >= 1204)
#define CUFLASH_WIDE_BOUNDS(threads) __maxnreg__(Mods::kScore ? 255 : CUFLASH_WIDE_MAX_REGISTERS)
#else
#define CUFLASH_WIDE_BOUNDS(threads) __launch_bounds__(threads, 1)
#endif

namespace cuflash {
namespace wide {

// The forward: a block owns kBlockM query rows, kRowsPerWarp = kBlockM / kWarps per warp (whole rows per warp, so
// the softmax statistics never leave the warp), and streams K/V tiles of kBlockN keys.
template <class M_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct WideFwdTraits {
  using M = M_;
  using T = typename M::T;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTM = M::kTM, kR = M::kR;
  static constexpr int kRowsPerWarp = kBlockM / kWarps;
  static constexpr int kMTiles = kRowsPerWarp / kTM;
  static constexpr int kNTilesS = kBlockN / 8;   // C blocks of S across the keys
  static constexpr int kNTilesO = kHeadDim / 8;  // C blocks of O across head_dim
  static_assert(kRowsPerWarp * kWarps == kBlockM && kMTiles * kTM == kRowsPerWarp && kMTiles >= 1,
                "each warp owns whole fragment rows");
  static_assert(kBlockN % 8 == 0 && kHeadDim % 32 == 0 && kHeadDim <= 256, "tile shape");

  static constexpr int kLd = kHeadDim + 4;
  static constexpr int kLdV = kHeadDim + (sizeof(T) == 8 ? 2 : 4);
  static constexpr int kLdP = kBlockN + 4;  // P staged for the FMA paths
  static constexpr int kSmemQ = kBlockM * kLd, kSmemK = kBlockN * kLd, kSmemV = kBlockN * kLdV;
  static constexpr int kSmemP = M::kRegA ? 0 : kBlockM * kLdP;
  static constexpr int kSmemBytes = (kSmemQ + kSmemK + kSmemV + kSmemP) * int(sizeof(T));
};

// The deterministic dQ pass: the forward's orientation, Q and dO [kBlockM] and K, V [kBlockN] in shared memory
// (and dS staged for the FMA paths).
template <class M_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct WideDqTraits : WideFwdTraits<M_, kHeadDim_, kBlockM_, kBlockN_, kWarps_> {
  using Base = WideFwdTraits<M_, kHeadDim_, kBlockM_, kBlockN_, kWarps_>;
  static constexpr int kSmemKV = kBlockN_ * Base::kLd;  // K and V both read as [n][k] (S = Q K^T, dP = dO V^T)
  static constexpr int kSmemBytes =
      (2 * Base::kSmemQ + 2 * kSmemKV + Base::kSmemP) * int(sizeof(typename Base::T));
};

// The backward's main kernel (FA2 Algorithm 2, transposed like the 16-bit one, kernels/bwd_traits.cuh): a block
// owns kBlockN keys in kWarpsN groups of kTM keys (one fragment row block each); kSplit = kWarps / kWarpsN warps
// share a group. Per visited query tile of kBlockM rows:
//   S^T, dP^T (kTM keys x kQCols queries per warp): the group's kSplit warps split the query columns in kQParts
//     parts (kQParts = kSplit unless the tile has fewer 8-column blocks; the other warps skip this phase);
//   P^T and dS^T go to shared memory [key][query], and every warp of the group adds its kDCols = kHeadDim / kSplit
//     columns of dV += P^T dO and dK += dS^T Q, accumulated in registers for the whole block;
//   dQ += dS K in units of (kTM query rows x 32 columns) spread over all warps, added with atomics (float32 or
//     float64 atomicAdd) to the dQ workspace, or left to the dq pass (deterministic mode).
template <class M_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct WideBwdTraits {
  using M = M_;
  using T = typename M::T;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTM = M::kTM, kR = M::kR;
  static constexpr int kWarpsN = kBlockN / kTM;
  static constexpr int kSplit = kWarps / kWarpsN;
  static constexpr int kQParts = kBlockM / 8 < kSplit ? kBlockM / 8 : kSplit;
  static constexpr int kQCols = kBlockM / kQParts;
  static constexpr int kNTilesS = kQCols / 8;
  static constexpr int kDCols = kHeadDim / kSplit;
  static constexpr int kDNTiles = kDCols / 8;
  static_assert(kWarpsN * kTM == kBlockN && kWarpsN * kSplit == kWarps, "whole key groups, equal parts");
  static_assert(kQCols * kQParts == kBlockM && kQCols % 8 == 0 && kDCols * kSplit == kHeadDim && kDCols % 8 == 0,
                "query and head-dim columns in whole 8-column blocks");
  static_assert(kHeadDim % 32 == 0, "dQ is computed in 32-column units");

  static constexpr int kLd = kHeadDim + 4;
  static constexpr int kLdS = kBlockM + 4;  // P^T, dS^T rows
  static constexpr int kSmemKV = kBlockN * kLd, kSmemQ = kBlockM * kLd, kSmemS = kBlockN * kLdS;
  static constexpr int kSmemBytes = (2 * kSmemKV + 2 * kSmemQ + 2 * kSmemS + 2 * kBlockM) * int(sizeof(T));
};

}  // namespace wide
}  // namespace cuflash
