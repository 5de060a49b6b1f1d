"""R2: the PyTorch runner (see :class:`slotserve.engine.runner_interface.Runner`).

One forward pass per engine step over a flattened batch: every scheduled chunk's tokens go
through the projections and MLPs together; attention runs per group (all one-token chunks in
one group, each longer chunk in its own) over the paged KV pool; only the rows that sample get
logits. A slot's KV is its block table: the prefix cache holds the blocks of cached prefixes
and shares them into a slot on a hit (``paged_kv``), a write into a shared block copies it
first, and a pool that runs short answers ``reserve_kv`` with False so the engine evicts or
preempts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.errors import RunnerFailure
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import (
    RECURRENT_STATE_NO_ROLLBACK,
    ModelInfo,
    ScheduledChunk,
)
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.paged_kv import PagedKvTables
from slotserve.runners.pytorch.attention import AttentionGroup, StepAttention, build_group
from slotserve.runners.pytorch.checkpoint import (
    DTYPES,
    TorchLoadConfig,
    kv_blocks,
    open_gguf,
    read_model_config,
)
from slotserve.runners.pytorch.config import ModelConfig
from slotserve.runners.pytorch.deltanet import BLOCK, LinearStatePool, LinearStep
from slotserve.runners.pytorch.gguf_weights import gguf_tensors
from slotserve.runners.pytorch.kv_cache import KvPool
from slotserve.runners.pytorch.model import Decoder
from slotserve.runners.pytorch.sampler import SequenceSampler, new_sequence_sampler, sample
from slotserve.runners.pytorch.tokenizer import HfTokenizer
from slotserve.runners.pytorch.weights import dummy_tensors, load_into, safetensors_tensors

logger = logging.getLogger(__name__)


class TorchFrontend:
    """What the API process keeps when this runner lives in the engine process."""

    def __init__(self, model_path: Path) -> None:
        self._tokenizer = (
            HfTokenizer.from_gguf(model_path)
            if model_path.is_file()
            else HfTokenizer.from_folder(model_path)
        )

    @property
    def tokenizer(self) -> HfTokenizer:
        return self._tokenizer

    def close(self) -> None:
        pass


class TorchRunner:
    def __init__(self, load: TorchLoadConfig) -> None:
        self.load = load
        if load.threads:
            torch.set_num_threads(load.threads)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu")
            if load.device == "auto"
            else load.device
        )
        self.dtype = DTYPES["bfloat16" if load.dtype == "auto" else load.dtype]
        path = load.model_path
        reader = open_gguf(path) if path.is_file() else None  # read once: config and weights
        self.config = config = read_model_config(path, reader)
        self.max_seq_len = min(config.max_position_embeddings, load.max_seq_len or 4096)
        started = time.monotonic()
        self._tokenizer = (
            HfTokenizer.from_gguf(path) if path.is_file() else HfTokenizer.from_folder(path)
        )
        with torch.device(self.device):
            self.model = Decoder(config, self.dtype, self.max_seq_len)
        self.model.eval()
        if load.load_format == "dummy":
            tensors = dummy_tensors(self.model)
        elif reader is not None:
            tensors = gguf_tensors(reader, config)
        else:
            tensors = safetensors_tensors(path)
        load_into(self.model, tensors)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            self.model.make_batch_invariant()  # E4 holds in bfloat16 on CPU only (attention.py)
            if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
                self.model.prepack()
        # Gated DeltaNet layers: a fixed state per slot, allocated before the KV pool is sized.
        self.linear_states = (
            LinearStatePool(config, load.num_slots, self.dtype, self.device)
            if config.linear_layers
            else None
        )
        bytes_per_token = config.kv_bytes_per_token(self.dtype.itemsize)
        num_blocks = kv_blocks(load, self.device, self.max_seq_len, bytes_per_token)
        self.pool = KvPool(
            config, num_blocks, load.block_size, load.num_slots, self.dtype, self.device
        )
        self._samplers: dict[int, SequenceSampler] = {}
        self._prompt_logprobs: dict[int, list[SampledToken]] = {}  # by slot, see the Runner
        self._forward_seconds = 0.0
        self._info = ModelInfo(
            name=load.model_name or config.name,
            vocab_size=config.vocab_size,
            num_slots=load.num_slots,
            max_seq_len=self.max_seq_len,
            eog_token_ids=self._tokenizer.end_of_generation_ids(config.eos_token_ids),
            chat_template=self._tokenizer.chat_template,
            bos_token=self._tokenizer.bos_token,
            eos_token=self._tokenizer.eos_token,
            runner="torch",
            kv_bytes_per_token=bytes_per_token,
            kv_capacity_tokens=self.pool.capacity_tokens,
            **_recurrent_state_rules(config),
        )
        logger.info(
            "loaded %s (%s) on %s in %s: %d slots × %d tokens, KV pool %d blocks × %d "
            "(%.0f MiB) in %.1f s",
            config.name,
            config.model_type,
            self.device,
            str(self.dtype).removeprefix("torch."),
            load.num_slots,
            self.max_seq_len,
            num_blocks,
            load.block_size,
            num_blocks * load.block_size * bytes_per_token / 2**20,
            time.monotonic() - started,
        )

    # ---- Runner protocol --------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    @property
    def tokenizer(self) -> HfTokenizer:
        return self._tokenizer

    @property
    def forward_seconds(self) -> float:
        return self._forward_seconds

    @property
    def paged_kv(self) -> PagedKvTables:
        return self.pool.tables

    def add_sequence(
        self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None
    ) -> None:
        self._samplers[slot] = new_sequence_sampler(
            params, prompt_token_ids, seed, self.config.vocab_size, self.device
        )

    def remove_sequence(self, slot: int) -> None:
        self._samplers.pop(slot, None)

    def copy_kv(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        if self.linear_states is not None:
            if num_tokens != self.pool.tables.lengths[src_slot]:
                raise RuntimeError("a recurrent state holds all of its positions or none")
            self.linear_states.copy(src_slot, dst_slot)
        self.pool.tables.copy(src_slot, dst_slot, num_tokens)

    def trim_kv(self, slot: int, num_tokens: int) -> None:
        # A recurrent state cannot forget its last positions; a sequence starting again from
        # position 0 zeroes it (``execute``).
        if self.linear_states is not None and 0 < num_tokens < self.pool.tables.lengths[slot]:
            raise RuntimeError(f"cannot roll slot {slot}'s recurrent state back to {num_tokens}")
        self.pool.tables.trim(slot, num_tokens)

    def kv_tokens(self, slot: int) -> int:
        return self.pool.tables.lengths[slot]

    def reserve_kv(self, slot: int, num_tokens: int) -> bool:
        return num_tokens <= self.max_seq_len and self.pool.reserve(slot, num_tokens)

    def kv_used_tokens(self, slots: Collection[int]) -> int:
        return self.pool.used_tokens(slots)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        started = time.perf_counter()
        # One-token chunks (decode steps) attend as one group, first; each longer chunk alone.
        ordered = sorted(chunks, key=lambda c: (len(c.token_ids) > 1, c.slot))
        tokens: list[int] = []
        positions: list[int] = []
        write_rows: list[int] = []
        sample_rows: list[int] = []
        scoring: list[tuple[ScheduledChunk, int]] = []  # (chunk, its first row): prompt logprobs
        for chunk in ordered:
            end = chunk.start_pos + len(chunk.token_ids)
            if chunk.prompt_logprob_targets:
                scoring.append((chunk, len(tokens)))
            tokens.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, end))
            write_rows.extend(self.pool.rows(chunk.slot, chunk.start_pos, end))
            if chunk.sample:  # the last position, and a verification chunk's draft positions
                sample_rows.extend(range(len(tokens) - 1 - chunk.num_drafts, len(tokens)))
        step = StepAttention(
            torch.tensor(write_rows, dtype=torch.int64, device=self.device),
            self._groups(ordered),
        )
        device = self.device
        self.pool.apply_pending_copies()
        linear_step = None
        if self.linear_states is not None:
            linear_step = self._linear_step(ordered)
        hidden = self.model(
            torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            step,
            self.pool.layers,
            linear_step,
            self.linear_states.layers if self.linear_states is not None else None,
        )
        for chunk in ordered:
            self.pool.tables.commit(chunk.slot, chunk.start_pos + len(chunk.token_ids))
        for chunk, first in scoring:
            self._score_prompt(chunk, hidden[first : first + len(chunk.prompt_logprob_targets)])
        sampling = [c for c in ordered if c.sample]
        result: dict[int, list[SampledToken]] = {}
        if sampling:
            logits = self.model.logits(hidden[torch.tensor(sample_rows, device=device)])
            # One reduction: NaN or an infinity anywhere makes a row's sum non-finite.
            if not bool(torch.isfinite(logits.sum(dim=-1)).all()):
                raise RunnerFailure("non-finite logits")
            result = self._sample_in_order(sampling, logits)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._forward_seconds += time.perf_counter() - started
        return result

    def _score_prompt(self, chunk: ScheduledChunk, hidden: torch.Tensor) -> None:
        logprobs = torch.log_softmax(self.model.logits(hidden).float(), dim=-1)
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

    def _sample_in_order(
        self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor
    ) -> dict[int, list[SampledToken]]:
        """Samples each chunk's rows of ``logits`` (``num_drafts + 1`` per chunk, in order),
        position by position, each sequence stopping at its first sample that differs from the
        draft after it: a sequence's sampler sees exactly the tokens it produces."""
        if not any(chunk.num_drafts for chunk in chunks):  # no drafts: one row each, no copy
            samplers = [self._samplers[chunk.slot] for chunk in chunks]
            tokens = sample(logits, samplers, [chunk.allowed_tokens for chunk in chunks])
            return {chunk.slot: [token] for chunk, token in zip(chunks, tokens, strict=True)}
        firsts, row = [], 0
        for chunk in chunks:
            firsts.append(row)
            row += chunk.num_drafts + 1
        result: dict[int, list[SampledToken]] = {chunk.slot: [] for chunk in chunks}
        alive = list(range(len(chunks)))
        depth = 0
        while alive:
            rows = torch.tensor([firsts[i] + depth for i in alive], device=logits.device)
            samplers = [self._samplers[chunks[i].slot] for i in alive]
            still = []
            # Constrained sequences are never drafted: their one mask is at depth 0.
            allowed = [chunks[i].allowed_tokens if depth == 0 else None for i in alive]
            for i, token in zip(alive, sample(logits[rows], samplers, allowed), strict=True):
                chunk = chunks[i]
                result[chunk.slot].append(token)
                draft_at = len(chunk.token_ids) - chunk.num_drafts + depth
                if depth < chunk.num_drafts and token.token_id == chunk.token_ids[draft_at]:
                    still.append(i)
            alive, depth = still, depth + 1
        return result

    def _groups(self, ordered: Sequence[ScheduledChunk]) -> list[AttentionGroup]:
        """All one-token chunks (first in ``ordered``) as one group, each longer chunk alone."""
        pool, c = self.pool, self.config
        window = c.sliding_window if any(c.sliding_layers) else None
        decode = [chunk for chunk in ordered if len(chunk.token_ids) == 1]
        batches = ([decode] if decode else []) + [[chunk] for chunk in ordered[len(decode) :]]
        groups, row = [], 0
        for batch in batches:
            q_len = len(batch[0].token_ids)
            groups.append(
                build_group(
                    row,
                    [pool.tables.tables[chunk.slot] for chunk in batch],
                    [chunk.start_pos for chunk in batch],
                    q_len,
                    pool.block_size,
                    pool.zero_block,
                    c.num_kv_heads,
                    window,
                    self.device,
                )
            )
            row += q_len * len(batch)
        return groups

    def _linear_step(self, ordered: Sequence[ScheduledChunk]) -> LinearStep:
        """The Gated DeltaNet layers' view of the step (one-token chunks first, as in
        ``ordered``); a sequence starting at position 0 starts from a zero state."""
        assert self.linear_states is not None
        self.linear_states.reset([c.slot for c in ordered if c.start_pos == 0])
        decode = [c.slot for c in ordered if len(c.token_ids) == 1]
        prefills, row = [], len(decode)
        for chunk in ordered[len(decode) :]:
            prefills.append((row, len(chunk.token_ids), chunk.slot))
            row += len(chunk.token_ids)
        slots = torch.tensor(decode, dtype=torch.int64, device=self.device)
        return LinearStep(slots, prefills)

    def close(self) -> None:
        """Drops the KV pool and the weights; on CUDA the allocator's cache is emptied too,
        so an unloaded model's device memory goes back to the GPU (and to other models)."""
        self._samplers.clear()
        self.pool.layers.clear()
        if self.linear_states is not None:
            self.linear_states.clear()
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _recurrent_state_rules(config: ModelConfig) -> dict[str, Any]:
    """What a model with Gated DeltaNet layers changes in the engine's rules: chunks cut on
    the chunked delta rule's block grid (batch invariance, ``deltanet.py``), no prefix cache
    and no speculation (a recurrent state is neither shareable by position range nor
    rewindable)."""
    if not config.linear_layers:
        return {}
    return {
        "chunk_policy": ChunkPolicy(grain=BLOCK),
        "prefix_cache_unsupported": (
            "the model's Gated DeltaNet layers keep a recurrent state, which cannot be shared "
            "by position range"
        ),
        "speculative_unsupported": RECURRENT_STATE_NO_ROLLBACK,
    }
