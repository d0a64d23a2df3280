// Emulated twins of kernels/arch.cuh (CUFLASH_EMULATE builds only). Work in progress.
#pragma once
#error "cuflash::arch emulated twins are not written yet"
