"""Tensor parallelism for the PyTorch runner (``--tensor-parallel-size N``).

Each rank holds a slice of every layer, Megatron-style: the q/k/v rows of its share of the
attention heads and the gate/up rows of its share of the MLP (column parallel), the matching
columns of ``o_proj`` and ``down_proj`` (row parallel, their partial outputs summed by one
all-reduce per layer and kind), and a contiguous share of the vocabulary in the embedding and
the LM head (vocab parallel: a token's embedding comes from the rank that owns it, the logits
are gathered). The model code is unchanged otherwise: it is built from :func:`shard_config`,
whose head and MLP sizes are one rank's.

The ranks talk through a process group of their own (a ``TCPStore`` on loopback and a gloo or
NCCL group built from it), never torch.distributed's global default group: an engine process
can hold several models, each with its own ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, PrefixStore, ReduceOp, TCPStore

from slotserve.runners.pytorch.model.config import ModelConfig, UnsupportedModelError

# A step blocks in a collective while a peer computes; a peer that died turns into an error
# (its socket closes), so this only bounds a peer that hangs.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# Ranks join before loading any weight: only a rank that failed to start is this late.
JOIN_TIMEOUT = datetime.timedelta(minutes=2)

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

    def embed(self, embedding: torch.nn.Embedding, token_ids: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the tokens it owns and zeroes the others: the sum over ranks is
        every token's one embedding row (sums of a value and zeros: exact in any dtype)."""
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        rows = embedding(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.all_reduce(rows)


def open_store(rank: int, size: int, port: int) -> TCPStore:
    """The group's rendezvous on loopback: rank 0 serves it (``port`` 0: any free port, read
    back from ``store.port``), the other ranks connect to it."""
    return TCPStore(
        "127.0.0.1",
        port,
        size,
        is_master=rank == 0,
        timeout=JOIN_TIMEOUT,
        wait_for_workers=False,
    )


def join_group(
    store: TCPStore, rank: int, size: int, device: torch.device, vocab_size: int
) -> TensorParallel:
    """Blocks until every rank joined. NCCL when every rank has a GPU of its own, else gloo
    (CPU; several ranks sharing one GPU)."""
    prefix = PrefixStore("slotserve-tp", store)
    group: Any
    if nccl_usable(device, size):
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
        group = dist.ProcessGroupNCCL(prefix, rank, size)  # type: ignore[call-arg]
    else:
        group = dist.ProcessGroupGloo(prefix, rank, size, COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size, group, vocab_size, device)


def nccl_usable(device: torch.device, size: int) -> bool:
    return device.type == "cuda" and dist.is_nccl_available() and torch.cuda.device_count() >= size


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """A GPU per rank where there are enough of them, else every rank on the one device."""
    if device.type == "cuda" and torch.cuda.device_count() >= size:
        return torch.device("cuda", rank)
    return device


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


def tensor_slicer(tp: TensorParallel) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """``(HF name, whole tensor) → this rank's slice`` for :func:`weights.load_into`."""

    def piece(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        share = tensor.shape[dim] // tp.size
        return tensor.narrow(dim, tp.rank * share, share)

    def slice_for_rank(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in _VOCAB_PARALLEL:
            rows = tensor[tp.vocab_start : tp.vocab_start + tp.vocab_rows]
            if rows.shape[0] == tp.vocab_rows:
                return rows
            padded = tensor.new_zeros((tp.vocab_rows, *tensor.shape[1:]))
            padded[: rows.shape[0]] = rows
            return padded
        if _COLUMN_PARALLEL.search(name):
            return piece(tensor, 0)  # output rows (and a bias)
        if _ROW_PARALLEL.search(name):
            return piece(tensor, 1)  # input columns
        return tensor  # norms, the MoE router, the shared expert's gate: on every rank

    return slice_for_rank
