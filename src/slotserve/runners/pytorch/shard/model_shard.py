"""What every tensor-parallel rank runs, rank 0 in the engine process and the others in theirs
(``ranks.py``): its slice of the model and of the KV pool, built in one pass
(:class:`ModelShard`), and one step's forward pass from a :class:`StepPlan`.

A plan is plain numbers (token ids, positions, cache rows, block tables, block copies), built
by rank 0 from the scheduled chunks and its block tables (only rank 0 keeps those), so every
rank runs the same step over its own heads. Without tensor parallelism the one rank runs the
same code: there is a single path through the forward pass.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from slotserve.runners.options import ATTENTION_BACKENDS
from slotserve.runners.pytorch import gpu_kernels
from slotserve.runners.pytorch.cpu_kernels import compute_path, load_cpu_kernels
from slotserve.runners.pytorch.families.base import CLASSIFIER_WEIGHT
from slotserve.runners.pytorch.load.checkpoint import Checkpoint
from slotserve.runners.pytorch.load.format_choice import weight_format
from slotserve.runners.pytorch.load.memory import decode_graph_bytes, kv_blocks
from slotserve.runners.pytorch.load.quant_weights import QuantWeights
from slotserve.runners.pytorch.load.settings import NO_CPU_KERNELS, TorchLoadConfig
from slotserve.runners.pytorch.load.weights import RandomWeights, WeightSource, load_into
from slotserve.runners.pytorch.model.attention import AttentionGroup, StepAttention, build_group
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.decoder import Decoder, StepImages
from slotserve.runners.pytorch.model.deltanet import LinearStep
from slotserve.runners.pytorch.model.layer_stack import layer_stack
from slotserve.runners.pytorch.model.lora import StepLora
from slotserve.runners.pytorch.model.tensor_parallel import TensorParallel
from slotserve.runners.pytorch.shard.cuda_graphs import (
    Capture,
    DecodeGraphs,
    capture_decode,
    cuda_capture,
)
from slotserve.runners.pytorch.shard.pools import KvPool, LinearStatePool
from slotserve.runners.pytorch.shard.step_plan import StepPlan, paged_step

logger = logging.getLogger(__name__)


class ModelShard:
    """One rank's decoder (the whole model without tensor parallelism) with its KV pool and
    recurrent states."""

    def __init__(
        self,
        load: TorchLoadConfig,
        checkpoint: Checkpoint,
        rank_config: ModelConfig,
        device: torch.device,
        tp: TensorParallel | None,
        lm_head_rows: Sequence[int] = (),
    ) -> None:
        """The rank's build, in the order it runs: the compute path's choices, the decoder of
        ``rank_config`` (this rank's shape of the model: ``tensor_parallel.shard_config``),
        its weights from their source stored in their format, the kernels, the recurrent
        states, the KV pool (what memory is left), the decode graphs. ``lm_head_rows``:
        vocabulary rows of the LM head kept aside in float32, as ``lm_head_rows`` (a
        reranker's classifier tokens, ``step/score_head.py``), read before the weights are
        packed for the kernels."""
        config, dtype = checkpoint.config, load.torch_dtype
        self.device = device
        if load.batch_invariant:
            _check_invariant_layers(config)
        self.triton = triton_attention(
            "triton" if load.batch_invariant else load.attention_backend, device
        )
        if load.kv_int8 and (device.type != "cpu" or self.triton):
            raise ValueError(
                "--kv-cache-dtype int8 is served on CPU (the CPU kernels or torch's operators), "
                f"not on {device.type} with the {'Triton' if self.triton else 'torch'} attention"
            )
        graphs = decode_graphs_apply(load, config, device, self.triton, tp)
        self.max_seq_len = load.sequence_length(config.max_position_embeddings)
        if self.max_seq_len > config.max_position_embeddings:
            logger.warning(
                "--max-model-len %d is past the %d positions %s was trained on%s",
                self.max_seq_len,
                config.max_position_embeddings,
                config.name,
                ""
                if config.rope_scaling.kind != "default"
                else ": its config sets no rope_scaling (such as YaRN, which --hf-overrides "
                "can lay over it), so replies past them may degrade",
            )

        with torch.device(device):
            self.model = Decoder(rank_config, dtype, self.max_seq_len, tp)
        self.model.eval()

        # The CPU kernels serve in bfloat16 on CPU, where batch invariance holds
        # (``model/attention.py``), unless --batch-invariant chose the Triton path.
        kernels_may_serve = device.type == "cpu" and dtype == torch.bfloat16 and load.cpu_kernels
        if kernels_may_serve and not load.batch_invariant and rank_config.head_dim % 16 == 0:
            self.model.kernels = load_cpu_kernels()

        dummy = load.load_format == "dummy"
        source: WeightSource = RandomWeights(config) if dummy else checkpoint
        weights = weight_format(
            load.quantization,
            None if dummy else checkpoint,
            self.model,
            self.model.kernels,
            load.quantized_kernels_refusal()
            or (NO_CPU_KERNELS if self.model.kernels is None else None),
        )
        quantized_types = ""
        slicer = tp.slice_weight if tp is not None else None
        aside = load_into(
            self.model,
            weights.tensors(source),
            slicer,
            weights,
            set_aside=(CLASSIFIER_WEIGHT,),
        )
        if isinstance(weights, QuantWeights):
            quantized_types = ", ".join(weights.kinds())
        # A sequence classifier's score head (``step/score_head.py``).
        self.classifier = aside[CLASSIFIER_WEIGHT].float() if aside else None
        self.lm_head_rows = (
            weights.head_rows(self.model, list(lm_head_rows)) if lm_head_rows else None
        )
        # The projections made ready for the compute path.
        weights.prepare(self.model, load.batch_invariant)
        self.model.stack = layer_stack(self.model)
        self.compute = compute_path(device, dtype, self.model.kernels)
        # A prompt's rows dequantized where the AMX GEMM outruns the integer sums (elsewhere
        # the bfloat16 GEMM is slower than they are).
        gemm = self.model.kernels.gemm if self.model.kernels else "none"
        self.model.prompts_dequantized = bool(quantized_types) and gemm == "amx"
        if quantized_types:
            kernels = f"{self.compute.kernels}, weights kept quantized ({quantized_types})"
            if self.model.prompts_dequantized:
                kernels += ", prompts dequantized on the AMX GEMM"
            tiles = self.model.kernels.quant_tiles if self.model.kernels else "none"
            if tiles != "none":
                kernels += f", batches' sums on {tiles} tiles"
            self.compute = dataclasses.replace(self.compute, kernels=kernels)
        if self.triton:
            matmuls = "invariant Triton" if load.batch_invariant else "torch"
            self.compute = dataclasses.replace(
                self.compute,
                kernels=f"Triton paged attention, {matmuls} matmuls ({dtype})",
                batch_invariant=load.batch_invariant,
            )

        # Gated DeltaNet layers: a fixed state per slot, allocated before the KV pool is sized.
        self.linear_states = (
            LinearStatePool(rank_config, load.num_slots, dtype, device, load.snapshots)
            if rank_config.linear_layers
            else None
        )
        self.kv_bytes_per_token = rank_config.kv_bytes_per_token(dtype.itemsize, load.kv_int8)
        reserved = decode_graph_bytes(rank_config, load.num_slots, dtype.itemsize) if graphs else 0
        num_blocks = kv_blocks(load, device, self.max_seq_len, self.kv_bytes_per_token, reserved)
        if tp is not None:  # every rank's pool has the same blocks: the smallest fits all
            num_blocks = tp.min_across_ranks(num_blocks)
        cpu = self.model.kernels
        self.pool = KvPool(
            rank_config, num_blocks, load.block_size, load.num_slots, dtype, device, load.kv_int8,
            cpu.huge_page_buffer if cpu is not None else None,
        )  # fmt: skip

        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = capture_decode(
                self.model, self.pool, load.num_slots, self.max_seq_len, cuda_capture(device)
            )
            kernels = f"{self.compute.kernels}, decode steps in CUDA graphs"
            self.compute = dataclasses.replace(self.compute, kernels=kernels)

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

    def capture_decode(self, max_batch: int, capture: Capture) -> DecodeGraphs:
        """Decode steps of up to ``max_batch`` sequences as graphs (``cuda_graphs.py``)."""
        return capture_decode(self.model, self.pool, max_batch, self.max_seq_len, capture)

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
