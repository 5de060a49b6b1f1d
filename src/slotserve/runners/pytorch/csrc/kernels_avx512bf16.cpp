// The kernels compiled for AVX512-BF16 (attention's bfloat16 dot products in one instruction);
// kernel_types.h says how the translation units divide.
#define SLOTSERVE_ISA avx512bf16
#define SLOTSERVE_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c"
#define SLOTSERVE_AVX512 1
#define SLOTSERVE_BF16 1
#include "isa_kernels.h"
