"""The contract between the engine and a model runner.

The engine drives any object that satisfies :class:`Runner`; it never learns which backend it
is. Everything crossing this boundary is a plain Python value: slot indices, token ids, and
:class:`~slotserve.engine.outputs.SampledToken` results.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from slotserve.engine.chunk_policy import ANY_SIZE, ChunkPolicy
from slotserve.engine.memory_need import MemoryNeed
from slotserve.engine.outputs import SampledToken
from slotserve.engine.sampling_defaults import NEUTRAL, SamplingDefaults
from slotserve.engine.sampling_params import SamplingParams
from slotserve.engine.verify_cost import VerifyCost


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


RECURRENT_STATE_NO_ROLLBACK = (
    "the model keeps a recurrent state, which cannot be rolled back past rejected drafts"
)


@dataclass(frozen=True)
class ComputePath:
    """Which kernels serve the model, for operators (``/v1/models``, the start-up log)."""

    device: str = "cpu"
    # The CPU features the kernels run with (as the backend names them: AVX2, AVX512_BF16,
    # AMX_INT8...); empty on a GPU.
    cpu_features: tuple[str, ...] = ()
    # The kernels that serve the weights, in words ("ggml, plain weights (...)", "slotserve
    # GEMM (avx512bf16)", "oneDNN"...).
    kernels: str = ""
    # Whether a sequence's tokens are independent of its batch on this path (E4).
    batch_invariant: bool = True


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter a runner holds; a request names it as its model."""

    name: str
    # From the adapter's files: the same adapter has the same id in every process and after a
    # restart, so the prefix cache (whose disk tier outlives the process) keys KV by it.
    adapter_id: int
    rank: int
    path: str


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
    # How prompts are cut into chunks and how much cached KV may be reused, so that a token is
    # computed the same way whatever runs beside it (scheduler invariants 6 and 8).
    chunk_policy: ChunkPolicy = ANY_SIZE
    # Bytes of KV one token takes (all layers, K and V): sizes the prefix cache's byte budget.
    kv_bytes_per_token: int = 0
    # Why KV cannot be shared by position range (recurrent state, sliding-window layers...);
    # the prefix cache is then off. None when sharing works.
    prefix_cache_unsupported: str | None = None
    # KV positions the runner can hold for all slots together (0: num_slots × max_seq_len,
    # every slot owning a fixed stream). A pooled runner may hold fewer than its slots could
    # ask for; the engine then preempts (see ``Runner.reserve_kv``).
    kv_capacity_tokens: int = 0
    # What a prompt token costs per earlier position it attends to, as a fraction of the rest
    # of its cost (its projections): from position 1 / context_cost on, attention is most of
    # a prefill chunk's time (scheduler invariant 2). 0: not stated.
    context_cost: float = 0.0
    # Speculative decoding: what verifying drafts adds to a one-sequence decode step on this
    # runner; the speculator drafts only as many tokens as are expected to pay for it.
    verify_cost: VerifyCost = field(default_factory=VerifyCost)
    # Why drafts cannot be verified (a recurrent state cannot be rolled back to before a
    # rejected draft); speculative decoding is then off. None when it works.
    speculative_unsupported: str | None = None
    tensor_parallel_size: int = 1  # ranks the model is split across (the PyTorch runner's)
    # What the model serves: text generation, and embeddings pooled from the prompt's final
    # hidden states ("last" token, "mean" of all tokens, "cls": the first token's; None: no
    # embeddings). "mean" and "cls" need every position computed, so those prompts take no
    # prefix-cache hit.
    can_generate: bool = True
    pooling: str | None = None
    # An encoder: every token attends to the whole prompt, so a prompt runs in one chunk of at
    # most ``max_batch_tokens`` and its KV is never reused (no prefix cache, no decode).
    bidirectional: bool = False
    # A cross-encoder: its prompt is a (query, document) pair and its "embedding" is one
    # relevance score, not a normalised vector; served by /v1/rerank and /v1/score only.
    cross_encoder: bool = False
    # What a request gets for the sampling fields it leaves out: the model's own values over
    # its runner's ecosystem's defaults (``engine/sampling_defaults.py``).
    sampling_defaults: SamplingDefaults = NEUTRAL
    compute: ComputePath = ComputePath()
    # LoRA adapters (``engine/adapters.py``): why none are served, and those loaded now.
    lora_unsupported: str | None = "this runner serves no LoRA adapters"
    adapters: tuple[AdapterInfo, ...] = ()
    # Images in prompts (``engine/images.py``): the runner is an ``ImageRunner``.
    accepts_images: bool = False
    # An image's tokens see the whole image (Gemma 3): each is computed within one chunk.
    whole_images: bool = False

    @property
    def can_embed(self) -> bool:
        return self.pooling is not None

    @property
    def routes_served(self) -> str:
        """What a model that does not generate serves, for the errors refusing generation."""
        if self.cross_encoder:
            return "a cross-encoder: it serves /v1/rerank and /v1/score only"
        return "an embedding model: it serves /v1/embeddings only"

    @property
    def kv_capacity(self) -> int:
        return self.kv_capacity_tokens or self.num_slots * self.max_seq_len


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


class PagedKv(Protocol):
    """Block tables of a runner whose KV is a pool of fixed-size blocks shared by reference
    (``engine/prefix_cache/block_table.py``). The prefix cache holds blocks of cached prefixes
    itself and hands them to slots; the runner copies a shared block before writing into it."""

    block_size: int

    def table(self, slot: int) -> Sequence[int]:
        """The blocks holding ``slot``'s positions, in order."""
        ...

    def share(self, slot: int, blocks: Sequence[int], num_tokens: int) -> None:
        """``slot``'s positions ``0 .. num_tokens - 1`` become those of ``blocks``."""
        ...

    def hold(self, blocks: Sequence[int]) -> None:
        """Keeps ``blocks`` allocated (for the cache) until :meth:`unhold`."""
        ...

    def unhold(self, blocks: Sequence[int]) -> None: ...

    def drop_holds(self) -> None:
        """Gives back every hold (a new engine's cache starts from nothing)."""
        ...

    def check_integrity(self, held: Mapping[int, int] | None = None) -> None:
        """Raises ``AssertionError`` when counts disagree with the tables and ``held``."""
        ...


@runtime_checkable
class StateSnapshots(Protocol):
    """A runner whose model carries a recurrent state beside its KV (Gated DeltaNet layers),
    which a prefix of positions cannot be cut from: the prefix cache keeps copies of it,
    taken at chosen positions of a prompt (multiples of the chunk policy's grain, where the
    state is the same for every prompt through that prefix), in ``snapshot_capacity``
    numbered places the cache allocates."""

    @property
    def snapshot_capacity(self) -> int: ...

    @property
    def snapshot_bytes(self) -> int:
        """The memory one snapshot takes."""
        ...

    def save_state(self, slot: int, position: int, snapshot: int) -> None:
        """When ``slot``'s coming prompt chunks reach ``position`` tokens, its state then is
        copied into ``snapshot`` (overwriting it). Forgotten by ``trim_kv(slot, 0)`` (with
        per-slot streams, by any ``trim_kv`` of the slot)."""
        ...

    def restore_state(self, slot: int, snapshot: int) -> None:
        """``slot``'s next chunk starts from the state in ``snapshot`` (read when that chunk
        runs, before any save of the same step; with per-slot streams, read at once, so the
        stream can then be trimmed to the snapshot's position)."""
        ...


class KvAllocator(Protocol):
    """The runner's KV memory as the scheduler sees it (see ``Runner``)."""

    def reserve_kv(self, slot: int, num_tokens: int) -> bool: ...

    def trim_kv(self, slot: int, num_tokens: int) -> None: ...


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
