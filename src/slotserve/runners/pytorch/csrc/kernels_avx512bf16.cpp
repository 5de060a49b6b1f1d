// The kernels compiled for AVX512-BF16 (attention's bfloat16 dot products in one instruction);
// kernel_types.h says how the translation units divide.
#include "kernel_types.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
namespace avx512bf16 {
#define SLOTSERVE_AVX512 1
#define SLOTSERVE_BF16 1
#include "vec.h"
#include "rowwise.h"
#include "attention.h"
#include "attend.h"
#include "gemm_vec.h"
#include "quant_pairs.h"
#include "quant_gemm.h"
}  // namespace avx512bf16
#pragma GCC pop_options

static_assert(sizeof(avx512bf16::ValuePair) * 8 <= kVectorScratch - kKeysBytes,
              "a block of key pairs' values fits the vector scratch");

Kernels avx512bf16_kernels() { return SLOTSERVE_KERNELS(avx512bf16); }
