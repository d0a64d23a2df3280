// cuflash — what one thread block of the backward's main kernel works on: its (batch, kv head, key tile), and the
// (query head, query tile) pairs it visits, in order. The transpose of block_info.cuh.
#pragma once

#include "block_info.cuh"
#include "mask.cuh"

namespace cuflash {

// Half-open range of query rows that see at least one key of [j0, j1), under the element rule of mask.cuh:
// query i sees key j iff lo <= j - i <= hi (and i < len_q, j < len_k), so i lies in [j - hi, j - lo].
// Empty (q_end <= q_begin) when the tile lies past len_k or no query row reaches it.
__device__ __forceinline__ void query_range(const Visibility& vis, int j0, int j1, int* q_begin, int* q_end) {
  const int last_key = min(j1, vis.len_k) - 1;
  if (last_key < j0) {
    *q_begin = *q_end = 0;
    return;
  }
  const long long b = (long long)j0 - vis.hi;
  const long long e = (long long)last_key - vis.lo + 1;
  *q_begin = (int)(b < 0 ? 0 : b);
  *q_end = (int)(e < vis.len_q ? e : vis.len_q);
}

template <class Traits>
struct BwdBlockInfo : SeqRows {
  int head_kv, n_block, key_begin;  // key tile index and its first key
  Visibility vis;
  int m_begin, m_end;  // query tiles [m_begin, m_end) hold every query row that sees a key of this tile

  __device__ __forceinline__ explicit BwdBlockInfo(const Params& p) {
    n_block = blockIdx.x;
    head_kv = blockIdx.y;
    key_begin = n_block * Traits::kBlockN;
    set(SeqSpan(p, blockIdx.z), blockIdx.z);
    vis = Visibility::make(len_q, len_k, p.window_left, p.window_right);
    int qb, qe;
    query_range(vis, key_begin, key_begin + Traits::kBlockN, &qb, &qe);
    if (qe > qb) {
      m_begin = qb / Traits::kBlockM;
      m_end = (qe + Traits::kBlockM - 1) / Traits::kBlockM;
    } else {
      m_begin = m_end = 0;  // no query sees these keys: dK = dV = 0
    }
  }

  // Interior tiles need no element mask (the split loop of FA2, as in the forward). With a score modifier
  // (score_mod), a query tile holding rows past len_q is a boundary tile (BlockInfo::needs_mask says why):
  // unmasked, a NaN score there makes P^T = exp2(S^T - L) NaN despite L = +inf, and dV_j += P^T dO_i,
  // dK_j += dS^T Q_i (Alg. 2 lines 16, 21) carry it into every key of the tile.
  __device__ __forceinline__ bool needs_mask(int m_block, bool score_mod) const {
    const int i0 = m_block * Traits::kBlockM;
    return (score_mod && i0 + Traits::kBlockM > len_q) ||
           !vis.all_visible(i0, i0 + Traits::kBlockM, key_begin, key_begin + Traits::kBlockN);
  }
};

// The (query head, query tile) pairs of one key tile: for each query head of the kv head's group (GQA: dK and dV
// sum over them in registers, no K/V copies and no atomics), the query tiles in [m_begin, m_end) — all of them, or
// with a BlockMask the entries of the key tile's transposed index list (BlockMask.q_lists at kernel tiles), so
// work is proportional to the mask's density. Visited from the last tile to the first, like the forward.
struct QueryTiles {
  const int* counts;  // nullptr without a BlockMask
  const int* lists;
  long long batch_offset, head_stride;  // in list entries (counts index) units; head_stride 0 for a shared mask
  int list_len, n_block, m_begin, m_end;
  int head, head_end;
  KeyTiles tiles;  // the list iterator of block_info.cuh, over query tiles here

  __device__ __forceinline__ void init(const int* counts_, const int* lists_, long long batch_offset_,
                                       long long head_stride_, int list_len_, int n_block_, int m_begin_, int m_end_,
                                       int head_begin, int head_end_) {
    counts = counts_;
    lists = lists_;
    batch_offset = batch_offset_;
    head_stride = head_stride_;
    list_len = list_len_;
    n_block = n_block_;
    m_begin = m_begin_;
    m_end = m_end_;
    head = head_begin;
    head_end = head_end_;
    start_head();
  }

  __device__ __forceinline__ void start_head() {
    if (counts != nullptr) {
      const long long at = batch_offset + head * head_stride + n_block;
      tiles.init(lists + at * list_len, counts[at], m_begin, m_end);
    } else {
      tiles.init(nullptr, 0, m_begin, m_end);
    }
  }

  // The next query tile (and its head in *head_out), or -1 when done; *partial as in KeyTiles::next.
  __device__ __forceinline__ int next(bool* partial, int* head_out) {
    while (head < head_end) {
      const int m = tiles.next(partial);
      if (m >= 0) {
        *head_out = head;
        return m;
      }
      if (++head < head_end) start_head();
    }
    *partial = false;
    return -1;
  }
};

}  // namespace cuflash
