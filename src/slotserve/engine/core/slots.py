"""The slot pool and its state machine.

::

    FREE ──acquire──▶ PREFILLING───────────── ──prompt computed──▶ GENERATING
      ▲                 │   ▲     │                                 │    │
      │                 │   │     └────── KV short: preempt ──┐     │    │
      │                 │ resume    ┌───── KV short: preempt ─┼─────┘    │
      │                 │   │       ▼                         ▼          │
      │                 │   └──── PREEMPTED ◀─────────────────┘          │
      │                 │            │                                   │
      │                 └────────────┴──── finish / cancel / error ──────┤
      │                                                                  ▼
      └────────────────────────────── release ◀──────────────────── DRAINING

A slot's index is also the runner's sequence id, so its KV and sampler state belong to the
sequence that holds it. DRAINING means "finished, KV not yet removed"; the step loop releases
every draining slot (runner KV freed) before it schedules the next batch. PREEMPTED means "KV
given back because the pool ran short; sampler state and output kept": the sequence holds its
slot and resumes by recomputing its tokens when memory allows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from slotserve.engine.request import Sequence


class SlotState(enum.Enum):
    FREE = "free"
    PREFILLING = "prefilling"
    GENERATING = "generating"
    DRAINING = "draining"
    PREEMPTED = "preempted"


_ALLOWED = {
    SlotState.FREE: {SlotState.PREFILLING},
    SlotState.PREFILLING: {SlotState.GENERATING, SlotState.DRAINING, SlotState.PREEMPTED},
    SlotState.GENERATING: {SlotState.DRAINING, SlotState.PREEMPTED},
    SlotState.PREEMPTED: {SlotState.PREFILLING, SlotState.DRAINING},
    SlotState.DRAINING: {SlotState.FREE},
}


@dataclass(frozen=True)
class SlotSnapshot:
    """A slot as ``/v1/slots`` shows it."""

    index: int
    state: str
    request_id: str | None
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int


@dataclass(eq=False)
class Slot:
    index: int
    state: SlotState = SlotState.FREE
    sequence: Sequence | None = None
    # When the sequence was placed (a pool-wide counter): the youngest is preempted first.
    admission: int = 0

    def held_sequence(self) -> Sequence:
        """The sequence a placed slot holds (asserted: a free slot holds none)."""
        assert self.sequence is not None, f"slot {self.index} holds no sequence"
        return self.sequence

    def move_to(self, state: SlotState) -> None:
        if state not in _ALLOWED[self.state]:
            raise RuntimeError(f"slot {self.index}: illegal move {self.state} -> {state}")
        self.state = state


class SlotPool:
    """Fixed set of slots; hands out the lowest free index unless told which (the prefix cache
    picks the slot that already holds a prompt's prefix)."""

    def __init__(self, num_slots: int) -> None:
        self.slots = [Slot(i) for i in range(num_slots)]
        self._admissions = 0

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def num_free(self) -> int:
        return sum(1 for s in self.slots if s.state is SlotState.FREE)

    def in_state(self, state: SlotState) -> list[Slot]:
        return [s for s in self.slots if s.state is state]

    def by_admission(self, state: SlotState) -> list[Slot]:
        """Slots in ``state``, oldest admission first (prefill order)."""
        return sorted(self.in_state(state), key=lambda slot: slot.admission)

    def running(self) -> list[Slot]:
        """Slots whose sequence is prefilling or generating."""
        return [s for s in self.slots if s.state in (SlotState.PREFILLING, SlotState.GENERATING)]

    def acquire(self, sequence: Sequence, index: int | None = None) -> Slot:
        """Places ``sequence`` in free slot ``index``, or in the lowest free one."""
        for slot in self.slots:
            if slot.state is SlotState.FREE and index in (None, slot.index):
                slot.move_to(SlotState.PREFILLING)
                slot.sequence = sequence
                self._admissions += 1
                slot.admission = self._admissions
                sequence.slot = slot.index
                return slot
        raise RuntimeError("no free slot" if index is None else f"slot {index} is not free")

    def sequence_in(self, index: int) -> Sequence | None:
        return self.slots[index].sequence

    def snapshot(self) -> tuple[SlotSnapshot, ...]:
        return tuple(
            SlotSnapshot(
                index=slot.index,
                state=slot.state.value,
                request_id=seq.request.request_id if seq else None,
                num_prompt_tokens=seq.num_prompt_tokens if seq else 0,
                num_computed_tokens=seq.num_computed_tokens if seq else 0,
                num_output_tokens=seq.num_output_tokens if seq else 0,
            )
            for slot in self.slots
            for seq in (slot.sequence,)
        )

    def drain(self, slot: Slot) -> None:
        slot.move_to(SlotState.DRAINING)

    def release(self, slot: Slot) -> None:
        slot.move_to(SlotState.FREE)
        slot.sequence = None
