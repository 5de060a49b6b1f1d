// The kernels compiled for AVX2 with FMA; kernel_types.h says how the translation units divide.
#define SLOTSERVE_ISA avx2
#define SLOTSERVE_TARGET "avx2,fma,f16c"
#define SLOTSERVE_AVX512 0
#define SLOTSERVE_BF16 0
#define SLOTSERVE_VNNI 0
#include "isa_kernels.h"
