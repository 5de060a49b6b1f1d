"""The model's shape, read from an HF ``config.json`` or GGUF metadata, checked before any weight
is read.

One frozen dataclass covers the supported families; each family's quirks are fields with the
defaults of the families that do not have them:

* Llama 2/3, SmolLM2, Mistral (``llama``, ``mistral``): RMSNorm, SwiGLU, rotary embeddings
  (with Llama 3's or linear scaling), grouped-query attention.
* Qwen2 (``qwen2``): biases on the q/k/v projections.
* Qwen3 (``qwen3``): RMSNorm on each head's queries and keys.
* Qwen3-MoE (``qwen3_moe``): Qwen3's attention; the MLP of sparse layers is a softmax
  router over ``num_experts`` SwiGLU experts of which ``num_experts_per_tok`` run per token
  (weights renormalised when ``norm_topk_prob``); ``mlp_only_layers`` and
  ``decoder_sparse_step`` name the dense ones.
* Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``, and their ``_text`` models): per ``layer_types``,
  Gated DeltaNet linear-attention layers (``deltanet.py``) and full-attention layers whose
  output is gated (``q_proj`` gives each head's query and gate) and whose rotary embedding
  turns the first ``partial_rotary_factor`` of each head; RMSNorm weights stored as (w - 1);
  the MoE variant renormalises its top-k and adds a shared expert gated by a sigmoid.
* Gemma 3 text (``gemma3_text``, ``gemma3``): embeddings scaled by sqrt(hidden), RMSNorm
  weights stored as (w - 1), four norms per layer, GeGLU (tanh GELU), query scaling from
  ``query_pre_attn_scalar``, sliding-window layers with their own rotary base.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "gemma3_text",
    "gemma3",
)


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or configuration cannot be served by this runner."""


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for long contexts (HF ``rope_scaling``)."""

    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False
    qk_norm: bool = False
    # Gemma 3.
    gemma_norms: bool = False  # (1 + w) RMSNorm weights, pre/post norms around attn and MLP
    scale_embeddings: bool = False
    hidden_activation: str = "silu"  # silu | gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    # Per layer: True for a sliding-window (local) layer.
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE); per layer: True for a sparse (experts) MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE: one expert every token runs
    # Qwen3.5: per layer, True for a Gated DeltaNet (linear attention) layer.
    linear_layers: tuple[bool, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attn_output_gate: bool = False  # q_proj yields [query | gate] per head
    rotary_dim: int = 0  # dims of each head the rotary embedding turns; 0: all of them
    centered_norms: bool = False  # (1 + w) RMSNorm weights without Gemma's four norms

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar or self.head_dim
        return 1.0 / math.sqrt(scalar)

    @property
    def plus_one_norms(self) -> bool:
        return self.gemma_norms or self.centered_norms

    @property
    def rotary_size(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def num_attention_layers(self) -> int:
        return self.num_layers - sum(self.linear_layers)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one position in every full-attention layer (DeltaNet layers keep a
        fixed-size state per sequence instead: ``linear_state_bytes``)."""
        return 2 * self.num_attention_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def linear_conv_channels(self) -> int:
        """The causal convolution runs over the q, k and v channels of a DeltaNet layer."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def linear_state_bytes(self, dtype_bytes: int) -> int:
        """One sequence's DeltaNet state over all linear layers: the convolution's last
        ``kernel - 1`` inputs (model dtype) and the float32 recurrent matrix of each value
        head (key dim × value dim)."""
        conv = (self.linear_conv_kernel - 1) * self.linear_conv_channels * dtype_bytes
        recurrent = (
            self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        )
        return sum(self.linear_layers) * (conv + recurrent)

    def projection_macs_per_token(self) -> int:
        """Multiply-adds of one token's projections through every layer (its experts' share
        for a sparse MLP), the output head left out: a prompt token's cost apart from
        attention."""
        hidden, q_dim = self.hidden_size, self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        total = 0
        for layer in range(self.num_layers):
            if self.is_linear(layer):  # qkvz, b and a in; the gated output out
                total += hidden * (2 * key_dim + 2 * value_dim + 2 * self.linear_num_value_heads)
                total += value_dim * hidden
            else:
                total += hidden * (q_dim * (2 if self.attn_output_gate else 1) + 2 * kv_dim)
                total += q_dim * hidden
            if self.is_sparse(layer):
                width = (
                    self.num_experts_per_tok * self.moe_intermediate_size
                    + self.shared_expert_intermediate_size
                )
            else:
                width = self.intermediate_size
            total += 3 * hidden * width
        return total

    def attention_macs_per_position(self) -> int:
        """Multiply-adds one query token spends on one earlier position (scores and values),
        over the full-attention layers; a sliding-window layer's are bounded by its window
        and left out."""
        layers = sum(
            not self.is_linear(layer) and not self.is_sliding(layer)
            for layer in range(self.num_layers)
        )
        return 2 * layers * self.num_heads * self.head_dim

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer]


def config_from_hf(raw: Mapping[str, Any], name: str) -> ModelConfig:
    """Validates an HF ``config.json`` (already parsed) without touching any weight."""
    model_type = raw.get("model_type")
    if model_type in ("gemma3", "qwen3_5", "qwen3_5_moe") and "text_config" in raw:
        # A multimodal checkpoint: its text model (the head's tying is set at the top).
        tied = raw.get("tie_word_embeddings", raw["text_config"].get("tie_word_embeddings"))
        model_type = f"{model_type}_text"
        raw = {**raw["text_config"], "model_type": model_type}
        if tied is not None:
            raw["tie_word_embeddings"] = tied
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name}: model_type {model_type!r} is not supported by the PyTorch runner; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )

    def need(key: str) -> Any:
        if key not in raw or raw[key] is None:
            raise UnsupportedModelError(f"{name}: config.json has no {key!r} ({model_type})")
        return raw[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    gemma = model_type in ("gemma3_text", "gemma3")
    qwen35 = model_type.startswith("qwen3_5")
    layers = int(need("num_hidden_layers"))
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    local_rope: Mapping[str, Any] = {}
    if "full_attention" in rope:  # transformers 5 keys Gemma 3's rotary settings by layer type
        local_rope = rope.get("sliding_attention") or {}
        rope = rope["full_attention"]
    theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    partial = rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 0.25
    local_theta = raw.get("rope_local_base_freq") or local_rope.get("rope_theta") or 10000.0
    sliding_window = raw.get("sliding_window") if gemma or model_type == "mistral" else None
    sliding_layers: tuple[bool, ...] = ()
    if gemma:
        types = raw.get("layer_types")
        if types:
            sliding_layers = tuple(t == "sliding_attention" for t in types)
        else:
            pattern = int(raw.get("sliding_window_pattern") or 6)
            sliding_layers = tuple((i + 1) % pattern != 0 for i in range(layers))
    elif sliding_window:
        sliding_layers = (True,) * layers
    linear_layers: tuple[bool, ...] = ()
    if qwen35:
        types = raw.get("layer_types") or [
            "full_attention"
            if (i + 1) % int(raw.get("full_attention_interval") or 4) == 0
            else "linear_attention"
            for i in range(layers)
        ]
        unknown = set(types) - {"linear_attention", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"{name}: layer types {sorted(unknown)} are not supported")
        linear_layers = tuple(t == "linear_attention" for t in types)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    sparse_layers: tuple[bool, ...] = ()
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        sparse_layers = (experts > 0,) * layers  # every layer, top-k always renormalised
    if model_type == "qwen3_moe":
        # transformers' rule: a layer is sparse unless listed dense or off the sparse step.
        dense = set(raw.get("mlp_only_layers") or ())
        step = int(raw.get("decoder_sparse_step") or 1)
        sparse_layers = tuple(
            i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)
        )
    config = ModelConfig(
        model_type=model_type,
        name=name,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(
            raw.get("intermediate_size") or 0 if any(sparse_layers) else need("intermediate_size")
        ),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        rope_scaling=_rope_scaling(rope, name),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or gemma or qwen35,
        gemma_norms=gemma,
        scale_embeddings=gemma,
        hidden_activation=str(
            raw.get("hidden_activation") or raw.get("hidden_act") or ("gelu" if gemma else "silu")
        ),
        query_pre_attn_scalar=(
            float(raw["query_pre_attn_scalar"]) if raw.get("query_pre_attn_scalar") else None
        ),
        sliding_window=int(sliding_window) if sliding_window else None,
        sliding_layers=sliding_layers,
        rope_local_theta=float(local_theta) if gemma else None,
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        num_experts=experts if any(sparse_layers) else 0,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0) if any(sparse_layers) else 0,
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", qwen35)),
        sparse_layers=sparse_layers if any(sparse_layers) else (),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        linear_layers=linear_layers if any(linear_layers) else (),
        linear_num_key_heads=int(raw.get("linear_num_key_heads") or 0),
        linear_num_value_heads=int(raw.get("linear_num_value_heads") or 0),
        linear_key_head_dim=int(raw.get("linear_key_head_dim") or 0),
        linear_value_head_dim=int(raw.get("linear_value_head_dim") or 0),
        linear_conv_kernel=int(raw.get("linear_conv_kernel_dim") or 0),
        attn_output_gate=qwen35,  # always on in Qwen3.5 (transformers has no switch)
        # As transformers: int(head_dim × factor); a GGUF states the dim itself.
        rotary_dim=int(raw.get("rotary_dim") or head_dim * float(partial)) if qwen35 else 0,
        centered_norms=qwen35,
    )
    _check(config)
    return config


def _rope_scaling(raw: Mapping[str, Any], name: str) -> RopeScaling:
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(raw["factor"]),
            float(raw.get("low_freq_factor", 1.0)),
            float(raw.get("high_freq_factor", 4.0)),
            int(raw.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModelError(f"{name}: rope scaling {kind!r} is not supported")


def _check(config: ModelConfig) -> None:
    problems = []
    if config.num_heads % config.num_kv_heads:
        problems.append("num_attention_heads is not a multiple of num_key_value_heads")
    if config.head_dim % 2:
        problems.append("head_dim must be even for rotary embeddings")
    if config.hidden_activation not in ("silu", "gelu_pytorch_tanh", "gelu"):
        problems.append(f"activation {config.hidden_activation!r} is not supported")
    if config.sliding_layers and len(config.sliding_layers) != config.num_layers:
        problems.append("layer_types does not list every layer")
    if config.sliding_layers and any(config.sliding_layers) and not config.sliding_window:
        problems.append("sliding-window layers without a sliding_window size")
    if config.sparse_layers and not (
        0 < config.num_experts_per_tok <= config.num_experts and config.moe_intermediate_size > 0
    ):
        problems.append(
            "mixture of experts needs 0 < num_experts_per_tok <= num_experts and "
            "moe_intermediate_size > 0"
        )
    if config.rotary_size % 2 or config.rotary_size > config.head_dim:
        problems.append("the rotary part of a head must be even and at most head_dim")
    if config.linear_layers:
        c = config
        sizes = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
            c.linear_conv_kernel,
        )
        if len(c.linear_layers) != c.num_layers:
            problems.append("layer_types does not list every layer")
        elif all(c.linear_layers):
            problems.append("at least one layer must be full attention")
        elif min(sizes) < 1 or c.linear_num_value_heads % c.linear_num_key_heads:
            problems.append(
                "linear attention needs positive head counts and sizes, and value heads a "
                "multiple of key heads"
            )
    if problems:
        raise UnsupportedModelError(f"{config.name}: " + "; ".join(problems))
