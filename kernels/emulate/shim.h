// Force-included (g++ -include) before every kernel source that cuflash.emulate compiles for the CPU.
//
// The toolkit's cuda_fp16.h / cuda_bf16.h are used in host mode (their conversions are exact); this header
// then gives the CUDA keywords CPU meanings and pulls in the fiber runtime and the device intrinsics.
// Kernel code selects emulation-only paths with CUFLASH_EMULATE, never with __CUDA_ARCH__.
// Include guards, not only #pragma once: the precompiled copy of these headers in the cache and the originals
// must count as the same file.
#pragma once
#ifndef CUFLASH_EMULATE_SHIM_H_
#define CUFLASH_EMULATE_SHIM_H_
#ifndef CUFLASH_EMULATE
#define CUFLASH_EMULATE 1
#endif

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_functions.h>
#include <vector_types.h>

// cuflash.emulate rewrites single-declarator `__shared__` declarations to registered storage (runtime.h:
// shared_var). Forms it does not recognise (several declarators on one line, macros) fall back to this: a
// function- or file-local static, shared by the fibers of a block but neither NaN-filled nor known to the
// shared-address checks of ldmatrix/cp.async.
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __forceinline__
#define __forceinline__ inline
// No __noinline__: nvcc defines it only for CUDA compilers (crt/host_defines.h), since GCC spells the attribute
// __attribute__((__noinline__)) too, as libstdc++ does (bits/shared_ptr_base.h): a macro here made that
// __attribute__((__attribute__((noinline)))), an error in every kernel that included such a header (g++ 13 on
// the H200 machine, 2026-11-28). The kernels do not use it.
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __constant__
#define __constant__
#undef __managed__
#define __managed__
// `const __grid_constant__ Params p`: a struct passed by value, which the CPU reads from the argument buffer.
// The toolkit's host_defines.h makes it __attribute__((grid_constant)), unknown to g++: hence the #undef.
#undef __grid_constant__
#define __grid_constant__

#include "runtime.h"
#include "intrinsics.h"

#endif  // CUFLASH_EMULATE_SHIM_H_
