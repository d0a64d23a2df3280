// cuflash — the split-KV combine (flash-decoding): merges the forward's num_splits partial results per query row.
//
// Split s left o_s (its rows normalized by its own l_s) and lse_s in the workspaces of params.cuh's SplitArg. With
// m = max_s lse_s: lse = m + log(sum_s exp(lse_s - m)) and o = sum_s exp(lse_s - lse) o_s, the log-sum-exp merge of
// cuflash/merge.py (merge_attention_states). A split that saw no key has lse_s = -inf and weight exp(-inf) = 0; a row
// no split saw (m = -inf) gets out = 0, lse = -inf, as the unsplit forward writes. Grid as the backward's
// preprocess: one warp per query row (x: rows / 4, y: query heads, z: batch); the head dim is spread over the lanes.
#pragma once

#include "params.cuh"

namespace cuflash {

__device__ __forceinline__ float combine_exp(float x) { return expf(x); }
__device__ __forceinline__ double combine_exp(double x) { return exp(x); }
__device__ __forceinline__ float combine_log(float x) { return logf(x); }
__device__ __forceinline__ double combine_log(double x) { return log(x); }
__device__ __forceinline__ bool combine_finite(float x) { return x > -3.0e38f; }
__device__ __forceinline__ bool combine_finite(double x) { return x > -1.0e308; }
__device__ __forceinline__ void combine_store(__half* dst, float x) { *dst = __float2half_rn(x); }
__device__ __forceinline__ void combine_store(__nv_bfloat16* dst, float x) { *dst = __float2bfloat16_rn(x); }
__device__ __forceinline__ void combine_store(float* dst, float x) { *dst = x; }
__device__ __forceinline__ void combine_store(double* dst, double x) { *dst = x; }

// T: the output's element type; Acc: the workspaces' and lse's (float; double for float64 inputs).
template <typename T, typename Acc>
__global__ void __launch_bounds__(128) flash_fwd_combine_kernel(const __grid_constant__ Params p) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * 4 + threadIdx.x / 32;
  const int head = blockIdx.y, batch = blockIdx.z;
  if (row >= p.seqlen_q) return;
  const int splits = p.split.num_splits;
  const long long at = batch * p.stats_batch_stride + head * p.stats_head_stride + row;
  const Acc* lse_s = static_cast<const Acc*>(p.split.lse_accum) + at;
  Acc m = lse_s[0];
  for (int s = 1; s < splits; ++s) m = max(m, lse_s[s * p.split.lse_split_stride]);
  const bool seen = combine_finite(m);  // each lse_s is finite or -inf: m is finite iff some split saw a key
  Acc sum = 0;
  if (seen) {
    for (int s = 0; s < splits; ++s) sum += combine_exp(lse_s[s * p.split.lse_split_stride] - m);
  }
  const Acc lse = seen ? m + combine_log(sum) : m;  // m = -inf when no split saw a key
  const Acc* o_s = static_cast<const Acc*>(p.split.o_accum) + batch * p.o.batch_stride + row * p.o.row_stride +
                   head * p.o.head_stride;
  T* o_row = p.o.at<T>(batch, head, row);
  // Each lane holds columns lane + 32 i (head_dim <= 256, the largest of specs.NATIVE_HEAD_DIMS: 8 of them), so each split's weight exp(lse_s - lse) is
  // computed once, not once per column (the float64 exp per column made sm_90 spill around its call).
  constexpr int kCols = 8;
  Acc x[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) x[i] = 0;
  if (seen) {
    for (int s = 0; s < splits; ++s) {
      const Acc w = combine_exp(lse_s[s * p.split.lse_split_stride] - lse);
      const Acc* o = o_s + s * p.split.o_split_stride;
#pragma unroll
      for (int i = 0; i < kCols; ++i) {
        const int c = lane + 32 * i;
        if (c < p.head_dim) x[i] += w * o[c];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    const int c = lane + 32 * i;
    if (c < p.head_dim) combine_store(o_row + c, x[i]);
  }
  if (lane == 0) static_cast<Acc*>(static_cast<void*>(p.lse))[at] = lse;
}

}  // namespace cuflash
