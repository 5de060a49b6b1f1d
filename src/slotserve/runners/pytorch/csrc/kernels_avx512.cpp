// The kernels compiled for AVX-512 (F, BW, VL, DQ); kernel_types.h says how the translation
// units divide.
#include "kernel_types.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace avx512 {
#define SLOTSERVE_AVX512 1
#define SLOTSERVE_BF16 0
#include "vec.h"
#include "rowwise.h"
#include "attention.h"
#include "attend.h"
#include "gemm_vec.h"
#include "quant_pairs.h"
#include "quant_gemm.h"
}  // namespace avx512
#pragma GCC pop_options

static_assert(sizeof(avx512::ValuePair) * 8 <= kVectorScratch - kKeysBytes,
              "a block of key pairs' values fits the vector scratch");

Kernels avx512_kernels() { return SLOTSERVE_KERNELS(avx512); }
