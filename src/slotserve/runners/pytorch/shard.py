"""What every tensor-parallel rank runs, rank 0 in the engine process and the others in theirs
(``tp_workers.py``): its slice of the model and of the KV pool, and one step's forward pass
from a :class:`StepPlan`.

A plan is plain numbers (token ids, positions, cache rows, block tables, block copies), built
by rank 0 from the scheduled chunks and its block tables (only rank 0 keeps those), so every
rank runs the same step over its own heads. Without tensor parallelism the one rank runs the
same code: there is a single path through the forward pass.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import torch

from slotserve.runners.pytorch import ATTENTION_BACKENDS, gpu_kernels
from slotserve.runners.pytorch.cpu_kernels import compute_path, load_cpu_kernels
from slotserve.runners.pytorch.cuda_graphs import Capture, DecodeGraphs, cuda_capture
from slotserve.runners.pytorch.kv_cache import KvPool
from slotserve.runners.pytorch.load.checkpoint import TorchLoadConfig
from slotserve.runners.pytorch.load.memory import decode_graph_bytes, kv_blocks
from slotserve.runners.pytorch.load.weights import checkpoint_tensors, load_into
from slotserve.runners.pytorch.model.attention import (
    AttentionGroup,
    PagedStep,
    StepAttention,
    build_group,
)
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.decoder import Decoder, StepImages
from slotserve.runners.pytorch.model.deltanet import LinearStatePool, LinearStep
from slotserve.runners.pytorch.model.lora import StepLora
from slotserve.runners.pytorch.model.tensor_parallel import (
    TensorParallel,
    shard_config,
    tensor_slicer,
)
from slotserve.runners.pytorch.score_head import CLASSIFIER_WEIGHT

logger = logging.getLogger(__name__)


class GroupPlan(msgspec.Struct, array_like=True, frozen=True):
    """Sequences that attend together (see ``attention.build_group``)."""

    first_row: int
    tables: list[list[int]]
    starts: list[int]
    q_len: int


class StepPlan(msgspec.Struct, array_like=True, frozen=True, tag=True):
    tokens: list[int]
    positions: list[int]
    write_rows: list[int]  # the KV cache row of each token
    groups: list[GroupPlan]
    block_copies: list[tuple[int, int]]  # copy-on-write before the step: (source, target)
    logit_rows: list[list[int]]  # rows whose logits are computed, call by call, in order
    # Gated DeltaNet (``deltanet.LinearStep``): slots starting from a zero state, slots
    # resuming from a saved state (pool row, slot), decoding slots, prompt chunks (row,
    # length, slot, position), states to save (slot, position, pool row).
    linear_resets: list[int] = []
    linear_loads: list[tuple[int, int]] = []
    linear_decode: list[int] = []
    linear_prefills: list[tuple[int, int, int, int]] = []
    linear_saves: list[tuple[int, int, int]] = []


class ModelShard:
    """One rank's decoder (the whole model without tensor parallelism) with its KV pool and
    recurrent states; ``config`` is the whole model's."""

    def __init__(
        self,
        load: TorchLoadConfig,
        config: ModelConfig,
        gguf_reader: Any,
        device: torch.device,
        dtype: torch.dtype,
        max_seq_len: int,
        tp: TensorParallel | None,
        lm_head_rows: Sequence[int] = (),
    ) -> None:
        """``lm_head_rows``: vocabulary rows of the LM head kept aside in float32, as
        ``lm_head_rows`` (a reranker's classifier tokens, ``score_head.py``), read before
        the weights are packed for the kernels."""
        self.device = device
        backend = "triton" if load.batch_invariant else load.attention_backend
        self.triton = triton_attention(backend, device)
        local = shard_config(config, tp.size if tp is not None else 1)
        if load.batch_invariant:
            _check_invariant_layers(local)
        with torch.device(device):
            self.model = Decoder(local, dtype, max_seq_len, tp)
        self.model.eval()
        tensors = checkpoint_tensors(load, config, gguf_reader)
        self.classifier: torch.Tensor | None = None  # a sequence classifier's score head
        load_into(
            self.model, self._set_aside(tensors), tensor_slicer(tp) if tp is not None else None
        )
        self.lm_head_rows = (
            self.model.lm_head.weight[list(lm_head_rows)].float().clone() if lm_head_rows else None
        )
        if load.batch_invariant:
            self.model.use_invariant_matmul()
        elif device.type == "cpu" and dtype == torch.bfloat16:
            # Batch invariance holds in bfloat16 on CPU only (attention.py).
            if load.cpu_kernels and local.head_dim % 16 == 0:
                self.model.kernels = load_cpu_kernels()
            if self.model.kernels is not None and self.model.kernels.has_gemm:
                self.model.prepack(self.model.kernels)
            else:
                self.model.make_batch_invariant()
                if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
                    self.model.prepack()
        self.compute = compute_path(device, dtype, self.model.kernels)
        if self.triton:
            matmuls = "invariant Triton" if load.batch_invariant else "torch"
            self.compute = dataclasses.replace(
                self.compute,
                kernels=f"Triton paged attention, {matmuls} matmuls ({dtype})",
                batch_invariant=load.batch_invariant,
            )
        # Gated DeltaNet layers: a fixed state per slot, allocated before the KV pool is sized.
        self.linear_states = (
            LinearStatePool(local, load.num_slots, dtype, device, load.state_snapshots)
            if local.linear_layers
            else None
        )
        self.kv_bytes_per_token = local.kv_bytes_per_token(dtype.itemsize)
        graphs = decode_graphs_apply(load, local, device, self.triton, tp)
        reserved = decode_graph_bytes(local, load.num_slots, dtype.itemsize) if graphs else 0
        num_blocks = kv_blocks(load, device, max_seq_len, self.kv_bytes_per_token, reserved)
        if tp is not None:  # every rank's pool has the same blocks: the smallest fits all
            num_blocks = tp.min_across_ranks(num_blocks)
        self.pool = KvPool(local, num_blocks, load.block_size, load.num_slots, dtype, device)
        self.max_seq_len = max_seq_len
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = self.capture_decode(load.num_slots, cuda_capture(device))
            kernels = f"{self.compute.kernels}, decode steps in CUDA graphs"
            self.compute = dataclasses.replace(self.compute, kernels=kernels)

    def _set_aside(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if name == CLASSIFIER_WEIGHT:
                self.classifier = tensor.float()
            else:
                yield name, tensor

    def forward(
        self, plan: StepPlan, lora: StepLora | None = None, images: StepImages | None = None
    ) -> torch.Tensor:
        """The step's final hidden states, one row per token of ``plan.tokens``; ``lora``:
        the rows' LoRA adapters; ``images``: a vision-language model's inputs."""
        device, pool = self.device, self.pool
        pool.copy_blocks(plan.block_copies)
        if self.model.kernels is not None:
            paged = paged_step(plan, pool.block_size)
            step = StepAttention(paged.cache_rows, [], paged)  # the kernels write K/V themselves
        elif self.triton:
            paged = paged_step(plan, pool.block_size)
            tiles = gpu_kernels.row_tiles(paged.token_seq.tolist(), device)
            paged = paged.to(device)
            step = StepAttention(paged.cache_rows.long(), [], paged, tiles)
        else:
            write_rows = torch.tensor(plan.write_rows, dtype=torch.int64, device=device)
            step = StepAttention(write_rows, self._groups(plan))
        if images is not None and images.runs:
            step.image_groups = self._image_groups(plan, images.runs)
        linear_step = None
        if self.linear_states is not None:
            self.linear_states.reset(plan.linear_resets)
            for row, slot in plan.linear_loads:
                self.linear_states.copy(row, slot)
            decode = torch.tensor(plan.linear_decode, dtype=torch.int64, device=device)
            linear_step = LinearStep(decode, list(plan.linear_prefills), list(plan.linear_saves))
        return self.model(  # type: ignore[no-any-return]
            torch.tensor(plan.tokens, dtype=torch.int64, device=device),
            torch.tensor(plan.positions, dtype=torch.int64, device=device),
            step,
            pool.layers,
            linear_step,
            self.linear_states.layers if self.linear_states is not None else None,
            lora,
            images,
        )

    @torch.inference_mode()
    def capture_decode(self, max_batch: int, capture: Capture) -> DecodeGraphs:
        """Decode steps of up to ``max_batch`` sequences as graphs (``cuda_graphs.py``)."""
        # The attention kernel takes int32 numbers, as the eager steps give it (one compiled
        # kernel for both).
        order = torch.arange(max_batch, dtype=torch.int32, device=self.device)
        ones = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        block_size = self.pool.block_size

        def logits(
            tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor
        ) -> torch.Tensor:
            size = tokens.shape[0]
            paged = PagedStep(tables.int(), order[:size], positions.int(), rows, block_size)
            tiles = gpu_kernels.RowTiles(order[:size], order[:size], ones[:size])
            step = StepAttention(rows, [], paged, tiles)
            hidden = self.model(tokens, positions, step, self.pool.layers)
            return self.model.logits(hidden)

        width = -(-self.max_seq_len // block_size)
        return DecodeGraphs(logits, max_batch, width, self.pool.ballast_row, self.device, capture)

    def replay_decode(self, plan: StepPlan) -> torch.Tensor | None:
        """The logits of a step of one-token chunks that all sample, from a captured graph;
        None where no graph takes the step (prompt chunks, drafts, scored or pooled rows, more
        sequences than the largest bucket)."""
        graphs, groups = self.graphs, plan.groups
        if graphs is None or len(groups) != 1 or groups[0].q_len != 1:
            return None
        n = len(plan.tokens)
        if plan.logit_rows != [list(range(n))] or not graphs.takes(n, groups[0].tables):
            return None
        self.pool.copy_blocks(plan.block_copies)
        return graphs.replay(plan.tokens, plan.positions, plan.write_rows, groups[0].tables)

    def _groups(self, plan: StepPlan) -> list[AttentionGroup]:
        pool, c = self.pool, self.model.config
        window = c.sliding_window if any(c.sliding_layers) else None
        return [
            build_group(
                group.first_row,
                group.tables,
                group.starts,
                group.q_len,
                pool.block_size,
                pool.zero_block,
                c.num_kv_heads,
                window,
                self.device,
            )
            for group in plan.groups
        ]

    def _image_groups(
        self, plan: StepPlan, runs: tuple[tuple[int, int], ...]
    ) -> list[AttentionGroup]:
        """A bidirectional group per image run (``StepImages.runs``), in its chunk's group."""
        pool, c = self.pool, self.model.config
        window = c.sliding_window if any(c.sliding_layers) else None
        groups = []
        for row, count in runs:
            group = next(g for g in plan.groups if 0 <= row - g.first_row < g.q_len * len(g.tables))
            sequence, offset = divmod(row - group.first_row, group.q_len)
            table, start = group.tables[sequence], group.starts[sequence] + offset
            image = build_group(
                row, [table], [start], count, pool.block_size, pool.zero_block, c.num_kv_heads,
                window, self.device, bidirectional=True,
            )  # fmt: skip
            groups.append(image)
        return groups

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return self.model.logits(hidden[torch.tensor(rows, device=hidden.device)])

    def close(self) -> None:
        self.graphs = None  # its memory pool goes with it
        self.pool.clear()
        if self.linear_states is not None:
            self.linear_states.clear()
        self.model = None  # type: ignore[assignment]


def _check_invariant_layers(config: ModelConfig) -> None:
    """``--batch-invariant`` covers attention, the projections, the head and LoRA updates; the
    layers it does not cover yet are refused rather than served with a broken promise."""
    if config.num_experts or any(config.linear_layers):
        raise ValueError(
            "--batch-invariant does not cover mixture-of-experts or Gated DeltaNet layers yet"
        )


def decode_graphs_apply(
    load: TorchLoadConfig,
    config: ModelConfig,
    device: torch.device,
    triton: bool,
    tp: TensorParallel | None,
) -> bool:
    """Whether decode steps replay CUDA graphs: on a GPU with the Triton attention, unless
    ``--enforce-eager``. Tensor parallelism, mixtures of experts, Gated DeltaNet layers
    and M-RoPE (per-step host inputs of the forward) stay eager."""
    return (
        device.type == "cuda"
        and triton
        and not load.enforce_eager
        and tp is None
        and not config.num_experts
        and not any(config.linear_layers)
        and not config.mrope_section
    )


def triton_attention(backend: str, device: torch.device) -> bool:
    """Whether attention runs as the Triton kernels where the CPU kernels do not
    (``--attention-backend``). auto: on a CUDA device where Triton is installed (the kernels
    and the decode graphs they allow are the GPU's fast path), else torch's."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "auto":
        return device.type == "cuda" and gpu_kernels.available()
    if backend == "torch":
        return False
    runs = gpu_kernels.available() and (device.type == "cuda" or gpu_kernels.interpreted())
    if not runs:
        raise ValueError(
            "Triton attention (--attention-backend triton, --batch-invariant) needs Triton "
            "(pip install -e '.[gpu]') and a CUDA device (or TRITON_INTERPRET=1, the "
            "interpreter the tests use)"
        )
    return True


def paged_step(plan: StepPlan, block_size: int) -> PagedStep:
    """The plan's groups as the kernels read them: one block table per sequence, and for each
    token its sequence and position (tokens are group after group, sequence-major)."""
    tables = [table for group in plan.groups for table in group.tables]
    width = max((len(table) for table in tables), default=1)
    token_seq: list[int] = []
    for group in plan.groups:
        for _ in group.tables:
            token_seq.extend([token_seq[-1] + 1 if token_seq else 0] * group.q_len)
    return PagedStep(
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(token_seq, dtype=torch.int32),
        torch.tensor(plan.positions, dtype=torch.int32),
        torch.tensor(plan.write_rows, dtype=torch.int32),
        block_size,
    )
