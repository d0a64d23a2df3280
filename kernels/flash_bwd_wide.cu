// cuflash — FlashAttention-2 backward by recomputation (FA2 Algorithm 2) for float32 and float64: flash_bwd.cu's
// kernels and features over the arithmetics of wide_mma.cuh, every intermediate in the element type.
//
//   flash_bwd_wide_preprocess_kernel   D = rowsum(dO o O) and L = the lse in softmax units per query row (float32:
//                                      lse * log2(e); float64: lse; L = +inf for rows that see no key: P = 0), and
//                                      zeroes the dQ workspace.
//   flash_bwd_wide_kernel              grid (key tiles, kv heads, batch): K_j, V_j loaded once; for every query head
//                                      of the kv head's group and every query tile i that sees the keys: S^T = K_j
//                                      Q_i^T (the forward's rounding), P^T = ex(S^T - L), dP^T = V_j dO_i^T,
//                                      dS^T = P^T o (dP^T - D); P^T and dS^T through shared memory; dV_j += P^T dO_i,
//                                      dK_j += dS^T Q_i in registers; dQ_i += dS K_j by atomics (float32 or float64
//                                      atomicAdd) into the workspace unless deterministic (wide_traits.cuh: layout).
//   flash_bwd_wide_convert_dq_kernel   dQ = workspace * scale (default mode).
//   flash_bwd_wide_dq_kernel           deterministic mode instead: grid (query tiles, query heads, batch), S, P, dP,
//                                      dS recomputed per key tile in the forward's orientation, dQ_i in registers.
//
// Masks, lengths, GQA, BlockMask lists (transposed for the main kernel), dropout (keep bits regenerated from
// (batch, query head, query, key), wide_scores.cuh) and modifiers (chain rule, dbias by atomics in the element type)
// follow flash_bwd.cu. With rescale = 1/(1-p): dV_j += (P o Z)^T dO_i * rescale (once, at the end),
// dS = P o (dP o Z * rescale - D).
#include "params.cuh"
#include "mask.cuh"
#include "block_info.cuh"
#include "bwd_block_info.cuh"
#include "mods.cuh"
#include "philox.cuh"
#include "wide_math.cuh"
#include "wide_mma.cuh"
#include "wide_traits.cuh"
#include "wide_tile.cuh"
#include "wide_scores.cuh"

namespace cuflash {

// ---------------------------------------------------------------------------------------------------------------
// Preprocess: one warp per query row, kWideHelperRows rows per 128-thread block (cuflash/cuda/specs.py,
// HELPER_ROWS). lse, L, D are (B, Hq, Sq) in T with row stride 1.
// ---------------------------------------------------------------------------------------------------------------
constexpr int kWideHelperRows = 4;

template <typename T>
__global__ void __launch_bounds__(128) flash_bwd_wide_preprocess_kernel(const __grid_constant__ Params p) {
  using R = wide::Real<T>;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWideHelperRows + threadIdx.x / 32;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SeqSpan seq(p, batch);
  if (row >= seq.rows_q) return;  // a packed sequence's blocks past its length touch nothing
  const int len_q = seq.len_q;
  const T* o_row = p.o.at<const T>(batch, head, seq.q0 + row);
  const T* do_row = p.dout.at<const T>(batch, head, seq.q0 + row);
  T sum = T(0);
  for (int c = lane; c < p.head_dim; c += 32) sum = R::fma(o_row[c], do_row[c], sum);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    const long long at = seq.stats + head * p.stats_head_stride + row;
    const T l = wide::stats<T>(p.lse)[at];
    const bool seen = row < len_q && l != R::neg_inf();  // else P = 0 and D = 0 (see flash_bwd.cu)
    wide::stats<T>(p.dsum)[at] = seen ? sum : T(0);
    wide::stats<T>(p.lse_log2)[at] = seen ? R::lse_to_units(l) : R::pos_inf();
  }
  if (p.dq_accum.ptr != nullptr) {
    T* acc_row = p.dq_accum.at<T>(batch, head, seq.q0 + row);
    for (int c = lane; c < p.head_dim; c += 32) acc_row[c] = T(0);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// dQ = scale * workspace. Same grid as the preprocess.
// ---------------------------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(128) flash_bwd_wide_convert_dq_kernel(const __grid_constant__ Params p) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWideHelperRows + threadIdx.x / 32;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SeqSpan seq(p, batch);
  if (row >= seq.rows_q) return;
  const T* src = p.dq_accum.at<const T>(batch, head, seq.q0 + row);
  T* dst = p.dq.at<T>(batch, head, seq.q0 + row);
  const T scale = wide::Real<T>::scale(p);
  for (int c = lane; c < p.head_dim; c += 32) dst[c] = src[c] * scale;
}

namespace wide {

// dQ_i += dS K_j (unscaled) for a kBlockM x kHeadDim query tile, added to the workspace with atomics: the warps
// take (kTM-row, 32-column) units in turn. dS^T is in smem as [key][query] (the A operand read column-major), K as
// [key][d] (B row-major). Rows >= rows_valid and columns >= cols_valid are not written.
template <class Tr>
__device__ __forceinline__ void dq_atomic(typename Tr::T* dq_tile, long long row_stride, int rows_valid,
                                          int cols_valid, const typename Tr::T* sdSt, const typename Tr::T* sK,
                                          int warp, int lane) {
  using T = typename Tr::T;
  using M = typename Tr::M;
  constexpr int kMTq = Tr::kBlockM / Tr::kTM;
  constexpr int kUnits = kMTq * (Tr::kHeadDim / 32);
  // a runtime loop: unrolled, the units would interleave and cost registers the dK/dV accumulators need
#pragma unroll 1
  for (int u = warp; u < kUnits; u += Tr::kWarps) {
    const int mt = u % kMTq;
    const int d0 = (u / kMTq) * 32;
    T acc[1][4][Tr::kR];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int r = 0; r < Tr::kR; ++r) acc[0][nt][r] = T(0);
    warp_gemm<M, 1, 4, Tr::kBlockN>(acc, ColMajor<T, Tr::kLdS>{sdSt + mt * Tr::kTM}, RowMajor<T, Tr::kLd>{sK + d0},
                                    lane);
#pragma unroll
    for (int h = 0; h < Tr::kR / 2; ++h) {
      const int r = mt * Tr::kTM + (lane >> 2) + 8 * h;
      if (r < rows_valid) {
        T* dst = dq_tile + r * row_stride;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int col = d0 + 8 * nt + 2 * (lane & 3);
          if (col < cols_valid) {  // cols_valid is a multiple of 8
            atomicAdd(dst + col, acc[0][nt][2 * h]);
            atomicAdd(dst + col + 1, acc[0][nt][2 * h + 1]);
          }
        }
      }
    }
  }
}

}  // namespace wide

template <bool B>
struct WideBool {  // a compile-time bool for the per-tile dropout branch (no <type_traits> in NVRTC)
  static constexpr bool value = B;
};

// ---------------------------------------------------------------------------------------------------------------
// The main kernel. Reads q, dout, k, v, lse_log2 and dsum; writes dk, dv and (unless deterministic) the dQ
// workspace. BlockMask lists per key tile (the transposed lists; ~m for a query tile kept only partly).
// ---------------------------------------------------------------------------------------------------------------
template <class M, int kHeadDim, int kBlockM, int kBlockN, int kWarps, class Mods>
__global__ void CUFLASH_WIDE_BOUNDS(kWarps * 32) flash_bwd_wide_kernel(const __grid_constant__ Params p) {
  using Tr = wide::WideBwdTraits<M, kHeadDim, kBlockM, kBlockN, kWarps>;
  using T = typename Tr::T;
  using R = wide::Real<T>;
  constexpr int kTM = Tr::kTM, kR = Tr::kR, kNTS = Tr::kNTilesS, kDNT = Tr::kDNTiles;
  constexpr int kLd = Tr::kLd, kLdS = Tr::kLdS;
  static_assert(kBlockM % kTM == 0, "dQ units of whole fragment rows");
  wide::check_mods<Mods, T>();

  alignas(16) extern __shared__ unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + Tr::kSmemKV;
  T* sQ = sV + Tr::kSmemKV;
  T* sdO = sQ + Tr::kSmemQ;
  T* sPt = sdO + Tr::kSmemQ;   // P^T [key][query] (dropped entries zero)
  T* sdSt = sPt + Tr::kSmemS;  // dS^T [key][query]
  T* sL = sdSt + Tr::kSmemS;   // lse * log2(e) per query
  T* sD = sL + kBlockM;        // D per query

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int key_group = warp % Tr::kWarpsN;  // this warp's kTM keys: [kTM * key_group, +kTM) of the tile
  const int part = warp / Tr::kWarpsN;       // its query columns of S^T and head-dim columns of dK/dV
  const int q_col0 = part * Tr::kQCols;
  const int d_col0 = part * Tr::kDCols;
  const bool s_phase = part < Tr::kQParts;   // warp-uniform

  const BwdBlockInfo<Tr> blk(p);
  const int head_dim = p.head_dim;
  const T* k_j = p.k.at<const T>(blk.batch, blk.head_kv, blk.k0 + blk.key_begin);
  const T* v_j = p.v.at<const T>(blk.batch, blk.head_kv, blk.k0 + blk.key_begin);
  const bool accum_dq = p.dq_accum.ptr != nullptr;
  const T* lse_log2 = wide::stats<T>(p.lse_log2);
  const T* dsum = wide::stats<T>(p.dsum);

  const int head_begin = blk.head_kv * p.heads_per_kv;
  QueryTiles tiles;
  tiles.init(p.mask.tile_counts, p.mask.tile_lists, blk.batch * p.mask.tiles_batch_stride, p.mask.tiles_head_stride,
             p.mask.list_len, blk.n_block, blk.m_begin, blk.m_end, head_begin, head_begin + p.heads_per_kv);

  // Issues query tile m of `head`: Q_i, dO_i by cp.async (rows past the sequence zero), L_i and D_i by plain loads
  // (rows past the array: L = +inf, D = 0, hence P = dS = 0).
  auto load_query_tile = [&](int m, int head) {
    const int row0 = m * kBlockM;
    wide::load_tile<T, kBlockM, kHeadDim, kLd, Tr::kThreads>(sQ, p.q.at<const T>(blk.batch, head, blk.q0 + row0),
                                                             p.q.row_stride, blk.len_q - row0, head_dim, tid);
    wide::load_tile<T, kBlockM, kHeadDim, kLd, Tr::kThreads>(
        sdO, p.dout.at<const T>(blk.batch, head, blk.q0 + row0), p.dout.row_stride, blk.len_q - row0,
        head_dim, tid);
    arch::cp_async_commit();
    const long long at = blk.stats(p) + head * p.stats_head_stride + row0;
    for (int r = tid; r < kBlockM; r += Tr::kThreads) {
      const bool in = row0 + r < blk.rows_q(p);
      sL[r] = in ? lse_log2[at + r] : R::pos_inf();
      sD[r] = in ? dsum[at + r] : T(0);
    }
  };

  T acc_dv[1][kDNT][kR], acc_dk[1][kDNT][kR];
#pragma unroll
  for (int nd = 0; nd < kDNT; ++nd)
#pragma unroll
    for (int r = 0; r < kR; ++r) acc_dv[0][nd][r] = acc_dk[0][nd][r] = T(0);

  bool partial;
  int head;
  int m = tiles.next(&partial, &head);
  if (m >= 0) {
    wide::load_tile<T, kBlockN, kHeadDim, kLd, Tr::kThreads>(sK, k_j, p.k.row_stride, blk.len_k - blk.key_begin,
                                                             head_dim, tid);
    wide::load_tile<T, kBlockN, kHeadDim, kLd, Tr::kThreads>(sV, v_j, p.v.row_stride, blk.len_k - blk.key_begin,
                                                             head_dim, tid);
    load_query_tile(m, head);
  }

  const T* sK_warp = sK + kTM * key_group * kLd;
  const T* sV_warp = sV + kTM * key_group * kLd;
  T* sPt_warp = sPt + kTM * key_group * kLdS;
  T* sdSt_warp = sdSt + kTM * key_group * kLdS;
  const int key_row0 = blk.key_begin + kTM * key_group;
  const DropoutRng rng{p.dropout.seed_lo, p.dropout.seed_hi, p.dropout.threshold};
  const bool dropout = p.dropout.threshold != 0u;

  while (m >= 0) {
    const int row0 = m * kBlockM;
    arch::cp_async_wait<0>();
    __syncthreads();  // Q_i, dO_i, L_i, D_i (and K_j, V_j) in smem; every warp is done with the last dS^T

    if (s_phase) {
      const ScorePos pos{blk.batch, head, blk.len_q, blk.len_k};
      // Lines 11-13: S^T = K_j Q_i^T with the forward's rounding, the element mask, P^T = ex(S^T - L).
      T S[1][kNTS][kR], S0[1][kNTS][kR];
#pragma unroll
      for (int nj = 0; nj < kNTS; ++nj)
#pragma unroll
        for (int r = 0; r < kR; ++r) S[0][nj][r] = T(0);
      wide::warp_gemm<M, 1, kNTS, kHeadDim>(S, wide::RowMajor<T, kLd>{sK_warp}, wide::ColMajor<T, kLd>{sQ + q_col0 * kLd},
                                            lane);
      wide::modify_scores<Mods, true, Mods::kScore, kTM>(S, S0, key_row0, row0 + q_col0, lane, pos, p);
      if (partial || blk.needs_mask(m, Mods::kScore) || Mods::kMask) {
        wide::mask_scores<Mods, true, kTM>(S, key_row0, row0 + q_col0, lane, blk.vis, partial, pos, p);
      }
#pragma unroll
      for (int nj = 0; nj < kNTS; ++nj)
#pragma unroll
        for (int r = 0; r < kR; ++r)
          S[0][nj][r] = R::prob(S[0][nj][r] - sL[q_col0 + 8 * nj + 2 * (lane & 3) + (r & 1)]);

      // Lines 17-19: dP^T = V_j dO_i^T (with dropout, of the dropped P: dP^T o Z^T / (1-p)), dS^T = P^T o (dP^T - D)
      // with the undropped P^T; then the modifier's chain rule (and dbias).
      T dP[1][kNTS][kR];
#pragma unroll
      for (int nj = 0; nj < kNTS; ++nj)
#pragma unroll
        for (int r = 0; r < kR; ++r) dP[0][nj][r] = T(0);
      wide::warp_gemm<M, 1, kNTS, kHeadDim>(dP, wide::RowMajor<T, kLd>{sV_warp},
                                            wide::ColMajor<T, kLd>{sdO + q_col0 * kLd}, lane);
      auto finish = [&](auto drop) {
        constexpr bool kDrop = decltype(drop)::value;
        wide::KeepBits<1, kNTS, kR> bits;
        if constexpr (kDrop) {
          wide::keep_bits<true, kTM>(bits, rng, blk.batch, head, key_row0, row0 + q_col0, lane);
          wide::apply_keep(dP, bits);
        }
        const T rescale = kDrop ? R::rescale(p) : T(1);
#pragma unroll
        for (int nj = 0; nj < kNTS; ++nj)
#pragma unroll
          for (int r = 0; r < kR; ++r)
            dP[0][nj][r] = S[0][nj][r] * R::fma(dP[0][nj][r], rescale, -sD[q_col0 + 8 * nj + 2 * (lane & 3) + (r & 1)]);
        wide::backprop_modifier<Mods, true, true, kTM>(dP, S0, key_row0, row0 + q_col0, lane, pos, p);
        if constexpr (kDrop) wide::apply_keep(S, bits);
      };
      if (dropout) {
        finish(WideBool<true>{});
      } else {
        finish(WideBool<false>{});
      }
      wide::store_frags<M, 1, kNTS, kLdS>(sPt_warp + q_col0, S, lane);
      wide::store_frags<M, 1, kNTS, kLdS>(sdSt_warp + q_col0, dP, lane);
    }
    __syncthreads();  // P^T and dS^T complete in smem

    // Lines 16 and 21: dV_j += P^T dO_i, dK_j += dS^T Q_i for this warp's keys and head-dim columns, each tile's
    // product summed apart (warp_gemm_add: a chain over every query would lose accuracy with the length).
    wide::warp_gemm_add<M, 1, kDNT, kBlockM>(acc_dv, wide::RowMajor<T, kLdS>{sPt_warp},
                                             wide::RowMajor<T, kLd>{sdO + d_col0}, lane);
    wide::warp_gemm_add<M, 1, kDNT, kBlockM>(acc_dk, wide::RowMajor<T, kLdS>{sdSt_warp},
                                             wide::RowMajor<T, kLd>{sQ + d_col0}, lane);
    __syncthreads();  // every warp is done with Q_i, dO_i, L_i, D_i and P^T

    // The next query tile's loads overlap the dQ product below, which reads only dS^T and K_j.
    bool next_partial;
    int next_head;
    const int m_next = tiles.next(&next_partial, &next_head);
    if (m_next >= 0) load_query_tile(m_next, next_head);

    // Line 20: dQ_i += dS K_j into the workspace (scaled by the convert kernel).
    if (accum_dq) {
      T* dq_tile = p.dq_accum.at<T>(blk.batch, head, blk.q0 + row0);
      wide::dq_atomic<Tr>(dq_tile, p.dq_accum.row_stride, blk.len_q - row0, head_dim, sdSt, sK, warp, lane);
    }

    m = m_next;
    head = next_head;
    partial = next_partial;
  }

  // Line 24: dK_j = scale * sum dS^T Q, dV_j (times 1/(1-p)), written once (zeros for keys no query sees).
  T* dk_w = p.dk.at<T>(blk.batch, blk.head_kv, blk.k0 + key_row0) + d_col0;
  T* dv_w = p.dv.at<T>(blk.batch, blk.head_kv, blk.k0 + key_row0) + d_col0;
  T scale_k[kR / 2], scale_v[kR / 2];
#pragma unroll
  for (int h = 0; h < kR / 2; ++h) scale_k[h] = R::scale(p), scale_v[h] = R::rescale(p);
  wide::store_rows<T, kDNT, kR>(dk_w, p.dk.row_stride, blk.rows_k(p) - key_row0, head_dim - d_col0, acc_dk[0], scale_k,
                                lane);
  wide::store_rows<T, kDNT, kR>(dv_w, p.dv.row_stride, blk.rows_k(p) - key_row0, head_dim - d_col0, acc_dv[0], scale_v,
                                lane);
}

// ---------------------------------------------------------------------------------------------------------------
// Deterministic dQ: grid (query tiles, query heads, batch), the forward's orientation and block info; per visible
// key tile S = Q_i K_j^T, P = ex(S - L), dP = dO_i V_j^T, dS = P o (dP - D), dQ_i += dS K_j in registers. No
// atomics: bitwise reproducible.
// ---------------------------------------------------------------------------------------------------------------
template <class M, int kHeadDim, int kBlockM, int kBlockN, int kWarps, class Mods>
__global__ void CUFLASH_WIDE_BOUNDS(kWarps * 32) flash_bwd_wide_dq_kernel(const __grid_constant__ Params p) {
  using Tr = wide::WideDqTraits<M, kHeadDim, kBlockM, kBlockN, kWarps>;
  using T = typename Tr::T;
  using R = wide::Real<T>;
  constexpr int kMT = Tr::kMTiles, kNTS = Tr::kNTilesS, kNTO = Tr::kNTilesO, kR = Tr::kR, kTM = Tr::kTM;
  constexpr int kLd = Tr::kLd, kLdP = Tr::kLdP, kH = kR / 2;
  wide::check_mods<Mods, T>();

  alignas(16) extern __shared__ unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + Tr::kSmemQ;
  T* sK = sdO + Tr::kSmemQ;
  T* sV = sK + Tr::kSmemKV;
  T* sP = sV + Tr::kSmemKV;  // dS staged for the FMA paths

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
  const int row0 = blk.row_begin + warp_row;

  KeyTiles tiles;
  plan_key_tiles(tiles, blk, p.mask);

  // This lane's rows (kH per fragment block), their L and D.
  T L[kMT * kH], Dr[kMT * kH];
#pragma unroll
  for (int r = 0; r < kMT * kH; ++r) {
    const int row = row0 + kTM * (r / kH) + (lane / 4) + 8 * (r % kH);
    const long long at = blk.stats(p) + blk.head * p.stats_head_stride + row;
    L[r] = row < blk.rows_q(p) ? wide::stats<T>(p.lse_log2)[at] : R::pos_inf();
    Dr[r] = row < blk.rows_q(p) ? wide::stats<T>(p.dsum)[at] : T(0);
  }

  T acc[kMT][kNTO][kR];
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int nd = 0; nd < kNTO; ++nd)
#pragma unroll
      for (int r = 0; r < kR; ++r) acc[mi][nd][r] = T(0);

  bool partial;
  int n = tiles.next(&partial);
  if (n >= 0) {
    wide::load_tile<T, kBlockM, kHeadDim, kLd, Tr::kThreads>(sQ, q_i, p.q.row_stride, blk.len_q - blk.row_begin,
                                                             head_dim, tid);
    wide::load_tile<T, kBlockM, kHeadDim, kLd, Tr::kThreads>(sdO, do_i, p.dout.row_stride, blk.len_q - blk.row_begin,
                                                             head_dim, tid);
    wide::load_tile<T, kBlockN, kHeadDim, kLd, Tr::kThreads>(sK, k_bh + (long long)n * kBlockN * k_row_stride,
                                                             k_row_stride, blk.len_k - n * kBlockN, head_dim, tid);
    wide::load_tile<T, kBlockN, kHeadDim, kLd, Tr::kThreads>(sV, v_bh + (long long)n * kBlockN * v_row_stride,
                                                             v_row_stride, blk.len_k - n * kBlockN, head_dim, tid);
    arch::cp_async_commit();
  }

  const DropoutRng rng{p.dropout.seed_lo, p.dropout.seed_hi, p.dropout.threshold};
  const bool dropout = p.dropout.threshold != 0u;
  const T rescale = R::rescale(p);

  while (n >= 0) {
    const int key0 = n * kBlockN;
    arch::cp_async_wait<0>();
    __syncthreads();  // K_j, V_j (and Q_i, dO_i) in smem; every warp is done with the previous K_j and staged dS

    T S[kMT][kNTS][kR], S0[kMT][kNTS][kR];  // the forward's S, bit for bit
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int nj = 0; nj < kNTS; ++nj)
#pragma unroll
        for (int r = 0; r < kR; ++r) S[mi][nj][r] = T(0);
    wide::warp_gemm<M, kMT, kNTS, kHeadDim>(S, wide::RowMajor<T, kLd>{sQ + warp_row * kLd}, wide::ColMajor<T, kLd>{sK},
                                            lane);
    wide::modify_scores<Mods, false, Mods::kScore, kTM>(S, S0, row0, key0, lane, pos, p);
    if (partial || blk.needs_mask(n, Mods::kScore) || Mods::kMask) {
      wide::mask_scores<Mods, false, kTM>(S, row0, key0, lane, blk.vis, partial, pos, p);
    }
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int nj = 0; nj < kNTS; ++nj)
#pragma unroll
        for (int r = 0; r < kR; ++r) S[mi][nj][r] = R::prob(S[mi][nj][r] - L[mi * kH + r / 2]);

    T dP[kMT][kNTS][kR];
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int nj = 0; nj < kNTS; ++nj)
#pragma unroll
        for (int r = 0; r < kR; ++r) dP[mi][nj][r] = T(0);
    wide::warp_gemm<M, kMT, kNTS, kHeadDim>(dP, wide::RowMajor<T, kLd>{sdO + warp_row * kLd},
                                            wide::ColMajor<T, kLd>{sV}, lane);
    __syncthreads();  // every warp is done with V_j
    bool next_partial;
    const int n_next = tiles.next(&next_partial);
    if (n_next >= 0) {
      wide::load_tile<T, kBlockN, kHeadDim, kLd, Tr::kThreads>(sV, v_bh + (long long)n_next * kBlockN * v_row_stride,
                                                               v_row_stride, blk.len_k - n_next * kBlockN, head_dim,
                                                               tid);
      arch::cp_async_commit();
    }
    if (dropout) {  // dP of the dropped P: dP o Z, times 1/(1-p) below
      wide::KeepBits<kMT, kNTS, kR> bits;
      wide::keep_bits<false, kTM>(bits, rng, blk.batch, blk.head, row0, key0, lane);
      wide::apply_keep(dP, bits);
    }
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int nj = 0; nj < kNTS; ++nj)
#pragma unroll
        for (int r = 0; r < kR; ++r)
          dP[mi][nj][r] = S[mi][nj][r] * R::fma(dP[mi][nj][r], dropout ? rescale : T(1), -Dr[mi * kH + r / 2]);
    // dS of the unmodified scores (dbias is the main kernel's job: it runs in both dQ modes)
    wide::backprop_modifier<Mods, false, false, kTM>(dP, S0, row0, key0, lane, pos, p);

    // dQ_i += dS K_j: K_j read as B[key][d], like V in the forward
    wide::warp_gemm_pv<M, kMT, kNTS, kNTO, kLdP>(acc, dP, sP + warp_row * kLdP, wide::RowMajor<T, kLd>{sK}, lane);
    if (n_next >= 0) {
      __syncthreads();  // every warp is done with K_j
      wide::load_tile<T, kBlockN, kHeadDim, kLd, Tr::kThreads>(sK, k_bh + (long long)n_next * kBlockN * k_row_stride,
                                                               k_row_stride, blk.len_k - n_next * kBlockN, head_dim,
                                                               tid);
      arch::cp_async_commit();
    }
    n = n_next;
    partial = next_partial;
  }

  T* dq_i = p.dq.at<T>(blk.batch, blk.head, blk.q0);
  T scale[kH];
#pragma unroll
  for (int h = 0; h < kH; ++h) scale[h] = R::scale(p);
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
    const int r0 = row0 + kTM * mi;
    wide::store_rows<T, kNTO, kR>(dq_i + r0 * p.dq.row_stride, p.dq.row_stride, blk.rows_q(p) - r0, head_dim, acc[mi],
                                  scale, lane);
  }
}

}  // namespace cuflash
