// cuflash — score and mask modifiers (cuflash/mods.py) as the kernels apply them.
//
// A modifier is compiled into the kernel: cuflash/cuda/modcode.py renders the call's expressions as a struct with
// the members of NoMods below and appends it to the source; the kernels take it as their last template parameter
// (NoMods: no modifier, and none of this code). Its operands (mod_arrays, bias, ALiBi slopes, softcap) travel in
// Params::mods. Order, as in the NumPy backend and the reference: s = scale * q.k, then the score modifier, then the
// masks (causal / window / seqlens / BlockMask / mask modifier), then the base-2 softmax on s * log2(e).
#pragma once

#include "mask.cuh"
#include "params.cuh"

namespace cuflash {

constexpr float kLog2e = 1.4426950408889634f;

// Python's floor division and modulo (the modifier language's // and %), not C's truncation toward zero. A zero
// divisor gives 0 for both, as NumPy's floor_divide and mod do (C's a / 0 traps on a CPU, and is garbage on a GPU).
// A divisor of -1 never divides: INT_MIN / -1 overflows, which traps on a CPU (the emulator died of SIGFPE) and is
// undefined on a GPU; the range check keeps it out of the problem's own elements, but padding rows are evaluated
// too. x % -1 is 0, and -x wraps as two's complement does.
__device__ __forceinline__ int floor_div(int a, int b) {
  if (b == 0) return 0;
  if (b == -1) return static_cast<int>(0u - static_cast<unsigned>(a));
  const int q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int floor_mod(int a, int b) {
  return (b == 0 || b == -1) ? 0 : a - floor_div(a, b) * b;
}

// min and max that propagate a NaN, as NumPy's minimum and maximum (fminf/fmaxf return the other operand).
template <typename A, typename B>
__device__ __forceinline__ auto nan_max(A a, B b) -> decltype(a + b) {
  return (a != a || b != b) ? a + b : (a > b ? a : b);
}
template <typename A, typename B>
__device__ __forceinline__ auto nan_min(A a, B b) -> decltype(a + b) {
  return (a != a || b != b) ? a + b : (a < b ? a : b);
}

// One element of an operand array read at the problem's (b, h, q_idx, kv_idx). Its strides are 0 for the index
// variables the array is not indexed by, and its shape was checked against the problem's extents: no read leaves it.
template <typename T>
__device__ __forceinline__ T mod_read(const ModArray& a, int b, int h, int q_idx, int kv_idx) {
  return static_cast<const T*>(a.ptr)[b * a.stride[0] + h * a.stride[1] + q_idx * a.stride[2] +
                                      kv_idx * a.stride[3]];
}

// Bit e of the packed bits of partial block `slot` (BlockMask.from_dense); slot -1: a block without bits (skipped).
__device__ __forceinline__ bool dense_bit(int slot, const ModArray& bits, int e) {
  return slot >= 0 && ((static_cast<const unsigned char*>(bits.ptr)[slot * bits.stride[0] + (e >> 3)] >> (e & 7)) & 1);
}

// Where a score of the (b, h) slice sits, and its sequence's own lengths: what a modifier may read besides score.
struct ScorePos {
  int b, h, len_q, len_k;
};

struct NoMods {
  static constexpr bool kScore = false;  // a score modifier (softcap, bias, ALiBi, score_mod)
  static constexpr bool kMask = false;   // a mask modifier, evaluated in every visited tile
  static constexpr bool kDBias = false;  // the backward accumulates dbias
  // rule: a BlockMask's element test (its block states, and its rule inside partial blocks), evaluated in the tiles
  // its schedule marks (~t in the tile lists); true without a BlockMask.
  __device__ static __forceinline__ bool rule(int, int, int, int, int, int, const Params&) { return true; }
  __device__ static __forceinline__ float score(float s, int, int, int, int, int, int, const Params&) { return s; }
  __device__ static __forceinline__ float dscore(float, int, int, int, int, int, int, const Params&) { return 1.f; }
  __device__ static __forceinline__ float dbias(float, int, int, int, int, int, int, const Params&) { return 1.f; }
  __device__ static __forceinline__ bool mask(int, int, int, int, int, int, const Params&) { return true; }
};

// The (query i, key j) of register r of n-tile nj of m-tile mi of S fragments (mma m16n8k16 C layout: row
// row0 + 16*mi + lane/4 + 8*(r/2), column col0 + 8*nj + 2*(lane%4) + r%2). kTransposed: rows are keys and columns
// queries (the backward's S^T).
template <bool kTransposed>
__device__ __forceinline__ void score_coords(int row0, int col0, int lane, int mi, int nj, int r, int& i, int& j) {
  const int row = row0 + 16 * mi + (lane >> 2) + 8 * (r >> 1);
  const int col = col0 + 8 * nj + 2 * (lane & 3) + (r & 1);
  i = kTransposed ? col : row;
  j = kTransposed ? row : col;
}

// Sets S = -inf for every score that is not kept: the visibility rule (causal / window / seqlens), the BlockMask's
// element test (`rule`: in the tiles its schedule marks) and the mask modifier. vis first: it rejects i >= len_q and
// j >= len_k, so the mask's and the modifier's operands are never read outside their extents.
template <class Mods, bool kTransposed, int kM, int kN>
__device__ __forceinline__ void mask_scores(float (&S)[kM][kN][4], int row0, int col0, int lane, const Visibility vis,
                                            bool rule, const ScorePos& pos, const Params& p) {
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int nj = 0; nj < kN; ++nj)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int i, j;
        score_coords<kTransposed>(row0, col0, lane, mi, nj, r, i, j);
        if (!(vis(i, j) && (!rule || Mods::rule(pos.b, pos.h, i, j, pos.len_q, pos.len_k, p)) &&
              (!Mods::kMask || Mods::mask(pos.b, pos.h, i, j, pos.len_q, pos.len_k, p))))
          S[mi][nj][r] = neg_inf();
      }
}

// The modifier is evaluated at every (i, j) of the tile, rows past len_q and columns past len_k included (those are
// masked or never used): its array operands carry a zero margin of a tile past their extents for that
// (cuflash/cuda/modcode.py, MOD_MARGIN), so no read leaves them.
//
// S = mod(S_raw * scale) * log2(e) (base 2 for the softmax), every step correctly rounded: __fmul_rn is never
// contracted into an FMA (NVRTC contracts `a * b - c` by default; g++ for x86-64 has no FMA to contract into), so the
// forward, the dQ pass and the backward's S^T hold the same bits, on the GPU as in the emulator. Without a score
// modifier this is one multiply by scale * log2(e). With kKeep, S0 receives the unmodified scaled scores
// S_raw * scale, where the backward differentiates the modifier.
template <class Mods, bool kTransposed, bool kKeep, int kM, int kN>
__device__ __forceinline__ void modify_scores(float (&S)[kM][kN][4], float (&S0)[kM][kN][4], int row0, int col0,
                                              int lane, const ScorePos& pos, const Params& p) {
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int nj = 0; nj < kN; ++nj)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if constexpr (!Mods::kScore) {
          S[mi][nj][r] = __fmul_rn(S[mi][nj][r], p.scale_log2);
        } else {
          int i, j;
          score_coords<kTransposed>(row0, col0, lane, mi, nj, r, i, j);
          const float s0 = __fmul_rn(S[mi][nj][r], p.scale);
          if constexpr (kKeep) S0[mi][nj][r] = s0;
          S[mi][nj][r] = __fmul_rn(Mods::score(s0, pos.b, pos.h, i, j, pos.len_q, pos.len_k, p), kLog2e);
        }
      }
}

// The backward's dS of the modified scores becomes that of the unmodified ones (chain rule: times d mod / d score
// at S0), after adding (with kWithDBias) dS times d mod / d bias to the fp32 dbias accumulator (fp32 atomics: bias
// elements that broadcast over batch or heads gather several contributions).
template <class Mods, bool kTransposed, bool kWithDBias, int kM, int kN>
__device__ __forceinline__ void backprop_modifier(float (&dS)[kM][kN][4], const float (&S0)[kM][kN][4], int row0,
                                                  int col0, int lane, const ScorePos& pos, const Params& p) {
  if constexpr (Mods::kScore) {
#pragma unroll
    for (int mi = 0; mi < kM; ++mi)
#pragma unroll
      for (int nj = 0; nj < kN; ++nj)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          int i, j;
          score_coords<kTransposed>(row0, col0, lane, mi, nj, r, i, j);
          const float s0 = S0[mi][nj][r];
          if constexpr (kWithDBias && Mods::kDBias) {
            if (i < pos.len_q && j < pos.len_k && dS[mi][nj][r] != 0.f) {
              const long long* st = p.mods.dbias_stride;
              atomicAdd(p.mods.dbias + pos.b * st[0] + pos.h * st[1] + i * st[2] + j * st[3],
                        dS[mi][nj][r] * Mods::dbias(s0, pos.b, pos.h, i, j, pos.len_q, pos.len_k, p));
            }
          }
          // masked scores have P = 0, hence dS = 0: they stay 0 whatever the derivative is there (log of a negative...)
          if (dS[mi][nj][r] != 0.f) dS[mi][nj][r] *= Mods::dscore(s0, pos.b, pos.h, i, j, pos.len_q, pos.len_k, p);
        }
  }
}

}  // namespace cuflash
