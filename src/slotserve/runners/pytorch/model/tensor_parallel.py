"""Tensor parallelism for the PyTorch runner (``--tensor-parallel-size N``).

Each rank holds a slice of every layer, Megatron-style: the q/k/v rows of its share of the
attention heads and the gate/up rows of its share of the MLP (column parallel), the matching
columns of ``o_proj`` and ``down_proj`` (row parallel, their partial outputs summed by one
all-reduce per layer and kind), and a contiguous share of the vocabulary in the embedding and
the LM head (vocab parallel: a token's embedding comes from the rank that owns it, the logits
are gathered). The model code is unchanged otherwise: it is built from :func:`shard_config`,
whose head and MLP sizes are one rank's.

The ranks talk through a process group of their own (``shard/ranks.py`` starts them and builds
it), never torch.distributed's global default group: an engine process can hold several
models, each with its own ranks.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from slotserve.runners.pytorch.model.config import ModelConfig, UnsupportedModelError

# Dense MLP, every expert and the shared expert alike; ``mlp.gate`` (the MoE router) and
# ``mlp.shared_expert_gate`` are whole on every rank.
_COLUMN_PARALLEL = re.compile(r"\.self_attn\.[qkv]_proj\.|\.(gate|up)_proj\.weight$")
_ROW_PARALLEL = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass
class TensorParallel:
    """One rank's view of its group: collectives, and its share of the vocabulary."""

    rank: int
    size: int
    # A ProcessGroupGloo or ProcessGroupNCCL: torch's stubs give their collectives to neither.
    group: Any
    vocab_size: int  # the whole vocabulary
    device: torch.device  # this rank's (NCCL takes only tensors on it)

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and LM head on every rank (the last one padded with zeros)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def min_across_ranks(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.MIN  # type: ignore[assignment]
        self.group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[rows, vocab_rows]`` logits side by side, cut to the vocabulary."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.group.allgather([parts], [logits.contiguous()]).wait()
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

    def slice_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole weight, by its HF name (for ``weights.load_into``)."""
        if name in _VOCAB_PARALLEL:
            rows = tensor[self.vocab_start : self.vocab_start + self.vocab_rows]
            if rows.shape[0] == self.vocab_rows:
                return rows
            padded = tensor.new_zeros((self.vocab_rows, *tensor.shape[1:]))
            padded[: rows.shape[0]] = rows
            return padded
        if _COLUMN_PARALLEL.search(name):
            return self._piece(tensor, 0)  # output rows (and a bias)
        if _ROW_PARALLEL.search(name):
            return self._piece(tensor, 1)  # input columns
        return tensor  # norms, the MoE router, the shared expert's gate: on every rank

    def _piece(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        share = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * share, share)

    def embed(self, embedding: torch.nn.Embedding, token_ids: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the tokens it owns and zeroes the others: the sum over ranks is
        every token's one embedding row (sums of a value and zeros: exact in any dtype)."""
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        rows = embedding(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.all_reduce(rows)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """One rank's shape of the model: its share of the heads and the MLP; refused with the
    reason when something does not divide or the model has no tensor-parallel layout here."""
    if size == 1:
        return config
    if any(config.linear_layers):
        raise UnsupportedModelError(
            f"{config.name}: tensor parallelism does not support Gated DeltaNet layers yet; "
            "serve it with --tensor-parallel-size 1"
        )
    sizes = {
        "attention heads (num_attention_heads)": config.num_heads,
        "KV heads (num_key_value_heads)": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
    }
    for what, value in sizes.items():
        if value % size:
            raise UnsupportedModelError(
                f"{config.name}: its {value} {what} do not divide across "
                f"--tensor-parallel-size {size}"
            )
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=config.num_kv_heads // size,
        intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=config.moe_intermediate_size // size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // size,
    )
