"""What a model family is to the PyTorch runner, and the reading its families share.

A family is one record (:class:`Family`, or :class:`EncoderFamily` for an encoder) in its own
file, listed once in ``registry.py``. A decoder family turns its checkpoints' configuration
into a :class:`ModelConfig` through :meth:`HfConfig.decoder`, which reads the keys every family
shares; the family passes only the fields it reads differently. A GGUF file is read as the
``config.json`` it was converted from: :func:`gguf_common_keys` gives the keys every
architecture states, the family's ``gguf_config`` the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from slotserve.runners.pytorch.families.vision.base import Vision
from slotserve.runners.pytorch.model.config import (
    ModelConfig,
    UnsupportedModelError,
    check,
    rope_scaling,
)

# The architecture suffix of a checkpoint with a classifier head (BERT's cross-encoders, a
# decoder reranker) in place of an LM head, and the head's tensor a decoder's loader sets
# aside.
CLASSIFIER_SUFFIX = "ForSequenceClassification"
CLASSIFIER_WEIGHT = "score.weight"
# sentence-transformers stores a non-default activation as a dotted torch path in
# ``config.json`` (``sentence_transformers.activation_fn``); these two are the ones it writes
# for one-label models.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
    "torch.nn.Sigmoid": torch.sigmoid,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.Identity": lambda x: x,
}


def is_sequence_classifier(raw: Mapping[str, Any]) -> bool:
    return any(str(a).endswith(CLASSIFIER_SUFFIX) for a in raw.get("architectures") or [])


def score_activation(
    raw: Mapping[str, Any], name: str
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The activation of a sequence classifier's logit (a BERT cross-encoder's, a decoder
    reranker's); None for a checkpoint that is not one. Raises for a classifier served nowhere
    here (several labels)."""
    if not is_sequence_classifier(raw):
        return None
    labels = int(raw.get("num_labels", len(raw.get("id2label") or {}) or 2))
    if labels != 1:
        raise ValueError(
            f"{name}: a cross-encoder with {labels} labels is not served (one label only: "
            "its logit is the relevance score)"
        )
    path = (raw.get("sentence_transformers") or {}).get("activation_fn")
    if path is None:
        return torch.sigmoid  # CrossEncoder's default for one label
    if path not in _ACTIVATIONS:
        raise ValueError(f"{name}: the cross-encoder activation {path!r} is not supported")
    return _ACTIVATIONS[path]


# llama.cpp's name for the norm before the MLP, where most families have HF's
# ``post_attention_layernorm``.
LLAMA_CPP_FFN_NORM = {
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}


class HfConfig:
    """An HF ``config.json``, already parsed (a multimodal one's text model), with the keys
    every decoder family reads the same way."""

    def __init__(self, raw: Mapping[str, Any], name: str, model_type: str) -> None:
        self.raw, self.name, self.model_type = raw, name, model_type
        self.hidden = int(self.need("hidden_size"))
        self.heads = int(self.need("num_attention_heads"))
        self.kv_heads = int(raw.get("num_key_value_heads") or self.heads)
        self.head_dim = int(raw.get("head_dim") or self.hidden // self.heads)
        self.layers = int(self.need("num_hidden_layers"))
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        # transformers 5 keys the rotary settings by layer type where they differ (Gemma 3).
        self.local_rope: Mapping[str, Any] = {}
        if "full_attention" in rope:
            self.local_rope = rope.get("sliding_attention") or {}
            rope = rope["full_attention"]
        self.rope: Mapping[str, Any] = rope
        self.experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)

    def need(self, key: str) -> Any:
        if key not in self.raw or self.raw[key] is None:
            raise UnsupportedModelError(
                f"{self.name}: config.json has no {key!r} ({self.model_type})"
            )
        return self.raw[key]

    def mrope(self) -> dict[str, Any]:
        """M-RoPE's fields (a vision-language model's text model), checked."""
        section = tuple(int(s) for s in self.rope.get("mrope_section") or ())
        if len(section) != 3 or 2 * sum(section) != self.head_dim:
            raise UnsupportedModelError(
                f"{self.name}: mrope_section {list(section)} must split half of head_dim "
                f"{self.head_dim} in three"
            )
        return {"mrope_section": section}

    def flag(self, key: str, default: bool) -> bool:
        """A switch the family defaults one way when ``config.json`` does not say."""
        return bool(self.raw.get(key, default))

    def activation(self, default: str) -> str:
        return str(self.raw.get("hidden_activation") or self.raw.get("hidden_act") or default)

    def decoder(self, **family: Any) -> ModelConfig:
        """The checked :class:`ModelConfig`: the shared keys, with ``family``'s fields over
        them. A model without a sparse (or a linear) layer keeps no expert (or DeltaNet)
        layout, whatever its keys say."""
        raw = self.raw
        sparse = any(family.get("sparse_layers", ()))
        eos = raw.get("eos_token_id")
        scalar = raw.get("query_pre_attn_scalar")
        fields: dict[str, Any] = {
            "model_type": self.model_type,
            "name": self.name,
            "vocab_size": int(self.need("vocab_size")),
            "hidden_size": self.hidden,
            "intermediate_size": int(
                raw.get("intermediate_size") or 0 if sparse else self.need("intermediate_size")
            ),
            "num_layers": self.layers,
            "num_heads": self.heads,
            "num_kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": float(raw.get("rms_norm_eps") or 1e-6),
            "rope_theta": float(raw.get("rope_theta") or self.rope.get("rope_theta") or 10000.0),
            "max_position_embeddings": int(raw.get("max_position_embeddings") or 4096),
            "tie_word_embeddings": self.flag("tie_word_embeddings", False),
            "rope_scaling": rope_scaling(
                self.rope, self.name, int(raw.get("max_position_embeddings") or 4096)
            ),
            "attention_bias": self.flag("attention_bias", False),
            "hidden_activation": self.activation("silu"),
            "query_pre_attn_scalar": float(scalar) if scalar else None,
            "final_logit_softcapping": raw.get("final_logit_softcapping"),
            "bos_token_id": raw.get("bos_token_id"),
            "eos_token_ids": (
                tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            ),
            "num_experts": self.experts if sparse else 0,
            "num_experts_per_tok": int(raw.get("num_experts_per_tok") or 0) if sparse else 0,
            "moe_intermediate_size": int(raw.get("moe_intermediate_size") or 0),
            "norm_topk_prob": self.flag("norm_topk_prob", False),
            "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
            "linear_num_key_heads": int(raw.get("linear_num_key_heads") or 0),
            "linear_num_value_heads": int(raw.get("linear_num_value_heads") or 0),
            "linear_key_head_dim": int(raw.get("linear_key_head_dim") or 0),
            "linear_value_head_dim": int(raw.get("linear_value_head_dim") or 0),
            "linear_conv_kernel": int(raw.get("linear_conv_kernel_dim") or 0),
        }
        fields |= family
        for per_layer in ("sparse_layers", "linear_layers"):
            if not any(fields.get(per_layer, ())):
                fields[per_layer] = ()
        config = ModelConfig(**fields)
        check(config)
        return config


class GgufKeys:
    """A GGUF file's ``<architecture>.*`` metadata keys, by the part after the dot."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, name: str) -> None:
        self.metadata, self.arch, self.name = metadata, arch, name

    def __call__(self, key: str, default: Any = None) -> Any:
        """The key's value, else ``default``; refused when neither is there."""
        value = self.metadata.get(f"{self.arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"{self.name}: GGUF metadata has no {self.arch}.{key}")
        return value

    def optional(self, key: str) -> Any:
        return self.metadata.get(f"{self.arch}.{key}")


def gguf_common_keys(keys: GgufKeys, model_type: str) -> dict[str, Any]:
    """The ``config.json`` keys every architecture states in its GGUF metadata."""
    metadata = keys.metadata
    heads = int(keys("attention.head_count"))
    hidden = int(keys("embedding_length"))
    vocab = keys.optional("vocab_size") or metadata.get("_vocab_tokens")
    if not vocab:
        raise UnsupportedModelError(f"{keys.name}: GGUF metadata gives no vocabulary size")
    experts = int(keys.optional("expert_count") or 0)
    raw: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(keys("feed_forward_length", 0 if experts else None)),
        "num_hidden_layers": int(keys("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(keys("attention.head_count_kv", heads)),
        "head_dim": int(keys("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(keys("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(keys("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(keys("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in metadata.get("_tensor_names", ()),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    if keys.optional("rope.scaling.type") == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": keys("rope.scaling.factor")}
    return raw


def _no_gguf_keys(keys: GgufKeys, raw: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _unchanged(template: str, weights: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    return weights


@dataclass(frozen=True)
class Family:
    """A decoder family: the model types it serves and how its checkpoints say what the
    shared decoder needs to know."""

    model_types: tuple[str, ...]  # HF ``model_type`` values (config.json)
    config: Callable[[HfConfig], ModelConfig]  # usually one call of ``HfConfig.decoder``
    # Model types whose config.json may hold the text model under ``text_config`` (a
    # multimodal checkpoint): read as ``<model_type>_text``, which must be listed too.
    multimodal: tuple[str, ...] = ()
    # HF weight names: prefixes the text model's tensors stand under in a multimodal
    # checkpoint (read as ``model.``), and tensors the decoder does not use.
    text_prefixes: tuple[str, ...] = ()
    skipped_weights: tuple[str, ...] = ()
    # GGUF ``general.architecture`` → the HF model_type its files are read as.
    gguf_architectures: Mapping[str, str] = field(default_factory=dict)
    # The config.json keys its GGUF files state under their own metadata keys, given the
    # keys every architecture states (``gguf_common_keys``).
    gguf_config: Callable[[GgufKeys, Mapping[str, Any]], dict[str, Any]] = _no_gguf_keys
    # GGUF tensor names (``blk.{i}.`` for a layer's) → HF names, beyond those of
    # ``load/gguf_file.py`` that every family shares.
    gguf_names: Mapping[str, str] = field(default_factory=dict)
    # Undoes what llama.cpp's converter changed in a tensor, given its GGUF name template.
    gguf_tensor: Callable[[str, torch.Tensor, ModelConfig], torch.Tensor] = _unchanged
    # A vision-language family's images (its ``multimodal`` checkpoints with a
    # ``vision_config``): their preparer and tower.
    vision: Vision | None = None

    def weight_name(self, name: str) -> str | None:
        """A checkpoint's tensor name as the decoder's (``model.…``), None when unused."""
        for prefix in self.text_prefixes:
            if name.startswith(prefix):
                name = "model." + name[len(prefix) :]
                break
        return None if name.startswith(self.skipped_weights) else name


@dataclass(frozen=True)
class EncoderConfig:
    """An encoder's shape (post-norm layers, learned absolute positions)."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_layers: int
    layer_norm_eps: float
    activation: Callable[[torch.Tensor], torch.Tensor]
    max_position_embeddings: int


@dataclass(frozen=True)
class EncoderFamily:
    """An encoder family, served by the encoder runner (``encoder/runner.py``) for embeddings
    and scores only."""

    model_types: tuple[str, ...]
    config: Callable[[Mapping[str, Any], str], EncoderConfig]  # (config.json, the model's name)
    weight_name: Callable[[str], str | None]  # a checkpoint's name as the runner's; None: unused
