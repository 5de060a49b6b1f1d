"""A checkpoint, as the load plan reads it: an HF folder (``hf_folder.py``) or a GGUF file
(``gguf_file.py``). Each says the same things its own way: its configuration, read by its
family (``families/registry.py``) and refused before any weight is read when no family serves
it; its weights under HF names; its tokenizer; its recommended sampling; its pooling; a
vision-language family's images. The plan asks, never which kind it holds."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from slotserve.engine.sampling_defaults import SamplingDefaults
from slotserve.runners.pytorch.families.vision.base import Vision
from slotserve.runners.pytorch.load.gguf_file import GgufFile
from slotserve.runners.pytorch.load.hf_folder import HfFolder
from slotserve.runners.pytorch.load.tokenizer import HfTokenizer
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.quant.tensor import QuantTensor


class Checkpoint(Protocol):
    """Nothing is read until it is asked for."""

    @property
    def path(self) -> Path: ...

    @property
    def name(self) -> str: ...

    @property
    def raw_config(self) -> Mapping[str, Any]:
        """``config.json`` as it stands (a GGUF file: empty): a classifier head's keys."""
        ...

    @property
    def config(self) -> ModelConfig:
        """The decoder's shape, checked (``UnsupportedModelError`` for no family's)."""
        ...

    @property
    def vision(self) -> Vision | None:
        """A vision-language checkpoint's images, from its family's record."""
        ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight under its HF name, one at a time."""
        ...

    def quantized_tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """As :meth:`tensors`, the matrices the quantized kernels multiply as stored kept as
        their blocks (only where :meth:`quantized_types` names any)."""
        ...

    def quantized_types(self) -> set[str]:
        """The block types of its matrices as stored (an HF folder's: its 4-bit weights')."""
        ...

    def tokenizer(self) -> HfTokenizer: ...

    def sampling_defaults(self) -> SamplingDefaults:
        """The checkpoint's recommended sampling over vLLM's neutral defaults."""
        ...

    def pooling(self) -> str | None:
        """The pooling a sentence-transformers folder names, if any."""
        ...


def open_checkpoint(path: Path, overrides: str | None = None) -> Checkpoint:
    """``path``: a ``.gguf`` file, or an HF folder; ``overrides``: ``--hf-overrides``."""
    return GgufFile(path, overrides) if path.is_file() else HfFolder(path, overrides)


def read_model_config(path: Path, overrides: str | None = None) -> ModelConfig:
    """The checkpoint's configuration, checked, without reading a weight."""
    return open_checkpoint(path, overrides).config


def sampling_defaults(path: Path) -> SamplingDefaults:
    return open_checkpoint(path).sampling_defaults()
