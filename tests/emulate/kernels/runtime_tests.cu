// Test kernels for the emulator's own semantics: shuffles, votes, barriers, shared memory, atomics, errors.
// They are valid CUDA too (nvcc -arch=sm_80 -cubin compiles them), so they say nothing only the emulator means.
#include <cassert>
#include <cstdio>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// out[i] = shuffle of in[i] across the warp. kind: 0 idx, 1 up, 2 down, 3 xor.
extern "C" __global__ void shuffle_kernel(const int* in, int* out, int kind, int arg, int width) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int v = in[i];
  if (kind == 0) v = __shfl_sync(0xffffffffu, v, arg, width);
  if (kind == 1) v = __shfl_up_sync(0xffffffffu, v, arg, width);
  if (kind == 2) v = __shfl_down_sync(0xffffffffu, v, arg, width);
  if (kind == 3) v = __shfl_xor_sync(0xffffffffu, v, arg, width);
  out[i] = v;
}

// Shuffles of other types: double and __half2 travel bit-exactly.
extern "C" __global__ void shuffle_types(const double* d, double* d_out, const __half2* h, __half2* h_out) {
  int l = threadIdx.x;
  d_out[l] = __shfl_xor_sync(0xffffffffu, d[l], 1);
  h_out[l] = __shfl_sync(0xffffffffu, h[l], 31 - l);
}

// Votes with the full mask, and with two disjoint half-warp masks used at the same time.
// out[4 l + 0..3] = ballot, any, all (full mask), ballot (own half's mask).
extern "C" __global__ void vote_kernel(const int* pred, unsigned* out) {
  int l = threadIdx.x, p = pred[l];
  out[4 * l + 0] = __ballot_sync(0xffffffffu, p);
  out[4 * l + 1] = __any_sync(0xffffffffu, p);
  out[4 * l + 2] = __all_sync(0xffffffffu, p);
  unsigned half = l < 16 ? 0x0000ffffu : 0xffff0000u;
  out[4 * l + 3] = __ballot_sync(half, p);
}

// out[t] = value written by thread t-1 (thread 0 reads its own). With barrier == 0 the barrier between
// the write and the read is missing: the forward schedule happens to run writers first, the others do not.
extern "C" __global__ void neighbour_kernel(const float* in, float* out, int barrier) {
  __shared__ float s[256];
  int t = threadIdx.x;
  s[t] = in[t];
  if (barrier) __syncthreads();
  out[t] = s[t > 0 ? t - 1 : 0];
}

// Warp-level version: a shared-memory exchange inside one warp needs __syncwarp.
extern "C" __global__ void warp_neighbour_kernel(const float* in, float* out, int sync) {
  __shared__ float s[32];
  int l = threadIdx.x;
  s[l] = in[l];
  if (sync) __syncwarp();
  out[l] = s[l > 0 ? l - 1 : 0];
}

// order[t] = position of thread t in the run order of the first phase.
extern "C" __global__ void order_kernel(int* counter, int* order) {
  order[threadIdx.x] = atomicAdd(counter, 1);
}

// mode 0: barrier reached only by the first warp (deadlock); 1: two different barriers (divergent);
// 2: device assert on negative input; 3: shuffle with a mask that excludes the caller;
// 4: lanes disagree about the mask (never completes); 5: __trap().
extern "C" __global__ void faulty_kernel(const float* in, float* out, int mode) {
  int t = threadIdx.x;
  if (mode == 0 && t < 32) __syncthreads();
  if (mode == 1) {
    if (t < 64) {
      __syncthreads();
    } else {
      __syncthreads();
    }
  }
  if (mode == 2) assert(in[blockIdx.x * blockDim.x + t] >= 0.f);
  if (mode == 3) out[t] = __shfl_sync(1u << ((t + 1) % 32), in[t], 0);
  if (mode == 4) out[t] = __shfl_sync(t == 0 ? 0x3u : 0xffffffffu, in[t], 0);
  if (mode == 5 && t == 3) __trap();
  if (mode == 6) out[t] = in[t];
}

// Block 1 reads what block 0 left in shared memory (static and dynamic): it must see NaN, not block 0's data.
extern "C" __global__ void stale_shared_kernel(float* out) {
  __shared__ float s[64];
  extern __shared__ float dyn[];
  int t = threadIdx.x;
  if (blockIdx.x == 0) {
    s[t] = 1.f;
    dyn[t] = 2.f;
  } else {
    out[2 * t] = s[t];
    out[2 * t + 1] = dyn[t];
  }
}

// out = count, and, or of pred over the block through the __syncthreads_* reductions.
extern "C" __global__ void sync_reduce_kernel(const int* pred, int* out) {
  int p = pred[threadIdx.x];
  int c = __syncthreads_count(p), a = __syncthreads_and(p), o = __syncthreads_or(p);
  if (threadIdx.x == 0) out[0] = c, out[1] = a, out[2] = o;
}

// Grid-wide atomics: sum, max, and a CAS-built float max.
extern "C" __global__ void atomics_kernel(const float* x, float* sum, int* imax, unsigned* cas_max_bits) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(sum, x[i]);
  atomicMax(imax, int(x[i] * 1000.f));
  unsigned old = *cas_max_bits, assumed;
  do {
    assumed = old;
    float cur = __uint_as_float(assumed);
    if (cur >= x[i]) break;
    old = atomicCAS(cas_max_bits, assumed, __float_as_uint(x[i]));
  } while (old != assumed);
}

// Every built-in index variable, per thread: 12 ints.
extern "C" __global__ void index_kernel(int* out) {
  int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int* o = out + 12 * (b * blockDim.x * blockDim.y * blockDim.z + t);
  o[0] = threadIdx.x, o[1] = threadIdx.y, o[2] = threadIdx.z, o[3] = blockIdx.x, o[4] = blockIdx.y;
  o[5] = blockIdx.z, o[6] = blockDim.x, o[7] = blockDim.y, o[8] = blockDim.z, o[9] = gridDim.x;
  o[10] = gridDim.y, o[11] = gridDim.z;
}

// Argument marshalling of every scalar kind, through a template name expression. OFFSET comes from -D.
#ifndef OFFSET
#define OFFSET 0
#endif
namespace testns {
template <typename T, int N>
__global__ void scalars_kernel(T* out, long long a, double b, unsigned c, bool d, float e, const void* p) {
  out[0] = T(a) + OFFSET, out[1] = T(b), out[2] = T(c), out[3] = T(d), out[4] = T(e), out[5] = T(N);
  out[6] = T(p == nullptr);
}
template __global__ void scalars_kernel<double, 7>(double*, long long, double, unsigned, bool, float, const void*);
}  // namespace testns

// Partial warp (block of 48): lanes 32-47 form warp 1, whose missing lanes do not block full-mask collectives.
// Sums over groups of 16 lanes, so no lane reads a missing one.
extern "C" __global__ void partial_warp_kernel(int* out) {
  int v = threadIdx.x;
  for (int o = 8; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  out[threadIdx.x] = v;
}

// Lanes 16-31 exit early; the remaining half-warp still synchronizes among itself.
extern "C" __global__ void early_exit_kernel(int* out) {
  int l = threadIdx.x;
  if (l >= 16) return;
  int v = l;
  for (int o = 8; o; o >>= 1) v += __shfl_xor_sync(0x0000ffffu, v, o);
  out[l] = v;
}

// The per-barrier cost of the scheduler.
extern "C" __global__ void barrier_loop(int iters, int* out) {
  int acc = 0;
  for (int i = 0; i < iters; ++i) {
    acc += i;
    __syncthreads();
  }
  out[threadIdx.x] = acc;
}

// Reads x[0..n) through a pointer: shows which address a (possibly strided) view passes.
extern "C" __global__ void copy_kernel(const float* x, float* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = x[i];
}

// A large per-thread array (FA kernels keep big register tiles as locals): needs a bigger fiber stack.
extern "C" __global__ void big_stack_kernel(float* out, int n) {
  volatile float big[96 * 1024];  // 384 KiB
  for (int i = 0; i < n; ++i) big[i] = float(i);
  out[threadIdx.x] = big[n - 1];
}

// The device intrinsics a kernel may use that have no plain host version (or whose host version lives in the
// toolkit headers): out[0..15], plus atomics on double and int, printf and assert.
extern "C" __global__ void intrinsics_kernel(const float* x, float* out, double* dsum, int* imax) {
  float a = x[0], b = x[1];
  if (threadIdx.x == 0) {
    out[0] = exp2f(a), out[1] = __expf(a), out[2] = expf(a), out[3] = __logf(b), out[4] = log2f(b);
    out[5] = fmaxf(a, b), out[6] = __fdividef(a, b), out[7] = __half2float(__float2half_rn(a));
    out[8] = __low2float(__floats2half2_rn(a, b)), out[9] = __high2float(__float22half2_rn(make_float2(a, b)));
    out[10] = __bfloat162float(__float2bfloat16_rn(a)), out[11] = __low2float(__floats2bfloat162_rn(a, b));
    out[12] = __high2float(__float22bfloat162_rn(make_float2(a, b))), out[13] = __ldg(&x[2]);
    out[14] = rsqrtf(b), out[15] = float(__popc(0xF0F0u));
    printf("emulated printf %d\n", 42);
  }
  assert(b > 0.f);
  atomicAdd(dsum, double(threadIdx.x));
  atomicMax(imax, int(threadIdx.x));
  atomicCAS(imax + 1, 0, 7);
}

// GCC's own spelling of the attribute, as libstdc++ writes it: the shim must leave __noinline__ to the compiler
__attribute__((__noinline__)) static int not_inlined(int x) { return 2 * x + 1; }

extern "C" __global__ void gcc_noinline_kernel(int* out) { out[threadIdx.x] = not_inlined(threadIdx.x); }
