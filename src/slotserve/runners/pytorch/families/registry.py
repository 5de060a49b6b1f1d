"""Every model family the PyTorch runner serves, in one table, and the lookups by HF
``model_type`` and GGUF architecture. Adding a family: its file, and a row here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slotserve.runners.pytorch.families import (
    bert,
    gemma3,
    llama,
    mistral,
    qwen2,
    qwen2_5_vl,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_vl,
    qwen3_vl_moe,
)
from slotserve.runners.pytorch.families.base import (
    EncoderFamily,
    Family,
    GgufKeys,
    HfConfig,
    gguf_common_keys,
    is_sequence_classifier,
)
from slotserve.runners.pytorch.families.vision.base import Vision
from slotserve.runners.pytorch.model.config import ModelConfig, UnsupportedModelError

FAMILIES: tuple[Family | EncoderFamily, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen2_5_vl.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    qwen3_5.FAMILY,
    qwen3_vl.FAMILY,
    qwen3_vl_moe.FAMILY,
    gemma3.FAMILY,
    bert.FAMILY,
)

DECODERS: dict[str, Family] = {
    t: f for f in FAMILIES if isinstance(f, Family) for t in f.model_types
}
ENCODERS: dict[str, EncoderFamily] = {
    t: f for f in FAMILIES if isinstance(f, EncoderFamily) for t in f.model_types
}
# GGUF architecture → (its family, the HF model_type its files are read as).
GGUF_ARCHITECTURES: dict[str, tuple[Family, str]] = {
    arch: (f, model_type)
    for f in DECODERS.values()
    for arch, model_type in f.gguf_architectures.items()
}


def family_of(config: ModelConfig) -> Family:
    return DECODERS[config.model_type]


def vision_of(raw: Mapping[str, Any]) -> Vision | None:
    """The images of a vision-language checkpoint (its ``config.json`` names a family's
    multimodal model type and has a ``vision_config``); None for any other."""
    model_type = raw.get("model_type")
    family = DECODERS.get(str(model_type))
    if family is None or model_type not in family.multimodal or "vision_config" not in raw:
        return None
    return family.vision


def with_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with ``overrides``' keys laid over it (``--hf-overrides``). A ``rope_scaling``
    given where the config keeps its rotary settings as transformers 5's ``rope_parameters``
    joins those, which would otherwise be read first (and hold its ``rope_theta``)."""
    merged = {**raw, **overrides}
    parameters = raw.get("rope_parameters")
    if "rope_scaling" in overrides and "rope_parameters" not in overrides and parameters:
        if "full_attention" not in parameters:
            merged["rope_parameters"] = {**parameters, **overrides["rope_scaling"]}
        else:  # per layer type (Gemma 3): the full-attention layers' settings
            full = {**parameters["full_attention"], **overrides["rope_scaling"]}
            merged["rope_parameters"] = {**parameters, "full_attention": full}
    return merged


def config_from_hf(
    raw: Mapping[str, Any], name: str, overrides: Mapping[str, Any] | None = None
) -> ModelConfig:
    """Validates an HF ``config.json`` (already parsed) without touching any weight;
    ``overrides`` (``--hf-overrides``) are laid over the decoder's settings (a multimodal
    checkpoint's ``text_config``)."""
    model_type = raw.get("model_type")
    family = DECODERS.get(str(model_type))
    if family is None:
        raise UnsupportedModelError(
            f"{name}: model_type {model_type!r} is not supported by the PyTorch runner; "
            f"supported: {', '.join(DECODERS)}"
        )
    if model_type in family.multimodal and "text_config" in raw:
        # A multimodal checkpoint: its text model (the head's tying is set at the top).
        tied = raw.get("tie_word_embeddings", raw["text_config"].get("tie_word_embeddings"))
        model_type = f"{model_type}_text"
        raw = {**raw["text_config"], "model_type": model_type}
        if tied is not None:
            raw["tie_word_embeddings"] = tied
    if overrides:
        raw = with_overrides(raw, overrides)
    if is_sequence_classifier(raw):
        # A sequence classifier has a score head instead of an LM head (``step/score_head.py``);
        # the head tied to the embeddings costs nothing and is never read.
        raw = {**raw, "tie_word_embeddings": True}
    return family.config(HfConfig(raw, name, str(model_type)))


def config_from_gguf(
    metadata: Mapping[str, Any], name: str, overrides: Mapping[str, Any] | None = None
) -> ModelConfig:
    """The same, from GGUF metadata (``general.architecture`` and ``<arch>.*`` keys): read as
    the ``config.json`` it was converted from."""
    arch = str(metadata.get("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{name}: GGUF architecture {arch!r} is not supported by the PyTorch runner "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))}); serve this file with "
            "the llama.cpp runner (--runner llama.cpp, or --runner auto)"
        )
    family, model_type = GGUF_ARCHITECTURES[arch]
    keys = GgufKeys(metadata, arch, name)
    raw = gguf_common_keys(keys, model_type)
    raw |= family.gguf_config(keys, raw)
    return config_from_hf(raw, name, overrides)
