// cuflash — moving tiles: global -> shared memory (cp.async, with ragged-tail predication), shared memory ->
// mma fragments (ldmatrix), and accumulator fragments -> global memory.
//
// Shared tiles are row-major [rows][Traits::kSmemStride] (rows padded by 16 bytes, see kernel_traits.cuh).
// Global tiles are addressed by a base pointer and a 64-bit row stride: inputs need only a contiguous last dim,
// and batch * seqlen * heads * head_dim may exceed 2^31 elements.
#pragma once

#include "kernel_traits.cuh"

namespace cuflash {

// Issues (does not wait for) the copy of a kRows x kHeadDim tile: row r of smem <- gmem + r * row_stride.
// Rows >= rows_valid (past the sequence's length) and columns >= cols_valid (the true head_dim, a multiple of 8)
// are zero-filled without reading global memory: zero keys/values/queries keep padded scores finite, and
// padded V rows must be zero (not stale shared memory) because P * V multiplies them by P = 0.
template <class Traits, int kRows>
__device__ __forceinline__ void load_tile(typename Traits::T* smem, const typename Traits::T* gmem,
                                          long long row_stride, int rows_valid, int cols_valid, int tid) {
  // kThreadsPerRow threads share a row, each taking every kThreadsPerRow-th 16-byte chunk: a warp reads 4 rows of
  // 128 contiguous bytes (or 8 of 64) per instruction, and each thread's column offsets are compile-time
  // constants, so the addresses cost a handful of registers (a flat chunk index would keep one per copy).
  constexpr int kThreadsPerRow = Traits::kChunksPerRow % 8 == 0 ? 8 : 4;  // kChunksPerRow: 4, 8, 12, 16, 24, 32
  constexpr int kRowsPerPass = Traits::kThreads / kThreadsPerRow;
  static_assert(Traits::kChunksPerRow % kThreadsPerRow == 0, "head_dim / 8 must be a multiple of 4");
  static_assert(kThreadsPerRow == 8 || kRows % 8 == 0, "rows are dealt in groups of 8");
  // A quarter-warp's 16-byte stores are served together. With 4 threads per row it spans two rows, whose chunks
  // fall in distinct bank groups only if the rows are 4 apart (4 odd strides = 4 chunks, mod the 8 chunks of the
  // 128 banked bytes): the 8 quads of a warp take its rows 0,4,1,5,2,6,3,7 (bank counts: cuflash.emulate).
  const int row0 = kThreadsPerRow == 8 ? tid / 8 : (tid >> 5) * 8 + ((tid >> 3) & 3) + (tid & 4);
  const int col0 = (tid % kThreadsPerRow) * 8;
#pragma unroll
  for (int pass = 0; pass < (kRows + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
    const int r = row0 + pass * kRowsPerPass;
    if (kRows % kRowsPerPass == 0 || r < kRows) {
      const typename Traits::T* src_row = gmem + r * row_stride;
#pragma unroll
      for (int c = 0; c < Traits::kChunksPerRow / kThreadsPerRow; ++c) {
        const int col = col0 + c * kThreadsPerRow * 8;
        const bool pred = r < rows_valid && col < cols_valid;
        // A predicated-off copy still needs some address; the tile base is valid and is not read.
        const void* src = pred ? static_cast<const void*>(src_row + col) : static_cast<const void*>(gmem);
        arch::cp_async_16(smem + r * Traits::kSmemStride + col, src, pred);
      }
    }
  }
}

// ---- ldmatrix addressing (PTX ISA, "Matrix fragments for mma.m16n8k16") ----
// ldmatrix.x4 loads four 8x8 b16 matrices; lanes 8m..8m+7 give the row addresses of matrix m, and register m of
// lane l receives row l/4, columns 2*(l%4), 2*(l%4)+1 of matrix m.

// A operand (16 x 16, row-major) of rows [0, 16) and columns [16*ks, 16*ks + 16) of a row-major smem tile:
// matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0..a3.
template <class Traits>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const typename Traits::T* tile16, int ks, int lane) {
  arch::ldmatrix_x4(a, tile16 + (lane & 15) * Traits::kSmemStride + ks * 16 + (lane >> 4) * 8);
}

// B operands of two adjacent n-tiles of S = Q K^T, keys [n0, n0 + 16), head-dim columns [16*ks, 16*ks + 16).
// The "col" B operand is K itself read row by row (B[k][n] = K[n][k]), so no transpose:
// matrices (keys 0-7, k 0-7) = b0, (keys 0-7, k 8-15) = b1 of n-tile n0/8; the same for keys 8-15 -> n-tile + 1.
template <class Traits>
__device__ __forceinline__ void load_k_frags(uint32_t (&b)[4], const typename Traits::T* sK, int n0, int ks,
                                             int lane) {
  arch::ldmatrix_x4(b, sK + (n0 + (lane & 7) + ((lane >> 4) << 3)) * Traits::kSmemStride + ks * 16 +
                           ((lane >> 3) & 1) * 8);
}

// B operands of two adjacent n-tiles of O = P V, keys [16*kk, 16*kk + 16), head-dim columns [d0, d0 + 16).
// V is stored [key][d] but the B operand wants pairs along the key (k) dimension: ldmatrix .trans.
// matrices (keys 0-7, d 0-7) = b0, (keys 8-15, d 0-7) = b1 of n-tile d0/8; (keys 0-7 / 8-15, d 8-15) -> n-tile + 1.
template <class Traits>
__device__ __forceinline__ void load_v_frags(uint32_t (&b)[4], const typename Traits::T* sV, int kk, int d0,
                                             int lane) {
  arch::ldmatrix_x4_trans(b, sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * Traits::kSmemStride + d0 +
                                 (lane >> 4) * 8);
}

// Writes one 16-row m-tile of O (accumulator layout: register pair (0,1) is row lane/4, pair (2,3) row lane/4 + 8,
// columns 8*nd + 2*(lane%4) + {0,1}) scaled per row, to gmem rows [row0, row0 + 16) of a (row_stride) tile.
// Rows >= rows_valid (past the array) and columns >= cols_valid are not written.
// Out is T, or float for the float32 workspace of split-KV (params.cuh, SplitArg).
__device__ __forceinline__ void store_pair(float* dst, float x, float y) {
  float2 v;
  v.x = x, v.y = y;
  *reinterpret_cast<float2*>(dst) = v;
}
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float x, float y) {
  *reinterpret_cast<uint32_t*>(dst) = arch::pack2<T>(x, y);
}

template <class Traits, typename Out>
__device__ __forceinline__ void store_o_tile(Out* gmem, long long row_stride, int rows_valid,
                                             int cols_valid, const float (&acc)[Traits::kNTilesO][4],
                                             const float (&row_scale)[2], int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = (lane >> 2) + 8 * half;
    if (r < rows_valid) {
      Out* dst = gmem + r * row_stride;
#pragma unroll
      for (int nd = 0; nd < Traits::kNTilesO; ++nd) {
        const int col = nd * 8 + 2 * (lane & 3);
        if (col < cols_valid) {  // cols_valid is a multiple of 8: both elements of the pair are in or out
          store_pair(dst + col, acc[nd][2 * half] * row_scale[half], acc[nd][2 * half + 1] * row_scale[half]);
        }
      }
    }
  }
}

}  // namespace cuflash
