// A decoder's layers as one call: the ops of cpu_kernels.h chained in C++, in the order and with
// the arguments the Python decoder (model/decoder.py) gives them, so the same bits come out;
// what it saves is the interpreter's time between the ops, which at one decode row is as long
// as the kernels' own. model/layer_stack.py says which models and steps it serves.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

namespace cpu {

// Consecutive outputs of a projection: quantized (quant_linear's format) or packed bfloat16
// (linear's), with an optional bias.
struct StackPart {
    at::Tensor packed;
    int64_t n = 0;
    bool quantized = false;
    int64_t bits = 0, offset = 0, sub = 0, super = 0;
    bool has_min = false;
    c10::optional<at::Tensor> bias;
};

// One layer: attention (q/k/v fused, the rotary embedding, the pool) and a gated MLP, pre-norms
// that fold the residual add in; with sandwich norms (Gemma 3's) the attention's and the MLP's
// outputs are normed too, and pre_mlp_norm folds the add in.
struct StackLayer {
    std::vector<StackPart> qkv, o_proj, gate_up, down;
    at::Tensor input_norm, post_attention_norm, cos, sin;
    c10::optional<at::Tensor> pre_mlp_norm, post_mlp_norm, q_norm, k_norm;
    int64_t window = 0;  // a sliding layer's window; 0: every position
};

// The MLP's activation of its gate: SiLU (the kernels' silu_mul), or GELU through torch's
// operator as the decoder calls it, tanh-approximated or exact.
enum class StackActivation : int64_t { silu = 0, gelu_tanh = 1, gelu = 2 };

class LayerStack {
public:
    LayerStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, bool plus_one,
               double scale, int64_t activation);

    // A new last layer; its projections' parts follow through add_part.
    void add_layer(const at::Tensor& input_norm, const at::Tensor& post_attention_norm,
                   const c10::optional<at::Tensor>& pre_mlp_norm,
                   const c10::optional<at::Tensor>& post_mlp_norm,
                   const c10::optional<at::Tensor>& q_norm,
                   const c10::optional<at::Tensor>& k_norm, const at::Tensor& cos,
                   const at::Tensor& sin, int64_t window);
    // The next part of the last layer's projection `which` (0 qkv, 1 o_proj, 2 gate_up,
    // 3 down): quant_linear's arguments when `quantized`, else linear's (bits and the rest 0).
    void add_part(int64_t which, const at::Tensor& packed, int64_t n, bool quantized,
                  int64_t bits, int64_t offset, bool has_min, int64_t sub, int64_t super,
                  const c10::optional<at::Tensor>& bias);
    // The hidden states after the last layer (the residual stream made whole) for the step's
    // embedded tokens `hidden`; keys[i], values[i]: layer i's pool; `prompt_rows`: the rows of
    // prompt tokens (quant_linear's).
    at::Tensor run(const at::Tensor& hidden, const at::Tensor& positions,
                   const at::Tensor& cache_rows, const at::Tensor& block_tables,
                   const at::Tensor& token_seq, int64_t block_size,
                   const std::vector<at::Tensor>& keys,
                   const std::vector<at::Tensor>& values,
                   const c10::optional<at::Tensor>& prompt_rows) const;

private:
    int64_t heads_, kv_heads_, head_dim_;
    double eps_, scale_;
    bool plus_one_;
    StackActivation activation_;
    std::vector<StackLayer> layers_;

    at::Tensor mlp(const StackLayer& layer, const at::Tensor& x,
                   const c10::optional<at::Tensor>& prompt_rows) const;
};

}  // namespace cpu
