// Test kernels for the emulated twins of kernels/arch.cuh. One warp each (blockDim.x == 32) unless noted.
// Fragments are built here straight from the PTX ISA tables, independently of the emulator's code.
#include "arch.cuh"

using cuflash::arch::mma_16816;

// Lane l: groupID g = l / 4, threadID_in_group t = l % 4.
__device__ __forceinline__ uint32_t pack16(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// D = A B + C with A 16x16 row-major, B 16x8 row-major (k, n), C and D 16x8 row-major, all from global memory.
template <typename T>
__global__ void mma_from_global(const uint16_t* A, const uint16_t* B, const float* C, float* D) {
  int l = threadIdx.x, g = l / 4, t = l % 4;
  uint32_t a[4] = {pack16(A[g * 16 + 2 * t], A[g * 16 + 2 * t + 1]),
                   pack16(A[(g + 8) * 16 + 2 * t], A[(g + 8) * 16 + 2 * t + 1]),
                   pack16(A[g * 16 + 2 * t + 8], A[g * 16 + 2 * t + 9]),
                   pack16(A[(g + 8) * 16 + 2 * t + 8], A[(g + 8) * 16 + 2 * t + 9])};
  uint32_t b[2] = {pack16(B[(2 * t) * 8 + g], B[(2 * t + 1) * 8 + g]),
                   pack16(B[(2 * t + 8) * 8 + g], B[(2 * t + 9) * 8 + g])};
  float c[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
  float d[4];
  mma_16816<T>(d, a, b, c);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}
template __global__ void mma_from_global<__half>(const uint16_t*, const uint16_t*, const float*, float*);
template __global__ void mma_from_global<__nv_bfloat16>(const uint16_t*, const uint16_t*, const float*, float*);

// ldmatrix of `nmat` 8x8 matrices: matrix m is rows 8m..8m+7 of `src` (32 x 8), staged in shared memory with a
// padded row stride so that the row addresses are not simply consecutive. out[lane * 4 + j] = register j.
extern "C" __global__ void ldmatrix_kernel(const uint16_t* src, uint32_t* out, int nmat, int trans) {
  constexpr int kStride = 24;  // 48-byte rows: 16-byte aligned, not contiguous
  __shared__ __align__(16) uint16_t s[32 * kStride];
  int l = threadIdx.x;
  for (int c = 0; c < 8; ++c) s[l * kStride + c] = src[l * 8 + c];
  __syncwarp();
  // Lanes whose address PTX ignores pass an invalid one, to prove it is not read.
  const void* row = l < 8 * nmat ? static_cast<const void*>(&s[l * kStride]) : reinterpret_cast<const void*>(8);
  uint32_t r[4] = {0, 0, 0, 0};
  if (nmat == 1) {
    uint32_t x[1];
    cuflash::arch::ldmatrix_x1(x, row);
    r[0] = x[0];
  } else if (nmat == 2) {
    uint32_t x[2];
    if (trans)
      cuflash::arch::ldmatrix_x2_trans(x, row);
    else
      cuflash::arch::ldmatrix_x2(x, row);
    r[0] = x[0], r[1] = x[1];
  } else {
    if (trans)
      cuflash::arch::ldmatrix_x4_trans(r, row);
    else
      cuflash::arch::ldmatrix_x4(r, row);
  }
  for (int j = 0; j < 4; ++j) out[l * 4 + j] = r[j];
}

// The forward kernel's use: A (16x16, row-major) with ldmatrix.x4; B either from a [n][k] tile (K, no .trans) or
// from a [k][n] tile (V, .trans). D = A B, 16x8.
template <typename T>
__global__ void ldmatrix_mma(const uint16_t* A, const uint16_t* B, int b_is_kn, float* D) {
  __shared__ __align__(16) uint16_t sA[16 * 16];
  __shared__ __align__(16) uint16_t sB[16 * 8];
  int l = threadIdx.x, g = l / 4, t = l % 4;
  for (int i = l; i < 256; i += 32) sA[i] = A[i];
  for (int i = l; i < 128; i += 32) sB[i] = B[i];
  __syncwarp();
  int m = l / 8, r = l % 8;
  uint32_t a[4], b[2];
  cuflash::arch::ldmatrix_x4(a, &sA[(r + 8 * (m & 1)) * 16 + 8 * (m >> 1)]);
  if (b_is_kn)  // B stored [k][n] (16 rows of 8): lanes 0-15 address rows k = l
    cuflash::arch::ldmatrix_x2_trans(b, &sB[(l % 16) * 8]);
  else  // B stored [n][k] (8 rows of 16): matrix 0 = k 0-7, matrix 1 = k 8-15
    cuflash::arch::ldmatrix_x2(b, &sB[(l % 8) * 16 + 8 * ((l / 8) % 2)]);
  float c[4] = {0.f, 0.f, 0.f, 0.f}, d[4];
  mma_16816<T>(d, a, b, c);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}
template __global__ void ldmatrix_mma<__half>(const uint16_t*, const uint16_t*, int, float*);
template __global__ void ldmatrix_mma<__nv_bfloat16>(const uint16_t*, const uint16_t*, int, float*);

// Each thread copies 16-byte chunks of `src` (n floats, n % 4 == 0) into dynamic shared memory with cp.async, in
// two commit groups (first and second half), then waits as `mode` says and writes shared memory back to `dst`:
//   0: wait<0>   1: no wait   2: wait<1> (only the first group)   3: second group never committed, wait<0>
// Chunks at index >= valid are issued with pred = false (zero-fill).
extern "C" __global__ void cp_async_kernel(const float* src, float* dst, int n, int valid, int mode) {
  extern __shared__ __align__(16) float smem[];
  int chunks = n / 4, half = chunks / 2;
  for (int c = threadIdx.x; c < half; c += blockDim.x)
    cuflash::arch::cp_async_16(&smem[4 * c], &src[4 * c], 4 * c < valid);
  cuflash::arch::cp_async_commit();
  for (int c = half + threadIdx.x; c < chunks; c += blockDim.x)
    cuflash::arch::cp_async_16(&smem[4 * c], &src[4 * c], 4 * c < valid);
  if (mode != 3) cuflash::arch::cp_async_commit();
  if (mode == 0 || mode == 3) cuflash::arch::cp_async_wait<0>();
  if (mode == 2) cuflash::arch::cp_async_wait<1>();
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = smem[i];
}

// D = A B + C for mma.m8n8k4 .f64: A 8x4, B 4x8 (k, n), C and D 8x8, all row-major in global memory. Fragments
// from the PTX ISA's table ("Matrix Fragments for mma.m8n8k4 with .f64"): a0 = A[g][t], b0 = B[t][g],
// c0, c1 = C[g][2t], C[g][2t+1].
extern "C" __global__ void mma_f64_from_global(const double* A, const double* B, const double* C, double* D) {
  int l = threadIdx.x, g = l / 4, t = l % 4;
  double c[2] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1]}, d[2];
  cuflash::arch::mma_884_f64(d, A[g * 4 + t], B[t * 8 + g], c);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
}

#include "mma_tf32.cuh"  // mma_tf32_from_global (also run on a GPU: tests/test_gpu_arch.py)

// cvt.rna.tf32.f32 of n floats, the b32 results.
extern "C" __global__ void tf32_kernel(const float* x, uint32_t* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = cuflash::arch::to_tf32(x[i]);
}

// pack2<T>: two floats rounded to T in one register, the first in the low half.
template <typename T>
__global__ void pack2_kernel(const float* x, uint32_t* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = cuflash::arch::pack2<T>(x[2 * i], x[2 * i + 1]);
}
template __global__ void pack2_kernel<__half>(const float*, uint32_t*, int);
template __global__ void pack2_kernel<__nv_bfloat16>(const float*, uint32_t*, int);

#ifdef CUFLASH_EMULATE
// The emulated mma's fp16 decoder, over every bit pattern (emulation only: it is not a CUDA function).
extern "C" __global__ void half_decode_kernel(float* out) {
  for (int i = threadIdx.x; i < 65536; i += blockDim.x)
    out[i] = cuflash::arch::emu::to_float<__half>(static_cast<uint16_t>(i));
}
#endif

// Bank conflicts as the emulator counts them: lane l copies 16 bytes into row l of a shared tile whose rows are
// `stride` elements apart, then ldmatrix.x4 reads the 32 rows back (8 rows per matrix, as a quarter-warp's stores).
extern "C" __global__ void bank_kernel(const uint16_t* src, int stride) {
  __shared__ __align__(128) uint16_t s[32 * 64];
  const int l = threadIdx.x;
  cuflash::arch::cp_async_16(&s[l * stride], src + 8 * l, true);
  cuflash::arch::cp_async_commit();
  cuflash::arch::cp_async_wait<0>();
  __syncthreads();
  uint32_t r[4];
  cuflash::arch::ldmatrix_x4(r, &s[l * stride]);
}

// red_add_f32x2 at p + offset: each of `n` threads adds (i, -i) to the pair at 2 * i (offset 1: misaligned).
extern "C" __global__ void red_add_kernel(float* p, int n, int offset) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) cuflash::arch::red_add_f32x2(p + offset + 2 * (i % 4), i, -i);
}
