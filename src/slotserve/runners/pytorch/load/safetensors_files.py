"""An HF folder's weights: ``model.safetensors``, or the shards its index lists."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch


def safetensors_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``model.safetensors`` or of the shards ``model.safetensors.index.json``
    lists, one at a time."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor an index of shards")
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, shard.get_tensor(name)
