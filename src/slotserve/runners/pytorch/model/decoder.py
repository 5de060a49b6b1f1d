"""The decoder, written once for every supported family (``families/``), run over one
flattened batch per engine step: the tokens of every scheduled chunk, prefill and decode alike,
go through each projection and MLP together; attention runs per group of sequences over the
paged KV pool (``attention.py``), Gated DeltaNet layers per sequence over their state
(``deltanet.py``), mixtures of experts per expert (``moe.py``).

Weights are fused where the math allows it (q/k/v in one projection, gate/up in one), which
computes the same dot products as separate projections with fewer passes over the input.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.model.attention import (
    PagedStep,
    StepAttention,
    attend,
    attend_images,
)
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.deltanet import LinearAttention, LinearStep, linear_attention
from slotserve.runners.pytorch.model.layers import (
    Embedding,
    Projection,
    RmsNorm,
    activation,
    prompt_rows,
)
from slotserve.runners.pytorch.model.lora import LayerLora, StepLora
from slotserve.runners.pytorch.model.moe import SparseMlp
from slotserve.runners.pytorch.model.rotary import (
    apply_rotary,
    mrope_rotary,
    rotary_tables,
    without_scaling,
)
from slotserve.runners.pytorch.model.tensor_parallel import TensorParallel


class StepImages(NamedTuple):
    """A vision-language model's step inputs: every token's M-RoPE positions ``[3, tokens]``
    (None: the model's own positions), the rows whose embeddings are the images' (``embeds``,
    one per row), and what is added to those rows' residual stream after each of the first
    layers (Qwen3-VL's deepstack); ``runs``: (first row, count) of each image's tokens that
    see the whole image (Gemma 3), every one with the rest of its image in the step."""

    rope_positions: torch.Tensor | None
    rows: torch.Tensor | None
    embeds: torch.Tensor | None
    deepstack: tuple[torch.Tensor, ...] = ()
    runs: tuple[tuple[int, int], ...] = ()


class _Norms:
    """RMSNorm through the CPU kernels when they serve the step, else the module itself."""

    def __init__(self, kernels: CpuKernels | None) -> None:
        self.kernels = kernels

    def __call__(self, x: torch.Tensor, norm: RmsNorm) -> torch.Tensor:
        if self.kernels is None:
            return norm(x)  # type: ignore[no-any-return]
        return self.kernels.rms_norm(x, norm.weight, norm.eps, norm.plus_one)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RmsNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the first layer's residual is x itself."""
        if residual is None:
            return self(x, norm), x
        if self.kernels is None:
            summed = residual + x
            return norm(summed), summed
        return self.kernels.add_rms_norm(x, residual, norm.weight, norm.eps, norm.plus_one)


def _query_and_gate(qkv: torch.Tensor, c: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated attention's query and output-gate heads, [tokens, heads, head_dim] each: each
    head's rows of the fused projection are [query | gate]."""
    both = qkv[:, : 2 * c.num_heads * c.head_dim].view(-1, c.num_heads, 2 * c.head_dim)
    return both[..., : c.head_dim], both[..., c.head_dim :]


def _project(
    projection: Projection, x: torch.Tensor, lora: LayerLora | None, target: str
) -> torch.Tensor:
    """``projection(x)``, plus each row's LoRA update where the step has adapters. Its
    ``forward`` called directly: a decode step makes hundreds of these calls, and a projection
    has no hooks for ``nn.Module.__call__`` to run."""
    out = projection.forward(x)
    return out if lora is None else lora.add(out, x, target)


class DecoderLayer(nn.Module):
    """One layer: a token mixer (full attention, or a Gated DeltaNet ``linear`` layer) and an
    MLP (dense, or a ``moe`` mixture of experts), with their norms."""

    qkv: Projection  # full attention: q (and its gate, per head), k, v
    o_proj: Projection
    linear: LinearAttention  # Gated DeltaNet instead of attention
    gate_up: Projection  # dense MLP
    down: Projection
    moe: SparseMlp  # mixture of experts instead
    input_norm: RmsNorm
    post_attention_norm: RmsNorm
    pre_mlp_norm: RmsNorm  # sandwich norms
    post_mlp_norm: RmsNorm  # sandwich norms
    q_norm: RmsNorm  # qk_norm
    k_norm: RmsNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        c = config
        self.sparse, self.is_linear = c.is_sparse(index), c.is_linear(index)
        if self.is_linear:
            self.linear = LinearAttention(c, dtype)
        else:
            q_rows = c.num_heads * c.head_dim * (2 if c.attn_output_gate else 1)
            qkv_rows = q_rows + 2 * c.num_kv_heads * c.head_dim
            self.qkv = Projection(c.hidden_size, qkv_rows, bias=c.attention_bias, dtype=dtype)
            self.o_proj = Projection(
                c.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=dtype
            )
        if self.sparse:
            self.moe = SparseMlp(c, dtype)
        else:
            self.gate_up = Projection(
                c.hidden_size, 2 * c.intermediate_size, bias=False, dtype=dtype
            )
            self.down = Projection(c.intermediate_size, c.hidden_size, bias=False, dtype=dtype)
        for name in ("qkv", "o_proj", "gate_up", "down"):
            if hasattr(self, name):
                getattr(self, name).by_role = True
        plus_one, eps = c.plus_one_norms, c.rms_norm_eps
        self.input_norm = RmsNorm(c.hidden_size, eps, plus_one, dtype)
        self.post_attention_norm = RmsNorm(c.hidden_size, eps, plus_one, dtype)
        if c.sandwich_norms:
            self.pre_mlp_norm = RmsNorm(c.hidden_size, eps, plus_one, dtype)
            self.post_mlp_norm = RmsNorm(c.hidden_size, eps, plus_one, dtype)
        if c.qk_norm and not self.is_linear:
            self.q_norm = RmsNorm(c.head_dim, eps, plus_one, dtype)
            self.k_norm = RmsNorm(c.head_dim, eps, plus_one, dtype)
        for parameter in self.parameters():
            parameter.requires_grad_(False)

    def attention(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        step: StepAttention,
        kv: tuple[torch.Tensor, torch.Tensor],
        sliding: bool,
        c: ModelConfig,
        kernels: CpuKernels | None,
        lora: LayerLora | None = None,
        rotary_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = _project(self.qkv, x, lora, "qkv")
        if kernels is not None and step.paged is not None:
            q, out = self._kernel_attention(
                qkv, rotary, step.paged, kv, sliding, c, kernels, rotary_rows
            )
            if step.image_groups:
                out = attend_images(q, kv[0], kv[1], out, step, sliding, c)
            if c.attn_output_gate:
                out = out * torch.sigmoid(_query_and_gate(qkv, c)[1].reshape(out.shape))
            return _project(self.o_proj, out, lora, "o_proj")
        gate = None
        if c.attn_output_gate:
            query, gate = _query_and_gate(qkv, c)
            kv_start = 2 * q_size
        else:
            query = qkv[:, :q_size].view(-1, c.num_heads, c.head_dim)
            kv_start = q_size
        key = qkv[:, kv_start : kv_start + kv_size].view(-1, c.num_kv_heads, c.head_dim)
        value = qkv[:, kv_start + kv_size :].view(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(query), self.k_norm(key)
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        else:
            # q and k heads side by side through one rotary pass (element-wise: the same
            # bits as two passes, in half the operators).
            qk = qkv[:, : q_size + kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
            qk = apply_rotary(qk, *rotary)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        out = attend(q, k, value, kv[0], kv[1], step, sliding, c)
        if step.image_groups:
            out = attend_images(q, kv[0], kv[1], out, step, sliding, c)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(out.shape))
        return _project(self.o_proj, out, lora, "o_proj")

    def _kernel_attention(
        self,
        qkv: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        paged: PagedStep,
        kv: tuple[torch.Tensor, torch.Tensor],
        sliding: bool,
        c: ModelConfig,
        kernels: CpuKernels,
        rotary_rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same attention through the CPU kernels (the rotated queries, and the output
        before any gate and ``o_proj``): the kernel reads each token's row of ``rotary`` (the
        whole tables, by position; ``rotary_rows`` where the tables are per token), the pool
        is read in place."""
        q_norm = self.q_norm.weight if c.qk_norm else None
        k_norm = self.k_norm.weight if c.qk_norm else None
        rows = paged.positions if rotary_rows is None else rotary_rows
        q = kernels.rotary_write(
            qkv, rotary[0], rotary[1], rows, paged.cache_rows, kv[0], kv[1],
            c.num_heads, c.num_kv_heads, c.head_dim, c.attn_output_gate, q_norm, k_norm,
            c.rms_norm_eps, c.plus_one_norms,
        )  # fmt: skip
        window = (c.sliding_window or 0) if sliding else 0
        out = kernels.paged_attention(
            q, kv[0], kv[1], paged.block_tables, paged.token_seq, paged.positions,
            paged.block_size, window, c.attention_scale,
        )  # fmt: skip
        return q, out

    def mlp(
        self,
        x: torch.Tensor,
        c: ModelConfig,
        kernels: CpuKernels | None,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        if self.sparse:
            return self.moe(x)  # type: ignore[no-any-return]
        gate_up = _project(self.gate_up, x, lora, "gate_up")
        if kernels is not None and c.hidden_activation == "silu":
            return _project(self.down, kernels.silu_mul(gate_up), lora, "down")
        gate, up = gate_up.chunk(2, dim=-1)
        return _project(self.down, activation(gate, c.hidden_activation) * up, lora, "down")


class Decoder(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor
    local_cos: torch.Tensor
    local_sin: torch.Tensor
    lm_head: Projection

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_positions: int,
        tp: TensorParallel | None = None,
    ) -> None:
        """``config``: one rank's shape under tensor parallelism (``shard_config``), whose
        layers then hold that rank's slices; ``tp`` sums and gathers their results."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        c = config
        vocab_rows = tp.vocab_rows if tp is not None else c.vocab_size
        self.embed = Embedding(vocab_rows, c.hidden_size, dtype=dtype)
        self.decoder_layers = [DecoderLayer(c, dtype, i) for i in range(c.num_layers)]
        self.layers = nn.ModuleList(self.decoder_layers)  # registers them; the list is typed
        self.norm = RmsNorm(c.hidden_size, c.rms_norm_eps, c.plus_one_norms, dtype)
        self.lm_head = Projection(c.hidden_size, vocab_rows, bias=False, dtype=dtype)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.requires_grad_(False)
        cos, sin = rotary_tables(c, c.rope_theta, max_positions, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        if c.rope_local_theta is not None:
            local_cos, local_sin = rotary_tables(
                without_scaling(c), c.rope_local_theta, max_positions, dtype
            )
            self.register_buffer("local_cos", local_cos, persistent=False)
            self.register_buffer("local_sin", local_sin, persistent=False)
        self._embed_scale = math.sqrt(c.hidden_size)
        self.kernels: CpuKernels | None = None  # set by the shard where they serve (CPU, bf16)
        # The layers chained in one call of the kernels (``layer_stack.py``), set by the shard
        # where every layer is one the chain computes.
        self.stack: Any | None = None
        # Whether the layers' quantized projections multiply a prompt's rows dequantized
        # (``model/layers.py``): where the GEMM is AMX's, which then outruns the integer sums.
        self.prompts_dequantized = False

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepAttention,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        linear_step: LinearStep | None = None,
        linear_states: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        lora: StepLora | None = None,
        images: StepImages | None = None,
    ) -> torch.Tensor:
        """Hidden states after the last layer (before the final norm), one row per token.
        ``linear_step`` and ``linear_states``: for models with Gated DeltaNet layers;
        ``lora``: the rows' LoRA adapters; ``images``: a vision-language model's."""
        c, tp, kernels = self.config, self.tp, self.kernels
        if step.paged is None:
            kernels = None  # a step planned for the torch path (the GPU's) stays on it
        hidden = self.embed(token_ids) if tp is None else tp.embed(self.embed, token_ids)
        if c.scale_embeddings:
            hidden = hidden * torch.tensor(self._embed_scale, dtype=hidden.dtype)
        rotary_rows = None
        if images is not None and images.rows is not None and images.embeds is not None:
            hidden = hidden.index_copy(0, images.rows, images.embeds.to(hidden.dtype))
        if images is not None and images.rope_positions is not None:
            rotary = mrope_rotary(
                self.cos, self.sin, images.rope_positions, c.mrope_section, c.mrope_interleaved
            )
            if kernels is not None:  # the kernels read the per-token tables row by row
                rotary_rows = torch.arange(len(token_ids), dtype=torch.int32)
        elif kernels is not None:  # the kernels read each token's row of the whole tables
            rotary = self.cos, self.sin
            if c.rope_local_theta is not None:
                local_rotary = self.local_cos, self.local_sin
        else:
            rotary = self.cos[positions], self.sin[positions]
            if c.rope_local_theta is not None:
                local_rotary = self.local_cos[positions], self.local_sin[positions]
        # The rows of prompt tokens, for the layers' quantized projections.
        prompts = None
        if step.paged is not None and self.prompts_dequantized:
            prompts = step.paged.prompt_rows
        if kernels is not None and self.stack is not None and lora is None and images is None:
            assert step.paged is not None and not step.image_groups
            paged = step.paged
            return self.stack.run(  # type: ignore[no-any-return]
                hidden, paged.positions, paged.cache_rows, paged.block_tables, paged.token_seq,
                paged.block_size, [kv[0] for kv in kv_layers], [kv[1] for kv in kv_layers],
                prompts,
            )  # fmt: skip
        with prompt_rows(prompts):
            norm = _Norms(kernels)
            residual: torch.Tensor | None = None
            for index, layer in enumerate(self.decoder_layers):
                # The previous layer's MLP output joins the residual stream inside the norm.
                x, residual = norm.add(hidden, residual, layer.input_norm)
                if layer.is_linear:
                    assert linear_step is not None and linear_states is not None
                    x = linear_attention(layer.linear, x, linear_step, linear_states[index], c)
                else:
                    sliding = c.is_sliding(index)
                    local = sliding and c.rope_local_theta is not None
                    x = layer.attention(
                        x,
                        local_rotary if local else rotary,
                        step,
                        kv_layers[index],
                        sliding,
                        c,
                        kernels,
                        None if lora is None else LayerLora(lora, index),
                        rotary_rows,
                    )
                if tp is not None:  # each rank's o_proj gave a partial sum
                    x = tp.all_reduce(x)
                if c.sandwich_norms:
                    x = norm(x, layer.post_attention_norm)
                    x, residual = norm.add(x, residual, layer.pre_mlp_norm)
                else:
                    x, residual = norm.add(x, residual, layer.post_attention_norm)
                x = layer.mlp(x, c, kernels, None if lora is None else LayerLora(lora, index))
                if tp is not None:
                    x = tp.all_reduce(x)
                if c.sandwich_norms:
                    x = norm(x, layer.post_mlp_norm)
                hidden = x
                if images is not None and index < len(images.deepstack):
                    # Added to the layer's whole output: the residual stream is made whole (the
                    # next norm adds a zero to it, exactly).
                    assert residual is not None and images.rows is not None
                    residual = (residual + hidden).index_add_(
                        0, images.rows, images.deepstack[index]
                    )
                    hidden = torch.zeros_like(hidden)
            return hidden if residual is None else residual + hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows of final hidden states."""
        logits: torch.Tensor = self.lm_head(_Norms(self.kernels)(hidden, self.norm))
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        logits = logits.float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
