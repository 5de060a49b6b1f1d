"""The decoder, written once for every supported family (see ``config.py``), run over one
flattened batch per engine step: the tokens of every scheduled chunk, prefill and decode alike,
go through each projection and MLP together; attention runs per group of sequences over the
paged KV pool (``attention.py``).

Weights are fused where the math allows it (q/k/v in one projection, gate/up in one), which
computes the same dot products as separate projections with fewer passes over the input.

A mixture-of-experts layer (Qwen3-MoE) runs each expert once per step over the rows of the
tokens routed to it (gathered, one matmul per projection) and sums each token's experts in
float32 in expert order: a token's result depends only on its own routing, never on which
other tokens share the step, so batch invariance holds as for the dense MLP.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.runners.pytorch.attention import StepAttention, attend
from slotserve.runners.pytorch.config import ModelConfig

# oneDNN's bfloat16 matmuls give every row the same bits whatever the batch while the reduced
# dimension is at most this long (measured up to 600 rows); beyond it some row counts switch to
# a split-K schedule that sums in another order.
INVARIANT_MAX_K = 1024


def _packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # contiguous(): a no-op for every input the decoder passes, kept for safety's sake.
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return out  # type: ignore[no-any-return]


class Projection(nn.Linear):
    """A linear layer that can be made batch-invariant on CPU: :meth:`split_k` cuts a long
    input dimension into equal chunks of at most ``INVARIANT_MAX_K``, whose bfloat16 products
    are summed in float32 in a fixed order. :meth:`prepack` stores the weights in oneDNN's
    blocked layout once, instead of oneDNN reordering them on every call."""

    chunks: list[torch.Tensor] | None = None
    chunks_packed = False
    packed: torch.Tensor | None = None  # the whole weight, prepacked

    def split_k(self) -> None:
        k = self.in_features
        parts = -(-k // INVARIANT_MAX_K)
        if parts == 1 or k % parts:
            return
        step = k // parts
        self.chunks = [self.weight[:, i * step : (i + 1) * step].contiguous() for i in range(parts)]
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def prepack(self, keep_weight: bool = False) -> None:
        """oneDNN's prepacked bfloat16 matmul: measured bit-identical to ``F.linear`` for every
        row count from 1 to 600 (so batch invariance is unchanged) and 1.2-2.9× faster here,
        most at one row (a decode step of one sequence). ``keep_weight``: the weight is shared
        (a tied embedding)."""
        reorder = torch.ops.mkldnn._reorder_linear_weight
        if self.chunks is not None:
            self.chunks = [reorder(chunk, 1) for chunk in self.chunks]
            self.chunks_packed = True
            return
        self.packed = reorder(self.weight.detach(), 1)
        if not keep_weight:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def _chunk(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.chunks_packed:
            return _packed_linear(x, weight, None)
        return F.linear(x, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.bias)
        if self.chunks is None:
            return F.linear(x, self.weight, self.bias)
        step = self.in_features // len(self.chunks)
        total = self._chunk(x[:, :step], self.chunks[0]).float()
        for i, chunk in enumerate(self.chunks[1:], start=1):
            total += self._chunk(x[:, i * step : (i + 1) * step], chunk).float()
        if self.bias is not None:
            total += self.bias.float()
        return total.to(x.dtype)


class RmsNorm(nn.Module):
    """RMSNorm as HF computes it: normalised in float32; Llama-style weights multiply in the
    model dtype, Gemma-style ones are stored as (w - 1) and multiply ``1 + w`` in float32."""

    def __init__(self, size: int, eps: float, gemma: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (hidden * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * hidden.to(x.dtype)


def rotary_tables(
    config: ModelConfig, theta: float, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, [max_positions, head_dim], as HF builds them."""
    dim = config.head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [tokens, heads, head_dim]; ``cos``/``sin``: [tokens, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Expert(nn.Module):
    """One SwiGLU expert of a mixture-of-experts layer (gate and up fused, as the dense MLP)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up = Projection(hidden, 2 * intermediate, bias=False, dtype=dtype)
        self.down = Projection(intermediate, hidden, bias=False, dtype=dtype)


class DecoderLayer(nn.Module):
    qkv: Projection
    o_proj: Projection
    gate_up: Projection
    down: Projection
    input_norm: RmsNorm
    post_attention_norm: RmsNorm
    pre_mlp_norm: RmsNorm  # Gemma
    post_mlp_norm: RmsNorm  # Gemma
    q_norm: RmsNorm  # Qwen3, Gemma
    k_norm: RmsNorm
    router: Projection  # mixture of experts: hidden → one logit per expert
    experts: list[Expert]

    def __init__(self, config: ModelConfig, dtype: torch.dtype, sparse: bool = False) -> None:
        super().__init__()
        c = config
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv = Projection(c.hidden_size, qkv_rows, bias=c.attention_bias, dtype=dtype)
        self.o_proj = Projection(c.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=dtype)
        self.sparse = sparse
        if sparse:
            self.router = Projection(c.hidden_size, c.num_experts, bias=False, dtype=dtype)
            self.experts = [
                Expert(c.hidden_size, c.moe_intermediate_size, dtype) for _ in range(c.num_experts)
            ]
            self.expert_modules = nn.ModuleList(self.experts)  # registered; the list is typed
        else:
            self.gate_up = Projection(
                c.hidden_size, 2 * c.intermediate_size, bias=False, dtype=dtype
            )
            self.down = Projection(c.intermediate_size, c.hidden_size, bias=False, dtype=dtype)
        g, eps = c.gemma_norms, c.rms_norm_eps
        self.input_norm = RmsNorm(c.hidden_size, eps, g, dtype)
        self.post_attention_norm = RmsNorm(c.hidden_size, eps, g, dtype)
        if c.gemma_norms:
            self.pre_mlp_norm = RmsNorm(c.hidden_size, eps, g, dtype)
            self.post_mlp_norm = RmsNorm(c.hidden_size, eps, g, dtype)
        if c.qk_norm:
            self.q_norm = RmsNorm(c.head_dim, eps, g, dtype)
            self.k_norm = RmsNorm(c.head_dim, eps, g, dtype)
        for parameter in self.parameters():
            parameter.requires_grad_(False)


class Decoder(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor
    local_cos: torch.Tensor
    local_sin: torch.Tensor
    lm_head: Projection

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.decoder_layers = [DecoderLayer(c, dtype, c.is_sparse(i)) for i in range(c.num_layers)]
        self.layers = nn.ModuleList(self.decoder_layers)  # registers them; the list is typed
        self.norm = RmsNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norms, dtype)
        self.lm_head = Projection(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.requires_grad_(False)
        cos, sin = rotary_tables(c, c.rope_theta, max_positions, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        if c.rope_local_theta is not None:
            local_cos, local_sin = rotary_tables(
                _without_scaling(c), c.rope_local_theta, max_positions, dtype
            )
            self.register_buffer("local_cos", local_cos, persistent=False)
            self.register_buffer("local_sin", local_sin, persistent=False)
        self._embed_scale = math.sqrt(c.hidden_size)

    def make_batch_invariant(self) -> None:
        """After loading: long-input projections split their reduction (see ``Projection``).
        A tied head keeps sharing the embedding: hidden sizes above the limit would need a
        copy, made here too."""
        for module in self.modules():
            if isinstance(module, Projection) and module is not self.lm_head:
                module.split_k()
        if self.config.hidden_size > INVARIANT_MAX_K:
            if self.config.tie_word_embeddings:
                self.lm_head.weight = nn.Parameter(self.embed.weight.clone(), requires_grad=False)
            self.lm_head.split_k()

    def prepack(self) -> None:
        """Every projection's weights in oneDNN's blocked layout (CPU, bfloat16; after
        :meth:`make_batch_invariant`). A tied head keeps the embedding's weight."""
        for module in self.modules():
            if isinstance(module, Projection):
                tied = module is self.lm_head and self.lm_head.weight is self.embed.weight
                module.prepack(keep_weight=tied)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepAttention,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states after the last layer (before the final norm), one row per token."""
        c = self.config
        hidden = self.embed(token_ids)
        if c.scale_embeddings:
            hidden = hidden * torch.tensor(self._embed_scale, dtype=hidden.dtype)
        cos, sin = self.cos[positions], self.sin[positions]
        if c.rope_local_theta is not None:
            local_cos, local_sin = self.local_cos[positions], self.local_sin[positions]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for index, layer in enumerate(self.decoder_layers):
            sliding = c.is_sliding(index)
            residual = hidden
            x = layer.input_norm(hidden)
            qkv = layer.qkv(x)
            v = qkv[:, q_size + kv_size :].view(-1, c.num_kv_heads, c.head_dim)
            local = sliding and c.rope_local_theta is not None
            rotary = (local_cos, local_sin) if local else (cos, sin)
            if c.qk_norm:
                q = layer.q_norm(qkv[:, :q_size].view(-1, c.num_heads, c.head_dim))
                k = layer.k_norm(
                    qkv[:, q_size : q_size + kv_size].view(-1, c.num_kv_heads, c.head_dim)
                )
                q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
            else:
                # q and k heads side by side through one rotary pass (element-wise: the same
                # bits as two passes, in half the operators).
                qk = qkv[:, : q_size + kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
                qk = apply_rotary(qk, *rotary)
                q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            key_cache, value_cache = kv_layers[index]
            attn = attend(q, k, v, key_cache, value_cache, step, sliding, c)
            x = layer.o_proj(attn)
            if c.gemma_norms:
                x = layer.post_attention_norm(x)
                hidden = residual + x
                residual = hidden
                x = layer.pre_mlp_norm(hidden)
            else:
                hidden = residual + x
                residual = hidden
                x = layer.post_attention_norm(hidden)
            if layer.sparse:
                x = _mixture_of_experts(layer, x, c)
            else:
                gate, up = layer.gate_up(x).chunk(2, dim=-1)
                x = layer.down(_activation(gate, c.hidden_activation) * up)
            if c.gemma_norms:
                x = layer.post_mlp_norm(x)
            hidden = residual + x
        return hidden  # type: ignore[no-any-return]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows of final hidden states."""
        logits: torch.Tensor = self.lm_head(self.norm(hidden)).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _mixture_of_experts(layer: DecoderLayer, x: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """Routes each token to its top-k experts (softmax over all experts in float32, as HF),
    gathers the rows of every (token, expert) pair sorted by expert, runs each chosen expert
    once over its contiguous rows, and sums each token's weighted results in float32 in
    expert order (``index_add_`` adds in index order)."""
    probabilities = torch.softmax(layer.router(x).float(), dim=-1)
    weights, chosen = torch.topk(probabilities, c.num_experts_per_tok, dim=-1)
    if c.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # by expert, then by token
    token_rows = order // c.num_experts_per_tok
    rows = x[token_rows]
    counts = torch.bincount(flat, minlength=c.num_experts).tolist()
    results, start = [], 0
    for expert_id, count in enumerate(counts):
        if count:
            expert = layer.experts[expert_id]
            gate, up = expert.gate_up(rows[start : start + count]).chunk(2, dim=-1)
            results.append(expert.down(_activation(gate, c.hidden_activation) * up))
            start += count
    scale = weights.to(x.dtype).flatten()[order, None]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_rows, (torch.cat(results) * scale).float())
    return out.to(x.dtype)


def _activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    if kind == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


def _without_scaling(config: ModelConfig) -> ModelConfig:
    from dataclasses import replace

    from slotserve.runners.pytorch.config import RopeScaling

    return replace(config, rope_scaling=RopeScaling())
