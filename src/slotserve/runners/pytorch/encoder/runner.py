"""The encoder runner (BERT, ``families/bert.py``): embeddings, or a cross-encoder's scores
(``cross_encoder.py``), never generation.

Every token attends to the whole prompt (no causal mask), positions are learned absolute
embeddings plus a token-type embedding (type 0: one segment; a cross-encoder's pair has two),
and each layer is post-norm (LayerNorm after each residual sum) with a GELU MLP. So a token's
hidden state depends on the tokens after it: a prompt runs in one chunk
(``ModelInfo.bidirectional``; the engine then refuses prompts longer than one step's budget),
nothing of it can be reused, and no KV is kept. The runner only remembers each slot's length,
so the engine's KV bookkeeping holds.

Each prompt runs through the encoder on its own, whatever else the step holds: its vector is
then the same alone or batched, at the price of one pass over the weights per prompt (the
models of this family are small).

A cross-encoder's prompt is a (query, document) pair; it ends with one relevance score where an
embedding model ends with its pooled vector, and the engine carries it the same way (as a
one-value ``RequestOutput.embedding``, never normalised).

``dtype auto`` is float32 here: embedding models are small, and their vectors are compared by
cosine similarity, where bfloat16's rounding shows.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from slotserve.engine.memory_need import MemoryNeed
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import ModelInfo, ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.pooling import PromptPools
from slotserve.runners.pytorch.encoder import cross_encoder
from slotserve.runners.pytorch.families.base import score_activation
from slotserve.runners.pytorch.families.registry import ENCODERS, with_overrides
from slotserve.runners.pytorch.load.hf_folder import HfFolder
from slotserve.runners.pytorch.load.settings import TORCH_DTYPES, TorchLoadConfig

logger = logging.getLogger(__name__)


def is_encoder(path: Path) -> bool:
    """True for an HF folder whose ``config.json`` names an encoder family."""
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        return False
    return json.loads(config_file.read_text()).get("model_type") in ENCODERS


class EncoderRunner:
    """An embedding-only runner for BERT; see :class:`slotserve.engine.runner_interface.Runner`
    and the module docstring for what it changes in the rules."""

    def __init__(self, load: TorchLoadConfig) -> None:
        started = time.monotonic()
        path = load.model_path
        checkpoint = HfFolder(path)
        raw = with_overrides(checkpoint.raw_config, json.loads(load.model_overrides or "{}"))
        family = ENCODERS.get(str(raw.get("model_type")))
        if family is None:
            raise ValueError(
                f"{path.name}: model_type {raw.get('model_type')!r} is not an encoder family"
            )
        config = family.config(raw, path.name)
        self.hidden, self.heads = config.hidden_size, config.num_heads
        self.layers, self.eps = config.num_layers, config.layer_norm_eps
        self.act = config.activation
        self.device = load.torch_device
        self.dtype = torch.float32 if load.dtype == "auto" else TORCH_DTYPES[load.dtype]
        self.max_seq_len = load.sequence_length(config.max_position_embeddings)
        self._score = score_activation(raw, path.name)
        self._weights = self._load(checkpoint.tensors(), family.weight_name)
        self.tokenizer = checkpoint.tokenizer()
        self._sep_id = self.tokenizer.sep_token_id
        if self._score is not None and self._sep_id is None:
            raise ValueError(f"{path.name}: a cross-encoder's tokenizer has no [SEP] token")
        self._scores: dict[int, list[float]] = {}
        pooling = checkpoint.pooling() or "cls"  # BERT's summary token
        self._pools = PromptPools(pooling)
        self._lengths = [0] * load.num_slots
        self.forward_seconds = 0.0
        self.model_info = ModelInfo(
            name=load.model_name or path.name,
            vocab_size=config.vocab_size,
            num_slots=load.num_slots,
            max_seq_len=self.max_seq_len,
            eog_token_ids=frozenset(),
            chat_template=None,
            bos_token="",
            eos_token="",
            runner="torch",
            prefix_cache_unsupported=(
                "the model is an encoder: a token's state depends on the tokens after it"
            ),
            speculative_unsupported="the model is an encoder: it does not generate",
            can_generate=False,
            pooling=pooling,
            bidirectional=True,
            cross_encoder=self._score is not None,
        )
        logger.info(
            "loaded %s %s (%s, %s pooling) on %s in %s: %d slots × %d tokens in %.1f s",
            "cross-encoder" if self._score is not None else "encoder",
            path.name,
            raw["model_type"],
            pooling,
            self.device,
            str(self.dtype).removeprefix("torch."),
            load.num_slots,
            self.max_seq_len,
            time.monotonic() - started,
        )

    def _load(
        self,
        tensors: Iterator[tuple[str, torch.Tensor]],
        weight_name: Callable[[str], str | None],
    ) -> dict[str, torch.Tensor]:
        weights: dict[str, torch.Tensor] = {}
        for raw_name, tensor in tensors:
            name = weight_name(raw_name)
            if name is not None:
                weights[name] = tensor.to(self.device, self.dtype)
        needed = [
            "embeddings.word_embeddings.weight",
            "embeddings.position_embeddings.weight",
            "embeddings.token_type_embeddings.weight",
            "embeddings.LayerNorm.weight",
            *(f"encoder.layer.{i}.output.LayerNorm.weight" for i in range(self.layers)),
        ]
        if self._score is not None:
            needed += ["pooler.dense.weight", "classifier.weight", "classifier.bias"]
        missing = [name for name in needed if name not in weights]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        return weights

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self._weights
        return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self._weights
        shape = (self.hidden,)
        return F.layer_norm(x, shape, w[f"{name}.weight"], w[f"{name}.bias"], self.eps)

    def encode(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The last layer's hidden states of one whole prompt, one row per token."""
        w, n = self._weights, len(token_ids)
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
        # An embedding prompt is one segment (type 0); a cross-encoder's pair is two.
        types = (
            cross_encoder.token_types(token_ids, self._sep_id, self.device)
            if self._score is not None and self._sep_id is not None
            else torch.zeros(n, dtype=torch.int64, device=self.device)
        )
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:n]
            + w["embeddings.token_type_embeddings.weight"][types]
        )
        x = self._norm(x, "embeddings.LayerNorm")
        head_dim = self.hidden // self.heads
        for i in range(self.layers):
            p = f"encoder.layer.{i}"
            q, k, v = (
                self._linear(x, f"{p}.attention.self.{part}")
                .view(n, self.heads, head_dim)
                .transpose(0, 1)
                for part in ("query", "key", "value")
            )
            attended = F.scaled_dot_product_attention(q, k, v)  # no mask: all see all
            attended = attended.transpose(0, 1).reshape(n, self.hidden)
            attended = self._linear(attended, f"{p}.attention.output.dense")
            x = self._norm(attended + x, f"{p}.attention.output.LayerNorm")
            inner = self.act(self._linear(x, f"{p}.intermediate.dense"))
            x = self._norm(self._linear(inner, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
        return x

    # ---- Runner protocol --------------------------------------------------------------------

    @property
    def paged_kv(self) -> None:
        return None

    def add_sequence(
        self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None
    ) -> None:
        if not params.embed:
            raise ValueError("an encoder serves embeddings only")

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        started = time.perf_counter()
        for chunk in chunks:
            if not (chunk.embed and chunk.embed_last and chunk.start_pos == 0):
                raise RuntimeError("an encoder runs whole embedding prompts only")
            hidden = self.encode(chunk.token_ids)
            self._lengths[chunk.slot] = len(chunk.token_ids)
            if self._score is not None:  # a score, not a pooled vector: never normalised
                self._scores[chunk.slot] = [cross_encoder.score(self._weights, hidden, self._score)]
                continue
            rows = self._pools.rows(chunk)
            part = None if rows is None else hidden[rows[0] : rows[1]].float().cpu().numpy()
            self._pools.add(chunk, part)
        self.forward_seconds += time.perf_counter() - started
        return {}

    def take_prompt_logprobs(self) -> dict[int, list[SampledToken]]:
        return {}

    def take_embeddings(self) -> dict[int, list[float]]:
        scores, self._scores = self._scores, {}
        return self._pools.take() | scores

    def remove_sequence(self, slot: int) -> None:
        self._pools.forget(slot)
        self._scores.pop(slot, None)

    # No KV is kept: only the lengths the engine's bookkeeping expects.
    def copy_kv(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        self._lengths[dst_slot] = min(num_tokens, self._lengths[src_slot])

    def trim_kv(self, slot: int, num_tokens: int) -> None:
        self._lengths[slot] = min(self._lengths[slot], num_tokens)

    def kv_tokens(self, slot: int) -> int:
        return self._lengths[slot]

    def reserve_kv(self, slot: int, num_tokens: int) -> bool:
        return num_tokens <= self.max_seq_len

    def kv_used_tokens(self, slots: Collection[int]) -> int:
        return 0  # nothing held between steps

    def close(self) -> None:
        self._weights.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def estimate_encoder_memory(load: TorchLoadConfig) -> MemoryNeed:
    """Weights only (no KV is kept), counted from the safetensors headers."""
    from safetensors import safe_open

    count = 0
    for file in sorted(load.model_path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                count += math.prod(handle.get_slice(name).get_shape())
    dtype_bytes = 4 if load.dtype == "auto" else TORCH_DTYPES[load.dtype].itemsize
    on_gpu = load.torch_device.type == "cuda"
    return MemoryNeed(count * dtype_bytes, 0, 0, 64 * 2**20, device_share=float(on_gpu))
