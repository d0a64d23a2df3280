// cuflash::wide — online softmax (FA2 Algorithm 1, lines 9-10 and 12-13) on C fragments of any height, in the
// element type: float32 statistics for float32, float64 for float64. kernels/softmax.cuh is the 16-bit kernels'
// (m16n8k16 layout, fp32); this is the same algorithm over wide_mma.cuh's layout (kR / 2 rows per lane and block).
//
// Scores arrive in softmax units (wide_math.cuh: base 2 for float32, P = exp2(S - m), lse = (m + log2 l) * ln 2;
// base e for float64, P = exp(S - m), lse = m + log l).
#pragma once

#include "wide_math.cuh"

namespace cuflash {
namespace wide {

template <class Tr>
struct OnlineSoftmax {
  using T = typename Tr::T;
  using R = Real<T>;
  static constexpr int kH = Tr::kR / 2;              // rows per lane in one fragment block (1 or 2)
  static constexpr int kRows = Tr::kMTiles * kH;     // rows per lane: row mi * kH + h
  T m_i[kRows];  // running row max (softmax units), -inf until a visible score is seen
  T l_i[kRows];  // running row sum of exp2(S - m): this lane's share; the quad's four are added in finalize

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m_i[r] = R::neg_inf();
      l_i[r] = T(0);
    }
  }

  // m_new = max(m_old, rowmax(S)); P = ex(S - m_new) over S; l = ex(m_old - m_new) l + rowsum(P);
  // acc = diag(ex(m_old - m_new)) acc (the caller adds P V).
  __device__ __forceinline__ void update(T (&S)[Tr::kMTiles][Tr::kNTilesS][Tr::kR],
                                         T (&acc)[Tr::kMTiles][Tr::kNTilesO][Tr::kR]) {
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi) {
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        const int row = mi * kH + h;
        T m_new = m_i[row];
#pragma unroll
        for (int nj = 0; nj < Tr::kNTilesS; ++nj) m_new = R::max(m_new, R::max(S[mi][nj][2 * h], S[mi][nj][2 * h + 1]));
        m_new = quad_max(m_new);
        // a row that has seen only masked scores: subtract 0, not -inf (-inf - -inf = NaN); P = 0, acc = l = 0;
        // an infinite score (+inf) likewise, as the float64 reference: lse = +inf, not NaN
        const T m_use = (m_new == R::neg_inf() || m_new == -R::neg_inf()) ? T(0) : m_new;
        if (m_new != m_i[row]) {  // rescale only when the max moved
          // m_new > m_old >= -inf here, so m_new is finite or +inf: alpha from m_new, and +inf gives ex(-inf) = 0.
          // ex(m_old - m_use) with m_use = 0 overflowed for a large m_old, and a zero share l_i became 0 * inf = NaN
          // (lse NaN instead of +inf); softmax.cuh says more.
          const T alpha = R::ex(m_i[row] - m_new);
          l_i[row] *= alpha;
#pragma unroll
          for (int nd = 0; nd < Tr::kNTilesO; ++nd) {
            acc[mi][nd][2 * h] *= alpha;
            acc[mi][nd][2 * h + 1] *= alpha;
          }
          m_i[row] = m_new;
        }
        T rowsum = T(0);
#pragma unroll
        for (int nj = 0; nj < Tr::kNTilesS; ++nj) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const T p = R::ex(S[mi][nj][2 * h + e] - m_use);
            S[mi][nj][2 * h + e] = p;
            rowsum += p;
          }
        }
        l_i[row] += rowsum;
      }
    }
  }

  // O = diag(l)^-1 acc and lse = m + log l (natural log), once after the last key tile. Rows that saw no key
  // (l = 0) or lie past the sequence give out = 0, lse = -inf; a NaN sum propagates.
  __device__ __forceinline__ void finalize(T (&inv_l)[kRows], T (&lse_row)[kRows], const bool (&row_valid)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const T l = quad_sum(l_i[r]);
      const bool seen = row_valid[r] && l != T(0);
      inv_l[r] = seen ? T(1) / l : T(0);
      lse_row[r] = seen ? R::lse(m_i[r], l) : R::neg_inf();
    }
  }
};

}  // namespace wide
}  // namespace cuflash
