// Test kernels for the emulator's hardening: hw_math rounding, struct arguments by value, Ctrl-C.
#include <cstdint>

// out[i] = exp2f(x[i]), out[n + i] = __expf(x[i]): the functions hw_math replaces with ex2.approx.ftz.f32.
extern "C" __global__ void exp2_kernel(const float* x, float* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    out[i] = exp2f(x[i]);
    out[n + i] = __expf(x[i]);
  }
}

// Plain fp32 arithmetic on denormals: out[i] = a[i] * b[i] (a denormal result), out[n + i] = a[i] + c[i] (a
// denormal operand). Under -ftz=true (hw_math) both flush to zero.
extern "C" __global__ void ftz_kernel(const float* a, const float* b, const float* c, float* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    out[i] = a[i] * b[i];
    out[n + i] = a[i] + c[i];
  }
}

// The kernels' coming calling convention: one params struct by value.
struct Params {
  float* out;
  long long n;
  float scale;
};

extern "C" __global__ void struct_kernel(const __grid_constant__ Params p) {
  for (long long i = threadIdx.x; i < p.n; i += blockDim.x) p.out[i] = p.scale * float(i);
}

// Many blocks without a single barrier: a launch can only be stopped between blocks.
extern "C" __global__ void busy_blocks_kernel(int work, unsigned* out) {
  unsigned acc = blockIdx.x;
  for (int i = 0; i < work; ++i) acc = acc * 1664525u + 1013904223u;
  if (threadIdx.x == 0) out[blockIdx.x % 64] = acc;
}
