// The per-row ops over torch tensors: RMSNorm (with the residual add), SiLU·mul, and q/k norm
// with the rotary embedding and the K/V write, rows spread over torch's threads on the chosen
// kernels (rowwise.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <tuple>

#include "cpu_kernels.h"

namespace cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool plus_one) {
    const Kernels& k = usable();
    check_rows(x, "x");
    const int64_t rows = x.size(0), n = x.size(1);
    at::Tensor out = at::empty({rows, n}, x.options());
    const uint16_t *in = bf16(x), *w = bf16(weight);
    uint16_t* o = bf16_mut(out);
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(n);
        for (int64_t r = begin; r < end; ++r)
            k.norm_bf16_row(in + r * stride, n, w, float(eps), plus_one, o + r * n,
                            scratch.data());
    });
    return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps,
                                                bool plus_one) {
    const Kernels& k = usable();
    check_rows(x, "x");
    check_rows(residual, "residual");
    TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
    const int64_t rows = x.size(0), n = x.size(1);
    at::Tensor out = at::empty({rows, n}, x.options());
    at::Tensor summed = at::empty({rows, n}, x.options());
    const uint16_t *a = bf16(x), *b = bf16(residual), *w = bf16(weight);
    uint16_t *o = bf16_mut(out), *s = bf16_mut(summed);
    const int64_t sa = x.stride(0), sb = residual.stride(0);
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(n);
        for (int64_t r = begin; r < end; ++r)
            k.add_norm_row(a + r * sa, b + r * sb, n, w, float(eps), plus_one, s + r * n,
                           o + r * n, scratch.data());
    });
    return {out, summed};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
    const Kernels& k = usable();
    check_rows(gate_up, "gate_up");
    const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
    at::Tensor out = at::empty({rows, n}, gate_up.options());
    const uint16_t* in = bf16(gate_up);
    uint16_t* o = bf16_mut(out);
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            k.silu_mul_row(in + r * stride, in + r * stride + n, n, o + r * n);
    });
    return out;
}

namespace {

// A head's K or V row of `d` bfloat16 values as the int8 pool's row: codes, then the scale
// (kernel_types.h). Plain scalar code: a row is written once, and std::nearbyint rounds to
// nearest even as torch.round does (model/kv_int8.py writes the same bytes).
void int8_row(const uint16_t* x, int64_t d, uint8_t* row) {
    const auto value = [x](int64_t i) {
        const uint32_t bits = uint32_t(x[i]) << 16;
        float v;
        std::memcpy(&v, &bits, sizeof(v));
        return v;
    };
    float top = 0.0f;
    for (int64_t i = 0; i < d; ++i) top = std::max(top, std::fabs(value(i)));
    const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
    for (int64_t i = 0; i < d; ++i) {
        const float code = std::clamp(std::nearbyint(value(i) * inverse), -127.0f, 127.0f);
        row[i] = uint8_t(int8_t(code));
    }
    const float scale = top / 127.0f;
    std::memcpy(row + d, &scale, sizeof(scale));
}

}  // namespace

at::Tensor rotary_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& positions, const at::Tensor& cache_rows,
                        at::Tensor& key_cache, at::Tensor& value_cache, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, bool gated,
                        const c10::optional<at::Tensor>& q_norm,
                        const c10::optional<at::Tensor>& k_norm, double eps, bool plus_one) {
    const Kernels& k = usable();
    check_rows(qkv, "qkv");
    const int64_t tokens = qkv.size(0);
    const int64_t q_cols = heads * head_dim * (gated ? 2 : 1);
    TORCH_CHECK(qkv.size(1) >= q_cols + 2 * kv_heads * head_dim, "qkv is too narrow");
    TORCH_CHECK(positions.scalar_type() == at::kInt && cache_rows.scalar_type() == at::kInt,
                "positions and cache rows must be int32");
    TORCH_CHECK(positions.numel() == tokens && cache_rows.numel() == tokens,
                "one position and one cache row per token");
    TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches: contiguous");
    // An int8 pool (uint8 rows of codes and a scale) or a bfloat16 one.
    const bool int8 = key_cache.scalar_type() == at::kByte;
    TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() &&
                    key_cache.size(2) == head_dim + (int8 ? kKvScaleBytes : 0),
                "caches: bfloat16 [rows, kv_heads, head_dim], or uint8 rows of int8 codes and "
                "a scale");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "rotary tables: contiguous");
    const int64_t rotary_dim = cos.size(1);
    const int64_t cache_rows_total = key_cache.size(0);
    HeadLayout layout{int(heads),
                      int(kv_heads),
                      int(head_dim),
                      int(rotary_dim),
                      gated,
                      q_norm ? bf16(*q_norm) : nullptr,
                      k_norm ? bf16(*k_norm) : nullptr,
                      float(eps),
                      plus_one};
    at::Tensor q = at::empty({tokens, heads, head_dim}, qkv.options());
    const uint16_t *in = bf16(qkv), *c = bf16(cos), *s = bf16(sin);
    uint16_t* qo = bf16_mut(q);
    uint16_t* kc = int8 ? nullptr : bf16_mut(key_cache);
    uint16_t* vc = int8 ? nullptr : bf16_mut(value_cache);
    uint8_t* k8 = int8 ? key_cache.data_ptr<uint8_t>() : nullptr;
    uint8_t* v8 = int8 ? value_cache.data_ptr<uint8_t>() : nullptr;
    const int32_t *pos = positions.data_ptr<int32_t>(), *rows = cache_rows.data_ptr<int32_t>();
    const int64_t stride = qkv.stride(0), row_size = kv_heads * head_dim;
    for (int64_t t = 0; t < tokens; ++t)
        TORCH_CHECK(rows[t] >= 0 && rows[t] < cache_rows_total && pos[t] >= 0 &&
                        pos[t] < cos.size(0),
                    "a cache row or position is out of range");
    at::parallel_for(0, tokens, grain((heads + kv_heads) * head_dim * 4),
                     [&](int64_t begin, int64_t end) {
                         std::vector<float> scratch(2 * head_dim);
                         // An int8 pool's K and V rows, first in bfloat16.
                         std::vector<uint16_t> staged(int8 ? 2 * row_size : 0);
                         for (int64_t t = begin; t < end; ++t) {
                             uint16_t* key = int8 ? staged.data() : kc + rows[t] * row_size;
                             uint16_t* value =
                                 int8 ? staged.data() + row_size : vc + rows[t] * row_size;
                             k.rotary_token(in + t * stride, layout, c + pos[t] * rotary_dim,
                                            s + pos[t] * rotary_dim, qo + t * heads * head_dim,
                                            key, value, scratch.data());
                             if (!int8) continue;
                             for (int64_t h = 0; h < kv_heads; ++h) {
                                 const int64_t at = (rows[t] * kv_heads + h) *
                                                    (head_dim + kKvScaleBytes);
                                 int8_row(key + h * head_dim, head_dim, k8 + at);
                                 int8_row(value + h * head_dim, head_dim, v8 + at);
                             }
                         }
                     });
    return q;
}

}  // namespace cpu
