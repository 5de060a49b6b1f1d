// The kernels compiled for AVX-512 (F, BW, VL, DQ); kernel_types.h says how the translation
// units divide.
#define SLOTSERVE_ISA avx512
#define SLOTSERVE_TARGET "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"
#define SLOTSERVE_AVX512 1
#define SLOTSERVE_BF16 0
#define SLOTSERVE_VNNI 0
#include "isa_kernels.h"
