"""BERT (``bert``), an encoder served for embeddings and, as a cross-encoder, for scores by
``encoder/runner.py``: its ``config.json`` keys, and the names its checkpoints give the weights
(under ``bert.`` in some; a cross-encoder's pooler and classifier too, see
``encoder/cross_encoder.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from slotserve.runners.pytorch.families.base import EncoderConfig, EncoderFamily

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _config(raw: Mapping[str, Any], name: str) -> EncoderConfig:
    problems = []
    if raw.get("position_embedding_type", "absolute") != "absolute":
        problems.append("only absolute position embeddings are supported")
    if str(raw.get("hidden_act", "gelu")) not in _ACTIVATIONS:
        problems.append(f"activation {raw.get('hidden_act')!r} is not supported")
    if int(raw.get("hidden_size", 0)) % max(int(raw.get("num_attention_heads", 1)), 1):
        problems.append("hidden_size is not a multiple of num_attention_heads")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))
    return EncoderConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_heads=int(raw["num_attention_heads"]),
        num_layers=int(raw["num_hidden_layers"]),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        activation=_ACTIVATIONS[str(raw.get("hidden_act", "gelu"))],
        max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
    )


def _weight_name(name: str) -> str | None:
    name = name.removeprefix("bert.")
    parts = ("embeddings.", "encoder.", "pooler.", "classifier.")
    used = name.startswith(parts) and not name.endswith("position_ids")
    return name if used else None


FAMILY = EncoderFamily(model_types=("bert",), config=_config, weight_name=_weight_name)
