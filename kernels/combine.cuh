// cuflash — the split-KV combine (flash-decoding): merges the forward's num_splits partial results per query row.
//
// Split s left o_s (its rows normalized by its own l_s) and lse_s in the workspaces of params.cuh's SplitArg. With
// m = max_s lse_s: lse = m + log(sum_s exp(lse_s - m)) and o = sum_s exp(lse_s - lse) o_s, the log-sum-exp merge of
// cuflash/merge.py (merge_attention_states). A split that saw no key has lse_s = -inf and weight exp(-inf) = 0; a row
// no split saw (m = -inf) gets out = 0, lse = -inf, as the unsplit forward writes. A NaN lse_s (the split saw a NaN
// score) makes the row's lse and out NaN, and a +inf one its lse +inf (out NaN), as unsplit: m propagates NaN, which
// CUDA's max (fmaxf) would drop, and every finite lse_s, however low, counts as seen. Grid as the backward's
// preprocess: one warp per query row (x: rows / 4, y: query heads, z: batch); the head dim is spread over the lanes.
#pragma once

#include "params.cuh"

namespace cuflash {

__device__ __forceinline__ float combine_exp(float x) { return expf(x); }
__device__ __forceinline__ double combine_exp(double x) { return exp(x); }
__device__ __forceinline__ float combine_log(float x) { return logf(x); }
__device__ __forceinline__ double combine_log(double x) { return log(x); }
// x = -inf: the split (every split, for m) saw no key. Below the most negative finite number of the type.
__device__ __forceinline__ bool combine_none(float x) { return x < -3.40282346638528859811704183484516925e38f; }
__device__ __forceinline__ bool combine_none(double x) { return x < -1.79769313486231570814527423731704357e308; }
__device__ __forceinline__ bool combine_top(float x) { return x > 3.40282346638528859811704183484516925e38f; }
__device__ __forceinline__ bool combine_top(double x) { return x > 1.79769313486231570814527423731704357e308; }
// max that keeps a NaN of either argument (x != x: NaN)
template <typename Acc>
__device__ __forceinline__ Acc combine_max(Acc m, Acc x) {
  if (m != m || x != x) return m != m ? m : x;
  return x > m ? x : m;
}
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
  for (int s = 1; s < splits; ++s) m = combine_max(m, lse_s[s * p.split.lse_split_stride]);
  const bool seen = !combine_none(m);  // m = -inf only when no split saw a key (NaN and +inf are seen)
  Acc sum = 0;
  if (seen) {
    for (int s = 0; s < splits; ++s) sum += combine_exp(lse_s[s * p.split.lse_split_stride] - m);
  }
  // m = -inf (no key) and m = +inf stay as they are (exp(inf - inf) is NaN); a NaN m gives NaN
  const Acc lse = seen && !combine_top(m) ? m + combine_log(sum) : m;
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
