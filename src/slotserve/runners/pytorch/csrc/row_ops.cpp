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
    uint16_t *qo = bf16_mut(q), *kc = bf16_mut(key_cache), *vc = bf16_mut(value_cache);
    const int32_t *pos = positions.data_ptr<int32_t>(), *rows = cache_rows.data_ptr<int32_t>();
    const int64_t stride = qkv.stride(0), row_size = kv_heads * head_dim;
    for (int64_t t = 0; t < tokens; ++t)
        TORCH_CHECK(rows[t] >= 0 && rows[t] < cache_rows_total && pos[t] >= 0 &&
                        pos[t] < cos.size(0),
                    "a cache row or position is out of range");
    at::parallel_for(0, tokens, grain((heads + kv_heads) * head_dim * 4),
                     [&](int64_t begin, int64_t end) {
                         std::vector<float> scratch(2 * head_dim);
                         for (int64_t t = begin; t < end; ++t)
                             k.rotary_token(in + t * stride, layout, c + pos[t] * rotary_dim,
                                            s + pos[t] * rotary_dim, qo + t * heads * head_dim,
                                            kc + rows[t] * row_size, vc + rows[t] * row_size,
                                            scratch.data());
                     });
    return q;
}

}  // namespace cpu
