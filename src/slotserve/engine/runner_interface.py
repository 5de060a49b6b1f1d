"""The contract between the engine and a model runner.

The engine drives any object that satisfies :class:`Runner`; it never learns which backend it
is. Everything crossing this boundary is a plain Python value: slot indices, token ids, and
:class:`~slotserve.engine.outputs.SampledToken` results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from slotserve.engine.outputs import SampledToken
from slotserve.engine.sampling_params import SamplingParams, StructuredOutput


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens of one sequence to run in this step.

    ``token_ids`` occupy positions ``start_pos .. start_pos + len(token_ids) - 1`` of the
    sequence held by ``slot``. When ``sample`` is true the runner samples the next token from
    the logits of the chunk's last position.
    """

    slot: int
    token_ids: Sequence[int]
    start_pos: int
    sample: bool


@dataclass(frozen=True)
class ModelInfo:
    """What the engine and server need to know about the loaded model."""

    name: str
    vocab_size: int
    num_slots: int
    max_seq_len: int  # tokens (prompt + output) one sequence may hold
    eog_token_ids: frozenset[int]
    chat_template: str | None
    bos_token: str
    eos_token: str
    runner: str
    # The runner prefers every prefill chunk of a step to have the same length (scheduler
    # invariant 6); llama.cpp with per-sequence KV streams does.
    equal_prefill_chunks: bool = False


class Tokenizer(Protocol):
    """Text <-> token ids for the loaded model."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenizes ``text``; special-token markup (``<|im_start|>``) becomes special tokens.

        ``add_special_tokens`` adds the BOS token when the model expects one.
        """
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to output text (empty for control tokens)."""
        ...

    def token_text(self, token_id: int) -> str:
        """A printable form of one token, used in logprobs (control tokens keep their markup)."""
        ...


class Runner(Protocol):
    """A model runner: owns the model, the KV cache and per-sequence sampler state.

    Guarantees the engine relies on:

    * ``slot`` indices are ``0 .. num_slots - 1`` and name independent sequences: work for one
      slot never changes another slot's results (batch invariance under greedy sampling, and a
      seeded sampler's draws depend only on its own sequence).
    * ``execute`` runs **one** forward pass over all chunks and returns one token for every
      chunk with ``sample=True``, keyed by slot. It is only called from the engine thread.
    * ``remove_sequence`` frees the slot's KV and sampler state; the slot may then be reused by
      a new ``add_sequence`` at once.
    * Methods raise ordinary exceptions on failure; the runner stays usable for other slots
      after a failed ``add_sequence``.
    """

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def forward_seconds(self) -> float:
        """Total time spent inside the forward pass itself (for the engine-overhead share)."""
        ...

    def check_structured_output(self, spec: StructuredOutput) -> None:
        """Raises ``InvalidRequestError`` if ``spec`` cannot be enforced. Thread-safe."""
        ...

    def add_sequence(
        self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None
    ) -> None:
        """Prepares sampler state for a new sequence in an empty slot."""
        ...

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, SampledToken]:
        """Runs one batched forward over ``chunks`` and samples where asked."""
        ...

    def remove_sequence(self, slot: int) -> None:
        """Frees the slot's KV cache entries and sampler state."""
        ...

    def close(self) -> None:
        """Releases the model and context."""
        ...
