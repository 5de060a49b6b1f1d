"""What the engine and the server know of the loaded model (:class:`ModelInfo`): its limits,
how its prompts are chunked, what it serves and how fast parts of it run, the LoRA adapters it
holds (:class:`AdapterInfo`) and the kernels that serve it (:class:`ComputePath`). A runner
states it; the engine process sends it to the API process whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from slotserve.engine.chunk_policy import ANY_SIZE, ChunkPolicy
from slotserve.engine.sampling_defaults import NEUTRAL, SamplingDefaults
from slotserve.engine.verify_cost import VerifyCost

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
    # its format's ecosystem's defaults (``engine/sampling_defaults.py``).
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
