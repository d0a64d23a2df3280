// cuflash — dropout bits: Philox-4x32-10, the device copy of cuflash/dropout.py (a test holds them bit-equal).
//
// The keep-mask is a pure function of (seed, batch, head, row, column), so the backward regenerates the forward's
// mask instead of storing it (FlashAttention's kernel fusion of dropout):
//     bits = Philox4x32-10(key = (seed_lo, seed_hi), counter = (col >> 2, row, head, batch))[col & 3]
//     keep = bits >= threshold,   threshold = floor(p * 2^32)
// One Philox call serves four adjacent columns; an mma accumulator fragment holds column pairs (2t, 2t+1), so
// callers that want both words of a pair call philox_pair once.
#pragma once

namespace cuflash {

struct Philox4 {
  unsigned int x, y, z, w;
};

__device__ __forceinline__ Philox4 philox4x32_10(Philox4 c, unsigned int k0, unsigned int k1) {
  // Salmon et al. (SC'11): ten rounds of two 32x32->64 multiplies and a Weyl-sequence key schedule.
  constexpr unsigned int kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned long long p0 = (unsigned long long)kM0 * c.x;
    const unsigned long long p1 = (unsigned long long)kM1 * c.z;
    const unsigned int hi0 = (unsigned int)(p0 >> 32), lo0 = (unsigned int)p0;
    const unsigned int hi1 = (unsigned int)(p1 >> 32), lo1 = (unsigned int)p1;
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

struct DropoutRng {
  unsigned int seed_lo, seed_hi, threshold;

  // The four words for columns [4*(col>>2), 4*(col>>2)+4) of one (batch, head, row).
  __device__ __forceinline__ Philox4 words(int batch, int head, int row, int col) const {
    return philox4x32_10(Philox4{(unsigned int)col >> 2, (unsigned int)row, (unsigned int)head,
                                 (unsigned int)batch}, seed_lo, seed_hi);
  }

  __device__ __forceinline__ static unsigned int pick(const Philox4& w, int lane) {
    return lane == 0 ? w.x : lane == 1 ? w.y : lane == 2 ? w.z : w.w;
  }

  __device__ __forceinline__ bool keep(int batch, int head, int row, int col) const {
    return pick(words(batch, head, row, col), col & 3) >= threshold;
  }

  // Keep bits of the column pair (col, col + 1), col even: one Philox call.
  __device__ __forceinline__ void keep_pair(int batch, int head, int row, int col, bool& k0, bool& k1) const {
    const Philox4 w = words(batch, head, row, col);
    k0 = pick(w, col & 3) >= threshold;
    k1 = pick(w, (col & 3) + 1) >= threshold;
  }
};

}  // namespace cuflash
