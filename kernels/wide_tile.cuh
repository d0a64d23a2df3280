// cuflash::wide — moving tiles of 4- and 8-byte elements: global -> shared memory (cp.async, ragged tails
// zero-filled) and C fragments -> global memory.
#pragma once

#include "wide_math.cuh"

namespace cuflash {
namespace wide {

// Issues (does not wait for) the copy of a kRows x kCols tile: smem row r (stride kLd) <- gmem + r * row_stride.
// 16-byte chunks (4 floats / 2 doubles). Eight threads share a row (8 x 16 bytes: a warp reads four whole 128-byte
// lines per instruction), each taking every eighth chunk, and walk down the tile kThreads / 8 rows per pass with
// one running pointer: a flat chunk index (thread -> (row, chunk) by division) made ptxas keep an address per copy
// live across the key loop, ~100 registers for a float64 128-column tile. Rows >= rows_valid and columns >=
// cols_valid (a multiple of 8) are zero-filled without reading global memory: zero keys keep padded scores finite,
// and padded V rows must be zero since P V multiplies them by P = 0.
template <typename T, int kRows, int kCols, int kLd, int kThreads>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, long long row_stride, int rows_valid, int cols_valid,
                                          int tid) {
  constexpr int kPer = 16 / int(sizeof(T));     // elements per chunk
  constexpr int kPerRow = 8;                    // threads per row
  constexpr int kChunks = kCols / kPer / kPerRow;  // chunks per thread and row
  constexpr int kRowsPerPass = kThreads / kPerRow;
  static_assert(kCols % (kPer * kPerRow) == 0 && kThreads % kPerRow == 0 && (kLd * int(sizeof(T))) % 16 == 0,
                "whole 128-byte rows of 16-byte chunks");
  const int row0 = tid / kPerRow, col0 = (tid % kPerRow) * kPer;
  const T* src = gmem + row0 * row_stride + col0;
  T* dst = smem + row0 * kLd + col0;
#pragma unroll
  for (int pass = 0; pass < (kRows + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
    const int r = row0 + pass * kRowsPerPass;
    if (kRows % kRowsPerPass == 0 || r < kRows) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int col = col0 + c * kPer * kPerRow;
        const bool pred = r < rows_valid && col < cols_valid;
        // a predicated-off copy still needs some address; the tile base is valid and is not read
        arch::cp_async_16(dst + c * kPer * kPerRow, pred ? static_cast<const void*>(src + c * kPer * kPerRow)
                                                         : static_cast<const void*>(gmem), pred);
      }
    }
    src += kRowsPerPass * row_stride;
    dst += kRowsPerPass * kLd;
  }
}

// Writes one fragment row block (kTM rows, kNT blocks of 8 columns) of accumulators, each row h times scale[h],
// to gmem rows [0, kTM) of a tile (row stride row_stride). Rows >= rows_valid and columns >= cols_valid (a
// multiple of 8) are not written. The two columns 2t, 2t+1 of a row go out as one 8- or 16-byte store.
template <typename T, int kNT, int kR>
__device__ __forceinline__ void store_rows(T* gmem, long long row_stride, int rows_valid, int cols_valid,
                                           const T (&acc)[kNT][kR], const T (&scale)[kR / 2], int lane) {
#pragma unroll
  for (int h = 0; h < kR / 2; ++h) {
    const int r = (lane >> 2) + 8 * h;
    if (r < rows_valid) {
      T* dst = gmem + r * row_stride;
#pragma unroll
      for (int nd = 0; nd < kNT; ++nd) {
        const int col = nd * 8 + 2 * (lane & 3);
        if (col < cols_valid) {
          const T x = acc[nd][2 * h] * scale[h], y = acc[nd][2 * h + 1] * scale[h];
          if constexpr (sizeof(T) == 4) {
            float2 v;
            v.x = x, v.y = y;
            *reinterpret_cast<float2*>(dst + col) = v;
          } else {
            double2 v;
            v.x = x, v.y = y;
            *reinterpret_cast<double2*>(dst + col) = v;
          }
        }
      }
    }
  }
}

}  // namespace wide
}  // namespace cuflash
