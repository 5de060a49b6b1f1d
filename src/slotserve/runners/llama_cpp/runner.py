"""The llama.cpp runner, over llama-cpp-python's low-level C bindings.

One model, one context with ``n_seq_max = num_slots``; a slot's index is its llama.cpp
sequence id. Each step fills one ``llama_batch`` with every scheduled chunk and calls
``llama_decode`` once.

KV layout: ``kv_unified = false`` gives each sequence its own KV stream of
``ctx_size / num_slots`` cells. With a unified cache a neighbour's long prefill chunk
interleaves its cells with ours and changes the attention's rounding, which breaks batch
invariance; separate streams keep every sequence's attention the same alone or batched.
The price: one sequence can use at most ``ctx_size / num_slots`` tokens, and sharing a prefix
between slots copies KV between streams instead of sharing cells
(docs/design/batch-invariance.md): ``llama_memory_seq_cp`` between streams copies the whole
stream buffer (a few ms), then ``llama_memory_seq_rm`` trims the copy to the shared prefix.
Hybrid models keep their recurrent state beside that KV: ``states.py``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import llama_cpp as llama
import numpy as np

from slotserve.engine.errors import RunnerFailure
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import AdapterInfo, ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.fingerprint import weights_fingerprint
from slotserve.runners.llama_cpp.adapters import GgufAdapters
from slotserve.runners.llama_cpp.backend import (
    FA_TILE_Q,
    check_gpu_offload,
    context_params,
    default_ctx_size,
    init_llama_backend,
)
from slotserve.runners.llama_cpp.batch import DecodeBatch, ballast_for, decode_groups
from slotserve.runners.llama_cpp.cpu import BUFFER_LOG, choose_weight_layout, extra_buffer_types
from slotserve.runners.llama_cpp.info import describe
from slotserve.runners.llama_cpp.metadata import pooling_of
from slotserve.runners.llama_cpp.sampling import build_chain, sample_row, with_logprobs
from slotserve.runners.llama_cpp.states import RECURRENT_PART, SequenceStates
from slotserve.runners.llama_cpp.tokenizer import LlamaCppTokenizer
from slotserve.runners.options import LlamaCppConfig
from slotserve.runners.pooling import PromptPools
from slotserve.runners.rope import MODEL_ROPE, RopeSettings

logger = logging.getLogger(__name__)


class LlamaCppRunner:
    """Runs a GGUF model on llama.cpp; see :class:`slotserve.engine.runner_interface.Runner`."""

    def __init__(
        self,
        model_path: str | Path,
        num_slots: int,
        ctx_size: int,
        max_batch_tokens: int,
        n_threads: int | None = None,
        flash_attn: bool = LlamaCppConfig.flash_attn,
        model_name: str | None = None,
        state_snapshots: int = 0,
        repack: str = LlamaCppConfig.repack,
        lora_modules: tuple[tuple[str, str], ...] = (),
        max_loras: int = LlamaCppConfig.max_loras,
        max_lora_rank: int = LlamaCppConfig.max_lora_rank,
        n_gpu_layers: int = LlamaCppConfig.n_gpu_layers,
        rope: RopeSettings = MODEL_ROPE,
        kv_types: tuple[str, str] = (LlamaCppConfig.cache_type_k, LlamaCppConfig.cache_type_v),
    ) -> None:
        init_llama_backend()
        check_gpu_offload(n_gpu_layers)
        path = Path(model_path)
        layout = choose_weight_layout(repack, extra_buffer_types())
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = n_gpu_layers
        model_params.use_extra_bufts = layout.use_extra_buffers
        with BUFFER_LOG.recording() as buffers:
            self._model = llama.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load the model at {path}")
        n_ctx_train = llama.llama_model_n_ctx_train(self._model)
        if ctx_size <= 0:
            ctx_size = default_ctx_size(num_slots, n_ctx_train)
        threads = n_threads or os.cpu_count() or 1
        ctx_params = context_params(
            ctx_size, max_batch_tokens, num_slots, threads, flash_attn, rope, kv_types
        )
        self._ctx = llama.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            llama.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not create a context of {ctx_size} tokens")
        self._memory = llama.llama_get_memory(self._ctx)
        self.lora = GgufAdapters(self._model, max_loras, max_lora_rank)
        for name, adapter_path in lora_modules:
            self.lora.load(name, Path(adapter_path))
        self._vocab = llama.llama_model_get_vocab(self._model)
        self.tokenizer = LlamaCppTokenizer(self._vocab)
        self._n_vocab = self.tokenizer.vocab_size
        self._batch = DecodeBatch(max_batch_tokens)
        self._chains: dict[int, Any] = {}
        self._params: dict[int, SamplingParams] = {}
        self._prompt_logprobs: dict[int, list[SampledToken]] = {}  # by slot, see the Runner
        pooling = pooling_of(self._model)
        self._pools = PromptPools(pooling)
        self._n_embd = llama.llama_model_n_embd(self._model)
        self.forward_seconds = 0.0
        self._model_path = path
        self._flash_attn = flash_attn
        self._stream_copy_sources: set[int] = set()  # slots a pending stream copy reads
        self._hybrid = bool(llama.llama_model_is_hybrid(self._model))
        self._states = SequenceStates(self._ctx, state_snapshots if self._hybrid else 0)
        self._ballast_states: dict[int, bytearray] = {}  # slot -> its state under a ballast
        self.model_info = describe(
            self._model,
            self._ctx,
            self.tokenizer,
            name=model_name or path.stem,
            num_slots=num_slots,
            snapshots=self._states.capacity,
            pooling=pooling,
            buffers=buffers,
            layout=layout,
            adapters=tuple(self.lora.adapters),
            kv_types=kv_types,
        )
        self._snapshot_bytes = self._recurrent_state_bytes() if self._states.capacity else 0
        logger.info(
            "loaded %s: %d slots × %d tokens, batch %d, %d threads, flash_attn=%s; %s; CPU "
            "features: %s%s",
            path.name,
            num_slots,
            self.model_info.max_seq_len,
            max_batch_tokens,
            threads,
            flash_attn,
            self.model_info.compute.kernels,
            " ".join(self.model_info.compute.cpu_features),
            "" if rope == MODEL_ROPE else f"; RoPE laid over the file's: {rope}",
        )

    @property
    def paged_kv(self) -> None:
        return None  # one KV stream per slot

    # ---- AdapterRunner (GGUF LoRA) ------------------------------------------------------------

    @property
    def adapters(self) -> list[AdapterInfo]:
        return self.lora.adapters

    def load_adapter(self, name: str, path: Path) -> AdapterInfo:
        return self.lora.load(name, path)

    def unload_adapter(self, name: str) -> AdapterInfo:
        return self.lora.unload(self._ctx, name)

    def add_sequence(
        self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None
    ) -> None:
        self.remove_sequence(slot)  # sampler state only; the engine has set up the KV
        if params.needs_sampler_chain and not params.embed:
            self._chains[slot] = build_chain(
                self._vocab,
                self._n_vocab,
                params,
                prompt_token_ids,
                seed,
                self.model_info.max_seq_len,
            )
        self._params[slot] = params

    # ---- StateSnapshots (hybrid models) -----------------------------------------------------

    @property
    def snapshot_capacity(self) -> int:
        return self._states.capacity

    @property
    def snapshot_bytes(self) -> int:
        return self._snapshot_bytes

    def save_state(self, slot: int, position: int, snapshot: int) -> None:
        assert position % FA_TILE_Q == 0  # where a chunk computes as a longer one would
        self._states.ask(slot, position, snapshot)

    def restore_state(self, slot: int, snapshot: int) -> None:
        self._states.restore(slot, snapshot)

    def _recurrent_state_bytes(self) -> int:
        """One sequence's recurrent state as llama.cpp serialises it, measured after one token
        (an empty sequence serialises no state)."""
        self._decode([ScheduledChunk(0, [0], 0, False)])
        size = int(llama.llama_state_seq_get_size_ext(self._ctx, 0, RECURRENT_PART))
        self.trim_kv(0, 0)
        return size

    # ---- forward ----------------------------------------------------------------------------

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        sampled: dict[int, list[SampledToken]] = {}
        for pieces in self._states.rounds(chunks):
            sampled.update(self._execute_round(pieces))
            if self._states.pending:
                self._states.take(pieces)
        return sampled

    def _execute_round(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        sampled: dict[int, list[SampledToken]] = {}
        for group in decode_groups(chunks):
            decoding = len(group[0].token_ids) == 1
            sampled.update(self._decode(group, self._ballast_for(group) if decoding else []))
        return sampled

    def _ballast_for(self, group: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
        ballast = ballast_for(
            group, self.model_info.num_slots, self.model_info.max_seq_len, self.kv_tokens
        )
        for extra in ballast:
            if self._hybrid and extra.start_pos:  # its recurrent state cannot be trimmed
                self._ballast_states[extra.slot] = self._states.read(extra.slot, RECURRENT_PART)
        return ballast

    def _decode(
        self, chunks: Sequence[ScheduledChunk], ballast: Sequence[ScheduledChunk] = ()
    ) -> dict[int, list[SampledToken]]:
        self.lora.activate(self._ctx, chunks[0].adapter)  # one adapter a call (decode_groups)
        rows = self._batch.fill([*chunks, *ballast])
        pooled = [(chunk, self._pools.rows(chunk)) for chunk in chunks if chunk.embed]
        # Embeddings only for the calls whose rows are pooled: llama.cpp then outputs every
        # row, logits too (the same values as without), at the cost of the vocabulary
        # projection of every row.
        embeddings = any(rows is not None for _, rows in pooled)
        if embeddings:
            self._batch.output_every_row(rows.count)
            llama.llama_set_embeddings(self._ctx, True)
        started = time.perf_counter()
        try:
            status = llama.llama_decode(self._ctx, self._batch.raw)
        finally:
            self._stream_copy_sources.clear()  # llama_decode made the copies first
            if embeddings:
                llama.llama_set_embeddings(self._ctx, False)
        self.forward_seconds += time.perf_counter() - started
        for extra in ballast:
            state = self._ballast_states.pop(extra.slot, None)
            if state is not None:
                self._states.write(extra.slot, state, RECURRENT_PART)
            self._cut_stream(extra.slot, extra.start_pos)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        if pooled:
            self._pool(pooled, rows.firsts, rows.count)
        for chunk, first in rows.scoring:
            top = self._params[chunk.slot].prompt_logprobs or 0
            self._prompt_logprobs.setdefault(chunk.slot, []).extend(
                with_logprobs(target, self._logits_at(first + i), top)
                for i, target in enumerate(chunk.prompt_logprob_targets)
            )
        return {chunk.slot: self._sample_in_order(chunk, row) for chunk, row in rows.sampling}

    def take_prompt_logprobs(self) -> dict[int, list[SampledToken]]:
        scored, self._prompt_logprobs = self._prompt_logprobs, {}
        return scored

    def _pool(
        self,
        pooled: Sequence[tuple[ScheduledChunk, tuple[int, int] | None]],
        firsts: dict[int, int],
        num_rows: int,
    ) -> None:
        """Hands each embedding chunk's rows (every row was an output) to the pools."""
        hidden = None
        if any(rows is not None for _, rows in pooled):
            pointer = llama.llama_get_embeddings(self._ctx)
            hidden = np.ctypeslib.as_array(pointer, shape=(num_rows, self._n_embd))
        for chunk, rows in pooled:
            at = firsts[chunk.slot]
            part = None if rows is None or hidden is None else hidden[at + rows[0] : at + rows[1]]
            self._pools.add(chunk, part)

    def take_embeddings(self) -> dict[int, list[float]]:
        return self._pools.take()

    def _logits_at(self, batch_row: int) -> np.ndarray[Any, Any]:
        return np.ctypeslib.as_array(
            llama.llama_get_logits_ith(self._ctx, batch_row), shape=(self._n_vocab,)
        )

    def _sample_in_order(self, chunk: ScheduledChunk, first_row: int) -> list[SampledToken]:
        """The chunk's samples position by position, stopping at the first that differs from
        the draft after it (``ScheduledChunk``): the sampler chain accepts only produced tokens."""
        tokens: list[SampledToken] = []
        drafts = list(chunk.token_ids[len(chunk.token_ids) - chunk.num_drafts :])
        for depth in range(chunk.num_drafts + 1):
            token = self._sample(chunk.slot, first_row + depth, chunk.allowed_tokens)
            tokens.append(token)
            if depth == chunk.num_drafts or token.token_id != drafts[depth]:
                break
        return tokens

    def remove_sequence(self, slot: int) -> None:
        chain = self._chains.pop(slot, None)
        if chain is not None:
            llama.llama_sampler_free(chain)
        self._params.pop(slot, None)
        self._pools.forget(slot)

    def copy_kv(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        # Between streams llama.cpp copies only whole sequences: the cell metadata now, the
        # buffers at the start of the next llama_decode, in call order. Trimming the copy is
        # metadata only, so a later copy out of or into either slot in the same step is safe.
        llama.llama_memory_seq_cp(self._memory, src_slot, dst_slot, -1, -1)
        self._stream_copy_sources.add(src_slot)
        self.trim_kv(dst_slot, num_tokens)

    def save_kv(self, slot: int) -> bytearray:
        return self._states.read(slot)

    def kv_fingerprint(self) -> str:
        # A state holds every stream's cell layout and the KV as this context stores it.
        info = self.model_info
        return ";".join(
            (
                "llama.cpp",
                llama.__version__,
                weights_fingerprint(self._model_path),
                f"slots={info.num_slots}",
                f"ctx={info.max_seq_len}",
                f"flash_attn={self._flash_attn}",
            )
        )

    def restore_kv(self, slot: int, data: bytearray) -> bool:
        # The state is written into the stream at once, while a copy out of it waits for the
        # next llama_decode: overwriting such a stream would hand the copy the wrong KV.
        if slot in self._stream_copy_sources:
            return False
        if not self._states.write(slot, data):  # llama.cpp has emptied the sequence
            logger.warning("llama.cpp could not restore a saved state into sequence %d", slot)
            return False
        return True

    def trim_kv(self, slot: int, num_tokens: int) -> None:
        self._states.forget(slot)  # the saves asked for by the sequence the slot held
        self._cut_stream(slot, num_tokens)

    def _cut_stream(self, slot: int, num_tokens: int) -> None:
        if not llama.llama_memory_seq_rm(self._memory, slot, num_tokens, -1):
            raise RuntimeError(f"llama.cpp refused to trim sequence {slot} to {num_tokens}")

    def kv_tokens(self, slot: int) -> int:
        first = llama.llama_memory_seq_pos_min(self._memory, slot)
        last = llama.llama_memory_seq_pos_max(self._memory, slot)
        if last < 0:
            return 0
        # A recurrent state is one cell at the sequence's last position: a hybrid model's
        # first position is that cell's.
        if first != 0 and not (self._hybrid and first == last):
            raise RuntimeError(f"sequence {slot} holds positions {first}..{last}, not from 0")
        return int(last) + 1

    def reserve_kv(self, slot: int, num_tokens: int) -> bool:
        # Every slot owns a stream of max_seq_len cells; requests were checked against it.
        return num_tokens <= self.model_info.max_seq_len

    def kv_used_tokens(self, slots: Collection[int]) -> int:
        return sum(self.kv_tokens(slot) for slot in slots)

    def close(self) -> None:
        for slot in list(self._chains):
            self.remove_sequence(slot)
        if self._ctx:
            self._batch.free()
            llama.llama_free(self._ctx)
            llama.llama_model_free(self._model)
            self._ctx = None
            self._model = None

    def _sample(
        self, slot: int, batch_row: int, allowed: np.ndarray[Any, Any] | None
    ) -> SampledToken:
        logits = self._logits_at(batch_row)
        # One pass: NaN and infinities both make the sum non-finite (finite logits are far
        # too small to overflow it). Broken weights or a device fault must not become tokens.
        if not math.isfinite(float(logits.sum())):
            raise RunnerFailure(f"non-finite logits for sequence {slot}")
        chain = self._chains.get(slot)
        return sample_row(self._ctx, batch_row, logits, self._params[slot], chain, allowed)
