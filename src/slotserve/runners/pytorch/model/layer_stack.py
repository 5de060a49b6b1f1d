"""A decoder's layers as one call of the CPU kernels (csrc/layer_stack.h), for the models and
steps whose every layer is a plain one: attention with q/k/v fused (biases, q/k norms, sliding
windows with their own rotary base allowed), an MLP gated by SiLU or GELU, pre-norms or
sandwich norms, every projection on the kernels' GEMM, bfloat16 or quantized. The chain calls
the kernels (and torch's GELU) the decoder's Python would call, in its order and with its
arguments, so a row gets the same bits either way; it saves the interpreter's time between
them, which at one decode row is about as long as the kernels'.

Steps with LoRA adapters, images or tensor parallelism, and models with gated attention, Gated
DeltaNet or expert layers, keep the Python decoder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slotserve.runners.pytorch.model.layers import Projection

if TYPE_CHECKING:
    from slotserve.runners.pytorch.model.decoder import Decoder

# The projections of a layer in the order the chain's ``add_part`` numbers them.
_PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
# The chain's number for each MLP activation (csrc/layer_stack.h's StackActivation).
_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}


def _parts(projection: Projection) -> list[tuple[Any, ...]] | None:
    """``add_part``'s arguments after ``which`` for each part of ``projection``, or None where
    it does not run on the kernels' GEMM."""
    if projection.invariant or projection.kernels is None:
        return None
    if projection.quant_parts is not None:
        return [
            (p.packed, p.rows, True, p.format.bits, p.format.offset, p.format.has_min,
             p.format.sub, p.format.super, p.bias)
            for p in projection.quant_parts
        ]  # fmt: skip
    if projection.kernel_weight is None:
        return None
    weight, bias = projection.kernel_weight, projection.kernel_bias
    return [(weight, projection.out_features, False, 0, 0, False, 0, 0, bias)]


def layer_stack(decoder: Decoder) -> Any | None:
    """``decoder``'s layers chained in one call of its CPU kernels, or None where one of them
    is not the plain layer the chain computes (see above)."""
    c, kernels = decoder.config, decoder.kernels
    if kernels is None or decoder.tp is not None:
        return None
    if c.attn_output_gate or c.hidden_activation not in _ACTIVATIONS:
        return None
    stack = kernels.layer_stack(
        c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.plus_one_norms,
        c.attention_scale, _ACTIVATIONS[c.hidden_activation],
    )  # fmt: skip
    for index, layer in enumerate(decoder.decoder_layers):
        if layer.is_linear or layer.sparse:
            return None
        sliding = c.is_sliding(index)
        local = sliding and c.rope_local_theta is not None
        cos, sin = (decoder.local_cos, decoder.local_sin) if local else (decoder.cos, decoder.sin)
        stack.add_layer(
            layer.input_norm.weight,
            layer.post_attention_norm.weight,
            layer.pre_mlp_norm.weight if c.sandwich_norms else None,
            layer.post_mlp_norm.weight if c.sandwich_norms else None,
            layer.q_norm.weight if c.qk_norm else None,
            layer.k_norm.weight if c.qk_norm else None,
            cos,
            sin,
            (c.sliding_window or 0) if sliding else 0,
        )
        for which, name in enumerate(_PROJECTIONS):
            parts = _parts(getattr(layer, name))
            if parts is None:
                return None
            for part in parts:
                stack.add_part(which, *part)
    return stack
