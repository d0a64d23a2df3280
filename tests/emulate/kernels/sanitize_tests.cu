// Planted memory errors for the AddressSanitizer / UBSan build. mode 0 is clean (barriers, shuffles, shared
// memory: the fiber switches must not confuse ASan); every other mode makes exactly one bad access.
extern "C" __global__ void planted_kernel(float* out, int n, int mode) {
  __shared__ float s[64];
  extern __shared__ unsigned char dyn[];  // launched with 100 bytes
  int t = threadIdx.x;
  s[t] = float(t);
  dyn[t] = 1;
  __syncthreads();
  float v = s[63 - t] + __shfl_xor_sync(0xffffffffu, float(dyn[t]), 1);
  if (mode == 1 && t == 0) out[n] = v;               // one element past a global buffer
  float* ps = s;  // through a pointer, as kernels address their tiles (UBSan's bounds check sees only arrays)
  if (mode == 2 && t == 0) ps[64 + t] = v;           // one past a static __shared__ array
  if (mode == 3 && t == 0) dyn[100] = 1;             // one byte past the dynamic shared memory
  if (mode == 4 && t == 0) {
    int big = 0x7fffffff - int(dyn[0]) + 1;
    v += float(big + int(s[1]));                      // signed overflow: UBSan
  }
  out[t] = v;
}
