// cuflash — FlashAttention-2 forward (FA2 Algorithm 1) for float32 and float64: flash_fwd.cu's algorithm, pipeline
// and features over the arithmetics of wide_mma.cuh (float64 DMMA or DFMA, float32 FFMA, TF32 or 3xTF32), with the
// softmax statistics and every intermediate in the element type.
//
// Grid: (query tiles, query heads, batch). Block: kWarps warps, warp w owns query rows [w * kRowsPerWarp, ...).
// Pipeline (as flash_fwd.cu; K and V tiles alternate as the two cp.async buffers in flight):
//     wait K_j -> issue V_j -> S = Q K_j^T, mask              (V_j lands while S is computed)
//     wait V_j -> issue K_next -> softmax, acc += P V_j       (K_next lands during softmax and P V)
// Causal, windows, seqlens, BlockMask, GQA and dropout are runtime arguments (Params), modifiers the Mods template
// parameter (rendered in the element type), exactly as in the 16-bit kernel: one specialization per (arithmetic,
// head_dim) serves every mask feature.
#include "params.cuh"
#include "mask.cuh"
#include "block_info.cuh"
#include "mods.cuh"
#include "philox.cuh"
#include "wide_math.cuh"
#include "wide_mma.cuh"
#include "wide_traits.cuh"
#include "wide_tile.cuh"
#include "wide_softmax.cuh"
#include "wide_scores.cuh"
#include "kv_tile.cuh"
#include "combine.cuh"

namespace cuflash {

// Reads q, k, v (B, S, H, ld) of the element type, writes o (like q) and lse (B, Hq, Sq) in the element type
// (natural log). M: the arithmetic (wide_mma.cuh), whose element type the arrays have.
// CUFLASH_WIDE_BOUNDS: the register budget (wide_traits.cuh).
template <class M, int kHeadDim, int kBlockM, int kBlockN, int kWarps, class Mods>
__global__ void CUFLASH_WIDE_BOUNDS(kWarps * 32) flash_fwd_wide_kernel(const __grid_constant__ Params p) {
  using Tr = wide::WideFwdTraits<M, kHeadDim, kBlockM, kBlockN, kWarps>;
  using T = typename Tr::T;
  using R = wide::Real<T>;
  constexpr int kMT = Tr::kMTiles, kNTS = Tr::kNTilesS, kNTO = Tr::kNTilesO, kR = Tr::kR, kTM = Tr::kTM;
  constexpr int kLd = Tr::kLd, kLdV = Tr::kLdV, kLdP = Tr::kLdP;
  wide::check_mods<Mods, T>();

  alignas(16) extern __shared__ unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Tr::kSmemQ;
  T* sV = sK + Tr::kSmemK;
  T* sP = sV + Tr::kSmemV;  // FMA paths only (kSmemP = 0 otherwise)

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp_row = (tid / 32) * Tr::kRowsPerWarp;
  T* sP_warp = sP + warp_row * kLdP;

  const BlockInfo<Tr, true> blk(p);
  const ScorePos pos{blk.batch, blk.head, blk.len_q, blk.len_k};
  const long long q_row_stride = p.q.row_stride;
  const int head_dim = p.head_dim;
  const T* q_i = p.q.at<const T>(blk.batch, blk.head, blk.q0 + blk.row_begin);
  // K/V rows of this (sequence, kv head): a batch entry or packed sequence (k_bh, v_bh), or the pages of a paged
  // KV cache, whose addresses load_kv derives from the params bank and blk where it needs them (nothing more stays
  // live across the key loop).
  const T* k_bh = p.k.at<const T>(blk.batch, blk.head_kv, blk.k0);
  const T* v_bh = p.v.at<const T>(blk.batch, blk.head_kv, blk.k0);
  // Issues the copy of keys [key0, key0 + kBlockN) of K (smem stride kL = kLd) or V (kLdV); uniform branch.
  auto load_kv = [&](auto ld, T* smem, const T* base, const TensorArg& t, int key0) {
    constexpr int kL = decltype(ld)::value;
    // float64: no paged path (its key loop has no register to spare for it, measured: spills); the launch gathers
    // a paged float64 cache's pages first (cuflash/cuda/launch.py, forward_kvcache_launch).
    if (sizeof(T) == 8 || p.paged.block_table == nullptr) {
      wide::load_tile<T, kBlockN, kHeadDim, kL, Tr::kThreads>(smem, base + key0 * t.row_stride, t.row_stride,
                                                              blk.len_k - key0, head_dim, tid);
    } else {
      load_paged_tile<T, kBlockN, kHeadDim, kL, Tr::kThreads>(
          smem, t.at<const T>(0, blk.head_kv), p.paged.block_table + blk.batch * p.paged.table_stride,
          t.batch_stride, t.row_stride, p.paged.page_size, key0, blk.len_k - key0, head_dim, tid);
    }
  };

  KeyTiles tiles;
  plan_key_tiles(tiles, blk, p.mask);

  T acc[kMT][kNTO][kR];
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int nd = 0; nd < kNTO; ++nd)
#pragma unroll
      for (int r = 0; r < kR; ++r) acc[mi][nd][r] = T(0);
  wide::OnlineSoftmax<Tr> softmax;
  softmax.init();

  bool partial;
  int n = tiles.next(&partial);
  if (n >= 0) {
    wide::load_tile<T, kBlockM, kHeadDim, kLd, Tr::kThreads>(sQ, q_i, q_row_stride, blk.len_q - blk.row_begin,
                                                             head_dim, tid);
    load_kv(IntConstant<kLd>{}, sK, k_bh, p.k, n * kBlockN);
    arch::cp_async_commit();
  }

  const DropoutRng rng{p.dropout.seed_lo, p.dropout.seed_hi, p.dropout.threshold};
  const bool dropout = p.dropout.threshold != 0u;
  const int row0 = blk.row_begin + warp_row;
  while (n >= 0) {
    const int key0 = n * kBlockN;
    arch::cp_async_wait<0>();
    __syncthreads();  // K_j (and Q) in smem; every warp is done with V_{j-1} and its staged P
    load_kv(IntConstant<kLdV>{}, sV, v_bh, p.v, key0);
    arch::cp_async_commit();

    // Line 8: S = Q_i K_j^T * scale * log2(e), the element mask on boundary tiles (and with a mask modifier).
    T S[kMT][kNTS][kR];
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int nj = 0; nj < kNTS; ++nj)
#pragma unroll
        for (int r = 0; r < kR; ++r) S[mi][nj][r] = T(0);
    wide::warp_gemm<M, kMT, kNTS, kHeadDim>(S, wide::RowMajor<T, kLd>{sQ + warp_row * kLd},
                                            wide::ColMajor<T, kLd>{sK}, lane);
    wide::modify_scores<Mods, false, false, kTM>(S, S, row0, key0, lane, pos, p);
    if (partial || blk.needs_mask(n, Mods::kScore) || Mods::kMask) {
      wide::mask_scores<Mods, false, kTM>(S, row0, key0, lane, blk.vis, partial, pos, p);
    }

    arch::cp_async_wait<0>();
    __syncthreads();  // V_j in smem; every warp is done with K_j
    bool next_partial;
    const int n_next = tiles.next(&next_partial);
    if (n_next >= 0) {
      load_kv(IntConstant<kLd>{}, sK, k_bh, p.k, n_next * kBlockN);
      arch::cp_async_commit();
    }

    // Lines 9-10: m, P = exp2(S - m), l and acc rescaled; with dropout l has summed the undropped P (lse is
    // dropout-free) before the dropped entries are zeroed; then acc += (P o Z) V_j.
    softmax.update(S, acc);
    if (dropout) {
      wide::KeepBits<kMT, kNTS, kR> bits;
      wide::keep_bits<false, kTM>(bits, rng, blk.batch, blk.head, row0, key0, lane);
      wide::apply_keep(S, bits);
    }
    wide::warp_gemm_pv<M, kMT, kNTS, kNTO, kLdP>(acc, S, sP_warp, wide::RowMajor<T, kLdV>{sV}, lane);

    n = n_next;
    partial = next_partial;
  }

  // Lines 12-15: O = diag(l)^-1 acc (times 1/(1-p) with dropout) and L = m + log l, written once.
  constexpr int kH = kR / 2;
  T inv_l[kMT * kH], lse_row[kMT * kH];
  bool row_valid[kMT * kH];
#pragma unroll
  for (int r = 0; r < kMT * kH; ++r) row_valid[r] = row0 + kTM * (r / kH) + (lane / 4) + 8 * (r % kH) < blk.len_q;
  softmax.finalize(inv_l, lse_row, row_valid);
  const T rescale = R::rescale(p);
#pragma unroll
  for (int r = 0; r < kMT * kH; ++r) inv_l[r] *= rescale;  // exact (x * 1) without dropout

  // Rows [len_q, rows_q) of a padded batch get out = 0, lse = -inf; a packed sequence writes only its own rows.
  // Split-KV: this split's normalized partial goes to the workspaces (in T, combine.cuh) instead.
  const long long o_row_stride = p.o.row_stride;
  long long o_at = blk.batch * p.o.batch_stride + blk.head * p.o.head_stride + blk.q0 * o_row_stride;
  long long lse_at = blk.stats(p) + blk.head * p.stats_head_stride;
  T* o_i = static_cast<T*>(p.o.ptr);
  T* lse_i = wide::stats<T>(p.lse);
  if (p.split.num_splits > 1) {
    const int split = blockIdx.z - blk.batch * p.split.num_splits;
    o_i = static_cast<T*>(p.split.o_accum) + split * p.split.o_split_stride;
    lse_i = static_cast<T*>(p.split.lse_accum) + split * p.split.lse_split_stride;
  }
  o_i += o_at;
  lse_i += lse_at;
  const int seqlen_q = blk.rows_q(p);
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
    const int r0 = row0 + kTM * mi;
    T scale[kH];
#pragma unroll
    for (int h = 0; h < kH; ++h) scale[h] = inv_l[mi * kH + h];
    wide::store_rows<T, kNTO, kR>(o_i + r0 * o_row_stride, o_row_stride, seqlen_q - r0, head_dim, acc[mi], scale, lane);
    if (lane % 4 == 0) {
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        const int row = r0 + lane / 4 + 8 * h;
        if (row < seqlen_q) lse_i[row] = lse_row[mi * kH + h];
      }
    }
  }
}

}  // namespace cuflash
