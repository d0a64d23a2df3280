// cuflash — what one thread block of the forward kernel works on: its (batch, head, query tile), the sequence's
// own lengths, and the key tiles it must visit, in the order it visits them.
#pragma once

#include "mask.cuh"
#include "params.cuh"

namespace cuflash {

// The key tiles of one query tile, visited from the last to the first (like FA2: the tile holding the ragged tail
// of the keys and the causal diagonal comes first, so its element mask is applied while the pipeline fills).
//
// Without a BlockMask the tiles are n_end-1, ..., n_begin: the range that causal / window / seqlens leave visible.
// With a BlockMask they are the entries of this query tile's sorted index list that fall inside that range; the
// loop count is the list length, so work is proportional to the mask's density (FA1 Algorithm 5, block-sparse).
// A list entry e >= 0 is a tile the mask keeps whole; e < 0 encodes tile ~e that the mask keeps only partly
// (a tile that needs the mask's element test, Mods::rule in mods.cuh).
struct KeyTiles {
  const int* list;  // nullptr without a BlockMask
  int pos;          // next list position to look at (counts down)
  int n_begin, n_end;
  int next_n;       // the iterator state without a list

  __device__ __forceinline__ void init(const int* list_, int count, int n_begin_, int n_end_) {
    list = list_;
    pos = count - 1;
    n_begin = n_begin_;
    n_end = n_end_;
    next_n = n_end_ - 1;
  }

  // The next tile to visit, or -1 when done; *partial tells whether the BlockMask keeps it only partly.
  __device__ __forceinline__ int next(bool* partial) {
    *partial = false;
    if (list == nullptr) {
      return next_n >= n_begin ? next_n-- : -1;
    }
    for (; pos >= 0; --pos) {
      const int e = list[pos];
      const int n = e >= 0 ? e : ~e;
      if (n >= n_end) continue;  // past the causal/window/seqlen range: look further down the list
      if (n < n_begin) break;    // sorted: everything below is out of range too
      --pos;
      *partial = e < 0;
      return n;
    }
    pos = -1;
    return -1;
  }
};

// Where sequence `batch` lives and how long it is. Padded batch: rows [0, seqlen) of batch entry `batch`, its own
// lengths from seqlens (rows past them are written as zeros / lse -inf). Packed batch (varlen, FA2's layout): rows
// [cu[b], cu[b+1]) of the pack, nothing past them may be written (they are the next sequence's). Masks, modifiers and
// dropout see (batch, row within the sequence) in both, so a packed sequence computes what entry b of the padded
// batch computes.
struct SeqSpan {
  int len_q, len_k;    // the sequence's own lengths
  int rows_q, rows_k;  // rows it owns in memory (written): padded seqlen_q/k, or len_q/k when packed
  int q0, k0;          // its first row in memory (0 padded; cu_seqlens[b] packed)
  long long stats;     // element offset of its (head 0, row 0) statistic (lse, L, D)

  __device__ __forceinline__ SeqSpan(const Params& p, int batch) {
    if (p.cu_seqlens_q != nullptr) {
      q0 = p.cu_seqlens_q[batch];
      k0 = p.cu_seqlens_k[batch];
      len_q = rows_q = p.cu_seqlens_q[batch + 1] - q0;
      len_k = rows_k = p.cu_seqlens_k[batch + 1] - k0;
    } else {
      q0 = k0 = 0;
      rows_q = p.seqlen_q;
      rows_k = p.seqlen_k;
      len_q = p.seqlens_q ? min(p.seqlens_q[batch], p.seqlen_q) : p.seqlen_q;
      len_k = p.seqlens_k ? min(p.seqlens_k[batch], p.seqlen_k) : p.seqlen_k;
    }
    stats = batch * p.stats_batch_stride + q0;  // stats_batch_stride is 0 when packed: (Hq, total_q)
  }
};

// What a thread block keeps of its SeqSpan: the rows it writes and the statistics' offset are recomputed where used,
// from values live anyway and the params bank (the backward's main loops have no register to spare for them).
struct SeqRows {
  int batch;
  int len_q, len_k;  // this sequence's own lengths
  int q0, k0;        // its first row in memory

  __device__ __forceinline__ void set(const SeqSpan& seq, int batch_) {
    batch = batch_;
    len_q = seq.len_q;
    len_k = seq.len_k;
    q0 = seq.q0;
    k0 = seq.k0;
  }
  __device__ __forceinline__ int rows_q(const Params& p) const { return p.cu_seqlens_q ? len_q : p.seqlen_q; }
  __device__ __forceinline__ int rows_k(const Params& p) const { return p.cu_seqlens_k ? len_k : p.seqlen_k; }
  __device__ __forceinline__ long long stats(const Params& p) const { return batch * p.stats_batch_stride + q0; }
};

// kSplitKV: the forward kernels, whose grid z may be batch * num_splits (params.cuh, SplitArg); the backward's dq
// kernel has grid z = batch and no split code (its registers are spoken for).
template <class Traits, bool kSplitKV = false>
struct BlockInfo : SeqRows {
  int head, head_kv;
  int m_block, row_begin;  // query tile index and its first row
  Visibility vis;
  int n_begin, n_end;      // key tiles [n_begin, n_end) hold every key some row of this tile sees

  __device__ __forceinline__ explicit BlockInfo(const Params& p) {
    m_block = blockIdx.x;
    head = blockIdx.y;
    head_kv = head / p.heads_per_kv;  // GQA/MQA: query heads share a kv head, no K/V copies
    row_begin = m_block * Traits::kBlockM;
    const int splits = kSplitKV && p.split.num_splits > 1 ? p.split.num_splits : 1;  // grid z = batch * splits
    const int b = blockIdx.z / splits;
    set(SeqSpan(p, b), b);
    vis = Visibility::make(len_q, len_k, p.window_left, p.window_right);
    const int key_begin = vis.key_begin(row_begin);
    const int key_end = vis.key_end(row_begin, row_begin + Traits::kBlockM);
    if (key_end > key_begin) {
      n_begin = key_begin / Traits::kBlockN;
      n_end = (key_end + Traits::kBlockN - 1) / Traits::kBlockN;
    } else {
      n_begin = n_end = 0;  // this tile sees nothing (past len_q, or outside the window): out = 0, lse = -inf
    }
    if (kSplitKV && splits > 1) {
      // Split-KV (flash-decoding): split s takes key tiles [s * per, (s + 1) * per) of the sequence, per = the
      // sequence's tiles / splits rounded up, intersected with the visible range; an empty share leaves out = 0,
      // lse = -inf, which the combine weighs 0.
      const int split = blockIdx.z - b * splits;
      const int per = ((len_k + Traits::kBlockN - 1) / Traits::kBlockN + splits - 1) / splits;
      n_begin = max(n_begin, split * per);
      n_end = min(n_end, (split + 1) * per);
      if (n_end <= n_begin) n_begin = n_end = 0;
    }
  }

  // Interior tiles need no element mask: every valid row sees every key of the tile. The others are the
  // boundary tiles of FA2's split loop (causal diagonal, window edges, ragged key tail).
  //
  // score_mod (Mods::kScore, a compile-time constant at every call): a tile holding rows past len_q (padding, or past the array)
  // is a boundary tile too. Those rows are never read, but their scores are computed, and a score modifier there (a
  // NaN bias in the padding, score / w[q_idx] on the zero margin) can make them NaN. Unmasked, the NaN survives the
  // zeroing of those rows, a multiply (Alg. 1 line 12: acc * 1/l with 1/l = 0), and in the backward
  // P = exp2(S - L) is NaN despite L = +inf (Alg. 2 line 13), which P^T dO and dS^T Q carry into every dV_j, dK_j
  // (lines 16, 21). Masked to -inf they give P = 0. Only the last query tile of a sequence pays, and only with a
  // score modifier: the plain kernels are left as they are (the float32 ones sit at their register cap; with the
  // zero-filled Q rows their padding scores are 0, NaN only for an infinite key).
  __device__ __forceinline__ bool needs_mask(int n_block, bool score_mod) const {
    const int j0 = n_block * Traits::kBlockN;
    return (score_mod && row_begin + Traits::kBlockM > len_q) ||
           !vis.all_visible(row_begin, row_begin + Traits::kBlockM, j0, j0 + Traits::kBlockN);
  }
};

// The key tiles a query tile visits (Algorithm 1 line 6 restricted to the visible ones; with a BlockMask, only the
// kept ones: Algorithm 5). The forward and
// the backward's dQ pass share this, so both walk exactly the same tiles.
template <class Info>
__device__ __forceinline__ void plan_key_tiles(KeyTiles& tiles, const Info& blk, const BlockMaskArg& mask) {
  if (mask.tile_counts == nullptr) {
    tiles.init(nullptr, 0, blk.n_begin, blk.n_end);
    return;
  }
  const long long at = blk.batch * mask.tiles_batch_stride + blk.head * mask.tiles_head_stride + blk.m_block;
  tiles.init(mask.tile_lists + at * mask.list_len, mask.tile_counts[at], blk.n_begin, blk.n_end);
}

}  // namespace cuflash
