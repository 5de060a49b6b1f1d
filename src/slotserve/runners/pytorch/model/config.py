"""The decoder's shape: one frozen dataclass of sizes and switches, with no family in it.

Each family (``families/``) reads its checkpoints into one; where a family departs from the
plain Llama-shaped decoder, a field says how (``qk_norm``, ``plus_one_norms``,
``sandwich_norms``, ``scale_embeddings``, ``sliding_layers``, ``linear_layers``,
``sparse_layers``, ``attn_output_gate``, ...), its default being the plain decoder's. The shared
code reads the fields and never the family's name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slotserve.runners.pytorch.model.kv_int8 import SCALE_BYTES


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or configuration cannot be served by this runner."""


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for long contexts (HF ``rope_scaling``)."""

    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN: the rotations per context below which a frequency is interpolated and above which it
    # is kept, and the factor cos and sin are scaled by (None: 0.1 · ln(factor) + 1).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # the checkpoint's HF model_type: for messages, never branched on
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
    attention_bias: bool = False  # biases on the q/k/v projections
    qk_norm: bool = False  # RMSNorm on each head's queries and keys
    # RMSNorm weights stored as (w - 1): every norm multiplies by (1 + w).
    plus_one_norms: bool = False
    # Four norms per layer: after attention and after the MLP too, before each joins the
    # residual stream.
    sandwich_norms: bool = False
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    hidden_activation: str = "silu"  # silu | gelu_pytorch_tanh | gelu
    query_pre_attn_scalar: float | None = None  # queries scaled by its root, not head_dim's
    sliding_window: int | None = None
    # Per layer: True for a sliding-window (local) layer.
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None  # the sliding layers' own rotary base
    # M-RoPE (Qwen2.5-VL, Qwen3-VL): the rotary dims' split among (time, height, width)
    # positions, in sections or interleaved (Qwen3-VL: t, h, w, t, h, w, ...).
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts; per layer: True for a sparse (experts) MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()
    shared_expert_intermediate_size: int = 0  # one expert every token runs, gated
    # Per layer: True for a Gated DeltaNet (linear attention) layer.
    linear_layers: tuple[bool, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attn_output_gate: bool = False  # q_proj yields [query | gate] per head
    rotary_dim: int = 0  # dims of each head the rotary embedding turns; 0: all of them

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar or self.head_dim
        return 1.0 / math.sqrt(scalar)

    @property
    def rotary_size(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def num_attention_layers(self) -> int:
        return self.num_layers - sum(self.linear_layers)

    def kv_bytes_per_token(self, dtype_bytes: int, int8: bool = False) -> int:
        """K and V of one position in every full-attention layer, in ``dtype_bytes`` a value
        or as int8 rows with a scale each (``kv_int8.py``); DeltaNet layers keep a fixed-size
        state per sequence instead: ``linear_state_bytes``."""
        row = self.head_dim + SCALE_BYTES if int8 else self.head_dim * dtype_bytes
        return 2 * self.num_attention_layers * self.num_kv_heads * row

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


def rope_scaling(raw: Mapping[str, Any], name: str, trained: int = 8192) -> RopeScaling:
    """HF's ``rope_scaling`` (or ``rope_parameters``) settings; refused when unknown.
    ``trained``: the model's ``max_position_embeddings``, YaRN's original context unless the
    settings name one."""
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind in ("default", "mrope"):  # M-RoPE is read as ``mrope_section`` (Qwen2.5-VL)
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
    if kind == "yarn":
        attention = raw.get("attention_factor")
        return RopeScaling(
            "yarn",
            float(raw["factor"]),
            original_max_position_embeddings=int(
                raw.get("original_max_position_embeddings") or trained
            ),
            beta_fast=float(raw.get("beta_fast") or 32.0),
            beta_slow=float(raw.get("beta_slow") or 1.0),
            attention_factor=None if attention is None else float(attention),
        )
    raise UnsupportedModelError(f"{name}: rope scaling {kind!r} is not supported")


def check(config: ModelConfig) -> None:
    """Refuses, with every reason, a shape the decoder cannot run."""
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
