// The kernels of one instruction set, included once by each kernels_<isa>.cpp after it names
// the set: SLOTSERVE_ISA (the namespace), SLOTSERVE_TARGET (GCC's target string),
// SLOTSERVE_AVX512 and SLOTSERVE_BF16 (which vector forms vec.h defines), SLOTSERVE_VNNI
// (whether quant_byte_pairs.h sums four-input products in one instruction). Every header below
// compiles inside that target region and namespace; SLOTSERVE_ISA::table() hands out the result.
#include "kernel_types.h"

#define SLOTSERVE_PRAGMA(text) _Pragma(#text)
#define SLOTSERVE_TARGET_PRAGMA(isa) SLOTSERVE_PRAGMA(GCC target(isa))
// The namespace expanded before SLOTSERVE_KERNELS names the table after it.
#define SLOTSERVE_TABLE_OF(ns) SLOTSERVE_KERNELS(ns)

#pragma GCC push_options
SLOTSERVE_TARGET_PRAGMA(SLOTSERVE_TARGET)
namespace SLOTSERVE_ISA {
#include "vec.h"
#include "rowwise.h"
#include "attention.h"
#include "attend_scores.h"
#include "attend.h"
#include "attend_heads.h"
#if SLOTSERVE_BF16
#include "attend_amx.h"
#include "attend_amx_row.h"
#include "attend_amx_unit_row.h"
#endif
#include "gemm_vec.h"
#include "quant_pairs.h"
#include "quant_byte_pairs.h"
#include "quant_scales.h"
#include "quant_inputs.h"
#include "quant_gemm.h"
#include "quant_panel.h"
#include "kv_rows.h"

static_assert(sizeof(ValuePair) * 8 <= kVectorScratch - kKeysBytes,
              "a block of key pairs' values fits the vector scratch");
}  // namespace SLOTSERVE_ISA
#pragma GCC pop_options

#if SLOTSERVE_BF16
#define SLOTSERVE_ATTEND_AMX(ns) &ns::attend_amx, &ns::attend_amx_row_heads
#else
#define SLOTSERVE_ATTEND_AMX(ns) nullptr, nullptr
#endif
Kernels SLOTSERVE_ISA::table() { return SLOTSERVE_TABLE_OF(SLOTSERVE_ISA); }
