// cuflash — online softmax (FA2 Algorithm 1, lines 9-10 and 12-13) on the S fragments of one warp.
//
// Base 2 throughout: scores arrive already multiplied by scale * log2(e) (one multiply per score, done by the
// caller), so P = exp2(S - m) and the row maximum m_i is in the same units. lse = ln(sum exp(scale * s)) is
// (m_i + log2 l_i) * ln 2.
//
// Each thread holds two rows per m-tile (lane/4 and lane/4 + 8) and, of each row, the columns 2*(lane%4), +1 of every
// n-tile: a row lives in the 4 lanes of one quad, so a row reduction is two xor-shuffles (1 and 2) and never leaves
// the warp.
#pragma once

#include "kernel_traits.cuh"
#include "mask.cuh"

namespace cuflash {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The backward's P = exp2(S - L) from the saved lse (FA2 Algorithm 2, line 13), capped at 1: exactly P <= 1, but
// from |L| = 2^22 the lse's roundings (in the forward and in the preprocess) exceed 1, S - L may come out above 0
// and exp2 overflow (float16 P from 2^16), making every gradient NaN. The cap keeps such rows finite and their
// largest P right; below that it changes only P = 1 + a rounding. A NaN stays NaN (fminf would drop it).
__device__ __forceinline__ float prob_from_lse(float s_minus_l) {
  const float p = exp2f(s_minus_l);
  return p > 1.f ? 1.f : p;
}

template <class Traits>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * Traits::kMTiles;  // rows per thread; row 2*mi + half
  float m_i[kRows];  // running row max of the scaled scores (base-2 units), -inf until a visible score is seen
  float l_i[kRows];  // running row sum of exp2(S - m_i): this thread's share only; the quad's four partial sums
                     // are added once in finalize (FA2: no shuffles for l inside the loop)

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m_i[r] = neg_inf();
      l_i[r] = 0.f;
    }
  }

  // One key tile: m_new = max(m_old, rowmax(S)); P = exp2(S - m_new) (written over S);
  // l = exp2(m_old - m_new) * l + rowsum(P); acc = diag(exp2(m_old - m_new)) * acc (P V_j is added by the caller).
  __device__ __forceinline__ void update(float (&S)[Traits::kMTiles][Traits::kNTilesS][4],
                                         float (&acc)[Traits::kMTiles][Traits::kNTilesO][4]) {
#pragma unroll
    for (int mi = 0; mi < Traits::kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = 2 * mi + half;
        float m_new = m_i[row];
#pragma unroll
        for (int nj = 0; nj < Traits::kNTilesS; ++nj) {
          m_new = fmaxf(m_new, fmaxf(S[mi][nj][2 * half], S[mi][nj][2 * half + 1]));
        }
        m_new = quad_max(m_new);
        // A row that has seen only masked scores so far has m_new = -inf, and S - m_new would be
        // -inf - (-inf) = NaN. Subtracting 0 instead gives P = exp2(-inf) = 0 and leaves acc = 0, l = 0.
        // An infinite score (m_new = +inf) is shifted by 0 too, as the float64 reference does: l = +inf and
        // lse = +inf, not inf - inf = NaN.
        const float m_use = (m_new == neg_inf() || m_new == -neg_inf()) ? 0.f : m_new;
        // Rescale only when the max moved (exp2(0) = 1 would change nothing); on the causal diagonal and for
        // smooth score distributions most tiles leave the max alone and skip kNTilesO*2 multiplies per row.
        // alpha from m_new, not m_use: here m_new > m_old >= -inf, so m_new is finite or +inf, and +inf gives
        // alpha = exp2(m_old - inf) = 0 (the old terms are nothing beside the infinite one). exp2(m_old - 0)
        // overflows to +inf from m_old = 128, and a thread whose share l_i is still 0 (its columns masked) made
        // 0 * inf = NaN, so l = NaN and lse = NaN instead of +inf (Alg. 1 line 10: l = e^(m_old - m_new) l + ...).
        if (m_new != m_i[row]) {
          const float alpha = exp2f(m_i[row] - m_new);  // m_old = -inf: alpha = 0, acc and l are still 0
          l_i[row] *= alpha;
#pragma unroll
          for (int nd = 0; nd < Traits::kNTilesO; ++nd) {
            acc[mi][nd][2 * half] *= alpha;
            acc[mi][nd][2 * half + 1] *= alpha;
          }
          m_i[row] = m_new;
        }
        float rowsum = 0.f;
#pragma unroll
        for (int nj = 0; nj < Traits::kNTilesS; ++nj) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2f(S[mi][nj][2 * half + e] - m_use);
            S[mi][nj][2 * half + e] = p;
            rowsum += p;
          }
        }
        l_i[row] += rowsum;
      }
    }
  }

  // Algorithm 1, lines 12-13: O_i = diag(l_i)^-1 acc and L_i = m_i + log l_i, once, after the last key tile.
  // Rows that saw no key (l = 0) and rows past the sequence's length give out = 0, lse = -inf.
  // Returns per row the factor to multiply acc by; writes the natural-log lse of each row into lse_row.
  __device__ __forceinline__ void finalize(float (&inv_l)[kRows], float (&lse_row)[kRows],
                                           const bool (&row_valid)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float l = quad_sum(l_i[r]);
      const bool seen = row_valid[r] && l != 0.f;  // not `l > 0`: a NaN sum propagates, as in the NumPy backend
      inv_l[r] = seen ? 1.f / l : 0.f;
      lse_row[r] = seen ? (m_i[r] + log2f(l)) * 0.69314718055994531f : neg_inf();
    }
  }
};

}  // namespace cuflash
