// cuflash — compile-time shape of the backward kernels (FA2 Algorithm 2; FA1 Sec. 3.1 "recomputation").
//
// The main kernel works in the *transposed* orientation of the forward: a thread block owns kBlockN keys
// (B_c rows of K, V, dK, dV) and visits the query tiles of kBlockM rows that can see them. Its warps are laid out
// as kWarpsN key groups of 16 keys times kSplit parts:
//
//   S^T, dP^T (16 keys x kBlockM/kSplit queries per warp): warp (g, h) = (w % kWarpsN, w / kWarpsN) multiplies its
//     16 keys with query columns [h*kBlockM/kSplit, (h+1)*kBlockM/kSplit). These are the forward's products with
//     the roles of Q and K exchanged, so they reuse gemm_qk (A = K or V rows, B = Q or dO read row by row) and,
//     because the C fragment of S^T is the A fragment of P^T, gemm_pv (dV += P^T dO, dK += dS^T Q) as well.
//   dV, dK (16 keys x kHeadDim/kSplit columns per warp, fp32 in registers for the whole block).
//     kSplit = 1: the warp owns every query column of its keys and feeds P^T / dS^T to the tensor cores
//       straight from registers.
//     kSplit = 2 (head dims 192, 256, where 16 x kHeadDim x 2 accumulators per warp would not fit in registers):
//       P^T and dS^T go through shared memory and each warp reads the other half's columns there.
//   dQ (kBlockM x kHeadDim per query tile): dS is in shared memory; the warps split (16-row m-tile, 32-column chunk)
//     units among themselves and add them to an fp32 workspace with atomics (or, deterministic mode, not at all:
//     the dq kernel recomputes dQ in a pass parallel over query tiles).
#pragma once

#include "kernel_traits.cuh"

namespace cuflash {

// The forward's traits with every A operand read from shared memory (no Q fragments pinned in registers): the
// backward's accumulators (dK and dV, or dQ) already hold most of the register file.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps>
struct SmemATraits : FwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps> {
  static constexpr bool kQInRegs = false;
};

// The deterministic dQ pass (flash_bwd_dq_kernel): the forward's orientation, with Q, dO [kBlockM] and K, V [kBlockN]
// tiles in shared memory.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps>
struct DqTraits : SmemATraits<T, kHeadDim, kBlockM, kBlockN, kWarps> {
  using Base = SmemATraits<T, kHeadDim, kBlockM, kBlockN, kWarps>;
  static constexpr int kSmemBytes = (2 * Base::kSmemQ + 2 * Base::kSmemKV) * int(sizeof(T));
};

template <typename T_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct BwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;  // padded (native) head dim
  static constexpr int kBlockM = kBlockM_;    // query rows per visited query tile (B_r)
  static constexpr int kBlockN = kBlockN_;    // keys per thread block (B_c)
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;

  static constexpr int kWarpsN = kBlockN / 16;        // key groups of 16 keys
  static constexpr int kSplit = kWarps / kWarpsN;     // parts of the query columns (S) and head-dim columns (dK, dV)
  static constexpr int kQCols = kBlockM / kSplit;     // query columns of a warp's S^T / dP^T
  static constexpr int kDCols = kHeadDim / kSplit;    // head-dim columns of a warp's dK / dV
  static constexpr int kDNTiles = kDCols / 8;         // n-tiles of a warp's dK / dV accumulators

  static_assert(kBlockN % 16 == 0 && kWarps % kWarpsN == 0, "whole 16-key groups, each split into equal parts");
  static_assert(kSplit == 1 || kSplit == 2 || kSplit == 4, "kSplit is 1, 2 or 4");
  static_assert(kQCols % 16 == 0 && kDCols % 16 == 0, "S^T columns and dK/dV columns in pairs of n-tiles");
  static_assert(kHeadDim % 32 == 0, "dQ is computed in 32-column chunks");

  // S^T = K Q^T and dP^T = V dO^T of one warp: the forward's S = Q K^T with kWarpsN "query" warps of 16 rows
  // (our keys) against kQCols "keys" (our queries). Also the B-fragment addressing (kSmemStride = kHeadDim + 8) of
  // every tile of kHeadDim columns.
  using SdP = SmemATraits<T, kHeadDim, kBlockN, kQCols, kWarpsN>;
  // gmem -> smem copies use every thread of the block (load_tile reads kThreads and kChunksPerRow only).
  using Load = FwdTraits<T, kHeadDim, 16 * kWarps, 16, kWarps>;

  // ---- shared memory: K, V [kBlockN][kStride]; Q, dO [kBlockM][kStride]; dS^T (and P^T when kSplit = 2)
  //      [kBlockN][kStrideS]; lse*log2(e) and D [kBlockM] fp32. Rows padded by 16 bytes: conflict-free ldmatrix
  //      (kernel_traits.cuh explains the odd number of 16-byte chunks).
  static constexpr int kStride = kHeadDim + 8;
  static constexpr int kStrideS = kBlockM + 8;
  static_assert(((kStrideS * 2 / 16) & 1) == 1, "padded dS row must be an odd number of 16-byte chunks");
  static constexpr int kSmemKV = kBlockN * kStride;
  static constexpr int kSmemQ = kBlockM * kStride;
  static constexpr int kSmemS = kBlockN * kStrideS;
  static constexpr int kSmemElems = 2 * kSmemKV + 2 * kSmemQ + (kSplit == 1 ? 1 : 2) * kSmemS;
  static constexpr int kSmemBytes = kSmemElems * int(sizeof(T)) + 2 * kBlockM * int(sizeof(float));

  // __launch_bounds__'s minimum blocks per SM (0: none asked, ptxas chooses). The head_dim 192 split-4 row asks for
  // one: left to itself, ptxas capped it at 128 registers to fit two blocks and spilled 8 bytes on sm_80; asking
  // one everywhere instead made the 256 row with a modifier take 255 registers and spill 100 bytes.
  static constexpr int kMinBlocks = (kHeadDim == 192 && kSplit == 4) ? 1 : 0;
};

}  // namespace cuflash
