// CUDA device intrinsics for the CPU emulator: warp shuffles and votes (per-warp rendezvous), barriers,
// atomics (trivial: one OS thread runs every fiber), and the math/bit intrinsics that have no host version.
#pragma once
#ifndef CUFLASH_EMULATE_INTRINSICS_H_
#define CUFLASH_EMULATE_INTRINSICS_H_
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <type_traits>

#include "runtime.h"

namespace cuflash_emu {

// ---------------------------------------------------------------------------------------------- shuffles

enum ShflKind : int { kIdx, kUp, kDown, kXor };

template <typename T>
struct ShflIn {
  T v;
  int arg, width, kind;
};

// Source lane of a shuffle, or `lane` itself where CUDA returns the caller's own value.
inline int shfl_source(int lane, int kind, int arg, int width) {
  int seg = lane & ~(width - 1);
  switch (kind) {
    case kIdx: return seg + (arg & (width - 1));
    case kUp: return lane - arg < seg ? lane : lane - arg;
    case kDown: return lane + arg >= seg + width ? lane : lane + arg;
    default: {  // xor may reach into earlier segments but not later ones
      int src = lane ^ arg;
      return src >= seg + width ? lane : src;
    }
  }
}

template <typename T>
void shfl_fn(Fiber* const* lanes, uint32_t active) {
  for (uint32_t m = active; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    auto* in = static_cast<const ShflIn<T>*>(lanes[l]->win);
    int src = shfl_source(l, in->kind, in->arg, in->width);
    void* out = lanes[l]->wout;
    if ((active >> src) & 1u)
      memcpy(out, &static_cast<const ShflIn<T>*>(lanes[src]->win)->v, sizeof(T));
    else  // reading an inactive or exited lane is undefined on the GPU: make it visible
      memset(out, 0xff, sizeof(T));
  }
}

template <typename T>
T shfl(const char* what, unsigned mask, T v, int arg, int width, int kind) {
  // Copied as bytes, like registers: __half2 & co. have user-written copy operators but plain representations.
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail("%s: width %d is not a power of two in [1, 32]", what, width);
  ShflIn<T> in{v, arg, width, kind};
  T out;
  warp_collective(what, mask, &shfl_fn<T>, &in, &out);
  return out;
}

// ---------------------------------------------------------------------------------------------- votes

struct VoteOut {
  unsigned ballot;
  int all;
};

inline void vote_fn(Fiber* const* lanes, uint32_t active) {
  unsigned ballot = 0;
  for (uint32_t m = active; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    if (*static_cast<const int*>(lanes[l]->win)) ballot |= 1u << l;
  }
  for (uint32_t m = active; m; m &= m - 1) {
    auto* out = static_cast<VoteOut*>(lanes[__builtin_ctz(m)]->wout);
    out->ballot = ballot, out->all = ballot == active;
  }
}

inline VoteOut vote(const char* what, unsigned mask, int pred) {
  int in = pred != 0;
  VoteOut out;
  warp_collective(what, mask, &vote_fn, &in, &out);
  return out;
}

inline void noop_fn(Fiber* const*, uint32_t) {}

template <typename T>
struct Identity {
  using type = T;
};

}  // namespace cuflash_emu

// ---------------------------------------------------------------------------------------------- CUDA names

#define threadIdx (::cuflash_emu::g_cur->tid)
#define blockIdx (::cuflash_emu::g_block_idx)
#define blockDim (::cuflash_emu::g_block_dim)
#define gridDim (::cuflash_emu::g_grid_dim)
static constexpr int warpSize = 32;

// The call site identifies the barrier, so threads waiting at two different __syncthreads are reported.
#define __syncthreads() ::cuflash_emu::syncthreads_at(__FILE__, __LINE__)
#define __syncthreads_count(p) ::cuflash_emu::syncthreads_at(__FILE__, __LINE__, (p), 1)
#define __syncthreads_and(p) ::cuflash_emu::syncthreads_at(__FILE__, __LINE__, (p), 2)
#define __syncthreads_or(p) ::cuflash_emu::syncthreads_at(__FILE__, __LINE__, (p), 3)

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::cuflash_emu::warp_collective("__syncwarp", mask, &::cuflash_emu::noop_fn, nullptr, nullptr);
}
inline unsigned __activemask() {
  unsigned w = ::cuflash_emu::g_cur->warp;
  return ::cuflash_emu::g.warp_exists[w] & ~::cuflash_emu::g.warp_exited[w];
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return ::cuflash_emu::vote("__ballot_sync", mask, pred).ballot; }
inline int __any_sync(unsigned mask, int pred) { return ::cuflash_emu::vote("__any_sync", mask, pred).ballot != 0; }
inline int __all_sync(unsigned mask, int pred) { return ::cuflash_emu::vote("__all_sync", mask, pred).all; }

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ::cuflash_emu::shfl("__shfl_sync", mask, var, src_lane, width, ::cuflash_emu::kIdx);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::cuflash_emu::shfl("__shfl_up_sync", mask, var, int(delta), width, ::cuflash_emu::kUp);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::cuflash_emu::shfl("__shfl_down_sync", mask, var, int(delta), width, ::cuflash_emu::kDown);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return ::cuflash_emu::shfl("__shfl_xor_sync", mask, var, lane_mask, width, ::cuflash_emu::kXor);
}

inline void __threadfence() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
inline void __nanosleep(unsigned) {}
[[noreturn]] inline void __trap() { ::cuflash_emu::fail("__trap() called"); }
[[noreturn]] inline void __brkpt() { ::cuflash_emu::fail("__brkpt() called"); }
inline long long clock64() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

// A failed device assert ends the launch with an error instead of aborting the process. Binding is local
// (hidden visibility), so glibc's __assert_fail is untouched for everyone else.
extern "C" [[noreturn]] inline void __assert_fail(const char* expr, const char* file, unsigned line,
                                                  const char* func) noexcept {
  if (!::cuflash_emu::g_cur) {
    fprintf(stderr, "%s:%u: %s: assertion `%s' failed (outside any emulated thread)\n", file, line, func, expr);
    abort();
  }
  ::cuflash_emu::fail("device assert failed: %s (%s:%u, %s)", expr, file, line, func);
}

// ---------------------------------------------------------------------------------------------- atomics
// Only one fiber runs at a time and switches happen only at barriers/collectives, so a plain
// read-modify-write is atomic here.

template <typename T>
inline T atomicAdd(T* a, typename ::cuflash_emu::Identity<T>::type v) {
  T old = *a;
  *a = old + v;
  return old;
}
template <typename T>
inline T atomicSub(T* a, typename ::cuflash_emu::Identity<T>::type v) {
  T old = *a;
  *a = old - v;
  return old;
}
template <typename T>
inline T atomicExch(T* a, typename ::cuflash_emu::Identity<T>::type v) {
  T old = *a;
  *a = v;
  return old;
}
template <typename T>
inline T atomicMax(T* a, typename ::cuflash_emu::Identity<T>::type v) {
  T old = *a;
  *a = old < v ? v : old;
  return old;
}
template <typename T>
inline T atomicMin(T* a, typename ::cuflash_emu::Identity<T>::type v) {
  T old = *a;
  *a = v < old ? v : old;
  return old;
}
template <typename T>
inline T atomicAnd(T* a, typename ::cuflash_emu::Identity<T>::type v) {
  T old = *a;
  *a = old & v;
  return old;
}
template <typename T>
inline T atomicOr(T* a, typename ::cuflash_emu::Identity<T>::type v) {
  T old = *a;
  *a = old | v;
  return old;
}
template <typename T>
inline T atomicXor(T* a, typename ::cuflash_emu::Identity<T>::type v) {
  T old = *a;
  *a = old ^ v;
  return old;
}
template <typename T>
inline T atomicCAS(T* a, typename ::cuflash_emu::Identity<T>::type compare,
                   typename ::cuflash_emu::Identity<T>::type v) {
  T old = *a;
  if (old == compare) *a = v;
  return old;
}
inline unsigned atomicInc(unsigned* a, unsigned v) {
  unsigned old = *a;
  *a = old >= v ? 0u : old + 1u;
  return old;
}
inline unsigned atomicDec(unsigned* a, unsigned v) {
  unsigned old = *a;
  *a = (old == 0u || old > v) ? v : old - 1u;
  return old;
}

// ---------------------------------------------------------------------------------------------- math

namespace cuflash_emu {

// ex2.approx.ftz.f32, what exp2f and __expf become on the GPU under CuPy (-ftz=true). PTX ISA 9.1, section
// 9.7.3.21 "Floating Point Instructions: ex2": "The maximum ulp error is 2 ulp from correctly rounded result
// across the full range of inputs", and .ftz "flushes subnormal inputs and results to sign-preserving zero";
// -Inf -> +0, +-0 -> +1, +Inf -> +Inf, NaN -> NaN. Emulated as the correctly rounded result moved by the full
// 2 ulp, up or down by a hash of the input bits: deterministic, and at least as far off as the hardware may be,
// so tolerances tested here hold on the GPU. The special inputs above give their exact results.
inline uint32_t mix_bits(uint32_t x) {  // murmur3's finalizer: every input bit flips each output bit ~half the time
  x ^= x >> 16, x *= 0x85ebca6bu, x ^= x >> 13, x *= 0xc2b2ae35u;
  return x ^ (x >> 16);
}

inline float ex2_approx_ftz(float x) {
  uint32_t in;
  memcpy(&in, &x, 4);
  if ((in & 0x7f800000u) == 0) return 1.0f;  // +-0 and subnormal inputs (flushed to zero): 2^0
  if (x != x || x == -INFINITY || x == INFINITY) return x == -INFINITY ? 0.0f : x;
  float r = static_cast<float>(exp2(static_cast<double>(x)));  // correctly rounded (double rounding aside)
  uint32_t out;
  memcpy(&out, &r, 4);
  if (out < 0x00800000u) return 0.0f;    // a subnormal result is flushed to +0
  if (out >= 0x7f800000u) return r;      // overflow: +Inf, as on the GPU
  uint32_t moved = (mix_bits(in) & 1u) ? out + 2u : out - 2u;
  if (moved < 0x00800000u || moved >= 0x7f800000u) moved = (mix_bits(in) & 1u) ? out - 2u : out + 2u;
  memcpy(&r, &moved, 4);
  return r;
}

// exp2f in kernel code (the macro at the end of this file routes it here): the host's exp2f unless the launch
// asked for hw_math.
inline float exp2f_emulated(float x) { return g.hw_math ? ex2_approx_ftz(x) : ::exp2f(x); }

}  // namespace cuflash_emu

// glibc declares (but does not export) __expf & co., hence extern "C" definitions with its exact signature.

extern "C" {
// __expf is ex2.approx.ftz(x * log2(e)) on the GPU, the product rounded to fp32 first.
inline float __expf(float x) noexcept {
  return ::cuflash_emu::g.hw_math ? ::cuflash_emu::ex2_approx_ftz(x * 1.44269504088896341f) : expf(x);
}
inline float __exp10f(float x) noexcept { return powf(10.0f, x); }
inline float __logf(float x) noexcept { return logf(x); }
inline float __log2f(float x) noexcept { return log2f(x); }
inline float __log10f(float x) noexcept { return log10f(x); }
inline float __powf(float x, float y) noexcept { return powf(x, y); }
inline float __sinf(float x) noexcept { return sinf(x); }
inline float __cosf(float x) noexcept { return cosf(x); }
inline float __tanf(float x) noexcept { return tanf(x); }
}
inline float __fdividef(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }

inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
inline float __uint_as_float(unsigned i) { float x; memcpy(&x, &i, 4); return x; }
inline long long __double_as_longlong(double x) { long long i; memcpy(&i, &x, 8); return i; }
inline double __longlong_as_double(long long i) { double x; memcpy(&x, &i, 8); return x; }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
inline unsigned __float2uint_rn(float x) { return static_cast<unsigned>(nearbyintf(x)); }
inline float __int2float_rn(int i) { return static_cast<float>(i); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned long long v = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (((s >> (4 * i)) & 7u) * 8)) & 0xffu) << (8 * i);
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>((v << (shift & 31u)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>(v >> (shift & 31u));
}
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((1ull * a * b) >> 32); }
inline int __mulhi(int a, int b) { return static_cast<int>((1ll * a * b) >> 32); }
inline int __mul24(int a, int b) { return (a << 8 >> 8) * (b << 8 >> 8); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }

// CUDA's integer min/max overloads (non-templates, so they win over std::min/std::max if both are visible).
#define CUFLASH_EMU_MINMAX(T)                            \
  inline T min(T a, T b) { return b < a ? b : a; }      \
  inline T max(T a, T b) { return a < b ? b : a; }
CUFLASH_EMU_MINMAX(int)
CUFLASH_EMU_MINMAX(unsigned)
CUFLASH_EMU_MINMAX(long)
CUFLASH_EMU_MINMAX(unsigned long)
CUFLASH_EMU_MINMAX(long long)
CUFLASH_EMU_MINMAX(unsigned long long)
#undef CUFLASH_EMU_MINMAX
// CUDA's floating-point min/max are fminf/fmaxf (fmin/fmax): a NaN argument gives the other one
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline unsigned min(int a, unsigned b) { return min(unsigned(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, unsigned(b)); }
inline unsigned max(int a, unsigned b) { return max(unsigned(a), b); }
inline unsigned max(unsigned a, int b) { return max(a, unsigned(b)); }

// Cache-hinted loads and stores are plain memory accesses on the CPU.
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldca(const T* p) { return *p; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
template <typename T> inline T __ldlu(const T* p) { return *p; }
template <typename T> inline T __ldcv(const T* p) { return *p; }
template <typename T> inline void __stcg(T* p, T v) { *p = v; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
template <typename T> inline void __stwb(T* p, T v) { *p = v; }
template <typename T> inline void __stwt(T* p, T v) { *p = v; }

// Last, so that the system headers above still declare and use the real exp2f. A kernel calling exp2f gets the
// emulated instruction when the launch has hw_math; std::exp2f and taking its address are not supported.
#define exp2f(x) ::cuflash_emu::exp2f_emulated(x)

#endif  // CUFLASH_EMULATE_INTRINSICS_H_
