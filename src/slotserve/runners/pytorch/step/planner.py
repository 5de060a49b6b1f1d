"""The engine's scheduled chunks as one step's :class:`StepPlan`: the plain numbers (tokens,
positions, cache rows, attention groups, block copies, logit rows, the Gated DeltaNet layers'
view) that every tensor-parallel rank runs. Rank 0 alone keeps what the plans are built from:
the block tables, where each slot's prompt ends, and the recurrent-state snapshots the prefix
cache asked for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from slotserve.engine.runner_interface import ScheduledChunk
from slotserve.runners.pytorch.model.deltanet import BLOCK
from slotserve.runners.pytorch.shard.pools import KvPool, LinearStatePool
from slotserve.runners.pytorch.shard.step_plan import GroupPlan, StepPlan


class StepPlanner:
    def __init__(self, pool: KvPool, linear_states: LinearStatePool | None) -> None:
        self.pool = pool
        self.linear_states = linear_states
        self._prompt_lengths: dict[int, int] = {}  # by slot: where decoding starts
        # Recurrent-state snapshots asked for by the prefix cache, by slot, until a chunk
        # reaches them: {position: snapshot} to save, the snapshot to resume from.
        self._pending_saves: dict[int, dict[int, int]] = {}
        self._pending_restores: dict[int, int] = {}

    def start(self, slot: int, prompt_length: int) -> None:
        self._prompt_lengths[slot] = prompt_length

    def forget(self, slot: int) -> None:
        self._prompt_lengths.pop(slot, None)

    def save_state(self, slot: int, position: int, snapshot: int) -> None:
        assert position % BLOCK == 0
        self._pending_saves.setdefault(slot, {})[position] = snapshot

    def restore_state(self, slot: int, snapshot: int) -> None:
        self._pending_restores[slot] = snapshot

    def drop_snapshots(self, slot: int) -> None:
        """The slot starts again from position 0: no snapshot asked for before still holds."""
        self._pending_saves.pop(slot, None)
        self._pending_restores.pop(slot, None)

    def order(self, chunks: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
        """One-token chunks attend as one group, first (decoded tokens before one-token prompt
        chunks, which a recurrent layer computes as prompts); each longer chunk alone. Rows
        with the same LoRA adapter sit together, so that its update reads one range."""
        return sorted(
            chunks,
            key=lambda c: (len(c.token_ids) > 1, not self._decodes(c), c.adapter, c.slot),
        )

    def plan(
        self, ordered: Sequence[ScheduledChunk]
    ) -> tuple[StepPlan, list[ScheduledChunk], list[ScheduledChunk]]:
        """The step as plain numbers for every rank, with the chunks whose prompt positions
        are scored and those that sample (``logit_rows``: one list of rows per scored chunk,
        then the sampled rows: each chunk's last position and any draft positions)."""
        tokens: list[int] = []
        positions: list[int] = []
        write_rows: list[int] = []
        prompt_rows: list[bool] = []
        sample_rows: list[int] = []
        logit_rows: list[list[int]] = []
        scoring: list[ScheduledChunk] = []
        for chunk in ordered:
            end = chunk.start_pos + len(chunk.token_ids)
            if chunk.prompt_logprob_targets:
                scoring.append(chunk)
                first = len(tokens)
                logit_rows.append(list(range(first, first + len(chunk.prompt_logprob_targets))))
            tokens.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, end))
            prompt_end = self._prompt_lengths.get(chunk.slot, 0)
            prompt_rows.extend(p < prompt_end for p in range(chunk.start_pos, end))
            write_rows.extend(self.pool.rows(chunk.slot, chunk.start_pos, end))
            if chunk.sample:
                sample_rows.extend(range(len(tokens) - 1 - chunk.num_drafts, len(tokens)))
        sampling = [c for c in ordered if c.sample]
        if sampling:
            logit_rows.append(sample_rows)
        plan = StepPlan(
            tokens,
            positions,
            write_rows,
            self._groups(ordered),
            self.pool.take_pending_copies(),
            logit_rows,
            prompt_rows,
            **self._linear_plan(ordered),
        )
        return plan, scoring, sampling

    def _groups(self, ordered: Sequence[ScheduledChunk]) -> list[GroupPlan]:
        """All one-token chunks (first in ``ordered``) as one group, each longer chunk alone."""
        tables = self.pool.tables.tables
        decode = [chunk for chunk in ordered if len(chunk.token_ids) == 1]
        batches = ([decode] if decode else []) + [[chunk] for chunk in ordered[len(decode) :]]
        groups, row = [], 0
        for batch in batches:
            q_len = len(batch[0].token_ids)
            groups.append(
                GroupPlan(
                    row,
                    [list(tables[chunk.slot]) for chunk in batch],
                    [chunk.start_pos for chunk in batch],
                    q_len,
                )
            )
            row += q_len * len(batch)
        return groups

    def _decodes(self, chunk: ScheduledChunk) -> bool:
        """A decoded token: one token past the prompt (a recurrent layer's one-token step)."""
        return len(chunk.token_ids) == 1 and chunk.start_pos >= self._prompt_lengths.get(
            chunk.slot, 0
        )

    def _linear_plan(self, ordered: Sequence[ScheduledChunk]) -> dict[str, Any]:
        """The Gated DeltaNet layers' view of the step (decoded tokens first, as in
        ``ordered``): a sequence starting at position 0 starts from a zero state, one the
        prefix cache resumed from a snapshot; snapshots its chunks reach are taken."""
        states = self.linear_states
        if states is None:
            return {}
        decode = [c.slot for c in ordered if self._decodes(c)]
        prefills, saves, row = [], [], len(decode)
        for chunk in ordered[len(decode) :]:
            length = len(chunk.token_ids)
            prefills.append((row, length, chunk.slot, chunk.start_pos))
            row += length
            pending = self._pending_saves.get(chunk.slot, {})
            for position in [p for p in pending if p <= chunk.start_pos + length]:
                # A position already passed would leave the snapshot unwritten: the cache
                # asks only for positions ahead of the slot.
                assert position > chunk.start_pos, f"slot {chunk.slot}: {position} is passed"
                saves.append((chunk.slot, position, states.snapshot_row(pending.pop(position))))
        loads = [
            (states.snapshot_row(self._pending_restores.pop(c.slot)), c.slot)
            for c in ordered
            if c.slot in self._pending_restores
        ]
        return {
            "linear_resets": [c.slot for c in ordered if c.start_pos == 0],
            "linear_loads": loads,
            "linear_decode": decode,
            "linear_prefills": prefills,
            "linear_saves": saves,
        }
