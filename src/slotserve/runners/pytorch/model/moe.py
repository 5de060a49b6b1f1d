"""The mixture-of-experts MLP (Qwen3-MoE, Qwen3.5-MoE).

Each expert runs once per step over the rows of the tokens routed to it (gathered, one matmul
per projection) and each token's experts are summed in float32 in expert order: a token's
result depends only on its own routing, never on which other tokens share the step, so batch
invariance holds as for the dense MLP. Qwen3.5-MoE adds a shared expert every token runs,
scaled by a sigmoid gate of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.layers import Projection, activation


class Expert(nn.Module):
    """One SwiGLU expert (gate and up fused, as the dense MLP)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up = Projection(hidden, 2 * intermediate, bias=False, dtype=dtype)
        self.down = Projection(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(activation(gate, kind) * up)  # type: ignore[no-any-return]


class SparseMlp(nn.Module):
    shared: Expert | None
    shared_gate: Projection | None  # hidden → 1: the shared expert's sigmoid gate

    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = c
        self.router = Projection(c.hidden_size, c.num_experts, bias=False, dtype=dtype)
        self.experts = [
            Expert(c.hidden_size, c.moe_intermediate_size, dtype) for _ in range(c.num_experts)
        ]
        self.expert_modules = nn.ModuleList(self.experts)  # registered; the list is typed
        # Set on the instance either way: a class-level None would hide the submodules.
        self.shared, self.shared_gate = None, None
        if c.shared_expert_intermediate_size:
            self.shared = Expert(c.hidden_size, c.shared_expert_intermediate_size, dtype)
            self.shared_gate = Projection(c.hidden_size, 1, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routes each token to its top-k experts (softmax over all experts in float32, as
        HF), gathers the rows of every (token, expert) pair sorted by expert, runs each chosen
        expert once over its contiguous rows, and sums each token's weighted results in
        float32 in expert order (``index_add_`` adds in index order)."""
        c = self.config
        probabilities = torch.softmax(self.router(x).float(), dim=-1)
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
                expert = self.experts[expert_id]
                results.append(expert(rows[start : start + count], c.hidden_activation))
                start += count
        scale = weights.to(x.dtype).flatten()[order, None]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token_rows, (torch.cat(results) * scale).float())
        routed = out.to(x.dtype)
        if self.shared is None or self.shared_gate is None:
            return routed
        shared = self.shared(x, c.hidden_activation)
        return routed + torch.sigmoid(self.shared_gate(x)) * shared  # type: ignore[no-any-return]
