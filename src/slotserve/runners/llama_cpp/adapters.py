"""The GGUF LoRA adapters the llama.cpp runner holds (``--lora-modules``, loaded and unloaded at
run time), at most ``--max-loras`` at once.

llama.cpp applies adapters to a whole context, not per row, so the runner decodes the rows of
each adapter in calls of their own within a step (``runner.py``) and sets the context's
adapter before each call: requests with different adapters, or none, still share every step.
An adapter file is what llama.cpp's ``convert_lora_to_gguf.py`` writes from a PEFT folder
(``general.type`` ``adapter``, ``adapter.type`` ``lora``); llama.cpp itself refuses one made
for another architecture or with shapes of another model.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import llama_cpp as llama

from slotserve.engine.adapters import HeldAdapters
from slotserve.engine.runner_interface import AdapterInfo
from slotserve.runners.fingerprint import weights_fingerprint

logger = logging.getLogger(__name__)


def read_lora_gguf(path: Path) -> int:
    """The adapter's rank, from its GGUF header; raises ``ValueError`` for a file that is not
    a LoRA adapter."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises what it meets: a truncated header
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None
    fields = reader.fields

    def text(key: str) -> str | None:
        return str(fields[key].contents()) if key in fields else None

    if text("general.type") != "adapter" or text("adapter.type") != "lora":
        raise ValueError(
            f"{path} is not a GGUF LoRA adapter (general.type {text('general.type')!r}, "
            f"adapter.type {text('adapter.type')!r}); convert a PEFT folder with llama.cpp's "
            "convert_lora_to_gguf.py"
        )
    ranks = [int(t.shape[-1]) for t in reader.tensors if t.name.endswith(".lora_a")]
    if not ranks:
        raise ValueError(f"{path} holds no LoRA tensors")
    return max(ranks)  # a GGUF shape lists ggml's order: lora_a is (in, rank)


class GgufAdapters:
    def __init__(self, model: Any, max_loras: int, max_rank: int) -> None:
        self._model = model
        self.max_rank = max_rank
        self._held: HeldAdapters[Any] = HeldAdapters(max_loras)  # llama_adapter_lora_p by id
        self._active: int | None = None  # None: the context's adapters are not known

    @property
    def adapters(self) -> list[AdapterInfo]:
        return self._held.infos

    def load(self, name: str, path: Path) -> AdapterInfo:
        self._held.check_name(name)
        if not path.is_file() or path.suffix != ".gguf":
            raise ValueError(
                f"{path} is not a .gguf file: the llama.cpp runner takes GGUF LoRA adapters "
                "(a PEFT folder is served by --runner torch)"
            )
        rank = read_lora_gguf(path)
        if rank > self.max_rank:
            raise ValueError(f"{path.name} has rank {rank}, over --max-lora-rank {self.max_rank}")
        adapter_id = int(weights_fingerprint(path)[:12], 16) or 1
        info = AdapterInfo(name, adapter_id, rank, str(path))
        self._held.add(info, lambda: self._init(path))
        logger.info("LoRA adapter %s loaded from %s (rank %d)", name, path, rank)
        return info

    def _init(self, path: Path) -> Any:
        handle = llama.llama_adapter_lora_init(self._model, str(path).encode())
        if not handle:
            raise ValueError(
                f"llama.cpp refused the adapter {path.name}: made for another model "
                "(its architecture or tensor shapes differ; the log says which)"
            )
        return handle

    def unload(self, ctx: Any, name: str) -> AdapterInfo:
        info, handle = self._held.remove(name)  # KeyError: none has the name
        if handle is not None:
            self.activate(ctx, 0)  # the context must not hold an adapter being freed
            llama.llama_adapter_lora_free(handle)
        logger.info("LoRA adapter %s unloaded", name)
        return info

    def activate(self, ctx: Any, adapter_id: int) -> None:
        """Sets the context's adapter (0: none) before a decode of that adapter's rows."""
        if adapter_id == self._active:
            return
        if adapter_id:
            handles = (llama.llama_adapter_lora_p_ctypes * 1)(self._held.by_id[adapter_id])
            scales = (ctypes.c_float * 1)(1.0)  # the adapter's own alpha / rank applies
            status = llama.llama_set_adapters_lora(ctx, handles, 1, scales)
        else:
            status = llama.llama_set_adapters_lora(ctx, None, 0, None)
        if status != 0:
            raise RuntimeError(f"llama.cpp could not set LoRA adapter {adapter_id:x}: {status}")
        self._active = adapter_id
