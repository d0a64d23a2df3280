// cuflash — FlashAttention-2 forward (FA2 Algorithm 1), one fused kernel: S and P never leave registers.
//
// Grid: (query tiles, query heads, batch). Block: kWarps warps; warp w owns query rows
// [w * kRowsPerWarp, (w + 1) * kRowsPerWarp) of the tile, so the softmax statistics of a row never cross warps.
//
// Pipeline (FA2's; K and V tiles alternate as the two cp.async buffers in flight):
//     wait K_j -> issue V_j  -> S = Q K_j^T, mask            (V_j lands while the tensor cores work on S)
//     wait V_j -> issue K_next -> softmax, acc += P V_j      (K_next lands during softmax and P V)
// Each wait is followed by __syncthreads(): the copy of every thread has landed, and every warp is done reading the
// buffer the next copy overwrites.
//
// One specialization serves every mask feature: causal, window, seqlens, BlockMask and GQA are runtime arguments
// whose cost is a few integer operations per key tile, never per score on interior tiles (the element mask runs
// only on boundary tiles: the split loop of FA2, written as a uniform branch per tile). Dropout likewise: a runtime
// threshold, one uniform branch per tile, the keep bits generated in registers (dropout.cuh).
#include "params.cuh"
#include "kernel_traits.cuh"
#include "mask.cuh"
#include "block_info.cuh"
#include "tile.cuh"
#include "warp_gemm.cuh"
#include "scores.cuh"
#include "softmax.cuh"
#include "dropout.cuh"
#include "kv_tile.cuh"
#include "combine.cuh"

namespace cuflash {

// The one argument is the params struct (params.cuh); this kernel reads q, k, v, o, lse and the mask, length,
// scale and dropout fields. q (B, Sq, Hq, ld), k/v (B, Sk, Hkv, ld), o like q: `head_dim` (a multiple of 8,
// <= kHeadDim) columns are read and written. lse (B, Hq, Sq) fp32, the natural-log log-sum-exp of the scaled
// scores. With dropout, the 1/(1-p) is folded into the final 1/l; the lse stays that of the undropped scores.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, class Mods>
__global__ void __launch_bounds__(kWarps * 32) flash_fwd_kernel(const __grid_constant__ Params p) {
  using Traits = FwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps>;
  constexpr int kMTiles = Traits::kMTiles;

  alignas(16) extern __shared__ unsigned char smem_raw[];  // 16-byte aligned: cp.async and ldmatrix rows
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Traits::kSmemQ;
  T* sV = sK + Traits::kSmemKV;

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp_row = (tid / 32) * Traits::kRowsPerWarp;  // first row of this warp inside the query tile
  const T* sQ_warp = sQ + warp_row * Traits::kSmemStride;

  const BlockInfo<Traits, true> blk(p);
  const ScorePos pos{blk.batch, blk.head, blk.len_q, blk.len_k};
  const long long q_row_stride = p.q.row_stride;
  const int head_dim = p.head_dim;
  const T* q_i = p.q.at<const T>(blk.batch, blk.head, blk.q0 + blk.row_begin);
  // K/V rows of this (sequence, kv head): a batch entry or packed sequence, or the pages of a paged KV cache.
  const int* pages = p.paged.block_table ? p.paged.block_table + blk.batch * p.paged.table_stride : nullptr;
  const T* k_bh = pages ? p.k.at<const T>(0, blk.head_kv) : p.k.at<const T>(blk.batch, blk.head_kv, blk.k0);
  const T* v_bh = pages ? p.v.at<const T>(0, blk.head_kv) : p.v.at<const T>(blk.batch, blk.head_kv, blk.k0);
  // Issues the copy of keys [key0, key0 + kBlockN) of K or V (uniform branch: paged or strided rows).
  auto load_kv = [&](T* smem, const T* base, const TensorArg& t, int key0) {
    if (pages == nullptr) {
      load_tile<Traits, kBlockN>(smem, base + key0 * t.row_stride, t.row_stride, blk.len_k - key0, head_dim, tid);
    } else {
      load_paged_tile<T, kBlockN, kHeadDim, Traits::kSmemStride, Traits::kThreads>(
          smem, base, pages, t.batch_stride, t.row_stride, p.paged.page_size, key0, blk.len_k - key0, head_dim, tid);
    }
  };

  KeyTiles tiles;
  plan_key_tiles(tiles, blk, p.mask);

  // Line 4: O_i = 0, l_i = 0, m_i = -inf, on chip.
  float acc[kMTiles][Traits::kNTilesO][4];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int nd = 0; nd < Traits::kNTilesO; ++nd)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mi][nd][r] = 0.f;
  OnlineSoftmax<Traits> softmax;
  softmax.init();
  QFrags<Traits> q_frags;

  bool partial;
  int n = tiles.next(&partial);
  if (n >= 0) {
    // Line 3: load Q_i (rows past the sequence's length are zero) and, in the same breath, the first K_j.
    load_tile<Traits, kBlockM>(sQ, q_i, q_row_stride, blk.len_q - blk.row_begin, head_dim, tid);
    arch::cp_async_commit();
    load_kv(sK, k_bh, p.k, n * kBlockN);
    arch::cp_async_commit();
    if constexpr (Traits::kQInRegs) {
      arch::cp_async_wait<1>();  // Q only; K_j may still be in flight
      __syncthreads();
      load_q_frags<Traits>(q_frags, sQ_warp, lane);
    }
  }

  const DropoutRng rng{p.dropout.seed_lo, p.dropout.seed_hi, p.dropout.threshold};
  const bool dropout = p.dropout.threshold != 0u;
  while (n >= 0) {
    const int key0 = n * kBlockN;
    // Dropout keep bits of this tile (dropout.cuh): integer work that overlaps the wait for K_j, done while S is
    // not live yet. Uniform branch (a kernel argument); threshold 0 keeps every element.
    unsigned int keep_bits[2] = {~0u, ~0u};
    if (dropout) {
      dropout_keep_bits<kMTiles, Traits::kNTilesS>(keep_bits, rng, blk.batch, blk.head, blk.row_begin + warp_row,
                                                   key0, lane);
    }
    arch::cp_async_wait<0>();
    __syncthreads();  // K_j is in smem; every warp is done with V_{j-1}
    load_kv(sV, v_bh, p.v, key0);
    arch::cp_async_commit();

    // Line 8: S = Q_i K_j^T * scale * log2(e), the element mask on boundary tiles only (scores.cuh).
    float S[kMTiles][Traits::kNTilesS][4];
    score_tile<Traits, Mods>(S, S, q_frags, sQ_warp, sK, lane, blk.needs_mask(n, Mods::kScore), partial,
                             blk.row_begin + warp_row, key0, blk.vis, pos, p);

    arch::cp_async_wait<0>();
    __syncthreads();  // V_j is in smem; every warp is done with K_j
    bool next_partial;
    const int n_next = tiles.next(&next_partial);
    if (n_next >= 0) {
      load_kv(sK, k_bh, p.k, n_next * kBlockN);
      arch::cp_async_commit();
    }

    // Lines 9-10: m_i, P = exp2(S - m_i), l_i, and acc rescaled; then acc += P V_j. With dropout, l_i has summed
    // the undropped P (so lse is dropout-free) before the dropped entries are zeroed: acc += (P o Z) V_j.
    softmax.update(S, acc);
    if (dropout) apply_keep_bits<kMTiles, Traits::kNTilesS>(S, keep_bits);
    gemm_pv<Traits>(acc, S, sV, lane);

    n = n_next;
    partial = next_partial;
  }

  // Lines 12-15: O_i = diag(l_i)^-1 acc and L_i = m_i + log(l_i), written once. With dropout the 1/(1-p) is folded
  // into the per-row factor diag(l_i)^-1 (one multiply per row instead of one per score).
  float inv_l[2 * kMTiles], lse_row[2 * kMTiles];
  bool row_valid[2 * kMTiles];
#pragma unroll
  for (int r = 0; r < 2 * kMTiles; ++r) {
    const int row = blk.row_begin + warp_row + 16 * (r / 2) + (lane / 4) + 8 * (r % 2);
    row_valid[r] = row < blk.len_q;
  }
  softmax.finalize(inv_l, lse_row, row_valid);
#pragma unroll
  for (int r = 0; r < 2 * kMTiles; ++r) inv_l[r] *= p.dropout.rescale;  // exact (x * 1) without dropout

  // Rows [len_q, rows_q) of a padded batch get out = 0, lse = -inf; a packed sequence writes only its own rows.
  const long long o_row_stride = p.o.row_stride;
  const int seqlen_q = blk.rows_q(p);
  auto write = [&](auto* o_i, float* lse_i) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      const int row0 = blk.row_begin + warp_row + 16 * mi;
      const float scale2[2] = {inv_l[2 * mi], inv_l[2 * mi + 1]};
      store_o_tile<Traits>(o_i + row0 * o_row_stride, o_row_stride, seqlen_q - row0, head_dim, acc[mi], scale2,
                           lane);
      if (lane % 4 == 0) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = row0 + lane / 4 + 8 * half;
          if (row < seqlen_q) lse_i[row] = lse_row[2 * mi + half];
        }
      }
    }
  };
  const long long o_at = blk.batch * p.o.batch_stride + blk.head * p.o.head_stride + blk.q0 * o_row_stride;
  const long long lse_at = blk.stats(p) + blk.head * p.stats_head_stride;
  if (p.split.num_splits > 1) {  // split-KV: this split's normalized partial to the float32 workspaces (combine.cuh)
    const int split = blockIdx.z - blk.batch * p.split.num_splits;
    write(static_cast<float*>(p.split.o_accum) + split * p.split.o_split_stride + o_at,
          static_cast<float*>(p.split.lse_accum) + split * p.split.lse_split_stride + lse_at);
  } else {
    write(static_cast<T*>(p.o.ptr) + o_at, p.lse + lse_at);
  }
}

}  // namespace cuflash
