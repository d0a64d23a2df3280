// cuflash — the one argument of every kernel: a params struct passed by value (FA2's Flash_fwd_params idea).
//
// Python packs the same layout as a NumPy structured dtype (cuflash/cuda/params.py) and CuPy passes it by value
// (a size-1 NumPy array). The two layouts are held together by static_asserts on sizeof/offsetof that Python
// generates from the dtype and appends to every compiled source (CuPy at run time, the compile check, the CPU
// emulator): a field added on one side only fails to compile everywhere.
//
// Kernels take it as `const __grid_constant__ Params p`: members are read straight from the parameter bank
// (no copy to local memory, whatever the kernel does with their addresses).
#pragma once

namespace cuflash {

// A (batch, row, head, dim) tensor in global memory: base pointer and strides in elements (64-bit: batch * seqlen
// * heads * head_dim may exceed 2^31); the head dim is contiguous.
struct TensorArg {
  void* ptr;
  long long batch_stride, row_stride, head_stride;

  template <typename T>
  __device__ __forceinline__ T* at(long long batch, long long head) const {
    return static_cast<T*>(ptr) + batch * batch_stride + head * head_stride;
  }
  // Row `row` of (batch, head): in a packed (varlen) batch batch_stride is 0 and `row` counts from the first token
  // of the pack (SeqSpan in block_info.cuh adds the sequence's offset).
  template <typename T>
  __device__ __forceinline__ T* at(long long batch, long long head, long long row) const {
    return at<T>(batch, head) + row * row_stride;
  }
};

// A BlockMask's schedule as a kernel reads it (cuflash/cuda/launch.py): per (batch|1, head|1, tile) the sorted list of
// tiles to visit (~t for a tile that needs the mask's element test: partial blocks, or blocks of several states),
// strides 0 over a broadcast batch/head. Null lists: no BlockMask. The element test itself is compiled in (mods.cuh:
// Mods::rule).
struct BlockMaskArg {
  const int* tile_counts;
  const int* tile_lists;
  long long tiles_batch_stride, tiles_head_stride;
  int list_len;
};

// Attention dropout (cuflash/dropout.py): keep iff Philox bits >= threshold; threshold 0 keeps everything and the
// kernels skip the generator. rescale = 1/(1-p) (1 without dropout).
struct DropoutArg {
  unsigned int seed_lo, seed_hi, threshold;
  float rescale;
};

// Score and mask modifiers' operands (cuflash/cuda/modcode.py; kernels/mods.cuh reads them). An array operand is read
// at the problem's (b, h, q_idx, kv_idx) with these element strides (0 for a variable it is not indexed by); one slot
// per (array, indexing), so doc[q_idx] and doc[kv_idx] are two slots over one array.
constexpr int kModArrays = 8, kModScalars = 8;
struct ModArray {
  const void* ptr;
  long long stride[4];
};
struct ModArgs {
  ModArray arrays[kModArrays];
  float scalars[kModScalars];  // float operands (softcap, user scalars)
  int iscalars[kModScalars];   // integer and bool operands
  float* dbias;                // fp32 accumulator of dbias in the bias's own broadcast shape, or null
  long long dbias_stride[4];   // (b, h, q_idx, kv_idx) element strides of dbias (0 where the bias broadcasts)
};

// The float64 kernels' scalars in float64 (kernels/wide_*.cuh): the float fields above would round them to 24 bits,
// an error of ~6e-8 in every score, far above float64's. Zero (unused) for the other kernels.
struct WideArg {
  double scale, rescale;  // softmax scale, dropout's 1/(1-p) (1 without dropout)
};

// A paged KV cache (the forward of attention_with_kvcache, kv_tile.cuh): k/v are (num_pages, page_size, Hkv, ld) with
// batch_stride = the page stride, and sequence b's key position pos lives in page
// block_table[b * table_stride + pos / page_size]. Null block_table: k/v are indexed by batch.
struct PagedArg {
  const int* block_table;
  long long table_stride;
  int page_size;
};

// Split-KV (flash-decoding, the forward of attention_with_kvcache): num_splits > 1 thread blocks per query tile
// (grid z = batch * num_splits) each take a share of the key tiles and write their normalized partial out and lse
// to workspaces in the accumulator type (float; double for float64), laid out like o and lse with one slab per
// split; combine.cuh merges them. num_splits <= 1: no split, the forward writes o and lse itself.
struct SplitArg {
  void* o_accum;
  void* lse_accum;
  long long o_split_stride, lse_split_stride;
  int num_splits;
};

struct Params {
  // q, dout, dq: (B, Sq, Hq, ld); k, v, dk, dv: (B, Sk, Hkv, ld); o: like q; dq_accum: fp32 like q, or null.
  TensorArg q, k, v, o, dout, dq, dk, dv, dq_accum;
  // In a packed (varlen) batch they are (total, H, ld) with batch_stride 0, and sequence b's rows start at
  // cu_seqlens_q/k[b] (FA2's layout, see SeqSpan in block_info.cuh).
  // (B, Hq, Sq) fp32 rows of statistics with row stride 1 (packed: (Hq, total_q), stats_batch_stride 0): lse
  // (natural log, the forward's output), and the backward's lse * log2(e) and D = rowsum(dO o O). (The float64 kernels read these, dq_accum and mods.dbias as
  // float64 arrays: the pointer types here are the 16/32-bit kernels'.)
  float* lse;
  float* lse_log2;
  float* dsum;
  long long stats_batch_stride, stats_head_stride;
  const int* seqlens_q;  // int32 (B,) own lengths, or null for the full lengths
  const int* seqlens_k;
  const int* cu_seqlens_q;  // int32 (B + 1,) offsets of a packed (varlen) batch, or null for a padded batch; then
  const int* cu_seqlens_k;  // seqlen_q/k are the largest lengths (max_seqlen_q/k: the grid's extent)
  int seqlen_q, seqlen_k;
  int head_dim;      // columns read and written (a multiple of 8, <= the specialization's head dim)
  int heads_per_kv;  // GQA/MQA group size
  float scale;       // softmax scale (dK, dQ)
  float scale_log2;  // scale * log2(e): the one multiply per score of every kernel (base-2 softmax)
  int window_left, window_right;  // kUnbounded (mask.cuh) for none; causal is right = 0
  BlockMaskArg mask;
  DropoutArg dropout;
  ModArgs mods;
  WideArg wide;
  PagedArg paged;
  SplitArg split;
};

}  // namespace cuflash
