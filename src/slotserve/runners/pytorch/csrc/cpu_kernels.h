// What the translation units of the ops share: the chosen instruction set's kernels, access to
// bfloat16 tensors, and the ops that cpu_kernels.cpp binds (defined in row_ops.cpp,
// paged_attention.cpp, linear.cpp and quant_linear.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <string>
#include <tuple>

#include "kernel_types.h"

namespace cpu {

// Attention's head dimensions come in whole vectors of this many lanes on every instruction set.
constexpr int kLanes = 16;

bool runs_avx512();
bool runs_avx2();
Kernels& kernels();
// The chosen kernels, refused where the CPU runs none.
const Kernels& usable();

inline const uint16_t* bf16(const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

inline uint16_t* bf16_mut(at::Tensor& t) {
    return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

inline void check_rows(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16,
                what, " must be a bfloat16 CPU tensor");
    TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be [rows, n] with unit stride");
}

// Rows per task so a task carries ~32k elements: one row of a small model stays on one thread.
inline int64_t grain(int64_t n) {
    return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, n));
}

// row_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool plus_one);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps,
                                                bool plus_one);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor rotary_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& positions, const at::Tensor& cache_rows,
                        at::Tensor& key_cache, at::Tensor& value_cache, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, bool gated,
                        const c10::optional<at::Tensor>& q_norm,
                        const c10::optional<at::Tensor>& k_norm, double eps, bool plus_one);

// attention_choice.cpp
enum class AmxAttention { none, tiles, emulated };
std::string& attention_name();
bool runs_attention(const std::string& name);
std::string select_attention(const std::string& name);
// How a call with heads of ``head_dim`` runs its partitions on kernels ``k``.
AmxAttention amx_attention(const Kernels& k, int64_t head_dim);

// paged_attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& token_seq, const at::Tensor& positions,
                           int64_t block_size, int64_t window, double scale);

// linear.cpp
at::Tensor pack_weight(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias, int64_t n);
at::Tensor linear_on(const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias, int64_t n, const std::string& path);
std::string& gemm_name();
bool runs_gemm(const std::string& name);
std::string select_gemm(const std::string& name);
std::string& quant_tiles_name();
std::string select_quant_tiles(const std::string& name);
bool runs_amx();
bool amx_verified();
bool amx_bytes_verified();
using BlocksFn = void (*)(const GemmOperands&, int64_t rows, int64_t b0, int64_t b1);
BlocksFn gemm_blocks_on(const std::string& chosen, int64_t k);

// quant_linear.cpp
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits,
                        int64_t offset, bool has_min, int64_t sub, int64_t super,
                        const c10::optional<at::Tensor>& bias, const std::string& tiles = "",
                        const c10::optional<at::Tensor>& prompt_rows = c10::nullopt);
at::Tensor quant_rows(const at::Tensor& packed, const at::Tensor& rows, int64_t n, int64_t k,
                      int64_t bits, int64_t offset, bool has_min, int64_t sub, int64_t super);

// huge_pages.cpp: an uninitialised buffer for what a step streams (packed weights, the KV pool),
// on huge pages where it can be
at::Tensor huge_page_buffer(at::IntArrayRef sizes, at::ScalarType dtype);

// quant_pack.cpp
void quant_pack(const at::Tensor& raw, const c10::optional<at::Tensor>& order, int64_t type,
                int64_t k, int64_t bits, int64_t offset, bool has_min, int64_t sub,
                int64_t super, const at::Tensor& out);

}  // namespace cpu
