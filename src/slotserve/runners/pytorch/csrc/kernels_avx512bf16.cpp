// The kernels compiled for AVX512-BF16 with VNNI (attention's bfloat16 dot products in one
// instruction, and the quantized projections' four-input integer sums: every CPU with the first
// has the second); kernel_types.h says how the translation units divide.
#define SLOTSERVE_ISA avx512bf16
#define SLOTSERVE_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c"
#define SLOTSERVE_AVX512 1
#define SLOTSERVE_BF16 1
#define SLOTSERVE_VNNI 1
#include "amx_tiles.h"  // attention on AMX tiles (attend_amx.h), at file scope
#include "isa_kernels.h"
