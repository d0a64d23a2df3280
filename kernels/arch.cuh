// cuflash::arch — the only place in kernels/ with inline PTX (sm_80+ tensor-core and async-copy primitives).
//
// Every wrapper has an emulated twin, selected by CUFLASH_EMULATE (defined only by cuflash.emulate's g++ build,
// never by nvcc/NVRTC: `#ifndef __CUDA_ARCH__` would also be taken by nvcc's host pass). The twins follow the
// PTX ISA fragment layouts exactly, so a kernel that is right under emulation is right on the GPU.
//
// API (namespace cuflash::arch, all __device__ __forceinline__):
//   mma_16816<T>(d, a, b, c)        D = A*B + C, m16n8k16 row.col, T = __half | __nv_bfloat16, fp32 accumulate
//   ldmatrix_x1/x2/x4(r, row)       ldmatrix.sync.aligned.m8n8.xN.shared.b16; each lane passes its row address
//   ldmatrix_x2_trans/x4_trans      the same with .trans
//   cp_async_16(smem, gmem, pred)   cp.async.cg 16 bytes; pred == false zero-fills smem and reads no gmem
//   cp_async_commit()               cp.async.commit_group
//   cp_async_wait<N>()              cp.async.wait_group N (N = 0 waits for all)
// Additions beyond the agreed contract:
//   pack2<T>(lo, hi) -> uint32_t    two floats rounded to T (round-to-nearest-even) packed into one b32
//                                   register, `lo` in the low 16 bits: the A-fragment layout of P in P*V.
// The float32/float64 kernels (kernels/wide_*.cuh; the fragment layouts are spelled out in wide_mma.cuh):
//   mma_884_f64(d, a, b, c)         D = A*B + C, mma.sync m8n8k4 row.col .f64 (sm_80+, PTX ISA "Matrix Fragments
//                                   for mma.m8n8k4 with .f64"): one double of A and of B, two of C/D per lane;
//                                   each element is a chain of .f64 fused multiply-adds, round to nearest even
//   mma_1688_tf32(d, a, b, c)       D = A*B + C, mma.sync m16n8k8 row.col .f32.tf32.tf32.f32 (sm_80+, "Matrix
//                                   Fragments for mma.m16n8k8"): four tf32 (b32) of A, two of B, four fp32 of C/D
//   to_tf32(x) -> uint32_t          cvt.rna.tf32.f32: x rounded to 10 mantissa bits, ties away from zero, as the
//                                   b32 bit pattern the tf32 mma takes (low 13 bits zero)
// The backward's dQ workspace:
//   red_add_f32x2(p, a, b)          p[0] += a, p[1] += b as global reductions (no return value); p 8-byte aligned.
//                                   sm_90: one red.global.add.v2.f32 (PTX ISA 8.1), a lane's 8 bytes in one
//                                   request (the first H100 profile: scalar reductions filled 16 of the 32 bytes
//                                   of each sector); before sm_90: two red.global.add.f32
#pragma once

#if defined(__CUDACC_RTC__)
typedef unsigned int uint32_t;  // NVRTC has no <cstdint>; an identical typedef elsewhere is harmless
#else
#include <cstdint>
#endif
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cuflash {
namespace arch {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

#ifndef CUFLASH_EMULATE  // ---------------------------------------------------------------- real PTX (sm_80+)

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                          const float (&c)[4]);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// ---- float64 / tf32 tensor cores (the wide kernels) ----
__device__ __forceinline__ void mma_884_f64(double (&d)[2], double a, double b, const double (&c)[2]) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%4, %5};\n"
               : "=d"(d[0]), "=d"(d[1])
               : "d"(a), "d"(b), "d"(c[0]), "d"(c[1]));
}

__device__ __forceinline__ void mma_1688_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                              const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// No "memory" clobber on ldmatrix: shared-memory writes by other lanes need a __syncwarp/__syncthreads anyway,
// and those are compiler barriers.
__device__ __forceinline__ void ldmatrix_x1(uint32_t (&r)[1], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(smem_addr(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}

// src-size 0 makes the hardware zero-fill all 16 bytes without touching gmem, so out-of-range tiles need no
// separate memset; gmem must still be some pointer value (it is not dereferenced).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(pred ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// "memory" clobber: the compiler must not hoist shared-memory reads above the wait.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

#endif  // !CUFLASH_EMULATE

}  // namespace arch
}  // namespace cuflash

#ifdef CUFLASH_EMULATE  // CPU twins, written against the emulator's runtime (kernels/emulate/shim.h)
#include "emulate/arch_emulated.h"
#endif
