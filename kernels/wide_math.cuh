// cuflash::wide — the float32/float64 kernels' scalar arithmetic, one definition per element type.
//
// The float32 kernels are the 16-bit kernels' arithmetic with float32 inputs: the same float fields of Params, the
// same correctly rounded multiplies, the same base-2 softmax (scores times scale * log2(e), exp2f, one fast ex2
// instruction each on the GPU).
//
// The float64 kernels compute every intermediate in float64 (the scores, the softmax statistics m, l, lse, P,
// D = rowsum(dO o O), the accumulators) with the scale and the dropout rescale from Params::wide, and their softmax
// is in base e: P = exp(s - m), lse = m + log(l), the backward's P = exp(s - lse). In float64 exp costs what exp2
// costs (both are instruction sequences), and base 2 would round twice more per score (s * log2(e), and
// lse * log2(e) in the backward): measured, base 2 gave the float64 gradients an RMS error up to 2.5x the naive
// float64 computation's, base e 1.x (README, Precision). "Softmax units" below: base-2 units for float32,
// natural units for float64.
#pragma once

#include "arch.cuh"
#include "params.cuh"

namespace cuflash {
namespace wide {

template <typename T>
struct Real;

template <>
struct Real<float> {
  __device__ static __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
  __device__ static __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
  __device__ static __forceinline__ float max(float a, float b) { return fmaxf(a, b); }
  __device__ static __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
  // correctly rounded, never contracted into an FMA (the forward and the backward must recompute the same bits)
  __device__ static __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
  __device__ static __forceinline__ float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
  __device__ static __forceinline__ float scale(const Params& p) { return p.scale; }
  __device__ static __forceinline__ float rescale(const Params& p) { return p.dropout.rescale; }
  // the softmax: scores in base-2 units
  __device__ static __forceinline__ float softmax_scale(const Params& p) { return p.scale_log2; }  // raw -> units
  __device__ static __forceinline__ float to_units(float s) { return __fmul_rn(s, 1.4426950408889634f); }
  __device__ static __forceinline__ float ex(float x) { return exp2f(x); }
  // the backward's P = ex(S - L), capped at 1 (see prob_from_lse in softmax.cuh; a NaN stays NaN)
  __device__ static __forceinline__ float prob(float x) {
    const float p = exp2f(x);
    return p > 1.f ? 1.f : p;
  }
  __device__ static __forceinline__ float lse(float m, float l) { return (m + log2f(l)) * 0.69314718055994531f; }
  __device__ static __forceinline__ float lse_to_units(float lse) { return __fmul_rn(lse, 1.4426950408889634f); }
};

template <>
struct Real<double> {
  __device__ static __forceinline__ double neg_inf() { return __longlong_as_double((long long)0xfff0000000000000ULL); }
  __device__ static __forceinline__ double pos_inf() { return __longlong_as_double((long long)0x7ff0000000000000ULL); }
  __device__ static __forceinline__ double max(double a, double b) { return fmax(a, b); }
  __device__ static __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
  __device__ static __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
  __device__ static __forceinline__ double fma(double a, double b, double c) { return __fma_rn(a, b, c); }
  __device__ static __forceinline__ double scale(const Params& p) { return p.wide.scale; }
  __device__ static __forceinline__ double rescale(const Params& p) { return p.wide.rescale; }
  // the softmax: scores in natural units
  __device__ static __forceinline__ double softmax_scale(const Params& p) { return p.wide.scale; }
  __device__ static __forceinline__ double to_units(double s) { return s; }
  __device__ static __forceinline__ double ex(double x) { return exp(x); }
  __device__ static __forceinline__ double prob(double x) {  // P = ex(S - L) capped at 1 (see Real<float>::prob)
    const double p = exp(x);
    return p > 1.0 ? 1.0 : p;
  }
  __device__ static __forceinline__ double lse(double m, double l) { return m + log(l); }
  __device__ static __forceinline__ double lse_to_units(double lse) { return lse; }
};

// The statistics arrays (lse, lse * log2(e), D) and the dQ / dbias accumulators are in the element type: Params
// declares them float* for the 16-bit kernels, and Python allocates float64 ones for float64.
template <typename T>
__device__ __forceinline__ T* stats(float* p) {
  return reinterpret_cast<T*>(p);
}

// Quad reductions: a row of a C fragment lives in the 4 lanes of a quad (lanes 4g .. 4g+3).
template <typename T>
__device__ __forceinline__ T quad_max(T x) {
  x = Real<T>::max(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return Real<T>::max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

template <typename T>
__device__ __forceinline__ T quad_sum(T x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// std::declval without <utility> (NVRTC has none): only for unevaluated operands.
template <typename T>
T&& declval_();

}  // namespace wide
}  // namespace cuflash
