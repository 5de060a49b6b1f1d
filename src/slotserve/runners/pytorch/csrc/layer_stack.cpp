// The decoder's layers chained in C++ (layer_stack.h).

#include "layer_stack.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>

#include "cpu_kernels.h"

namespace cpu {

namespace {

// A projection as Projection.forward computes it: each part's outputs, side by side.
at::Tensor project(const at::Tensor& x, const std::vector<StackPart>& parts,
                   const c10::optional<at::Tensor>& prompt_rows) {
    const auto one = [&](const StackPart& p) {
        if (p.quantized)
            return quant_linear(x, p.packed, p.n, p.bits, p.offset, p.has_min, p.sub, p.super,
                                p.bias, "", prompt_rows);
        return linear(x, p.packed, p.bias, p.n);
    };
    if (parts.size() == 1) return one(parts[0]);
    std::vector<at::Tensor> outs;
    outs.reserve(parts.size());
    for (const StackPart& p : parts) outs.push_back(one(p));
    return at::cat(outs, 1);
}

}  // namespace

LayerStack::LayerStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                       bool plus_one, double scale, int64_t activation)
    : heads_(heads),
      kv_heads_(kv_heads),
      head_dim_(head_dim),
      eps_(eps),
      scale_(scale),
      plus_one_(plus_one),
      activation_(StackActivation(activation)) {
    TORCH_CHECK(activation >= 0 && activation <= 2,
                "activation 0 (SiLU), 1 (GELU, tanh), 2 (GELU)");
}

void LayerStack::add_layer(const at::Tensor& input_norm, const at::Tensor& post_attention_norm,
                           const c10::optional<at::Tensor>& pre_mlp_norm,
                           const c10::optional<at::Tensor>& post_mlp_norm,
                           const c10::optional<at::Tensor>& q_norm,
                           const c10::optional<at::Tensor>& k_norm, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t window) {
    StackLayer layer;
    layer.input_norm = input_norm;
    layer.post_attention_norm = post_attention_norm;
    layer.pre_mlp_norm = pre_mlp_norm;
    layer.post_mlp_norm = post_mlp_norm;
    layer.q_norm = q_norm;
    layer.k_norm = k_norm;
    layer.cos = cos;
    layer.sin = sin;
    layer.window = window;
    layers_.push_back(std::move(layer));
}

void LayerStack::add_part(int64_t which, const at::Tensor& packed, int64_t n, bool quantized,
                          int64_t bits, int64_t offset, bool has_min, int64_t sub,
                          int64_t super, const c10::optional<at::Tensor>& bias) {
    TORCH_CHECK(!layers_.empty(), "add_layer first");
    TORCH_CHECK(which >= 0 && which < 4, "projection 0 (qkv), 1 (o_proj), 2 (gate_up), 3 (down)");
    StackLayer& layer = layers_.back();
    std::vector<StackPart>* const projections[] = {&layer.qkv, &layer.o_proj, &layer.gate_up,
                                                   &layer.down};
    projections[which]->push_back({packed, n, quantized, bits, offset, sub, super, has_min, bias});
}

at::Tensor LayerStack::mlp(const StackLayer& layer, const at::Tensor& x,
                           const c10::optional<at::Tensor>& prompt_rows) const {
    const at::Tensor gate_up = project(x, layer.gate_up, prompt_rows);
    if (activation_ == StackActivation::silu)
        return project(silu_mul(gate_up), layer.down, prompt_rows);
    const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
    const char* approximate = activation_ == StackActivation::gelu_tanh ? "tanh" : "none";
    const at::Tensor gated = at::mul(at::gelu(halves[0], approximate), halves[1]);
    return project(gated.contiguous(), layer.down, prompt_rows);
}

at::Tensor LayerStack::run(const at::Tensor& hidden, const at::Tensor& positions,
                           const at::Tensor& cache_rows, const at::Tensor& block_tables,
                           const at::Tensor& token_seq, int64_t block_size,
                           const std::vector<at::Tensor>& keys,
                           const std::vector<at::Tensor>& values,
                           const c10::optional<at::Tensor>& prompt_rows) const {
    const size_t count = layers_.size();
    TORCH_CHECK(keys.size() == count && values.size() == count, "one pool per layer");
    at::Tensor x = hidden, residual;
    for (size_t i = 0; i < count; ++i) {
        const StackLayer& layer = layers_[i];
        if (i == 0) {
            residual = x;
            x = rms_norm(x, layer.input_norm, eps_, plus_one_);
        } else {
            std::tie(x, residual) = add_rms_norm(x, residual, layer.input_norm, eps_, plus_one_);
        }
        at::Tensor key_cache = keys[i], value_cache = values[i];
        const at::Tensor qkv = project(x, layer.qkv, prompt_rows);
        const at::Tensor q = rotary_write(qkv, layer.cos, layer.sin, positions, cache_rows,
                                          key_cache, value_cache, heads_, kv_heads_, head_dim_,
                                          false, layer.q_norm, layer.k_norm, eps_, plus_one_);
        const at::Tensor attended = paged_attention(q, key_cache, value_cache, block_tables,
                                                    token_seq, positions, block_size,
                                                    layer.window, scale_);
        x = project(attended, layer.o_proj, prompt_rows);
        if (layer.pre_mlp_norm) {
            x = rms_norm(x, layer.post_attention_norm, eps_, plus_one_);
            std::tie(x, residual) =
                add_rms_norm(x, residual, *layer.pre_mlp_norm, eps_, plus_one_);
        } else {
            std::tie(x, residual) =
                add_rms_norm(x, residual, layer.post_attention_norm, eps_, plus_one_);
        }
        x = mlp(layer, x, prompt_rows);
        if (layer.post_mlp_norm) x = rms_norm(x, *layer.post_mlp_norm, eps_, plus_one_);
    }
    return count == 0 ? x : at::add(residual, x);
}

}  // namespace cpu
