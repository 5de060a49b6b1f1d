"""R1: the llama.cpp runner, over llama-cpp-python's low-level C bindings.

One model, one context with ``n_seq_max = num_slots``; a slot's index is its llama.cpp
sequence id. Each step fills one ``llama_batch`` with every scheduled chunk and calls
``llama_decode`` once.

KV layout: ``kv_unified = false`` gives each sequence its own KV stream of
``ctx_size / num_slots`` cells. With a unified cache a neighbour's long prefill chunk
interleaves its cells with ours and changes the attention's rounding, which breaks batch
invariance (SPEC E4); separate streams keep every sequence's attention the same alone or
batched. The price: one sequence can use at most ``ctx_size / num_slots`` tokens, and sharing
a prefix between slots copies KV between streams instead of sharing cells (ARCHITECTURE.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp as llama
import numpy as np

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import ModelInfo, ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams, StructuredOutput
from slotserve.runners.llama_cpp_sampling import build_chain, grammar_for
from slotserve.runners.llama_cpp_tokenizer import LlamaCppTokenizer

logger = logging.getLogger(__name__)


@functools.cache
def init_llama_backend() -> None:
    """Initialises llama.cpp once per process, with its logging routed to ours."""
    llama.llama_log_set(_silence_log, ctypes.c_void_p(0))
    llama.llama_backend_init()


_GGML_LOG_WARN, _GGML_LOG_ERROR = 3, 4


@llama.llama_log_callback  # type: ignore[untyped-decorator]
def _silence_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Routes llama.cpp's warnings and errors to our logger; drops its chatty info lines."""
    if level in (_GGML_LOG_WARN, _GGML_LOG_ERROR):
        message = text.decode("utf-8", errors="replace").rstrip()
        if message:
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
    ) -> None:
        init_llama_backend()
        path = Path(model_path)
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = llama.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load the model at {path}")
        n_ctx_train = llama.llama_model_n_ctx_train(self._model)
        if ctx_size <= 0:
            ctx_size = num_slots * min(n_ctx_train, 4096)
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
        self._decode_seconds = 0.0
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
            equal_prefill_chunks=True,
        )
        logger.info(
            "loaded %s: %d slots × %d tokens, batch %d, %d threads, flash_attn=%s",
            path.name,
            num_slots,
            max_seq_len,
            max_batch_tokens,
            threads,
            flash_attn,
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

    def check_structured_output(self, spec: StructuredOutput) -> None:
        grammar = grammar_for(spec)
        sampler = llama.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
        if not sampler:
            raise InvalidRequestError("The grammar could not be parsed.", param="response_format")
        llama.llama_sampler_free(sampler)

    def add_sequence(
        self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None
    ) -> None:
        self.remove_sequence(slot)
        if params.needs_sampler_chain:
            self._chains[slot] = build_chain(
                self._vocab,
                self._n_vocab,
                params,
                prompt_token_ids,
                seed,
                self._info.max_seq_len,
            )
        self._params[slot] = params

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, SampledToken]:
        batch = self._batch
        row = 0
        sample_rows: list[tuple[int, int]] = []  # (slot, batch row)
        # NOTE: with per-sequence KV streams llama.cpp builds each sub-batch from a run of
        # consecutive sequence ids, starting at the batch's first unused token: slot order
        # keeps the number of sub-batches (one weight pass each) down.
        for chunk in sorted(chunks, key=lambda c: c.slot):
            size = len(chunk.token_ids)
            end = row + size
            if end > self._capacity:
                raise ValueError(f"batch of {end} tokens exceeds capacity {self._capacity}")
            self._tokens[row:end] = chunk.token_ids
            self._positions[row:end] = np.arange(chunk.start_pos, chunk.start_pos + size)
            self._wants_logits[row:end] = 0
            for i in range(row, end):
                self._seq_id_rows[i][0] = chunk.slot
            if chunk.sample:
                self._wants_logits[end - 1] = 1
                sample_rows.append((chunk.slot, end - 1))
            row = end
        self._n_seq_ids[:row] = 1
        batch.n_tokens = row
        started = time.perf_counter()
        status = llama.llama_decode(self._ctx, batch)
        self._decode_seconds += time.perf_counter() - started
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return {slot: self._sample(slot, batch_row) for slot, batch_row in sample_rows}

    def remove_sequence(self, slot: int) -> None:
        chain = self._chains.pop(slot, None)
        if chain is not None:
            llama.llama_sampler_free(chain)
        self._params.pop(slot, None)
        llama.llama_memory_seq_rm(self._memory, slot, -1, -1)

    def close(self) -> None:
        for slot in list(self._chains):
            self.remove_sequence(slot)
        if self._ctx:
            llama.llama_batch_free(self._batch)
            llama.llama_free(self._ctx)
            llama.llama_model_free(self._model)
            self._ctx = None
            self._model = None

    def _sample(self, slot: int, batch_row: int) -> SampledToken:
        params = self._params[slot]
        chain = self._chains.get(slot)
        logits = np.ctypeslib.as_array(
            llama.llama_get_logits_ith(self._ctx, batch_row), shape=(self._n_vocab,)
        )
        if chain is None:
            token_id = int(logits.argmax())
        else:
            token_id = llama.llama_sampler_sample(chain, self._ctx, batch_row)
        if params.logprobs is None:
            return SampledToken(token_id)
        return _with_logprobs(token_id, logits, params.logprobs)


def _with_logprobs(token_id: int, logits: np.ndarray[Any, Any], top_k: int) -> SampledToken:
    """Log-probabilities under the model's raw distribution (before any sampling transform)."""
    shifted = logits.astype(np.float64) - float(logits.max())
    log_norm = float(np.log(np.exp(shifted).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if top_k > 0:
        best = np.argpartition(-shifted, top_k)[:top_k]
        best = best[np.argsort(-shifted[best], kind="stable")]
        top = tuple((int(t), float(shifted[t]) - log_norm) for t in best)
    return SampledToken(token_id, float(shifted[token_id]) - log_norm, top)
