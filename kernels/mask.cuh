// cuflash — the visibility rule, the one device-side copy of cuflash.problem.visible (a test holds them together).
//
// Query row i sees key column j iff
//     i < len_q  and  j < len_k  and  i + off - left <= j <= i + off + right,   off = len_k - len_q,
// with len_q/len_k the sequence's own lengths (seqlens, or the full lengths) and the diagonal aligned bottom-right.
// Causal is right = 0; an unbounded side is passed as kUnbounded. A BlockMask's own element test is compiled in
// (mods.cuh).
#pragma once

namespace cuflash {

// "No bound" for window_left/right. Lengths are below 2^30 (checked by the launch path), so j - i lies in
// (-2^30, 2^30) and off -/+ a clamped bound fits in int32 (see Visibility::make).
constexpr int kUnbounded = 1 << 30;

// The score of a masked element, and +inf (no INFINITY macro: NVRTC has no <math.h>).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

struct Visibility {
  int len_q, len_k;
  int lo, hi;  // j - i must lie in [lo, hi]: lo = off - left, hi = off + right (clamped to +-2^30)

  __device__ __forceinline__ static Visibility make(int len_q, int len_k, int left, int right) {
    const long long off = (long long)len_k - len_q;
    auto clamp = [](long long x) {
      return (int)(x < -kUnbounded ? -kUnbounded : (x > kUnbounded ? kUnbounded : x));
    };
    Visibility v;
    v.len_q = len_q;
    v.len_k = len_k;
    v.lo = left >= kUnbounded ? -kUnbounded : clamp(off - left);
    v.hi = right >= kUnbounded ? kUnbounded : clamp(off + right);
    return v;
  }

  // The element rule.
  __device__ __forceinline__ bool operator()(int i, int j) const {
    return i < len_q && j < len_k && j - i >= lo && j - i <= hi;
  }

  // Half-open range [key_begin, key_end) of keys seen by at least one row of [i0, i1) (rows >= len_q see nothing).
  // Empty (key_end <= key_begin) when no row of the range sees a key.
  __device__ __forceinline__ int key_begin(int i0) const { return max(0, i0 + lo); }
  __device__ __forceinline__ int key_end(int i0, int i1) const {
    const int last_row = min(i1, len_q) - 1;
    if (last_row < i0) return 0;
    return (int)min((long long)len_k, (long long)last_row + hi + 1);
  }

  // True when every (i, j), i in [i0, min(i1, len_q)), j in [j0, j1), is visible: the tile needs no element mask.
  // The visible set is convex in (i, j), so checking the two extreme corners of j - i suffices.
  __device__ __forceinline__ bool all_visible(int i0, int i1, int j0, int j1) const {
    const int last_row = min(i1, len_q) - 1;
    if (last_row < i0) return true;  // no valid rows: nothing of this tile is ever written
    return j1 <= len_k && j0 - last_row >= lo && (j1 - 1) - i0 <= hi;
  }
};

}  // namespace cuflash
