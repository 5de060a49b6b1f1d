"""The PyTorch runner (see :class:`slotserve.engine.runner_interface.Runner`): loaded in one
pass (:class:`TorchRunner`'s constructor, the load plan), then one forward pass per engine step.

A step runs over a flattened batch: every scheduled chunk's tokens go through the projections
and MLPs together; attention runs per group (all one-token chunks in one group, each longer
chunk in its own) over the paged KV pool; only the rows that sample get logits. A slot's KV is
its block table: the prefix cache holds the blocks of cached prefixes and shares them into a
slot on a hit (``paged_kv``), a write into a shared block copies it first, and a pool that
runs short answers ``reserve_kv`` with False so the engine evicts or preempts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from pathlib import Path

import torch

import slotserve
from slotserve.engine.errors import RunnerFailure
from slotserve.engine.outputs import SampledToken
from slotserve.engine.prefix_cache.block_table import PagedKvTables
from slotserve.engine.runner_interface import AdapterInfo, ModelInfo, ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.fingerprint import weights_fingerprint
from slotserve.runners.pooling import PromptPools
from slotserve.runners.pytorch.load.checkpoint import open_checkpoint
from slotserve.runners.pytorch.load.memory import return_freed_memory
from slotserve.runners.pytorch.load.model_rules import (
    context_cost,
    quantized_rules,
    recurrent_state_rules,
)
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.model.lora import StepLora
from slotserve.runners.pytorch.model.tensor_parallel import shard_config
from slotserve.runners.pytorch.shard.model_shard import ModelShard
from slotserve.runners.pytorch.shard.ranks import rank_device, start_ranks
from slotserve.runners.pytorch.shard.step_plan import StepPlan
from slotserve.runners.pytorch.step import score_head
from slotserve.runners.pytorch.step.adapters import AdapterSet
from slotserve.runners.pytorch.step.planner import StepPlanner
from slotserve.runners.pytorch.step.sampler import (
    SequenceSampler,
    new_sequence_sampler,
    sample_chunks,
)
from slotserve.runners.pytorch.vision.step_inputs import VisionInputs

logger = logging.getLogger(__name__)


class TorchFrontend:
    """What the API process keeps when this runner lives in the engine process."""

    def __init__(self, model_path: Path) -> None:
        self.tokenizer = open_checkpoint(model_path).tokenizer()

    def close(self) -> None:
        pass


class TorchRunner:
    def __init__(self, load: TorchLoadConfig) -> None:
        """The load plan, every stage in the order it runs (nano-vllm's
        ``ModelRunner.__init__``: config → model → weights → KV → graphs):

        1. the checkpoint (``load/checkpoint.py``): an HF folder or a GGUF file, its family
           and configuration, refused before any process starts or any weight is read; its
           tokenizer, and a reranker's classifier tokens;
        2. the other tensor-parallel ranks (``shard/ranks.py``), which build theirs alongside;
        3. this rank's shard (``shard/model_shard.py``): the decoder, its weights stored in
           their format (``load/weight_format.py``), the kernels, the recurrent states, the KV
           pool, the decode graphs;
        4. what rank 0 alone keeps: the family's vision tower, the LoRA adapters, the score
           head and pooling, the step planner and samplers;
        5. the ``ModelInfo`` the engine reads.
        """
        started = time.monotonic()
        self.load = load
        ranks = load.tensor_parallel_size
        if load.threads or ranks > 1:
            torch.set_num_threads(load.rank_threads)
        self.dtype = load.torch_dtype

        checkpoint = open_checkpoint(load.model_path, load.model_overrides)
        self.config = config = checkpoint.config
        # This rank's shape of the model: refused here, before any process starts.
        rank_config = shard_config(config, ranks)
        self.tokenizer = checkpoint.tokenizer()
        head_rows = score_head.token_ids(self.tokenizer, load.classifier_from_token, checkpoint)
        eog_token_ids = self.tokenizer.end_of_generation_ids(config.eos_token_ids)

        self.device = rank_device(load.torch_device, 0, ranks)
        self.ranks, tp = start_ranks(load, self.device, config.vocab_size)
        try:
            self.shard = ModelShard(load, checkpoint, rank_config, self.device, tp, head_rows)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        return_freed_memory()
        self.pool = self.shard.pool
        self.max_seq_len = self.shard.max_seq_len

        self.image_inputs = VisionInputs.load(checkpoint, self.device, self.dtype, ranks)
        kernels = self.shard.model.kernels
        self.lora = AdapterSet(
            config,
            self.dtype,
            self.device,
            kernels if kernels is not None and kernels.has_gemm else None,
            load,
        )
        for name, folder in load.lora_modules:
            self.lora.load(name, Path(folder))
        # A reranker scores its last token; a sentence-transformers folder names its pooling;
        # else the last token's final state.
        self.score_head = score_head.choose(
            checkpoint, self.shard.classifier, self.shard.lm_head_rows
        )
        pooling = "last" if self.score_head is not None else checkpoint.pooling() or "last"
        self._pools = PromptPools(pooling, self.score_head)
        self._planner = StepPlanner(self.pool, self.shard.linear_states)
        self._samplers: dict[int, SequenceSampler] = {}
        self._prompt_logprobs: dict[int, list[SampledToken]] = {}  # by slot, see the Runner
        self.forward_seconds = 0.0

        snapshots = load.snapshots if self.shard.linear_states is not None else 0
        rules = quantized_rules(
            recurrent_state_rules(config, snapshots), self.shard.model.prompts_dequantized
        )
        cost = context_cost(config, self.device)
        if self.score_head is not None:
            rules["speculative_unsupported"] = "the model is a reranker: it does not generate"
        bytes_per_token = self.shard.kv_bytes_per_token * ranks
        self.model_info = ModelInfo(
            name=load.model_name or config.name,
            vocab_size=config.vocab_size,
            num_slots=load.num_slots,
            max_seq_len=self.max_seq_len,
            eog_token_ids=eog_token_ids,
            chat_template=self.tokenizer.chat_template,
            bos_token=self.tokenizer.bos_token,
            eos_token=self.tokenizer.eos_token,
            runner="torch",
            kv_bytes_per_token=bytes_per_token,
            kv_capacity_tokens=self.pool.capacity_tokens,
            context_cost=cost,
            tensor_parallel_size=ranks,
            sampling_defaults=checkpoint.sampling_defaults(),
            pooling=pooling,
            compute=self.shard.compute,
            lora_unsupported=(
                "LoRA adapters are not served under tensor parallelism" if ranks > 1 else None
            ),
            adapters=tuple(self.lora.adapters),
            can_generate=self.score_head is None,
            cross_encoder=self.score_head is not None,
            accepts_images=self.image_inputs is not None,
            whole_images=self.image_inputs is not None and self.image_inputs.tower.whole_images,
            **rules,
        )
        num_blocks = self.pool.tables.num_blocks
        logger.info(
            "loaded %s (%s) on %s%s in %s (%s): %d slots × %d tokens, KV pool %d blocks × %d "
            "(%.0f MiB%s) in %.1f s",
            config.name,
            config.model_type,
            self.device,
            f" × {ranks} tensor-parallel ranks" if ranks > 1 else "",
            str(self.dtype).removeprefix("torch."),
            self.shard.compute.kernels,
            load.num_slots,
            self.max_seq_len,
            num_blocks,
            load.block_size,
            num_blocks * load.block_size * bytes_per_token / 2**20,
            ", int8" if load.kv_int8 else "",
            time.monotonic() - started,
        )

    # ---- Runner protocol --------------------------------------------------------------------

    @property
    def paged_kv(self) -> PagedKvTables:
        return self.pool.tables

    # ---- StateSnapshots (models with Gated DeltaNet layers) -----------------------------------

    @property
    def snapshot_capacity(self) -> int:
        states = self.shard.linear_states
        return 0 if states is None else self.load.snapshots

    @property
    def snapshot_bytes(self) -> int:
        return self.config.linear_state_bytes(self.dtype.itemsize)

    def save_state(self, slot: int, position: int, snapshot: int) -> None:
        assert 0 <= snapshot < self.snapshot_capacity
        self._planner.save_state(slot, position, snapshot)

    def restore_state(self, slot: int, snapshot: int) -> None:
        assert 0 <= snapshot < self.snapshot_capacity
        self._planner.restore_state(slot, snapshot)

    # ---- AdapterRunner (LoRA) -----------------------------------------------------------------

    @property
    def adapters(self) -> list[AdapterInfo]:
        return self.lora.adapters

    def load_adapter(self, name: str, path: Path) -> AdapterInfo:
        if self.model_info.lora_unsupported:
            raise ValueError(self.model_info.lora_unsupported)
        return self.lora.load(name, path)

    def unload_adapter(self, name: str) -> AdapterInfo:
        return self.lora.unload(name)

    # ---- Runner protocol (continued) ----------------------------------------------------------

    def add_sequence(
        self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None
    ) -> None:
        self._planner.start(slot, len(prompt_token_ids))
        if self.image_inputs is not None:
            self.image_inputs.start(slot, len(prompt_token_ids))
        if params.embed:  # pooled, never sampled
            self._samplers.pop(slot, None)
            return
        self._samplers[slot] = new_sequence_sampler(params, prompt_token_ids, seed, self.device)

    def remove_sequence(self, slot: int) -> None:
        self._samplers.pop(slot, None)
        self._planner.forget(slot)
        self._pools.forget(slot)
        if self.image_inputs is not None:
            self.image_inputs.forget(slot)

    def copy_kv(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        if self.shard.linear_states is not None:
            if num_tokens != self.pool.tables.lengths[src_slot]:
                raise RuntimeError("a recurrent state holds all of its positions or none")
            self.shard.linear_states.copy(src_slot, dst_slot)
        self.pool.tables.copy(src_slot, dst_slot, num_tokens)

    def trim_kv(self, slot: int, num_tokens: int) -> None:
        # A recurrent state cannot forget its last positions; a sequence starting again from
        # position 0 zeroes it (``execute``).
        if self.shard.linear_states is not None and 0 < num_tokens < self.pool.tables.lengths[slot]:
            raise RuntimeError(f"cannot roll slot {slot}'s recurrent state back to {num_tokens}")
        if num_tokens == 0:
            self._planner.drop_snapshots(slot)
        self.pool.tables.trim(slot, num_tokens)

    def kv_tokens(self, slot: int) -> int:
        return self.pool.tables.lengths[slot]

    def reserve_kv(self, slot: int, num_tokens: int) -> bool:
        return num_tokens <= self.max_seq_len and self.pool.reserve(slot, num_tokens)

    def kv_used_tokens(self, slots: Collection[int]) -> int:
        return self.pool.used_tokens(slots)

    # ---- SavablePagedKv (the prefix cache's host and disk tiers) -----------------------------

    def save_kv_blocks(self, blocks: Sequence[int], num_tokens: int) -> bytearray:
        return self.pool.save_positions(blocks, num_tokens)

    def restore_kv_blocks(self, slot: int, start: int, end: int, data: bytearray) -> bool:
        return self.pool.load_positions(slot, start, end, data)

    def kv_fingerprint(self) -> str:
        # The KV's bits depend on the weights and on the code computing them: the kernels
        # (their GEMM or oneDNN), torch and this release.
        kernels = self.shard.model.kernels
        config = self.config
        return ";".join(
            (
                "torch",
                slotserve.__version__,
                torch.__version__,
                weights_fingerprint(self.load.model_path),
                f"load={self.load.load_format}",
                str(self.dtype),
                f"kv={self.load.kv_cache_dtype}",
                self.device.type,
                ("triton" if self.shard.triton else "torch ops")
                if kernels is None
                else f"{kernels.isa},gemm={kernels.has_gemm}",
                f"layers={config.num_attention_layers}x{config.num_kv_heads}x{config.head_dim}",
            )
        )

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        started = time.perf_counter()
        ordered = self._planner.order(chunks)
        plan, scoring, sampling = self._planner.plan(ordered)
        if self.ranks is not None:
            self.ranks.send(plan)
        lora = self.lora.step([(chunk.adapter, len(chunk.token_ids)) for chunk in ordered])
        logits = self.shard.replay_decode(plan) if lora is None else None
        if logits is None:
            logits = self._forward(plan, ordered, scoring, lora)
        for chunk in ordered:
            self.pool.tables.commit(chunk.slot, chunk.start_pos + len(chunk.token_ids))
        result: dict[int, list[SampledToken]] = {}
        if sampling:
            assert logits is not None
            # One reduction: NaN or an infinity anywhere makes a row's sum non-finite.
            if not bool(torch.isfinite(logits.sum(dim=-1)).all()):
                raise RunnerFailure("non-finite logits")
            result = sample_chunks(sampling, logits, self._samplers)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - started
        return result

    def _forward(
        self,
        plan: StepPlan,
        ordered: Sequence[ScheduledChunk],
        scoring: Sequence[ScheduledChunk],
        lora: StepLora | None,
    ) -> torch.Tensor | None:
        """The step run op by op: pooled and scored rows taken; the sampled rows' logits."""
        images = self.image_inputs.step(ordered) if self.image_inputs is not None else None
        hidden = self.shard.forward(plan, lora, images)
        if any(chunk.embed for chunk in ordered):
            self._pool(ordered, hidden)
        # Logits in the plan's order: the other ranks gather the vocabulary in the same calls.
        for chunk, rows in zip(scoring, plan.logit_rows, strict=False):
            self._score_prompt(chunk, self.shard.logits(hidden, rows))
        if len(plan.logit_rows) > len(scoring):
            return self.shard.logits(hidden, plan.logit_rows[-1])
        return None

    def _score_prompt(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(list(chunk.prompt_logprob_targets), device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top = self._samplers[chunk.slot].params.prompt_logprobs or 0
        best_values, best_ids = logprobs.topk(top, dim=-1) if top else (None, None)
        scored = self._prompt_logprobs.setdefault(chunk.slot, [])
        for i, target in enumerate(chunk.prompt_logprob_targets):
            alternatives: tuple[tuple[int, float], ...] = ()
            if best_ids is not None and best_values is not None:
                alternatives = tuple(
                    zip(best_ids[i].tolist(), best_values[i].tolist(), strict=True)
                )
            scored.append(SampledToken(target, chosen[i], alternatives))

    def take_prompt_logprobs(self) -> dict[int, list[SampledToken]]:
        scored, self._prompt_logprobs = self._prompt_logprobs, {}
        return scored

    def _pool(self, ordered: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        """Hands the pools the final-norm states of the embedding chunks' rows they read
        (``hidden`` holds the step's rows in ``ordered``'s order). The norm is per row, so a
        vector does not depend on what ran beside it."""
        first = 0
        for chunk in ordered:
            rows = self._pools.rows(chunk)
            part = None
            if rows is not None:
                states = self.shard.model.norm(hidden[first + rows[0] : first + rows[1]])
                part = states.float().cpu().numpy()
            if chunk.embed:
                self._pools.add(chunk, part)
            first += len(chunk.token_ids)

    def take_embeddings(self) -> dict[int, list[float]]:
        return self._pools.take()

    def close(self) -> None:
        """Drops the KV pool and the weights; on CUDA the allocator's cache is emptied too,
        so an unloaded model's device memory goes back to the GPU (and to other models)."""
        self._samplers.clear()
        if self.ranks is not None:
            self.ranks.close()
        self.shard.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
