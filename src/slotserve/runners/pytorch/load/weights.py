"""Weights into the decoder from their source (:class:`WeightSource`): a checkpoint's
(``checkpoint.py``: an HF folder's safetensors, a GGUF file's tensors) or random values of the
right shapes (:class:`RandomWeights`, ``--load-format dummy``).

Every source yields ``(hf_name, tensor)`` pairs in HF's naming; :func:`load_into` puts each in
its place, the q/k/v and gate/up pieces into their rows of the fused projections, so no second
full copy of the model is ever held. A projection's weight is stored by the weight format
(``weight_format.py``), everything else copied. Experts are named one by one
(``mlp.experts.{e}.gate_proj.weight``, as HF checkpoints store them); stacked expert tensors
(GGUF's ``ffn_*_exps``, a fused ``mlp.experts.gate_up_proj``) are cut into those names first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from slotserve.runners.pytorch.families.registry import family_of
from slotserve.runners.pytorch.load.weight_format import DenseWeights, ProjectionRows, WeightFormat
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.decoder import Decoder, DecoderLayer
from slotserve.runners.pytorch.model.layers import Projection
from slotserve.runners.pytorch.model.moe import Expert

# A weight's place: a projection's rows (the weight format stores them), or a tensor.
Place = ProjectionRows | torch.Tensor

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def load_into(
    model: Decoder,
    tensors: Iterator[tuple[str, Any]],
    shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    weights: WeightFormat | None = None,
    set_aside: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Puts every named tensor into ``model``; raises if one is unknown or one is missing.
    ``shard``: cuts each whole tensor to a tensor-parallel rank's slice first; ``weights``:
    how projections are stored (dense by default); ``set_aside``: tensors the decoder does not
    hold (a sequence classifier's head), returned whole by name."""
    weights = weights or DenseWeights()
    c = model.config
    family = family_of(c)
    expected = _expected_names(c)
    seen: set[str] = set()
    aside: dict[str, torch.Tensor] = {}
    for raw_name, tensor in _per_expert(tensors, c.hidden_size):
        if raw_name in set_aside:
            aside[raw_name] = tensor
            continue
        name = family.weight_name(raw_name)  # a multimodal checkpoint's text model
        if name is None or name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        target = _target(model, name)
        if shard is not None:
            tensor = shard(name, tensor)
        if target.shape != tensor.shape:
            raise ValueError(f"{raw_name}: shape {tuple(tensor.shape)}, expected {target.shape}")
        if isinstance(target, ProjectionRows) or name == "model.embed_tokens.weight":
            weights.store(target, tensor)  # the weight format's one place
        else:
            target.copy_(tensor)
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return aside


def _rows(projection: Projection, start: int = 0, stop: int | None = None) -> ProjectionRows:
    return ProjectionRows(projection, slice(start, stop))


def _target(model: Decoder, name: str) -> Place:
    if name == "model.embed_tokens.weight":
        return model.embed.weight
    if name == "model.norm.weight":
        return model.norm.weight
    if name == "lm_head.weight":
        return _rows(model.lm_head)
    match = _LAYER.match(name)
    if match is None:
        raise ValueError(f"unexpected tensor {name}")
    c = model.config
    layer = model.decoder_layers[int(match.group(1))]
    part = match.group(2)
    pieces = _mixer_pieces(layer, c) | _mlp_pieces(layer, c, part)
    pieces |= {
        "input_layernorm.weight": layer.input_norm.weight,
        "post_attention_layernorm.weight": layer.post_attention_norm.weight,
    }
    if c.sandwich_norms:
        pieces |= {
            "pre_feedforward_layernorm.weight": layer.pre_mlp_norm.weight,
            "post_feedforward_layernorm.weight": layer.post_mlp_norm.weight,
        }
    if part not in pieces:
        raise ValueError(f"unexpected tensor {name}")
    return pieces[part]


def _mixer_pieces(layer: DecoderLayer, c: ModelConfig) -> dict[str, Place]:
    """Attention's (or a Gated DeltaNet layer's) tensors by HF name, as their places in the
    fused weights they go into."""
    if layer.is_linear:
        linear = layer.linear
        channels, heads = c.linear_conv_channels, c.linear_num_value_heads
        value_dim = heads * c.linear_value_head_dim
        in_proj = linear.in_proj
        z_end = channels + value_dim
        return {
            "linear_attn.in_proj_qkv.weight": _rows(in_proj, 0, channels),
            "linear_attn.in_proj_z.weight": _rows(in_proj, channels, z_end),
            "linear_attn.in_proj_b.weight": _rows(in_proj, z_end, z_end + heads),
            "linear_attn.in_proj_a.weight": _rows(in_proj, z_end + heads),
            "linear_attn.conv1d.weight": linear.conv_weight.view(channels, 1, -1),
            "linear_attn.A_log": linear.A_log,
            "linear_attn.dt_bias": linear.dt_bias,
            "linear_attn.norm.weight": linear.norm.weight,
            "linear_attn.out_proj.weight": _rows(linear.out_proj),
        }
    kv = c.num_kv_heads * c.head_dim
    q = c.num_heads * c.head_dim * (2 if c.attn_output_gate else 1)
    pieces: dict[str, Place] = {
        "self_attn.q_proj.weight": _rows(layer.qkv, 0, q),
        "self_attn.k_proj.weight": _rows(layer.qkv, q, q + kv),
        "self_attn.v_proj.weight": _rows(layer.qkv, q + kv),
        "self_attn.o_proj.weight": _rows(layer.o_proj),
    }
    if c.attention_bias:
        pieces |= {
            "self_attn.q_proj.bias": layer.qkv.bias[:q],
            "self_attn.k_proj.bias": layer.qkv.bias[q : q + kv],
            "self_attn.v_proj.bias": layer.qkv.bias[q + kv :],
        }
    if c.qk_norm:
        pieces |= {
            "self_attn.q_norm.weight": layer.q_norm.weight,
            "self_attn.k_norm.weight": layer.k_norm.weight,
        }
    return pieces


def _mlp_pieces(layer: DecoderLayer, c: ModelConfig, part: str) -> dict[str, Place]:
    if not layer.sparse:
        inter = c.intermediate_size
        return {
            "mlp.gate_proj.weight": _rows(layer.gate_up, 0, inter),
            "mlp.up_proj.weight": _rows(layer.gate_up, inter),
            "mlp.down_proj.weight": _rows(layer.down),
        }
    moe = layer.moe
    pieces: dict[str, Place] = {"mlp.gate.weight": _rows(moe.router)}
    expert = _EXPERT.match(part)
    if expert is not None and int(expert.group(1)) < c.num_experts:
        mlp = moe.experts[int(expert.group(1))]
        pieces[part] = _expert_piece(mlp, expert.group(2), c.moe_intermediate_size)
    if moe.shared is not None and moe.shared_gate is not None:
        inter = c.shared_expert_intermediate_size
        pieces["mlp.shared_expert_gate.weight"] = _rows(moe.shared_gate)
        for kind in ("gate", "up", "down"):
            pieces[f"mlp.shared_expert.{kind}_proj.weight"] = _expert_piece(moe.shared, kind, inter)
    return pieces


def _expert_piece(expert: Expert, kind: str, intermediate: int) -> ProjectionRows:
    if kind == "down":
        return _rows(expert.down)
    return _rows(expert.gate_up, *((0, intermediate) if kind == "gate" else (intermediate,)))


def _expected_names(c: ModelConfig) -> set[str]:
    attention = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
    ]
    if c.attention_bias:
        attention += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if c.qk_norm:
        attention += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    linear = [
        f"linear_attn.{p}"
        for p in (
            "in_proj_qkv.weight",
            "in_proj_z.weight",
            "in_proj_b.weight",
            "in_proj_a.weight",
            "conv1d.weight",
            "A_log",
            "dt_bias",
            "norm.weight",
            "out_proj.weight",
        )
    ]
    norms = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if c.sandwich_norms:
        norms += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    dense_mlp = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    sparse_mlp = ["mlp.gate.weight"] + [
        f"mlp.experts.{e}.{p}_proj.weight"
        for e in range(c.num_experts)
        for p in ("gate", "up", "down")
    ]
    if c.shared_expert_intermediate_size:
        sparse_mlp += ["mlp.shared_expert_gate.weight"] + [
            f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")
        ]
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not c.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(c.num_layers):
        parts = norms + (linear if c.is_linear(i) else attention)
        parts += sparse_mlp if c.is_sparse(i) else dense_mlp
        names |= {f"model.layers.{i}.{p}" for p in parts}
    return names


_STACKED = re.compile(
    r"^(.*\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$"
)


def _per_expert(tensors: Iterator[tuple[str, Any]], hidden: int) -> Iterator[tuple[str, Any]]:
    """Cuts stacked expert tensors ([experts, rows, columns]) into one tensor per expert under
    HF's per-expert names; a fused ``gate_up_proj`` holds each expert's gate rows then its up
    rows. Each expert's matrix is turned to a linear layer's [out, in] (``hidden`` in or out)
    where it is stored [in, out], as the hub's Qwen3-VL MoE checkpoints store theirs."""
    for name, tensor in tensors:
        stacked = _STACKED.match(name)
        if stacked is None or not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix, kind = stacked.group(1), stacked.group(2)
        hidden_axis = 0 if kind == "down_proj" else 1
        if tensor.shape[1 + hidden_axis] != hidden and tensor.shape[2 - hidden_axis] == hidden:
            tensor = tensor.transpose(1, 2)
        for expert, rows in enumerate(tensor):
            if kind == "gate_up_proj":
                gate, up = rows.chunk(2, dim=0)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up
            else:
                yield f"{prefix}.{expert}.{kind}.weight", rows


class WeightSource(Protocol):
    """Where the weights come from (``--load-format``): the checkpoint's own tensors
    (``checkpoint.py``), or :class:`RandomWeights`."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight of the whole model under its HF name, one at a time."""
        ...


@dataclass(frozen=True)
class RandomWeights:
    """``--load-format dummy``: random weights of the whole model's shapes (benchmarks without
    the real weights): norms at their neutral value, DeltaNet decays spread as HF initialises
    them."""

    config: ModelConfig
    seed: int = 0

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        with torch.device("meta"):  # shapes only
            model = Decoder(c, torch.float32, 1)
        generator = torch.Generator().manual_seed(self.seed)
        for name in sorted(_expected_names(c)):
            shape = _target(model, name).shape
            if name.endswith("linear_attn.norm.weight"):
                yield name, torch.ones(shape)  # plain w even where the other norms are (1 + w)
            elif "norm" in name:
                yield name, torch.full(shape, 0.0 if c.plus_one_norms else 1.0)
            elif name.endswith("A_log"):
                yield name, torch.empty(shape).uniform_(1, 16, generator=generator).log()
            elif name.endswith("dt_bias"):
                yield name, torch.ones(shape)
            else:
                yield name, torch.randn(shape, generator=generator) * 0.02
