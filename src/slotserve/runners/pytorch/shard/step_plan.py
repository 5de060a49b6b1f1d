"""One step as plain numbers (:class:`StepPlan`), what every tensor-parallel rank runs: built by
rank 0 from the scheduled chunks and its block tables (``step/planner.py``), sent to the other
ranks over ZMQ (``ranks.py``), run by each rank's shard (``model_shard.py``)."""

from __future__ import annotations

import msgspec
import torch

from slotserve.runners.pytorch.model.attention import PagedStep


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
    # Whether each token is its sequence's prompt's (not one it generated): quantized
    # projections multiply the two kinds in two arithmetics (``model/layers.py``).
    prompt_rows: list[bool]
    # Gated DeltaNet (``deltanet.LinearStep``): slots starting from a zero state, slots
    # resuming from a saved state (pool row, slot), decoding slots, prompt chunks (row,
    # length, slot, position), states to save (slot, position, pool row).
    linear_resets: list[int] = []
    linear_loads: list[tuple[int, int]] = []
    linear_decode: list[int] = []
    linear_prefills: list[tuple[int, int, int, int]] = []
    linear_saves: list[tuple[int, int, int]] = []


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
        torch.tensor(plan.prompt_rows, dtype=torch.bool) if any(plan.prompt_rows) else None,
    )
