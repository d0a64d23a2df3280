// One TF32 tensor-core product from global memory, for the emulator's test (arch_tests.cu includes it after arch.cuh)
// and the GPU's (tests/test_gpu_arch.py appends it to arch.cuh): the same kernel on both sides.
// D = A B + C for mma.m16n8k8 .tf32: A 16x8, B 8x8 (k, n), C and D 16x8 row-major; A and B are fp32 and rounded to
// tf32 here with cvt.rna ("Matrix Fragments for mma.m16n8k8", .tf32: a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4],
// a3 = A[g+8][t+4]; b0 = B[t][g], b1 = B[t+4][g]; C as m16n8k16's).
extern "C" __global__ void mma_tf32_from_global(const float* A, const float* B, const float* C, float* D) {
  using cuflash::arch::to_tf32;
  int l = threadIdx.x, g = l / 4, t = l % 4;
  uint32_t a[4] = {to_tf32(A[g * 8 + t]), to_tf32(A[(g + 8) * 8 + t]), to_tf32(A[g * 8 + t + 4]),
                   to_tf32(A[(g + 8) * 8 + t + 4])};
  uint32_t b[2] = {to_tf32(B[t * 8 + g]), to_tf32(B[(t + 4) * 8 + g])};
  float c[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
  float d[4];
  cuflash::arch::mma_1688_tf32(d, a, b, c);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}
