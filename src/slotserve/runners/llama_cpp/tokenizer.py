"""Tokenizer over a llama.cpp vocabulary (the model's own, from the GGUF)."""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as llama


class LlamaCppTokenizer:
    def __init__(self, vocab: Any) -> None:
        self._vocab = vocab
        self.vocab_size: int = llama.llama_vocab_n_tokens(vocab)
        # Output text is built from these bytes on the engine's hot path: one table lookup per
        # token instead of one C call.
        self._output_bytes = [self._piece(t, special=False) for t in range(self.vocab_size)]
        self._display_text: dict[int, str] = {}
        self.eog_token_ids = frozenset(
            t for t in range(self.vocab_size) if llama.llama_vocab_is_eog(vocab, t)
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buffer = (llama.llama_token * capacity)()
        count = llama.llama_tokenize(
            self._vocab, data, len(data), buffer, capacity, add_special_tokens, True
        )
        if count < 0:  # buffer too small: -count is the size needed
            capacity = -count
            buffer = (llama.llama_token * capacity)()
            count = llama.llama_tokenize(
                self._vocab, data, len(data), buffer, capacity, add_special_tokens, True
            )
        return list(buffer[:count])

    def token_bytes(self, token_id: int) -> bytes:
        return self._output_bytes[token_id]

    def token_text(self, token_id: int) -> str:
        text = self._display_text.get(token_id)
        if text is None:
            text = self._piece(token_id, special=True).decode("utf-8", errors="replace")
            self._display_text[token_id] = text
        return text

    def special_token_text(self, token_id: int) -> str:
        if token_id < 0:
            return ""
        return self._piece(token_id, special=True).decode("utf-8", errors="replace")

    def _piece(self, token_id: int, special: bool) -> bytes:
        buffer = ctypes.create_string_buffer(64)
        size = llama.llama_token_to_piece(self._vocab, token_id, buffer, 64, 0, special)
        if size < 0:
            buffer = ctypes.create_string_buffer(-size)
            size = llama.llama_token_to_piece(self._vocab, token_id, buffer, -size, 0, special)
        return buffer.raw[:size]
