// cuflash — key/value tiles of a paged KV cache (attention_with_kvcache with block_table): global -> shared memory.
//
// A paged cache is (num_pages, page_size, Hkv, ld): key position pos of sequence b is row pos % page_size of page
// block_table[b][pos / page_size], so a tile's rows are gathered page by page (page_size need not divide the tile,
// nor the tile the page). Params::k/v carry the caches with batch_stride = the page stride. Only the forward kernels
// read a paged cache; a contiguous one (or a batch) goes through the strided loads of tile.cuh / wide_tile.cuh.
#pragma once

#include "arch.cuh"

namespace cuflash {

template <int V>
struct IntConstant {  // a compile-time int as a value (a generic lambda's template argument; no <type_traits> in NVRTC)
  static constexpr int value = V;
};

// Issues (does not wait for) the copy of a kRows x kCols tile into smem rows of stride kLd: row r <- the cache row of
// key position key0 + r of this sequence (its page looked up once per row). Rows >= rows_valid and columns >=
// cols_valid are zero-filled without reading global memory (nor the block table past the sequence's pages), as in
// load_tile. `base` is page 0 of the kv head: also the address of predicated-off copies (valid, not read).
template <typename T, int kRows, int kCols, int kLd, int kThreads>
__device__ __forceinline__ void load_paged_tile(T* smem, const T* base, const int* pages, long long page_stride,
                                                long long row_stride, int page_size, int key0, int rows_valid,
                                                int cols_valid, int tid) {
  constexpr int kPer = 16 / int(sizeof(T));                 // elements per 16-byte chunk
  constexpr int kChunks = kCols / kPer;                     // chunks per row
  constexpr int kPerRow = kChunks % 8 == 0 ? 8 : 4;         // threads sharing a row
  constexpr int kRowsPerPass = kThreads / kPerRow;
  static_assert(kCols % kPer == 0 && kChunks % kPerRow == 0 && kThreads % kPerRow == 0, "whole 16-byte chunks");
  const int row0 = tid / kPerRow, c0 = tid % kPerRow;
#pragma unroll
  for (int pass = 0; pass < (kRows + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
    const int r = row0 + pass * kRowsPerPass;
    if (kRows % kRowsPerPass == 0 || r < kRows) {
      const T* src_row = base;
      if (r < rows_valid) {
        const int pos = key0 + r, page = pos / page_size;
        src_row = base + pages[page] * page_stride + (pos - page * page_size) * row_stride;
      }
#pragma unroll
      for (int i = 0; i < kChunks / kPerRow; ++i) {
        const int col = (c0 + i * kPerRow) * kPer;
        const bool pred = r < rows_valid && col < cols_valid;
        arch::cp_async_16(smem + r * kLd + col, pred ? static_cast<const void*>(src_row + col)
                                                      : static_cast<const void*>(base), pred);
      }
    }
  }
}

}  // namespace cuflash
