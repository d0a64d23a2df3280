// cuflash — FlashAttention-2 backward by recomputation (FA1 Sec. 3.1 "recomputation", FA2 Algorithm 2): dQ, dK, dV
// from Q, K, V, O, dO and the forward's lse, without ever storing S or P.
//
// Four kernels, three launched per backward (cuflash/cuda/launch.py builds the launch descriptions); each takes the
// params struct of params.cuh:
//   flash_bwd_preprocess_kernel   D = rowsum(dO o O) and L = lse * log2(e) per query row (fp32; L = +inf for rows
//                                 that see no key, so P = exp2(S - L) = 0 there), and zeroes the dQ workspace.
//   flash_bwd_kernel              grid (key tiles, kv heads, batch): K_j, V_j loaded once; for every query head of
//                                 the kv head's group and every query tile i that sees the keys:
//                                   S = Q_i K_j^T (the forward's product and rounding), P = exp2(S*scale*log2e - L),
//                                   dV_j += P^T dO_i, dP = dO_i V_j^T, dS = P o (dP - D_i), dK_j += dS^T Q_i,
//                                   dQ_i += dS K_j (fp32 atomics into the workspace; skipped in deterministic mode).
//                                 dK_j * scale and dV_j are written once, after the last query tile.
//   flash_bwd_convert_dq_kernel   dQ = workspace * scale, rounded to the input dtype (default mode).
//   flash_bwd_dq_kernel           deterministic mode instead: grid (query tiles, query heads, batch), recomputes
//                                 S, P, dP, dS per key tile in the forward's orientation and accumulates dQ_i in
//                                 registers; no atomics anywhere, so the result is bitwise reproducible.
//
// Masks, lengths, GQA and 64-bit strides follow the forward (flash_fwd.cu): the element rule of mask.cuh on
// boundary tiles only, BlockMask index lists (transposed for the main kernel), per-sequence lengths with
// zero-filled ragged tails, kv head = query head / heads_per_kv.
//
// Dropout (runtime arguments, one uniform branch per tile on dropout_threshold != 0): the keep bits Z of each
// recomputed P tile are regenerated in registers (dropout.cuh in the forward's orientation, bwd_dropout.cuh in the
// main kernel's transposed one), from (batch, QUERY head, query row, key column) as in the forward. With
// rescale = 1/(1-p): dV_j += (P o Z)^T dO_i * rescale (the rescale applied once, to dV at the end),
// dS = P o (dP o Z * rescale - D) (P undropped; one fma per element, dP * 1 - D exactly without dropout).
#include "params.cuh"
#include "kernel_traits.cuh"
#include "mask.cuh"
#include "block_info.cuh"
#include "tile.cuh"
#include "warp_gemm.cuh"
#include "scores.cuh"
#include "softmax.cuh"
#include "bwd_traits.cuh"
#include "bwd_block_info.cuh"
#include "bwd_gemm.cuh"
#include "dropout.cuh"
#include "bwd_dropout.cuh"
#include "mods.cuh"

namespace cuflash {

template <bool B>
struct BoolConstant {  // a compile-time bool to instantiate a generic lambda per case (no <type_traits> in NVRTC)
  static constexpr bool value = B;
};

// ---------------------------------------------------------------------------------------------------------------
// Preprocess and dQ conversion: kRowLanes lanes per query row, 8 elements (16 bytes of T) each per step, so
// kHelperRows rows per 128-thread block (cuflash/cuda/specs.py, HELPER_ROWS). Rows start 16-byte aligned (O and dO
// pass cuflash/cuda/launch.py's _aligned or are copied; dQ and its workspace are cuflash's contiguous allocations)
// and head_dim is a multiple of 8. Why: one warp per row with 2-byte loads kept
// the issue slots 75% busy at 2.5x the kernel's memory floor (ncu, H200, N = 512, B = 32, H = 32, d = 64: 154 us
// against 62). lse, L, D are (B, Hq, Sq) fp32 with row stride 1.
// ---------------------------------------------------------------------------------------------------------------
constexpr int kRowLanes = 8;
constexpr int kHelperRows = 128 / kRowLanes;

// row[0 .. 8) as floats, from one 16-byte load.
template <typename T>
__device__ __forceinline__ void load8(float (&x)[8], const T* row) {
  const uint4 v = *reinterpret_cast<const uint4*>(row);
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = to_float(e[i]);
}

// D_i = rowsum(dO_i o O_i) (FA2 Algorithm 2) and L = lse * log2(e) per row, and the dQ workspace zeroed.
template <typename T>
__global__ void __launch_bounds__(128) flash_bwd_preprocess_kernel(const __grid_constant__ Params p) {
  const int part = threadIdx.x % kRowLanes;  // this lane's 8-element chunks: 8 * part + 8 * kRowLanes * i
  const int row = blockIdx.x * kHelperRows + threadIdx.x / kRowLanes;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SeqSpan seq(p, batch);
  // A packed sequence's rows past its length touch nothing; they still take part in the shuffles (all 32 lanes).
  const bool in = row < seq.rows_q;
  float sum = 0.f;
  if (in) {
    const T* o_row = p.o.at<const T>(batch, head, seq.q0 + row);
    const T* do_row = p.dout.at<const T>(batch, head, seq.q0 + row);
    for (int c = 8 * part; c < p.head_dim; c += 8 * kRowLanes) {
      float o[8], d[8];
      load8(o, o_row + c), load8(d, do_row + c);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += o[i] * d[i];
    }
  }
#pragma unroll
  for (int off = kRowLanes / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (!in) return;
  if (part == 0) {
    const long long at = seq.stats + head * p.stats_head_stride + row;
    const float l = p.lse[at];
    // A row past its sequence's length, or one that sees no key (lse = -inf), has P = 0: exp2(S - +inf) = 0 for
    // every finite or -inf score. (S - -inf would give +inf.) Its D is 0, not dO.O: an infinite dO there (padding,
    // never read as such) would make dS = P * (dP - D) = 0 * NaN, and every key's dK NaN through dS^T Q.
    const bool seen = row < seq.len_q && l != neg_inf();
    p.dsum[at] = seen ? sum : 0.f;
    p.lse_log2[at] = seen ? l * kLog2e : pos_inf();
  }
  if (p.dq_accum.ptr != nullptr) {
    float* acc_row = p.dq_accum.at<float>(batch, head, seq.q0 + row);
    for (int c = 4 * part; c < p.head_dim; c += 4 * kRowLanes) {
      *reinterpret_cast<float4*>(acc_row + c) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// dQ = scale * workspace, in the input dtype (rounded to nearest even, as from_float). Same grid as the preprocess.
// ---------------------------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(128) flash_bwd_convert_dq_kernel(const __grid_constant__ Params p) {
  const int part = threadIdx.x % kRowLanes;
  const int row = blockIdx.x * kHelperRows + threadIdx.x / kRowLanes;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SeqSpan seq(p, batch);
  if (row >= seq.rows_q) return;
  const float* src = p.dq_accum.at<const float>(batch, head, seq.q0 + row);
  T* dst = p.dq.at<T>(batch, head, seq.q0 + row);
  const float s = p.scale;
  for (int c = 8 * part; c < p.head_dim; c += 8 * kRowLanes) {
    const float4 a = *reinterpret_cast<const float4*>(src + c), b = *reinterpret_cast<const float4*>(src + c + 4);
    uint4 v;
    v.x = arch::pack2<T>(a.x * s, a.y * s), v.y = arch::pack2<T>(a.z * s, a.w * s);
    v.z = arch::pack2<T>(b.x * s, b.y * s), v.w = arch::pack2<T>(b.z * s, b.w * s);
    *reinterpret_cast<uint4*>(dst + c) = v;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The main kernel (see the top of the file and bwd_traits.cuh for the warp layout).
//
// Reads q, dout (B, Sq, Hq, ld), k, v (B, Sk, Hkv, ld), lse_log2 and dsum from the preprocess, and writes dk, dv
// (B, Sk, Hkv, ld) and, unless deterministic (dq_accum null), dQ into the fp32 workspace dq_accum. The BlockMask
// lists are per key tile here (the transposed lists; ~m for a query tile kept only partly).
// ---------------------------------------------------------------------------------------------------------------
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, class Mods>
__global__ void __launch_bounds__(kWarps * 32, (BwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps>::kMinBlocks)) flash_bwd_kernel(const __grid_constant__ Params p) {
  using Tr = BwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps>;
  using SdP = typename Tr::SdP;
  using Load = typename Tr::Load;
  constexpr int kSplit = Tr::kSplit;
  constexpr int kNTilesS = SdP::kNTilesS;  // n-tiles of a warp's S^T (query columns / 8)

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + Tr::kSmemKV;
  T* sQ = sV + Tr::kSmemKV;
  T* sdO = sQ + Tr::kSmemQ;
  T* sdS = sdO + Tr::kSmemQ;                                   // dS^T [key][query]
  T* sP = sdS + Tr::kSmemS;                                    // P^T [key][query] (kSplit = 2 only)
  float* sL = reinterpret_cast<float*>(sdS + (kSplit == 1 ? 1 : 2) * Tr::kSmemS);  // lse * log2(e) per query
  float* sD = sL + kBlockM;                                                        // D per query

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int key_group = warp % Tr::kWarpsN;  // this warp's 16 keys: [16 * key_group, +16) of the tile
  const int part = warp / Tr::kWarpsN;       // its query columns of S^T, and its head-dim columns of dK/dV
  const int q_col0 = part * Tr::kQCols;
  const int d_col0 = part * Tr::kDCols;

  const BwdBlockInfo<Tr> blk(p);
  const int head_dim = p.head_dim;
  const T* k_j = p.k.at<const T>(blk.batch, blk.head_kv, blk.k0 + blk.key_begin);
  const T* v_j = p.v.at<const T>(blk.batch, blk.head_kv, blk.k0 + blk.key_begin);
  const bool accum_dq = p.dq_accum.ptr != nullptr;

  const int head_begin = blk.head_kv * p.heads_per_kv;
  QueryTiles tiles;
  tiles.init(p.mask.tile_counts, p.mask.tile_lists, blk.batch * p.mask.tiles_batch_stride, p.mask.tiles_head_stride,
             p.mask.list_len, blk.n_block, blk.m_begin, blk.m_end, head_begin, head_begin + p.heads_per_kv);

  // Issues the loads of query tile m of `head`: Q_i and dO_i by cp.async (rows past the sequence zero-filled),
  // L_i and D_i by plain loads into smem (rows past the array: L = +inf, D = 0, hence P = dS = 0).
  auto load_query_tile = [&](int m, int head) {
    const int row0 = m * kBlockM;
    load_tile<Load, kBlockM>(sQ, p.q.at<const T>(blk.batch, head, blk.q0 + row0), p.q.row_stride,
                             blk.len_q - row0, head_dim, tid);
    load_tile<Load, kBlockM>(sdO, p.dout.at<const T>(blk.batch, head, blk.q0 + row0),
                             p.dout.row_stride, blk.len_q - row0, head_dim, tid);
    arch::cp_async_commit();
    const long long at = blk.stats(p) + head * p.stats_head_stride + row0;
    for (int r = tid; r < kBlockM; r += Tr::kThreads) {
      const bool in = row0 + r < blk.rows_q(p);
      sL[r] = in ? p.lse_log2[at + r] : pos_inf();
      sD[r] = in ? p.dsum[at + r] : 0.f;
    }
  };

  // dV_j, dK_j of this warp's 16 keys x kDCols columns, fp32, for the whole block (lines 7-8, 15-16 of Alg. 2).
  float acc_dv[1][Tr::kDNTiles][4], acc_dk[1][Tr::kDNTiles][4];
#pragma unroll
  for (int nd = 0; nd < Tr::kDNTiles; ++nd)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc_dv[0][nd][r] = acc_dk[0][nd][r] = 0.f;

  bool partial;
  int head;
  int m = tiles.next(&partial, &head);
  if (m >= 0) {
    // Line 6: K_j, V_j to smem, once; with them the first query tile.
    load_tile<Load, kBlockN>(sK, k_j, p.k.row_stride, blk.len_k - blk.key_begin, head_dim, tid);
    load_tile<Load, kBlockN>(sV, v_j, p.v.row_stride, blk.len_k - blk.key_begin, head_dim, tid);
    load_query_tile(m, head);
  }

  const T* sK_warp = sK + 16 * key_group * Tr::kStride;
  const T* sV_warp = sV + 16 * key_group * Tr::kStride;
  QFrags<SdP> no_frags;  // A operands come from smem (SmemATraits)
  const DropoutRng rng{p.dropout.seed_lo, p.dropout.seed_hi, p.dropout.threshold};
  const bool dropout = p.dropout.threshold != 0u;

  while (m >= 0) {
    const int row0 = m * kBlockM;
    // Dropout keep bits of this warp's S^T tile (rows keys, columns queries of `head`), while S is not live and the
    // loads of Q_i, dO_i are in flight.
    unsigned int keep_bits = ~0u;
    if (dropout) {
      keep_bits = dropout_keep_bits_t<kNTilesS>(rng, blk.batch, head, blk.key_begin + 16 * key_group,
                                                row0 + q_col0, lane);
    }
    arch::cp_async_wait<0>();
    __syncthreads();  // Q_i, dO_i, L_i, D_i (and K_j, V_j) are in smem; every warp is done with the last dS

    // Lines 11-13: S^T = K_j Q_i^T with the forward's rounding (fp32 accumulate, one multiply by scale*log2e),
    // the element mask on boundary tiles, P^T = exp2(S^T - L).
    // (S0: the scaled scores before a score modifier, whose derivative the backward needs; unused without one.)
    float S[1][kNTilesS][4], S0[1][kNTilesS][4];
    const ScorePos pos{blk.batch, head, blk.len_q, blk.len_k};
    const int key_row0 = blk.key_begin + 16 * key_group;
    gemm_qk<SdP>(S, no_frags, sK_warp, sQ + q_col0 * Tr::kStride, lane);
    modify_scores<Mods, true, Mods::kScore>(S, S0, key_row0, row0 + q_col0, lane, pos, p);
    if (partial || blk.needs_mask(m, Mods::kScore) || Mods::kMask) {
      mask_scores<Mods, true>(S, key_row0, row0 + q_col0, lane, blk.vis, partial, pos, p);
    }
    // Lines 13-21 for this tile, compiled twice: with dropout (kDrop) and without, picked by a uniform branch per
    // tile, so that the path without dropout is exactly the code without it (one scheduling region, no dropout
    // instructions).
    auto backprop_tile = [&](auto drop) {
      constexpr bool kDrop = decltype(drop)::value;
#pragma unroll
      for (int nj = 0; nj < kNTilesS; ++nj) {
        const float2 L = *reinterpret_cast<const float2*>(sL + q_col0 + 8 * nj + 2 * (lane & 3));
        S[0][nj][0] = prob_from_lse(S[0][nj][0] - L.x);
        S[0][nj][1] = prob_from_lse(S[0][nj][1] - L.y);
        S[0][nj][2] = prob_from_lse(S[0][nj][2] - L.x);
        S[0][nj][3] = prob_from_lse(S[0][nj][3] - L.y);
      }

      // Lines 17-19: dP^T = V_j dO_i^T (with dropout: that of the dropped P, dP^T o Z^T / (1-p)),
      // dS^T = P^T o (dP^T - D_i) with the undropped P^T.
      float dP[1][kNTilesS][4];
      gemm_qk<SdP>(dP, no_frags, sV_warp, sdO + q_col0 * Tr::kStride, lane);
      if constexpr (kDrop) apply_keep_bits_t<kNTilesS>(dP, keep_bits);
#pragma unroll
      for (int nj = 0; nj < kNTilesS; ++nj) {
        const float2 D = *reinterpret_cast<const float2*>(sD + q_col0 + 8 * nj + 2 * (lane & 3));
        const float rescale = kDrop ? p.dropout.rescale : 1.f;
        dP[0][nj][0] = S[0][nj][0] * fmaf(dP[0][nj][0], rescale, -D.x);
        dP[0][nj][1] = S[0][nj][1] * fmaf(dP[0][nj][1], rescale, -D.y);
        dP[0][nj][2] = S[0][nj][2] * fmaf(dP[0][nj][2], rescale, -D.x);
        dP[0][nj][3] = S[0][nj][3] * fmaf(dP[0][nj][3], rescale, -D.y);
      }
      backprop_modifier<Mods, true, true>(dP, S0, key_row0, row0 + q_col0, lane, pos, p);

      // Line 16: dV_j += (P^T o Z^T) dO_i (straight from registers when the warp holds every query column); after
      // dS, which needs the undropped P. The 1/(1-p) is applied to dV once, at the end.
      if constexpr (kDrop) apply_keep_bits_t<kNTilesS>(S, keep_bits);
      if constexpr (kSplit == 1) {
        gemm_pv<SdP>(acc_dv, S, sdO, lane);
      } else {
        store_frags_smem<T, kNTilesS, Tr::kStrideS>(sP + 16 * key_group * Tr::kStrideS + q_col0, S, lane);
      }
      if (kSplit > 1 || accum_dq) {
        store_frags_smem<T, kNTilesS, Tr::kStrideS>(sdS + 16 * key_group * Tr::kStrideS + q_col0, dP, lane);
      }

      // Line 21: dK_j += dS^T Q_i (scaled once at the end).
      if constexpr (kSplit == 1) {
        gemm_pv<SdP>(acc_dk, dP, sQ, lane);
      } else {
        __syncthreads();  // the other part's P^T and dS^T columns are in smem
        gemm_smem_a<SdP, kBlockM / 16, Tr::kDNTiles, Tr::kStrideS>(acc_dv, sP + 16 * key_group * Tr::kStrideS,
                                                                  sdO + d_col0, lane);
        gemm_smem_a<SdP, kBlockM / 16, Tr::kDNTiles, Tr::kStrideS>(acc_dk, sdS + 16 * key_group * Tr::kStrideS,
                                                                  sQ + d_col0, lane);
      }
    };
    if (dropout) {
      backprop_tile(BoolConstant<true>{});
    } else {
      backprop_tile(BoolConstant<false>{});
    }
    __syncthreads();  // dS^T complete in smem; every warp is done with Q_i, dO_i, L_i, D_i

    // The next query tile's loads overlap the dQ product below, which reads only dS and K_j.
    bool next_partial;
    int next_head;
    const int m_next = tiles.next(&next_partial, &next_head);
    if (m_next >= 0) load_query_tile(m_next, next_head);

    // Line 20: dQ_i += dS K_j, added to the fp32 workspace (scaled by the convert kernel).
    if (accum_dq) {
      float* dq_tile = p.dq_accum.at<float>(blk.batch, head, blk.q0 + row0);
      dq_atomic<Tr>(dq_tile, p.dq_accum.row_stride, blk.len_q - row0, head_dim, sdS, sK, warp, lane);
    }

    m = m_next;
    head = next_head;
    partial = next_partial;
  }

  // Line 24: dK_j = scale * sum dS^T Q, dV_j (times 1/(1-p)), written once (zeros for keys no query sees; rows <
  // rows_k: the padded seqlen_k, or a packed sequence's own length).
  const int key0 = blk.key_begin + 16 * key_group;
  T* dk_w = p.dk.at<T>(blk.batch, blk.head_kv, blk.k0 + key0) + d_col0;
  T* dv_w = p.dv.at<T>(blk.batch, blk.head_kv, blk.k0 + key0) + d_col0;
  store_acc_tile<T, Tr::kDNTiles>(dk_w, p.dk.row_stride, blk.rows_k(p) - key0, head_dim - d_col0, acc_dk, p.scale,
                                  lane);
  store_acc_tile<T, Tr::kDNTiles>(dv_w, p.dv.row_stride, blk.rows_k(p) - key0, head_dim - d_col0, acc_dv,
                                  p.dropout.rescale, lane);
}

// ---------------------------------------------------------------------------------------------------------------
// Deterministic dQ: grid (query tiles, query heads, batch), the forward's orientation and block info. Warps own
// 16-row m-tiles of the query tile; per visible key tile: S = Q_i K_j^T, P = exp2(S*scale*log2e - L),
// dP = dO_i V_j^T, dS = P o (dP - D), dQ_i += dS K_j in registers. The key tiles and their BlockMask lists are
// the forward's (tile_lists at this kernel's tiles). No atomics: bitwise reproducible. Dropout as in the main kernel
// (dS = P o (dP o Z / (1-p) - D)), the keep bits made like the forward's (dropout.cuh).
// ---------------------------------------------------------------------------------------------------------------
// __launch_bounds__(..., 1): one block per SM is all it needs; left to itself ptxas caps 4-warp blocks at 168 registers
// to fit three per SM, and with a modifier compiled in that spilled.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, class Mods>
__global__ void __launch_bounds__(kWarps * 32, 1) flash_bwd_dq_kernel(const __grid_constant__ Params p) {
  using Tr = DqTraits<T, kHeadDim, kBlockM, kBlockN, kWarps>;
  constexpr int kMTiles = Tr::kMTiles;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + Tr::kSmemQ;
  T* sK = sdO + Tr::kSmemQ;
  T* sV = sK + Tr::kSmemKV;

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp_row = (tid / 32) * Tr::kRowsPerWarp;
  const BlockInfo<Tr> blk(p);
  const ScorePos pos{blk.batch, blk.head, blk.len_q, blk.len_k};
  const int head_dim = p.head_dim;
  const long long k_row_stride = p.k.row_stride, v_row_stride = p.v.row_stride;
  const T* q_i = p.q.at<const T>(blk.batch, blk.head, blk.q0 + blk.row_begin);
  const T* do_i = p.dout.at<const T>(blk.batch, blk.head, blk.q0 + blk.row_begin);
  const T* k_bh = p.k.at<const T>(blk.batch, blk.head_kv, blk.k0);
  const T* v_bh = p.v.at<const T>(blk.batch, blk.head_kv, blk.k0);

  KeyTiles tiles;
  plan_key_tiles(tiles, blk, p.mask);

  // This thread's rows: 2 per m-tile (lane/4 and lane/4 + 8), their L and D.
  float L[2 * kMTiles], Dr[2 * kMTiles];
#pragma unroll
  for (int r = 0; r < 2 * kMTiles; ++r) {
    const int row = blk.row_begin + warp_row + 16 * (r / 2) + (lane / 4) + 8 * (r % 2);
    const long long at = blk.stats(p) + blk.head * p.stats_head_stride + row;
    L[r] = row < blk.rows_q(p) ? p.lse_log2[at] : pos_inf();
    Dr[r] = row < blk.rows_q(p) ? p.dsum[at] : 0.f;
  }

  float acc[kMTiles][Tr::kNTilesO][4];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int nd = 0; nd < Tr::kNTilesO; ++nd)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mi][nd][r] = 0.f;

  const T* sQ_warp = sQ + warp_row * Tr::kSmemStride;
  const T* sdO_warp = sdO + warp_row * Tr::kSmemStride;
  QFrags<Tr> no_frags;

  bool partial;
  int n = tiles.next(&partial);
  if (n >= 0) {
    load_tile<Tr, kBlockM>(sQ, q_i, p.q.row_stride, blk.len_q - blk.row_begin, head_dim, tid);
    load_tile<Tr, kBlockM>(sdO, do_i, p.dout.row_stride, blk.len_q - blk.row_begin, head_dim, tid);
    load_tile<Tr, kBlockN>(sK, k_bh + (long long)n * kBlockN * k_row_stride, k_row_stride, blk.len_k - n * kBlockN,
                           head_dim, tid);
    load_tile<Tr, kBlockN>(sV, v_bh + (long long)n * kBlockN * v_row_stride, v_row_stride, blk.len_k - n * kBlockN,
                           head_dim, tid);
    arch::cp_async_commit();
  }

  const DropoutRng rng{p.dropout.seed_lo, p.dropout.seed_hi, p.dropout.threshold};
  const bool dropout = p.dropout.threshold != 0u;

  while (n >= 0) {
    const int key0 = n * kBlockN;
    arch::cp_async_wait<0>();
    __syncthreads();  // K_j, V_j (and Q_i, dO_i) are in smem; every warp is done with the previous K_j

    float S[kMTiles][Tr::kNTilesS][4], S0[kMTiles][Tr::kNTilesS][4];  // the forward's S, bit for bit (scores.cuh)
    score_tile<Tr, Mods, Mods::kScore>(S, S0, no_frags, sQ_warp, sK, lane, blk.needs_mask(n, Mods::kScore),
                                       partial, blk.row_begin + warp_row, key0, blk.vis, pos, p);
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int nj = 0; nj < Tr::kNTilesS; ++nj)
#pragma unroll
        for (int r = 0; r < 4; ++r) S[mi][nj][r] = prob_from_lse(S[mi][nj][r] - L[2 * mi + r / 2]);

    float dP[kMTiles][Tr::kNTilesS][4];
    gemm_qk<Tr>(dP, no_frags, sdO_warp, sV, lane);
    __syncthreads();  // every warp is done with V_j
    bool next_partial;
    const int n_next = tiles.next(&next_partial);
    if (n_next >= 0) {
      load_tile<Tr, kBlockN>(sV, v_bh + (long long)n_next * kBlockN * v_row_stride, v_row_stride,
                             blk.len_k - n_next * kBlockN, head_dim, tid);
      arch::cp_async_commit();
    }
    if (dropout) {
      // dP of the dropped P: dP o Z, times 1/(1-p) in the fma below. The keep bits are made here, while the next V
      // tile loads, not at the top of the loop: there ptxas gave the head_dim 32 specialization a lower register
      // budget and a 28-byte spill on sm_80.
      unsigned int keep_bits[2];
      dropout_keep_bits<kMTiles, Tr::kNTilesS>(keep_bits, rng, blk.batch, blk.head, blk.row_begin + warp_row, key0,
                                               lane);
      apply_keep_bits<kMTiles, Tr::kNTilesS>(dP, keep_bits);
    }
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int nj = 0; nj < Tr::kNTilesS; ++nj)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          dP[mi][nj][r] = S[mi][nj][r] * fmaf(dP[mi][nj][r], p.dropout.rescale, -Dr[2 * mi + r / 2]);
    // dS of the unmodified scores (dbias is the main kernel's job: it runs in both dQ modes)
    backprop_modifier<Mods, false, false>(dP, S0, blk.row_begin + warp_row, key0, lane, pos, p);

    gemm_pv<Tr>(acc, dP, sK, lane);  // dQ_i += dS K_j: K_j read like V in the forward
    if (n_next >= 0) {
      __syncthreads();  // every warp is done with K_j
      load_tile<Tr, kBlockN>(sK, k_bh + (long long)n_next * kBlockN * k_row_stride, k_row_stride,
                             blk.len_k - n_next * kBlockN, head_dim, tid);
      arch::cp_async_commit();
    }
    n = n_next;
    partial = next_partial;
  }

  T* dq_i = p.dq.at<T>(blk.batch, blk.head, blk.q0);
  const float scale2[2] = {p.scale, p.scale};
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    const int row0 = blk.row_begin + warp_row + 16 * mi;
    store_o_tile<Tr>(dq_i + row0 * p.dq.row_stride, p.dq.row_stride, blk.rows_q(p) - row0, head_dim, acc[mi], scale2,
                     lane);
  }
}

}  // namespace cuflash
