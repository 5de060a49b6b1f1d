"""PEFT LoRA folders (``adapter_config.json`` and ``adapter_model.safetensors``) read onto the
decoder's fused projections (``model/lora.py``), checked against the base model's shapes."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from slotserve.engine.runner_interface import AdapterInfo
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.lora import LoraAdapter, LowRank

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's module names, by the fused projection that holds them and their part of it.
_PARTS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
# A decoder layer's projection, under the prefixes PEFT and transformers put before the
# decoder (``base_model.model.model.layers.3...``; a vision-language model's
# ``...model.language_model.layers.3...``): anchored, so that a vision tower's
# ``...encoder.layers.3.self_attn.q_proj`` is never read as decoder layer 3.
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?"
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.default)?\.weight$"
)


def adapter_id(folder: Path) -> int:
    """A 48-bit id from the adapter's files (never 0, the base model's)."""
    digest = hashlib.blake2b(digest_size=6)
    for name in (CONFIG_FILE, *WEIGHT_FILES):
        path = folder / name
        if path.is_file():
            digest.update(path.read_bytes())
    return int.from_bytes(digest.digest(), "little") or 1


def read_adapter(
    name: str,
    folder: Path,
    config: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    low_rank: Callable[[torch.Tensor, torch.Tensor], LowRank],
) -> LoraAdapter:
    """A PEFT LoRA folder as updates to the decoder's fused projections, each made by
    ``low_rank(down, up)``; ``ValueError`` names what cannot be served (another base model's
    shapes, a rank over ``max_rank``, a variant or module this runner does not apply)."""
    settings = _read_settings(folder)
    tensors = _read_tensors(folder)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown = [key for key in tensors if (m := _KEY.match(key)) is None or m[2] not in _PARTS]
    if unknown:
        shown = ", ".join(unknown[:3]) + (
            f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        )
        raise ValueError(
            f"adapter {name}: {len(unknown)} of its {len(tensors)} tensors adapt modules this "
            f"runner does not (only the decoder layers' {', '.join(_PARTS)}): {shown}"
        )
    for key, tensor in tensors.items():
        found = _KEY.match(key)
        assert found is not None
        layer, module, half = int(found[1]), found[2], found[3]
        if not 0 <= layer < config.num_layers:
            raise ValueError(f"adapter {name}: {key} names a layer the base model lacks")
        parts.setdefault((layer, module), {})[half] = tensor
    rank = 0
    for (layer, module), pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {name}: layer {layer} {module} lacks lora_A or lora_B")
        rank = max(rank, pair["A"].shape[0])
    if rank > max_rank:
        raise ValueError(f"adapter {name} has rank {rank}, over --max-lora-rank {max_rank}")
    layers: list[dict[str, LowRank]] = [{} for _ in range(config.num_layers)]
    for layer in range(config.num_layers):
        by_target: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, (target, index) in _PARTS.items():
            found_pair = parts.get((layer, module))
            if found_pair is None:
                continue
            _check_layer(name, config, layer, module)
            a, b = found_pair["A"].float(), found_pair["B"].float()
            scale = _scale(settings, _module_path(layer, module), a.shape[0])
            by_target.setdefault(target, {})[index] = (a, b * scale)
        for target, pieces in by_target.items():
            down, up = _fuse(name, config, layer, target, pieces)
            layers[layer][target] = low_rank(
                down.to(device, dtype).contiguous(), up.to(device, dtype).contiguous()
            )
    info = AdapterInfo(name, adapter_id(folder), rank, str(folder))
    return LoraAdapter(info, layers)


def _read_settings(folder: Path) -> Mapping[str, object]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{folder} is not a PEFT adapter folder: it has no {CONFIG_FILE}")
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} holds no JSON object")
    kind = str(settings.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise ValueError(f"{folder} is a {kind} adapter; only LoRA adapters are served")
    for flag in ("use_dora", "fan_in_fan_out"):
        if settings.get(flag):
            raise ValueError(f"{folder}: {flag} adapters are not served")
    if settings.get("bias", "none") != "none":
        raise ValueError(f"{folder}: adapters that train biases are not served")
    if settings.get("modules_to_save"):
        raise ValueError(f"{folder}: adapters with modules_to_save are not served")
    return settings


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    safetensors, pickled = (folder / name for name in WEIGHT_FILES)
    try:
        if safetensors.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors))
        if pickled.is_file():
            loaded = torch.load(pickled, map_location="cpu", weights_only=True)
            return dict(loaded)
    except Exception as exc:  # a truncated or corrupt file, in any of its readers' words
        raise ValueError(f"{folder}: the adapter's weights cannot be read: {exc}") from None
    raise ValueError(f"{folder} has no {' or '.join(WEIGHT_FILES)}")


def _scale(settings: Mapping[str, object], module: str, rank: int) -> float:
    """PEFT's scaling: alpha / rank (alpha / sqrt(rank) with rsLoRA), alpha from the first
    ``alpha_pattern`` entry matching the module's path (``layers.3.self_attn.q_proj``)."""
    alpha = float(settings.get("lora_alpha", 8))  # type: ignore[arg-type]
    patterns = settings.get("alpha_pattern") or {}
    assert isinstance(patterns, dict)
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = float(value)
            break
    return alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def _module_path(layer: int, module: str) -> str:
    group = "self_attn" if _PARTS[module][0] in ("qkv", "o_proj") else "mlp"
    return f"layers.{layer}.{group}.{module}"


def _check_layer(name: str, config: ModelConfig, layer: int, module: str) -> None:
    target = _PARTS[module][0]
    if target in ("qkv", "o_proj") and config.is_linear(layer):
        raise ValueError(f"adapter {name}: layer {layer} is a linear-attention layer")
    if target in ("gate_up", "down") and config.is_sparse(layer):
        raise ValueError(f"adapter {name}: layer {layer}'s MLP is a mixture of experts")


def _sizes(config: ModelConfig, target: str) -> tuple[int, list[int]]:
    """A fused projection's input size and its parts' output sizes."""
    c = config
    if target == "qkv":
        q = c.num_heads * c.head_dim * (2 if c.attn_output_gate else 1)
        kv = c.num_kv_heads * c.head_dim
        return c.hidden_size, [q, kv, kv]
    if target == "o_proj":
        return c.num_heads * c.head_dim, [c.hidden_size]
    if target == "gate_up":
        return c.hidden_size, [c.intermediate_size, c.intermediate_size]
    return c.intermediate_size, [c.hidden_size]


def _fuse(
    name: str,
    config: ModelConfig,
    layer: int,
    target: str,
    pieces: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' down-projections stacked and their up-projections block-diagonal (zeros
    where a part has no update), shapes checked against the base model's."""
    in_features, outs = _sizes(config, target)
    rank = sum(pieces[i][0].shape[0] for i in pieces)
    down = torch.zeros(rank, in_features)
    up = torch.zeros(sum(outs), rank)
    row = 0
    for index, (a, b) in sorted(pieces.items()):
        out_start = sum(outs[:index])
        r = a.shape[0]
        if a.shape != (r, in_features) or b.shape != (outs[index], r):
            module = next(m for m, part in _PARTS.items() if part == (target, index))
            raise ValueError(
                f"adapter {name} was trained for another base model: layer {layer} {module} "
                f"has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, this model's "
                f"projection takes {in_features} inputs to {outs[index]} outputs"
            )
        down[row : row + r] = a
        up[out_start : out_start + outs[index], row : row + r] = b
        row += r
    return down, up
