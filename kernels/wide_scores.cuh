// cuflash::wide — what happens to a tile of scores between the two products, on wide_mma.cuh's C fragments: the
// scale and the score modifier, the masks, the modifier's chain rule (and dbias) in the backward, and dropout.
//
// These are mods.cuh's modify_scores / mask_scores / backprop_modifier and dropout.cuh's keep bits, written for
// fragments of any height (8 or 16 rows) and element type: the 16-bit kernels' helpers assume m16n8k16's
// float[kM][kN][4]. Same order and semantics: s = scale * q.k (correctly rounded), then the score modifier, then
// the masks, then the softmax (base 2 on s * log2(e) for float32, base e for float64: wide_math.cuh). The float64 kernels take a modifier struct rendered in float64
// (cuflash/cuda/modcode.py, real="double": double score(double, ...), float64 operands); check_mods says so at
// compile time.
#pragma once

#include "mask.cuh"
#include "mods.cuh"
#include "philox.cuh"
#include "wide_math.cuh"

namespace cuflash {
namespace wide {

// A float64 kernel must not take a float modifier (its score would be rounded to float silently).
template <class Mods, typename T>
__device__ __forceinline__ void check_mods() {
  static_assert(!Mods::kScore || sizeof(decltype(Mods::score(T(0), 0, 0, 0, 0, 0, 0, declval_<const Params&>()))) ==
                                     sizeof(T),
                "the modifier struct's arithmetic differs from the kernel's element type (modcode.render(real=...))");
}

// (query i, key j) of element r of block (mi, nj): row row0 + kTM * mi + g + 8 * (r / 2), column col0 + 8 * nj +
// 2t + r % 2. kTransposed: rows are keys and columns queries (the backward's S^T).
template <int kTM, bool kTransposed>
__device__ __forceinline__ void coords(int row0, int col0, int lane, int mi, int nj, int r, int& i, int& j) {
  const int row = row0 + kTM * mi + (lane >> 2) + 8 * (r >> 1);
  const int col = col0 + 8 * nj + 2 * (lane & 3) + (r & 1);
  i = kTransposed ? col : row;
  j = kTransposed ? row : col;
}

// S = -inf where the score is not kept: the visibility rule, the BlockMask's element test (Mods::rule, in the tiles
// its schedule marks) and the mask modifier; vis first, so the mask's and the modifier's operands are never read
// outside their extents.
template <class Mods, bool kTransposed, bool kRule, int kTM, typename T, int kM, int kN, int kR>
__device__ __forceinline__ void mask_scores_(T (&S)[kM][kN][kR], int row0, int col0, int lane, const Visibility vis,
                                             const ScorePos& pos, const Params& p) {
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int nj = 0; nj < kN; ++nj)
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        int i, j;
        coords<kTM, kTransposed>(row0, col0, lane, mi, nj, r, i, j);
        if (!(vis(i, j) && (!kRule || Mods::rule(pos.b, pos.h, i, j, pos.len_q, pos.len_k, p)) &&
              (!Mods::kMask || Mods::mask(pos.b, pos.h, i, j, pos.len_q, pos.len_k, p))))
          S[mi][nj][r] = Real<T>::neg_inf();
      }
}

// The BlockMask's element test runs only in the tiles its schedule marks (`rule`): a uniform branch, so that the
// common tile does not pay for it in instructions or registers.
template <class Mods, bool kTransposed, int kTM, typename T, int kM, int kN, int kR>
__device__ __forceinline__ void mask_scores(T (&S)[kM][kN][kR], int row0, int col0, int lane, const Visibility vis,
                                            bool rule, const ScorePos& pos, const Params& p) {
  if (rule) {
    mask_scores_<Mods, kTransposed, true, kTM>(S, row0, col0, lane, vis, pos, p);
  } else {
    mask_scores_<Mods, kTransposed, false, kTM>(S, row0, col0, lane, vis, pos, p);
  }
}

// S = mod(S_raw * scale) in softmax units (wide_math.cuh: * log2(e) for float32), every multiply correctly rounded
// (so the forward and both backward kernels hold the same bits); without a score modifier one multiply by
// Real::softmax_scale. kKeep: S0 receives S_raw * scale.
template <class Mods, bool kTransposed, bool kKeep, int kTM, typename T, int kM, int kN, int kR>
__device__ __forceinline__ void modify_scores(T (&S)[kM][kN][kR], T (&S0)[kM][kN][kR], int row0, int col0, int lane,
                                              const ScorePos& pos, const Params& p) {
  using R = Real<T>;
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int nj = 0; nj < kN; ++nj)
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        if constexpr (!Mods::kScore) {
          S[mi][nj][r] = R::mul(S[mi][nj][r], R::softmax_scale(p));
        } else {
          int i, j;
          coords<kTM, kTransposed>(row0, col0, lane, mi, nj, r, i, j);
          const T s0 = R::mul(S[mi][nj][r], R::scale(p));
          if constexpr (kKeep) S0[mi][nj][r] = s0;
          // (i, j) may lie past len_q / len_k in a boundary tile: the operands' zero margin covers it (mods.cuh)
          S[mi][nj][r] = R::to_units(Mods::score(s0, pos.b, pos.h, i, j, pos.len_q, pos.len_k, p));
        }
      }
}

// dS of the modified scores -> of the unmodified ones (times d mod / d score at S0), after adding (kWithDBias)
// dS * d mod / d bias to the dbias accumulator in the element type (atomics: a broadcast bias gathers several).
template <class Mods, bool kTransposed, bool kWithDBias, int kTM, typename T, int kM, int kN, int kR>
__device__ __forceinline__ void backprop_modifier(T (&dS)[kM][kN][kR], const T (&S0)[kM][kN][kR], int row0, int col0,
                                                  int lane, const ScorePos& pos, const Params& p) {
  if constexpr (Mods::kScore) {
#pragma unroll
    for (int mi = 0; mi < kM; ++mi)
#pragma unroll
      for (int nj = 0; nj < kN; ++nj)
#pragma unroll
        for (int r = 0; r < kR; ++r) {
          int i, j;
          coords<kTM, kTransposed>(row0, col0, lane, mi, nj, r, i, j);
          const T s0 = S0[mi][nj][r];
          if constexpr (kWithDBias && Mods::kDBias) {
            if (i < pos.len_q && j < pos.len_k && dS[mi][nj][r] != T(0)) {
              const long long* st = p.mods.dbias_stride;
              atomicAdd(stats<T>(p.mods.dbias) + pos.b * st[0] + pos.h * st[1] + i * st[2] + j * st[3],
                        dS[mi][nj][r] * Mods::dbias(s0, pos.b, pos.h, i, j, pos.len_q, pos.len_k, p));
            }
          }
          // masked scores have P = 0, hence dS = 0, whatever the derivative is there
          if (dS[mi][nj][r] != T(0)) dS[mi][nj][r] *= Mods::dscore(s0, pos.b, pos.h, i, j, pos.len_q, pos.len_k, p);
        }
  }
}

// ---- dropout: the keep-mask of cuflash/dropout.py, Philox-4x32-10 keyed by (seed) at (batch, query head, query
// row, key column), regenerated here; bit (mi * kN + nj) * kR + r of `bits` is element r of block (mi, nj). In the
// forward orientation a lane's two columns 2t, 2t+1 of a row share one Philox call (keep_pair); in the transposed
// one (rows keys, columns queries) every element is its own (query, key) call. (The 16-bit kernels share calls
// across lanes with shuffles, dropout.cuh; here the generator's integer work is small beside float64 or FFMA
// products.)
template <int kM, int kN, int kR>
struct KeepBits {
  static constexpr int kBits = kM * kN * kR, kWords = (kBits + 31) / 32;
  unsigned int w[kWords];
  __device__ __forceinline__ bool get(int k) const { return (w[k >> 5] >> (k & 31)) & 1u; }
};

template <bool kTransposed, int kTM, int kM, int kN, int kR>
__device__ __forceinline__ void keep_bits(KeepBits<kM, kN, kR>& bits, const DropoutRng& rng, int batch, int head,
                                          int row0, int col0, int lane) {
#pragma unroll
  for (int k = 0; k < KeepBits<kM, kN, kR>::kWords; ++k) bits.w[k] = 0u;
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int nj = 0; nj < kN; ++nj)
#pragma unroll
      for (int h = 0; h < kR / 2; ++h) {
        int i, j;  // element r = 2h: column even
        coords<kTM, kTransposed>(row0, col0, lane, mi, nj, 2 * h, i, j);
        bool k0, k1;
        if constexpr (!kTransposed) {
          rng.keep_pair(batch, head, i, j, k0, k1);  // (row i, columns j, j + 1)
        } else {
          k0 = rng.keep(batch, head, i, j);          // (query i, key j) and (query i + 1, key j)
          k1 = rng.keep(batch, head, i + 1, j);
        }
        const int b = (mi * kN + nj) * kR + 2 * h;
        bits.w[b >> 5] |= ((unsigned int)k0 << (b & 31)) | ((unsigned int)k1 << ((b + 1) & 31));
      }
}

template <typename T, int kM, int kN, int kR>
__device__ __forceinline__ void apply_keep(T (&F)[kM][kN][kR], const KeepBits<kM, kN, kR>& bits) {
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int nj = 0; nj < kN; ++nj)
#pragma unroll
      for (int r = 0; r < kR; ++r)
        if (!bits.get((mi * kN + nj) * kR + r)) F[mi][nj][r] = T(0);
}

}  // namespace wide
}  // namespace cuflash
