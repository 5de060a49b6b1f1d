"""The llama.cpp runner, over llama-cpp-python's low-level C bindings.

One model, one context with ``n_seq_max = num_slots``; a slot's index is its llama.cpp
sequence id. Each step fills one ``llama_batch`` with every scheduled chunk and calls
``llama_decode`` once.

KV layout: ``kv_unified = false`` gives each sequence its own KV stream of
``ctx_size / num_slots`` cells. With a unified cache a neighbour's long prefill chunk
interleaves its cells with ours and changes the attention's rounding, which breaks batch
invariance; separate streams keep every sequence's attention the same alone or
batched. The price: one sequence can use at most ``ctx_size / num_slots`` tokens, and sharing
a prefix between slots copies KV between streams instead of sharing cells
(docs/design/batch-invariance.md):
``llama_memory_seq_cp`` between streams copies the whole stream buffer (a few ms), then
``llama_memory_seq_rm`` trims the copy to the shared prefix.

Hybrid models (attention beside recurrent layers: Qwen3.5's Gated DeltaNet, Mamba...): a
sequence's recurrent state covers all its positions and cannot be trimmed to fewer, so the
prefix cache keeps copies of it taken at chosen positions (:class:`StateSnapshots`), in host
memory as llama.cpp serialises a sequence's recurrent part alone. A state exists only after a
whole ``llama_decode``, so a chunk is cut where one is wanted; cuts fall on the 64-token grid
anchored at position 0, where a chunk computes its tokens as a longer one would.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import llama_cpp as llama
import numpy as np

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.decoding.structured_output import allowed_mask
from slotserve.engine.errors import RunnerFailure
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import (
    RECURRENT_STATE_NO_ROLLBACK,
    ComputePath,
    ModelInfo,
    ScheduledChunk,
    VerifyCost,
)
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.fingerprint import weights_fingerprint
from slotserve.runners.llama_cpp.cpu import (
    BUFFER_LOG,
    choose_weight_layout,
    cpu_features,
    extra_buffer_types,
)
from slotserve.runners.llama_cpp.metadata import kv_shape, pooling_of, sampling_defaults
from slotserve.runners.llama_cpp.sampling import build_chain, with_logprobs
from slotserve.runners.llama_cpp.tokenizer import LlamaCppTokenizer
from slotserve.runners.pooling import PromptPools

logger = logging.getLogger(__name__)


def default_ctx_size(num_slots: int, n_ctx_train: int) -> int:
    """``--ctx-size 0``: every slot gets the trained context, at most 4096 tokens."""
    return num_slots * min(n_ctx_train, 4096)


@functools.cache
def init_llama_backend() -> None:
    """Initialises llama.cpp once per process, with its logging routed to ours."""
    llama.llama_log_set(_silence_log, ctypes.c_void_p(0))
    llama.llama_backend_init()


_GGML_LOG_WARN, _GGML_LOG_ERROR = 3, 4

# ggml's CPU flash attention switches to 64-query tiles at 64 queries of one sequence
# (GGML_FA_TILE_Q): the grain of this runner's chunk policy (why: engine/chunk_policy.py).
_FA_TILE_Q = 64
# ggml takes its split-KV decode path from 512 KV cells, and llama.cpp pads a stream's cells
# to multiples of 256: a lone query at position 256 or later can take it (margin of one).
_SPLIT_KV_CONTEXT = 255
# A sequence's state without its attention KV: the recurrent layers' (hybrid models).
_RECURRENT_PART = llama.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


@llama.llama_log_callback  # type: ignore[untyped-decorator]
def _silence_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Routes llama.cpp's warnings and errors to our logger; drops its chatty info lines but
    for the weight buffers a load reports."""
    message = text.decode("utf-8", errors="replace").rstrip()
    BUFFER_LOG.feed(message)
    if level in (_GGML_LOG_WARN, _GGML_LOG_ERROR) and message:
        logger.log(
            logging.WARNING if level == _GGML_LOG_WARN else logging.ERROR,
            "llama.cpp: %s",
            message,
        )


class LlamaCppRunner:
    """Runs a GGUF model on llama.cpp; see :class:`slotserve.engine.runner_interface.Runner`."""

    def __init__(
        self,
        model_path: str | Path,
        num_slots: int,
        ctx_size: int,
        max_batch_tokens: int,
        n_threads: int | None = None,
        flash_attn: bool = True,
        model_name: str | None = None,
        state_snapshots: int = 0,
        repack: str = "auto",
    ) -> None:
        init_llama_backend()
        path = Path(model_path)
        layout = choose_weight_layout(repack, extra_buffer_types())
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model_params.use_extra_bufts = layout.use_extra_buffers
        with BUFFER_LOG.recording() as buffers:
            self._model = llama.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load the model at {path}")
        n_ctx_train = llama.llama_model_n_ctx_train(self._model)
        if ctx_size <= 0:
            ctx_size = default_ctx_size(num_slots, n_ctx_train)
        threads = n_threads or os.cpu_count() or 1
        ctx_params = llama.llama_context_default_params()
        ctx_params.n_ctx = ctx_size
        ctx_params.n_batch = max_batch_tokens
        ctx_params.n_ubatch = max_batch_tokens
        ctx_params.n_seq_max = num_slots
        ctx_params.kv_unified = False
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        ctx_params.no_perf = True
        # Per-token embeddings, pooled here: llama.cpp's own pooling works per batch, while a
        # prompt may span several chunks (runners/pooling.py).
        ctx_params.pooling_type = llama.LLAMA_POOLING_TYPE_NONE
        ctx_params.flash_attn_type = (
            llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if flash_attn
            else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        self._ctx = llama.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            llama.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not create a context of {ctx_size} tokens")
        self._memory = llama.llama_get_memory(self._ctx)
        self._vocab = llama.llama_model_get_vocab(self._model)
        self._tokenizer = LlamaCppTokenizer(self._vocab)
        self._n_vocab = self._tokenizer.vocab_size
        self._capacity = max_batch_tokens
        self._batch = llama.llama_batch_init(max_batch_tokens, 0, 1)
        # Writing through numpy views of the batch's C arrays costs one copy per chunk.
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(max_batch_tokens,))
        self._positions = np.ctypeslib.as_array(self._batch.pos, shape=(max_batch_tokens,))
        self._n_seq_ids = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(max_batch_tokens,))
        self._wants_logits = np.ctypeslib.as_array(self._batch.logits, shape=(max_batch_tokens,))
        self._seq_id_rows = [self._batch.seq_id[i] for i in range(max_batch_tokens)]
        self._chains: dict[int, Any] = {}
        self._params: dict[int, SamplingParams] = {}
        self._prompt_logprobs: dict[int, list[SampledToken]] = {}  # by slot, see the Runner
        pooling = pooling_of(self._model)
        self._pools = PromptPools(pooling)
        self._n_embd = llama.llama_model_n_embd(self._model)
        self._decode_seconds = 0.0
        self._model_path = path
        self._flash_attn = flash_attn
        self._stream_copy_sources: set[int] = set()  # slots a pending stream copy reads
        self._hybrid = bool(llama.llama_model_is_hybrid(self._model))
        # Recurrent-state snapshots by place, and the saves asked for: {slot: {position: place}}.
        snapshots = state_snapshots if self._hybrid else 0
        self._snapshots: list[bytearray | None] = [None] * snapshots
        self._pending_saves: dict[int, dict[int, int]] = {}
        self._ballast_states: dict[int, bytearray] = {}  # slot -> its state under a ballast
        max_seq_len = llama.llama_n_ctx_seq(self._ctx)
        template = llama.llama_model_chat_template(self._model, None)
        self._info = ModelInfo(
            name=model_name or path.stem,
            vocab_size=self._n_vocab,
            num_slots=num_slots,
            max_seq_len=max_seq_len,
            eog_token_ids=self._tokenizer.eog_token_ids,
            chat_template=template.decode("utf-8") if template else None,
            bos_token=self._tokenizer.special_token_text(llama.llama_vocab_bos(self._vocab)),
            eos_token=self._tokenizer.special_token_text(llama.llama_vocab_eos(self._vocab)),
            runner="llama.cpp",
            chunk_policy=ChunkPolicy(
                grain=_FA_TILE_Q,
                equal_chunks=True,
                anchored=self._hybrid,
                odd_part_alone=self._hybrid,
            ),
            kv_bytes_per_token=kv_shape(self._model).bytes_per_token,
            prefix_cache_unsupported=self._why_no_prefix_sharing(),
            speculative_unsupported=(
                RECURRENT_STATE_NO_ROLLBACK
                if llama.llama_model_is_recurrent(self._model)
                or llama.llama_model_is_hybrid(self._model)
                else None
            ),
            # ggml's CPU matmuls for these quantised types cost about as much per token in a
            # chunk as alone: each draft adds half a step (benchmarks/verify_cost.py). A lone
            # decode past _SPLIT_KV_CONTEXT carries a ballast token a first draft can replace.
            verify_cost=VerifyCost(0.39, 0.5, _SPLIT_KV_CONTEXT if num_slots > 1 else None),
            sampling_defaults=sampling_defaults(self._model),
            pooling=pooling,
            compute=ComputePath(
                cpu_features=cpu_features(),
                kernels=f"ggml; weights in {', '.join(buffers) or 'no'} buffers "
                f"(extra buffer types {'on' if layout.use_extra_buffers else 'off'}: "
                f"{layout.reason})",
            ),
        )
        self._snapshot_bytes = self._recurrent_state_bytes() if snapshots else 0
        logger.info(
            "loaded %s: %d slots × %d tokens, batch %d, %d threads, flash_attn=%s; %s; CPU "
            "features: %s",
            path.name,
            num_slots,
            max_seq_len,
            max_batch_tokens,
            threads,
            flash_attn,
            self._info.compute.kernels,
            " ".join(self._info.compute.cpu_features),
        )

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    @property
    def tokenizer(self) -> LlamaCppTokenizer:
        return self._tokenizer

    @property
    def forward_seconds(self) -> float:
        return self._decode_seconds

    @property
    def paged_kv(self) -> None:
        return None  # one KV stream per slot

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
                self._info.max_seq_len,
            )
        self._params[slot] = params

    # ---- StateSnapshots (hybrid models) -----------------------------------------------------

    @property
    def snapshot_capacity(self) -> int:
        return len(self._snapshots)

    @property
    def snapshot_bytes(self) -> int:
        return self._snapshot_bytes

    def save_state(self, slot: int, position: int, snapshot: int) -> None:
        assert 0 <= snapshot < self.snapshot_capacity and position % _FA_TILE_Q == 0
        self._pending_saves.setdefault(slot, {})[position] = snapshot

    def restore_state(self, slot: int, snapshot: int) -> None:
        # Read at once: the slot's stream can then be trimmed to the snapshot's position.
        data = self._snapshots[snapshot]
        assert data is not None, f"snapshot {snapshot} was never taken"
        if not self._set_state(slot, data, _RECURRENT_PART):
            raise RuntimeError(f"llama.cpp could not restore a snapshot into sequence {slot}")

    def _recurrent_state_bytes(self) -> int:
        """One sequence's recurrent state as llama.cpp serialises it, measured after one token
        (an empty sequence serialises no state)."""
        self._decode([ScheduledChunk(0, [0], 0, False)])
        size = int(llama.llama_state_seq_get_size_ext(self._ctx, 0, _RECURRENT_PART))
        self.trim_kv(0, 0)
        return size

    def _rounds(self, chunks: Sequence[ScheduledChunk]) -> list[list[ScheduledChunk]]:
        """The step's chunks, cut where a snapshot is wanted inside one: the pieces before
        each cut run in earlier rounds (one ``llama_decode`` per length and round)."""
        if not self._pending_saves:
            return [list(chunks)]
        rounds: list[list[ScheduledChunk]] = []
        for chunk in chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            wanted = self._pending_saves.get(chunk.slot, {})
            cuts = sorted(p for p in wanted if chunk.start_pos < p < end)
            for depth, piece in enumerate(_cut(chunk, cuts)):
                if depth == len(rounds):
                    rounds.append([])
                rounds[depth].append(piece)
        return rounds

    def _take_snapshots(self, chunks: Sequence[ScheduledChunk]) -> None:
        for chunk in chunks:
            wanted = self._pending_saves.get(chunk.slot)
            if not wanted:
                continue
            end = chunk.start_pos + len(chunk.token_ids)
            snapshot = wanted.pop(end, None)
            if snapshot is not None:
                self._snapshots[snapshot] = self._state_of(chunk.slot, _RECURRENT_PART)
            # A position passed would leave its place unwritten: the cache asks only ahead.
            assert all(p > end for p in wanted), f"slot {chunk.slot}: {sorted(wanted)} passed"
            if not wanted:
                del self._pending_saves[chunk.slot]

    # ---- forward ----------------------------------------------------------------------------

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        sampled: dict[int, list[SampledToken]] = {}
        for pieces in self._rounds(chunks):
            sampled.update(self._execute_round(pieces))
            if self._pending_saves:
                self._take_snapshots(pieces)
        return sampled

    def _execute_round(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        # One llama_decode per chunk length. With per-sequence KV streams llama.cpp cuts a
        # batch into sub-batches taking the same number of tokens from each of a run of
        # consecutive sequence ids, so chunks of different lengths in one call would be cut
        # into pieces sized by their neighbours, and attention rounds differently in pieces
        # shorter than 64 tokens: a token's result would depend on what ran beside it.
        # Grouped by length, every chunk runs whole or in pieces of 64 or more, in as many
        # weight passes as llama.cpp would have made anyway.
        by_length: dict[int, list[ScheduledChunk]] = {}
        for chunk in sorted(chunks, key=lambda c: c.slot):
            length = len(chunk.token_ids)
            # Multiples of 64 may share a call: llama.cpp's cuts then fall on multiples of 64.
            key = _FA_TILE_Q if length % _FA_TILE_Q == 0 else length
            by_length.setdefault(key, []).append(chunk)
        sampled: dict[int, list[SampledToken]] = {}
        for length, group in by_length.items():
            sampled.update(self._decode(group, self._ballast_for(group) if length == 1 else []))
        return sampled

    def _ballast_for(self, group: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
        """Throw-away tokens that keep one-token chunks off ggml's split-KV attention path.

        llama.cpp runs each run of consecutive sequence ids as its own sub-batch, and ggml's
        flash attention takes a split-KV path for a sub-batch of one query of one sequence
        over 512+ cells (padded from 256+ tokens of context), which rounds differently from
        the path batched decoding takes: a sequence decoding alone in its run would not match
        itself decoding beside others. For such a run, one token of a neighbouring slot
        joins it; it is removed from that slot's KV right after the forward. It costs about
        one token's compute (benchmarks/RESULTS.md); shorter contexts never need it.
        """
        taken = {chunk.slot for chunk in group}
        num_slots = self._info.num_slots
        ballast: list[ScheduledChunk] = []
        for chunk in sorted(group, key=lambda c: c.slot):
            slot = chunk.slot
            if chunk.start_pos < _SPLIT_KV_CONTEXT or slot - 1 in taken or slot + 1 in taken:
                continue
            for neighbour in (slot + 1, slot - 1):
                if 0 <= neighbour < num_slots and neighbour not in taken:
                    held = self.kv_tokens(neighbour)
                    if held < self._info.max_seq_len:  # a full slot cannot take a token
                        if self._hybrid and held:  # its recurrent state cannot be trimmed
                            self._ballast_states[neighbour] = self._state_of(
                                neighbour, _RECURRENT_PART
                            )
                        ballast.append(ScheduledChunk(neighbour, [0], held, False))
                        taken.add(neighbour)
                        break
        return ballast

    def _decode(
        self, chunks: Sequence[ScheduledChunk], ballast: Sequence[ScheduledChunk] = ()
    ) -> dict[int, list[SampledToken]]:
        batch = self._batch
        row = 0
        sampling: list[tuple[ScheduledChunk, int]] = []  # (chunk, batch row of its first sample)
        scoring: list[tuple[ScheduledChunk, int]] = []  # (chunk, its first row): prompt logprobs
        firsts: dict[int, int] = {}  # slot -> the batch row of its chunk's first token
        for chunk in sorted([*chunks, *ballast], key=lambda c: c.slot):
            size = len(chunk.token_ids)
            firsts[chunk.slot] = row
            end = row + size
            if end > self._capacity:
                raise ValueError(f"batch of {end} tokens exceeds capacity {self._capacity}")
            self._tokens[row:end] = chunk.token_ids
            self._positions[row:end] = np.arange(chunk.start_pos, chunk.start_pos + size)
            self._wants_logits[row:end] = 0
            for i in range(row, end):
                self._seq_id_rows[i][0] = chunk.slot
            if chunk.sample:  # the last position, and a verification chunk's draft positions
                self._wants_logits[end - 1 - chunk.num_drafts : end] = 1
                sampling.append((chunk, end - 1 - chunk.num_drafts))
            if chunk.prompt_logprob_targets:
                self._wants_logits[row : row + len(chunk.prompt_logprob_targets)] = 1
                scoring.append((chunk, row))
            row = end
        self._n_seq_ids[:row] = 1
        batch.n_tokens = row
        pooled = [(chunk, self._pools.rows(chunk)) for chunk in chunks if chunk.embed]
        # Embeddings only for the calls whose rows are pooled: llama.cpp then outputs every
        # row, logits too (the same values as without), at the cost of the vocabulary
        # projection of every row.
        embeddings = any(rows is not None for _, rows in pooled)
        if embeddings:
            self._wants_logits[:row] = 1
            llama.llama_set_embeddings(self._ctx, True)
        started = time.perf_counter()
        try:
            status = llama.llama_decode(self._ctx, batch)
        finally:
            self._stream_copy_sources.clear()  # llama_decode made the copies first
            if embeddings:
                llama.llama_set_embeddings(self._ctx, False)
        self._decode_seconds += time.perf_counter() - started
        for extra in ballast:
            state = self._ballast_states.pop(extra.slot, None)
            if state is not None:
                self._set_state(extra.slot, state, _RECURRENT_PART)
            self._cut_stream(extra.slot, extra.start_pos)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        if pooled:
            self._pool(pooled, firsts, row)
        for chunk, first in scoring:
            top = self._params[chunk.slot].prompt_logprobs or 0
            self._prompt_logprobs.setdefault(chunk.slot, []).extend(
                with_logprobs(target, self._logits_at(first + i), top)
                for i, target in enumerate(chunk.prompt_logprob_targets)
            )
        return {chunk.slot: self._sample_in_order(chunk, row) for chunk, row in sampling}

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
        return self._state_of(slot, 0)

    def _state_of(self, slot: int, flags: int) -> bytearray:
        size = llama.llama_state_seq_get_size_ext(self._ctx, slot, flags)
        data = bytearray(size)
        written = llama.llama_state_seq_get_data_ext(
            self._ctx, (ctypes.c_uint8 * size).from_buffer(data), size, slot, flags
        )
        if written != size:
            raise RuntimeError(f"llama.cpp wrote {written} of {size} bytes of sequence {slot}")
        return data

    def _set_state(self, slot: int, data: bytearray, flags: int) -> bool:
        size = len(data)
        read = llama.llama_state_seq_set_data_ext(
            self._ctx, (ctypes.c_uint8 * size).from_buffer(data), size, slot, flags
        )
        return bool(read)

    def kv_fingerprint(self) -> str:
        # A state holds every stream's cell layout and the KV as this context stores it.
        info = self._info
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
        if not self._set_state(slot, data, 0):  # llama.cpp has emptied the sequence
            logger.warning("llama.cpp could not restore a saved state into sequence %d", slot)
            return False
        return True

    def trim_kv(self, slot: int, num_tokens: int) -> None:
        self._pending_saves.pop(slot, None)  # asked for by the sequence the slot held
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
        return num_tokens <= self._info.max_seq_len

    def kv_used_tokens(self, slots: Collection[int]) -> int:
        return sum(self.kv_tokens(slot) for slot in slots)

    def close(self) -> None:
        for slot in list(self._chains):
            self.remove_sequence(slot)
        if self._ctx:
            llama.llama_batch_free(self._batch)
            llama.llama_free(self._ctx)
            llama.llama_model_free(self._model)
            self._ctx = None
            self._model = None

    def _why_no_prefix_sharing(self) -> str | None:
        model = self._model
        if self._hybrid and not self._snapshots:
            return (
                "the model's recurrent layers keep a state, which the cache keeps only as "
                "snapshots, and --prefix-cache-snapshots is 0"
            )
        if llama.llama_model_is_recurrent(model) and not self._hybrid:
            return "the model keeps recurrent state, which cannot be shared by position range"
        if llama.llama_model_n_swa(model) > 0:
            return "sliding-window layers discard early positions, so a prefix cannot be reused"
        return None

    def _sample(
        self, slot: int, batch_row: int, allowed: np.ndarray[Any, Any] | None
    ) -> SampledToken:
        params = self._params[slot]
        chain = self._chains.get(slot)
        logits = self._logits_at(batch_row)
        # One pass: NaN and infinities both make the sum non-finite (finite logits are far
        # too small to overflow it). Broken weights or a device fault must not become tokens.
        if not math.isfinite(float(logits.sum())):
            raise RunnerFailure(f"non-finite logits for sequence {slot}")
        raw = logits
        if allowed is not None:  # structured output: the sampler reads the buffer, masked here
            if params.logprobs is not None:
                raw = logits.copy()
            logits[~allowed_mask(allowed, self._n_vocab)] = -np.inf
        if chain is None:
            token_id = int(logits.argmax())
        else:
            token_id = llama.llama_sampler_sample(chain, self._ctx, batch_row)
        if params.logprobs is None:
            return SampledToken(token_id)
        return with_logprobs(token_id, raw, params.logprobs)


def _cut(chunk: ScheduledChunk, cuts: Sequence[int]) -> list[ScheduledChunk]:
    """``chunk`` as pieces ending at each of ``cuts`` (positions inside it) and at its end; the
    last piece samples, the others only compute (and score their prompt log-probabilities)."""
    pieces = []
    start = chunk.start_pos
    for cut in [*cuts, chunk.start_pos + len(chunk.token_ids)]:
        offset, size = start - chunk.start_pos, cut - start
        pieces.append(
            replace(
                chunk,
                token_ids=chunk.token_ids[offset : offset + size],
                start_pos=start,
                prompt_logprob_targets=chunk.prompt_logprob_targets[offset : offset + size],
            )
        )
        start = cut
    last = pieces[-1]
    pieces[:-1] = [
        replace(p, sample=False, num_drafts=0, allowed_tokens=None, embed_last=False)
        for p in pieces[:-1]
    ]
    return [*pieces[:-1], last]
