"""What the API process keeps of a GGUF model when the llama.cpp runner lives in the engine
process: its vocabulary alone (llama.cpp's ``vocab_only`` load reads no weights), for the
tokenizer."""

from __future__ import annotations

from pathlib import Path

import llama_cpp as llama

from slotserve.runners.llama_cpp_runner import init_llama_backend
from slotserve.runners.llama_cpp_tokenizer import LlamaCppTokenizer


class LlamaCppFrontend:
    def __init__(self, model_path: Path) -> None:
        init_llama_backend()
        params = llama.llama_model_default_params()
        params.vocab_only = True
        params.n_gpu_layers = 0
        self._model = llama.llama_model_load_from_file(str(model_path).encode(), params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not read the vocabulary of {model_path}")
        self._vocab = llama.llama_model_get_vocab(self._model)
        self._tokenizer = LlamaCppTokenizer(self._vocab)

    @property
    def tokenizer(self) -> LlamaCppTokenizer:
        return self._tokenizer

    def close(self) -> None:
        if self._model:
            llama.llama_model_free(self._model)
            self._model = None
