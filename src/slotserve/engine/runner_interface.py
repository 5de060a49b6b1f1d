"""The contract between the engine and a model runner.

The engine drives any object that satisfies :class:`Runner`; it never learns which backend it
is. Everything crossing this boundary is a plain Python value: slot indices, token ids, and
:class:`~slotserve.engine.outputs.SampledToken` results.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from slotserve.engine.kv_layouts import KvAllocator, PagedKv, StateSnapshots
from slotserve.engine.memory_need import MemoryNeed
from slotserve.engine.model_info import (
    RECURRENT_STATE_NO_ROLLBACK,
    AdapterInfo,
    ComputePath,
    ModelInfo,
)
from slotserve.engine.outputs import SampledToken
from slotserve.engine.sampling_params import SamplingParams

# What the model is (``model_info.py``) and how its KV is kept (``kv_layouts.py``) live beside
# this contract; the runners import them from here with the rest of it.
__all__ = [
    "RECURRENT_STATE_NO_ROLLBACK",
    "AdapterInfo",
    "ComputePath",
    "KvAllocator",
    "ModelInfo",
    "PagedKv",
    "PairTokenizer",
    "RequestChecker",
    "Runner",
    "RunnerFrontend",
    "RunnerSpec",
    "ScheduledChunk",
    "StateSnapshots",
    "Tokenizer",
]


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens of one sequence to run in this step.

    ``token_ids`` occupy positions ``start_pos .. start_pos + len(token_ids) - 1`` of the
    sequence held by ``slot``. When ``sample`` is true the runner samples the next token from
    the logits of the chunk's last position.

    A verification chunk (speculative decoding, ``engine/decoding/speculative.py``) ends with
    ``num_drafts`` draft tokens: the runner samples the last ``num_drafts + 1`` positions in
    order with the sequence's sampler and stops at the first sample that differs from the
    draft after it, returning the accepted drafts followed by that sample (or by the token
    after the last draft when all were accepted).

    ``allowed_tokens`` (structured output, ``engine/decoding/structured_output.py``): the tokens the
    sequence's grammar allows at the sampled position, as llguidance's packed bitmask (bit
    ``t % 32`` of int32 word ``t // 32``). The runner sets the other logits of that row to
    ``-inf`` before its sampler (log-probabilities stay those of the raw logits).
    """

    slot: int
    token_ids: Sequence[int]
    start_pos: int
    sample: bool
    num_drafts: int = 0
    allowed_tokens: np.ndarray[Any, Any] | None = None
    # Prompt log-probabilities: the prompt tokens at positions ``start_pos + 1`` onwards; the
    # runner scores each with the logits of the position before it (see
    # ``Runner.take_prompt_logprobs``).
    prompt_logprob_targets: Sequence[int] = ()
    # Embedding (``SamplingParams.embed``): every prompt chunk of such a sequence has ``embed``
    # set and ``sample`` never; the runner keeps what the model's pooling needs of these
    # positions (``ModelInfo.pooling``), and after the chunk that ends the prompt
    # (``embed_last``) hands the slot's vector over in ``Runner.take_embeddings``.
    embed: bool = False
    embed_last: bool = False
    adapter: int = 0  # the LoRA adapter the rows run with (``AdapterInfo.adapter_id``; 0: none)


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


@runtime_checkable
class PairTokenizer(Tokenizer, Protocol):
    """A cross-encoder's tokenizer: a (query, document) pair in the model's own template
    (BERT's ``[CLS] a [SEP] b [SEP]``; a decoder reranker's texts one after the other)."""

    def encode_pair(self, first: str, second: str) -> list[int]: ...


class RequestChecker(Protocol):
    """What validating a request needs of the model: a runner, or the API process's
    :class:`RunnerFrontend` with the model info the engine process sent."""

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...


class RunnerFrontend(Protocol):
    """The part of a runner the API process needs when the runner lives in the engine
    process: the model's tokenizer."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    def close(self) -> None: ...


@runtime_checkable
class RunnerSpec(Protocol):
    """A picklable recipe for a runner: called in the engine process to build it, asked for
    the frontend the API process keeps beside it (``engine/client/mp_client.py``) and for the
    memory the runner will take."""

    def __call__(self) -> Runner: ...

    def frontend(self) -> RunnerFrontend: ...

    def memory_needed(self) -> MemoryNeed: ...


class Runner(Protocol):
    """A model runner: owns the model, the KV cache and per-sequence sampler state.

    Guarantees the engine relies on:

    * ``slot`` indices are ``0 .. num_slots - 1`` and name independent sequences: work for one
      slot never changes another slot's results (batch invariance under greedy sampling, and a
      seeded sampler's draws depend only on its own sequence).
    * ``execute`` runs **one** forward pass over all chunks and returns, keyed by slot, the
      tokens of every chunk with ``sample=True``: one, or for a verification chunk the
      accepted drafts and one more (see :class:`ScheduledChunk`). It is only called from the
      engine thread.
    * A slot's KV is positions ``0 .. n-1`` of one token list. It outlives the sequence:
      ``remove_sequence`` frees only sampler state, and the engine decides with ``trim_kv`` and
      ``copy_kv`` what the KV holds when the slot is next used (the prefix cache reuses it).
      ``copy_kv`` and ``trim_kv`` take effect before the next ``execute`` touches the slots,
      in call order, and never change what another slot's KV holds.
    * Before ``execute`` runs a chunk ending at position ``n - 1``, the engine has called
      ``reserve_kv(slot, n)`` and got True. A runner whose KV memory is a shared pool answers
      False when it is exhausted; the engine then evicts cached prefixes or preempts a
      sequence (its KV trimmed to 0, recomputed later) and asks again. A slot's sampler state
      survives preemption: it is only freed by ``remove_sequence``.
    * Methods raise ordinary exceptions on failure; the runner stays usable for other slots
      after a failed ``add_sequence``. An exception from ``execute`` (or
      ``RunnerFailure`` for non-finite logits) means the model can no longer be trusted: the
      engine fails every request and the model must be reloaded.
    """

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def forward_seconds(self) -> float:
        """Total time spent inside the forward pass itself (for the engine-overhead share)."""
        ...

    @property
    def paged_kv(self) -> PagedKv | None:
        """The block tables when the KV is a shared pool of blocks (the prefix cache then
        holds blocks itself); None when every slot owns one KV stream (llama.cpp)."""
        ...

    def add_sequence(
        self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None
    ) -> None:
        """Prepares sampler state for a new sequence in a slot (its KV is left as it is)."""
        ...

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        """Runs one batched forward over ``chunks`` and samples where asked."""
        ...

    def take_prompt_logprobs(self) -> dict[int, list[SampledToken]]:
        """By slot, the log-probabilities the last ``execute`` computed for chunks with
        ``prompt_logprob_targets`` (one per target, with the slot's ``prompt_logprobs`` top
        alternatives); cleared by the call."""
        ...

    def take_embeddings(self) -> dict[int, list[float]]:
        """By slot, the L2-normalised vectors of the chunks with ``embed_last`` the last
        ``execute`` ran; cleared by the call."""
        ...

    def remove_sequence(self, slot: int) -> None:
        """Frees the slot's sampler state; its KV stays until trimmed or overwritten."""
        ...

    def copy_kv(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        """Replaces ``dst_slot``'s KV with the first ``num_tokens`` positions of ``src_slot``'s."""
        ...

    def trim_kv(self, slot: int, num_tokens: int) -> None:
        """Keeps only the first ``num_tokens`` positions of the slot's KV (0 frees it all)."""
        ...

    def kv_tokens(self, slot: int) -> int:
        """How many positions (``0 .. n-1``) the slot's KV holds; raises if not contiguous."""
        ...

    def reserve_kv(self, slot: int, num_tokens: int) -> bool:
        """Makes sure ``slot``'s KV can hold positions ``0 .. num_tokens - 1``; False, with
        nothing changed, when the KV memory is exhausted. Reserved room beyond what the slot
        holds is given back by ``trim_kv``."""
        ...

    def kv_used_tokens(self, slots: Collection[int]) -> int:
        """KV positions taken by ``slots`` (positions shared between them counted once, in the
        runner's unit of allocation): over ``ModelInfo.kv_capacity``, the KV usage metric."""
        ...

    def close(self) -> None:
        """Releases the model and context."""
        ...
