// The kernels compiled for AVX2 with FMA; kernel_types.h says how the translation units divide.
#include "kernel_types.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define SLOTSERVE_AVX512 0
#define SLOTSERVE_BF16 0
#include "vec.h"
#include "rowwise.h"
#include "attention.h"
#include "attend.h"
#include "gemm_vec.h"
#include "quant_pairs.h"
#include "quant_gemm.h"
}  // namespace avx2
#pragma GCC pop_options

static_assert(sizeof(avx2::ValuePair) * 8 <= kVectorScratch - kKeysBytes,
              "a block of key pairs' values fits the vector scratch");

Kernels avx2_kernels() { return SLOTSERVE_KERNELS(avx2); }
