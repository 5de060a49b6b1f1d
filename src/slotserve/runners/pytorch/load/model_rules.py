"""What a model's shape changes in the engine's rules, as the PyTorch runner states them in
``ModelInfo``: the cost of context on this device, and the rules of recurrent layers."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from slotserve.engine.chunk_policy import ANY_SIZE, ChunkPolicy
from slotserve.engine.runner_interface import RECURRENT_STATE_NO_ROLLBACK
from slotserve.runners.pytorch.model.config import ModelConfig
from slotserve.runners.pytorch.model.deltanet import BLOCK

# A multiply-add of CPU attention takes about this many of a projection's: in a prefill step
# over a long context the attention kernel runs at 0.6-0.7 of the projection GEMM's rate
# (benchmarks/RESULTS.md, "A prefill over a long context runs alone").
CPU_ATTENTION_WEIGHT = 1.7


def context_cost(config: ModelConfig, device: torch.device) -> float:
    """``ModelInfo.context_cost`` on this device: on a CPU a prompt token's attention over a
    long context outweighs its projections. Not stated on a GPU, where neither sets a
    step's length the same way."""
    if device.type != "cpu":
        return 0.0
    ratio = config.attention_macs_per_position() / config.projection_macs_per_token()
    return CPU_ATTENTION_WEIGHT * ratio


def recurrent_state_rules(config: ModelConfig, snapshots: int) -> dict[str, Any]:
    """What a model with Gated DeltaNet layers changes in the engine's rules: chunks cut on
    the chunked delta rule's block grid from position 0 (batch invariance, ``model/deltanet.py``);
    a prefix cache only through snapshots of the recurrent state, which cannot be cut at
    any position; no speculation (the state cannot be rewound past a rejected draft)."""
    if not config.linear_layers:
        return {}
    return {
        "chunk_policy": ChunkPolicy(grain=BLOCK, anchored=True),
        "prefix_cache_unsupported": (
            None
            if snapshots
            else "the model's Gated DeltaNet layers keep a recurrent state, which the cache "
            "keeps only as snapshots, and --prefix-cache-snapshots is 0"
        ),
        "speculative_unsupported": RECURRENT_STATE_NO_ROLLBACK,
    }


def quantized_rules(rules: dict[str, Any], prompts_dequantized: bool) -> dict[str, Any]:
    """``rules`` with what a prompt's rows dequantized change: a generated token's K and V
    come from the integer arithmetic, a prompt's from the dequantized one
    (``model/layers.py``), so the prefix cache keeps prompts only (a later prompt through the
    same tokens would compute them as a prompt)."""
    if not prompts_dequantized:
        return rules
    policy = rules.get("chunk_policy", ANY_SIZE)
    return {**rules, "chunk_policy": dataclasses.replace(policy, prompts_only=True)}
