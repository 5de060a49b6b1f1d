"""The fake runner with a state API, for the KV-tier and state-snapshot tests: a slot's KV saved
to host memory and restored (``SavingFakeRunner``), the same per paged block
(``PagedSavingFakeRunner``), and a recurrent model's per-sequence state
(``RecurrentFakeRunner``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import ModelInfo, ScheduledChunk
from tests.fake_runner import FakeRunner


@dataclass
class SavingFakeRunner(FakeRunner):
    """The fake runner with the llama.cpp runner's per-sequence state API: a slot's KV saved
    to host memory and restored into any slot. ``refuse_restores`` makes every restore fail as
    the real one does for a slot a pending copy still reads (nothing changed)."""

    refuse_restores: bool = False
    saves: list[int] = field(default_factory=list)
    restores: list[int] = field(default_factory=list)

    def save_kv(self, slot: int) -> bytearray:
        assert self.pool is None, "saved states are the per-slot streams' API"
        self.saves.append(slot)
        return bytearray(np.asarray(self.streams[slot], dtype=np.int32).tobytes())

    def restore_kv(self, slot: int, data: bytearray) -> bool:
        if self.refuse_restores:
            return False
        self.restores.append(slot)
        self.streams[slot] = np.frombuffer(bytes(data), dtype=np.int32).tolist()
        return True

    def kv_fingerprint(self) -> str:
        return f"fake runner, {self.num_slots} slots of {self.max_seq_len}"


@dataclass
class PagedSavingFakeRunner(FakeRunner):
    """The paged fake runner with the PyTorch runner's copy of positions out of its pool and
    back: a saved state is the tokens written at positions ``0 .. n-1``, so a state restored
    into the wrong blocks or positions changes the output. ``refuse_restores`` makes every
    restore fail as a state the runner cannot read does (nothing written)."""

    kv_pool_blocks: int = 64
    refuse_restores: bool = False
    saves: list[int] = field(default_factory=list)  # positions saved, per save
    restores: list[tuple[int, int]] = field(default_factory=list)  # (start, end) written

    def save_kv_blocks(self, blocks: Sequence[int], num_tokens: int) -> bytearray:
        size = self.kv_block_size
        tokens = [self.block_tokens[blocks[p // size]][p % size] for p in range(num_tokens)]
        self.saves.append(num_tokens)
        return bytearray(np.asarray(tokens, dtype=np.int32).tobytes())

    def restore_kv_blocks(self, slot: int, start: int, end: int, data: bytearray) -> bool:
        tokens = np.frombuffer(bytes(data), dtype=np.int32).tolist()
        if self.refuse_restores or len(tokens) < end:
            return False
        self.restores.append((start, end))
        self._write(slot, start, tokens[start:end])
        return True

    def kv_fingerprint(self) -> str:
        return f"paged fake runner, blocks of {self.kv_block_size}"


@dataclass
class RecurrentFakeRunner(FakeRunner):
    """The fake runner with a recurrent state beside its KV, as a Gated DeltaNet model has:
    the "state" of a slot is every token it absorbed since position 0, so a snapshot
    restored from the wrong place, at the wrong time or never leaves it unequal to the slot's
    KV, which ``execute`` asserts (the engine then fails the request). Prompt chunks must
    start on the grid from position 0, snapshots are taken only on it, and only within a
    prompt (as the real runner's chunked form).

    Paged (``kv_pool_blocks``) as the PyTorch runner; else per-slot streams as llama.cpp's
    hybrid models: a restore is read at once, a copy takes the source's whole state, and a
    stream's state cannot be trimmed to fewer positions than it covers (only emptied)."""

    snapshot_places: int = 4
    prefill_grain: int = 8
    snapshot_bytes: int = 100
    states: dict[int, list[int]] = field(default_factory=dict)
    snapshots: dict[int, list[int]] = field(default_factory=dict)  # place -> the state kept
    pending_saves: dict[int, dict[int, int]] = field(default_factory=dict)
    pending_restores: dict[int, int] = field(default_factory=dict)
    saved_at: list[int] = field(default_factory=list)  # positions of every save
    restored: list[int] = field(default_factory=list)  # lengths of every restored state

    @property
    def model_info(self) -> ModelInfo:
        policy = ChunkPolicy(self.prefill_grain, anchored=True)
        return replace(super().model_info, chunk_policy=policy)

    @property
    def snapshot_capacity(self) -> int:
        return self.snapshot_places

    def save_state(self, slot: int, position: int, snapshot: int) -> None:
        assert position % self.prefill_grain == 0 and 0 <= snapshot < self.snapshot_places
        self.pending_saves.setdefault(slot, {})[position] = snapshot

    def restore_state(self, slot: int, snapshot: int) -> None:
        assert snapshot in self.snapshots, "restored from a place never filled"
        if self.pool is None:
            self.states[slot] = list(self.snapshots[snapshot])
            self.restored.append(len(self.states[slot]))
        else:
            self.pending_restores[slot] = snapshot

    def trim_kv(self, slot: int, num_tokens: int) -> None:
        if self.pool is None:
            self._cut_state(slot, num_tokens)
            self.pending_saves.pop(slot, None)
        else:
            assert num_tokens in (0, self.kv_tokens(slot)), "a recurrent state cannot be cut"
            if num_tokens == 0:
                self.pending_saves.pop(slot, None)
                self.pending_restores.pop(slot, None)
        super().trim_kv(slot, num_tokens)

    def copy_kv(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        if self.pool is None:
            self.states[dst_slot] = list(self.states.get(src_slot, []))
            self._cut_state(dst_slot, num_tokens)
            self.pending_saves.pop(dst_slot, None)
        super().copy_kv(src_slot, dst_slot, num_tokens)

    def _cut_state(self, slot: int, num_tokens: int) -> None:
        state = self.states.setdefault(slot, [])
        assert num_tokens == 0 or num_tokens >= len(state), "a recurrent state cannot be cut"
        if num_tokens == 0:
            state.clear()

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        for chunk in chunks:
            slot, start = chunk.slot, chunk.start_pos
            if start == 0:
                self.states[slot] = []
            if slot in self.pending_restores:
                self.states[slot] = list(self.snapshots[self.pending_restores.pop(slot)])
                self.restored.append(len(self.states[slot]))
            state = self.states[slot]
            assert state == self._held(slot), f"slot {slot}: state {len(state)} tokens off"
            end = start + len(chunk.token_ids)
            if start < self.prompt_lengths[slot]:
                assert start % self.prefill_grain == 0, f"a prompt chunk starts at {start}"
            state.extend(chunk.token_ids)
            pending = self.pending_saves.get(slot, {})
            for position in [p for p in pending if p <= end]:
                assert start < position <= self.prompt_lengths[slot], "saved off the prompt"
                self.snapshots[pending.pop(position)] = state[:position]
                self.saved_at.append(position)
        return super().execute(chunks)
