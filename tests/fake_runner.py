"""A deterministic stand-in for a model runner, for engine-logic tests.

Tokens are bytes (ids 0-255) plus ``EOS`` (256). For a prompt whose text is a key of
``replies`` the fake "model" emits that reply's bytes one token per step, then EOS; for any
other prompt it emits the letters ``a..z`` cyclically forever. Every call is recorded.
The variants with a state API (saved KV, paged blocks, recurrent state) are in
fake_state_runners.py.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.decoding.structured_output import allowed_mask
from slotserve.engine.memory_need import MemoryNeed
from slotserve.engine.outputs import SampledToken
from slotserve.engine.prefix_cache.block_table import PagedKvTables
from slotserve.engine.runner_interface import ModelInfo, ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams
from slotserve.engine.verify_cost import VerifyCost

EOS = 256


class ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace") or "<eos>"


@dataclass
class FakeRunner:
    num_slots: int = 4
    max_seq_len: int = 256
    replies: dict[str, bytes] = field(default_factory=dict)
    fail_on_execute: bool = False
    equal_prefill_chunks: bool = False
    # Seconds one forward pass takes: a fake model as slow as a real one, for tests that race
    # the engine thread against the event loop.
    forward_seconds_per_step: float = 0.0
    prefix_cache_unsupported: str | None = None
    prefill_grain: int = 1
    verify_cost: VerifyCost = field(default_factory=VerifyCost)  # what drafts cost
    # A shared, paged KV pool of this many blocks (0: every slot owns max_seq_len positions),
    # kept by the real block tables: lets tests run the engine out of KV memory, and the engine
    # then keeps cached prefixes in blocks the radix tree holds (``paged_kv``). The "KV" is then
    # the tokens written into each block, so a wrongly shared block changes the output.
    kv_pool_blocks: int = 0
    kv_block_size: int = 4
    batches: list[list[ScheduledChunk]] = field(default_factory=list)
    added: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (src, dst, tokens)
    # slot -> tokens whose "KV" is held (without a pool): checks the engine feeds contiguous
    # positions, and the fake model's next token depends on it, so wrongly reused KV changes
    # the output. Read it through ``kv``.
    streams: dict[int, list[int]] = field(default_factory=dict)
    active: set[int] = field(default_factory=set)  # slots with sampler state
    prompt_lengths: dict[int, int] = field(default_factory=dict)  # slot -> its prompt's length
    # (start_pos, length, prompt length) of every chunk that computed prompt tokens.
    prompt_chunks: list[tuple[int, int, int]] = field(default_factory=list)
    fail_with: Exception | None = None  # raised by the next execute, once
    fail_add_sequence: bool = False  # a request-level failure (a grammar the runner rejects)
    prompt_scores: dict[int, list[SampledToken]] = field(default_factory=dict)
    drop_samples_once: bool = False  # the next execute returns no tokens: breaks the engine loop
    drop_samples_at_step: int = 0  # ... the same at this execute (for a runner in a process)
    # Embeddings: how the fake model pools (None: it cannot embed), whether it generates, and
    # whether it is an encoder. Its vector is [tokens pooled, their sum, the last token]: a
    # pooled position missing (a wrong cache hit, a lost chunk) changes it.
    pooling: str | None = "last"
    can_generate: bool = True
    bidirectional: bool = False
    context_cost: float = 0.0  # ModelInfo.context_cost (scheduler invariant 2)
    pooled: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (count, sum)
    embeddings: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for slot in range(self.num_slots):
            self.streams.setdefault(slot, [])
        self.pool = (
            PagedKvTables(self.kv_pool_blocks, self.kv_block_size, self.num_slots)
            if self.kv_pool_blocks
            else None
        )
        self.block_tokens: dict[int, list[int]] = {}  # pool block -> the tokens written in it

    @property
    def kv(self) -> dict[int, list[int]]:
        """Every slot's held tokens (a copy)."""
        return {slot: self._held(slot) for slot in range(self.num_slots)}

    def _held(self, slot: int) -> list[int]:
        if self.pool is None:
            return list(self.streams[slot])
        table, size = self.pool.tables[slot], self.kv_block_size
        return [
            self.block_tokens[table[p // size]][p % size] for p in range(self.pool.lengths[slot])
        ]

    @property
    def paged_kv(self) -> PagedKvTables | None:
        return self.pool

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            name="fake",
            vocab_size=257,
            num_slots=self.num_slots,
            max_seq_len=self.max_seq_len,
            eog_token_ids=frozenset({EOS}),
            chat_template=None,
            bos_token="",
            eos_token="",
            runner="fake",
            chunk_policy=ChunkPolicy(self.prefill_grain, self.equal_prefill_chunks),
            kv_bytes_per_token=64,
            prefix_cache_unsupported=self.prefix_cache_unsupported,
            kv_capacity_tokens=self.kv_pool_blocks * self.kv_block_size,
            verify_cost=self.verify_cost,
            context_cost=self.context_cost,
            pooling=self.pooling,
            can_generate=self.can_generate,
            bidirectional=self.bidirectional,
        )

    @property
    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    @property
    def forward_seconds(self) -> float:
        return 0.0

    def add_sequence(
        self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None
    ) -> None:
        if self.fail_add_sequence:
            raise RuntimeError("simulated sampler setup failure")
        assert slot not in self.active, f"slot {slot} reused before removal"
        held = self._held(slot)
        assert held == list(prompt_token_ids[: len(held)]), "the slot's KV is not a prompt prefix"
        assert len(held) < len(prompt_token_ids), "the last prompt token must be computed"
        self.added.append(slot)
        self.active.add(slot)
        self.prompt_lengths[slot] = len(prompt_token_ids)

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        self.batches.append(list(chunks))
        if self.forward_seconds_per_step:
            time.sleep(self.forward_seconds_per_step)
        if self.fail_on_execute:
            raise RuntimeError("simulated device failure")
        if self.fail_with is not None:
            failure, self.fail_with = self.fail_with, None
            raise failure
        sampled: dict[int, list[SampledToken]] = {}
        for chunk in chunks:
            assert chunk.slot in self.active, f"slot {chunk.slot} has no sequence"
            held = self._held(chunk.slot)
            assert chunk.start_pos == len(held), "positions must continue the slot's KV"
            self._write(chunk.slot, chunk.start_pos, chunk.token_ids)
            prompt_length = self.prompt_lengths[chunk.slot]
            if chunk.start_pos < prompt_length:
                self.prompt_chunks.append((chunk.start_pos, len(chunk.token_ids), prompt_length))
            held.extend(chunk.token_ids)
            for offset, target in enumerate(chunk.prompt_logprob_targets):
                # A made-up score that names its position, so tests can see order and gaps.
                score = SampledToken(target, -float(chunk.start_pos + offset + 1))
                self.prompt_scores.setdefault(chunk.slot, []).append(score)
            if chunk.embed:
                self._pool(chunk, held)
            if chunk.sample:  # verified in order, as the real runners do (ScheduledChunk)
                tokens = sampled[chunk.slot] = []
                for depth in range(chunk.num_drafts + 1):
                    end = len(held) - chunk.num_drafts + depth
                    tokens.append(SampledToken(self._allowed(self._next(held[:end]), chunk)))
                    if depth == chunk.num_drafts or tokens[-1].token_id != held[end]:
                        break
        if self.drop_samples_once or len(self.batches) == self.drop_samples_at_step:
            self.drop_samples_once = False
            return {}
        return sampled

    def take_prompt_logprobs(self) -> dict[int, list[SampledToken]]:
        scored, self.prompt_scores = self.prompt_scores, {}
        return scored

    def _pool(self, chunk: ScheduledChunk, held: list[int]) -> None:
        assert not chunk.sample, "an embedding chunk never samples"
        if self.pooling != "last":
            assert chunk.start_pos == 0 or chunk.slot in self.pooled, "a pooled position missed"
        count, total = (0, 0) if chunk.start_pos == 0 else self.pooled.get(chunk.slot, (0, 0))
        self.pooled[chunk.slot] = (count + len(chunk.token_ids), total + sum(chunk.token_ids))
        if chunk.embed_last:
            count, total = self.pooled.pop(chunk.slot)
            self.embeddings[chunk.slot] = [float(count), float(total), float(held[-1])]

    def take_embeddings(self) -> dict[int, list[float]]:
        vectors, self.embeddings = self.embeddings, {}
        return vectors

    def remove_sequence(self, slot: int) -> None:
        self.removed.append(slot)
        self.active.discard(slot)

    def _write(self, slot: int, start: int, tokens: Sequence[int]) -> None:
        if self.pool is None:
            self.streams[slot].extend(tokens)
            return
        end = start + len(tokens)
        self.pool.commit(slot, end)
        table, size = self.pool.tables[slot], self.kv_block_size
        for pos, token in zip(range(start, end), tokens, strict=True):
            self.block_tokens.setdefault(table[pos // size], [-1] * size)[pos % size] = token

    def copy_kv(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        assert src_slot != dst_slot and num_tokens <= self.kv_tokens(src_slot)
        self.copies.append((src_slot, dst_slot, num_tokens))
        if self.pool is not None:
            self.pool.copy(src_slot, dst_slot, num_tokens)
        else:
            self.streams[dst_slot] = self.streams[src_slot][:num_tokens]

    def trim_kv(self, slot: int, num_tokens: int) -> None:
        if self.pool is not None:
            self.pool.trim(slot, num_tokens)
        else:
            del self.streams[slot][num_tokens:]

    def kv_tokens(self, slot: int) -> int:
        return self.pool.lengths[slot] if self.pool is not None else len(self.streams[slot])

    def reserve_kv(self, slot: int, num_tokens: int) -> bool:
        if self.pool is None:
            return num_tokens <= self.max_seq_len
        copies = self.pool.reserve(slot, num_tokens)
        if copies is None:
            return False
        for src, dst in copies:  # copy-on-write: the shared block's content goes along
            self.block_tokens[dst] = list(self.block_tokens.get(src, [-1] * self.kv_block_size))
        return True

    def kv_used_tokens(self, slots: Collection[int]) -> int:
        if self.pool is None:
            return sum(self.kv_tokens(slot) for slot in slots)
        return self.pool.used_blocks(slots) * self.kv_block_size

    @property
    def blocks_in_use(self) -> int:
        return 0 if self.pool is None else self.pool.num_blocks - self.pool.num_free

    def close(self) -> None:
        pass

    def _allowed(self, token_id: int, chunk: ScheduledChunk) -> int:
        """The planned token if the chunk's grammar mask allows it, else the first allowed."""
        if chunk.allowed_tokens is None:
            return token_id
        allowed = allowed_mask(chunk.allowed_tokens, self.model_info.vocab_size)
        return token_id if allowed[token_id] else int(np.flatnonzero(allowed)[0])

    def _next(self, held: list[int]) -> int:
        for prompt, reply in self.replies.items():
            prompt_ids = list(prompt.encode("utf-8"))
            if held[: len(prompt_ids)] == prompt_ids:
                done = len(held) - len(prompt_ids)
                return reply[done] if done < len(reply) else EOS
        return ord("a") + len(held) % 26


class FakeFrontend:
    """What the API process keeps of the fake model in engine-process mode."""

    tokenizer = ByteTokenizer()

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class FakeSpec:
    """A picklable recipe for a :class:`FakeRunner` built in an engine process."""

    options: dict[str, Any] = field(default_factory=dict)
    load_error: str | None = None

    def __call__(self) -> FakeRunner:
        if self.load_error is not None:
            raise RuntimeError(self.load_error)
        return FakeRunner(**self.options)

    def frontend(self) -> FakeFrontend:
        return FakeFrontend()

    def memory_needed(self) -> MemoryNeed:
        return MemoryNeed(weights_bytes=0, kv_bytes=0, kv_tokens=0, overhead_bytes=0)
