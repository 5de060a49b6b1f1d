"""Rotary position embeddings as HF builds them: Llama 3's, YaRN's and linear frequency scaling,
and a partial rotary dim (Qwen3.5 turns only the first quarter of each head)."""

from __future__ import annotations

import math

import torch

from slotserve.runners.pytorch.model.config import ModelConfig, RopeScaling


def rotary_tables(
    config: ModelConfig, theta: float, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, [max_positions, rotary dim], as HF builds them (the
    rotary dim is the whole head except for Qwen3.5's partial rotary embedding)."""
    dim = config.rotary_size
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    magnitude = 1.0
    if scaling.kind == "yarn":
        inv_freq, magnitude = _yarn(inv_freq, theta, dim, scaling)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * magnitude).to(dtype), (emb.sin() * magnitude).to(dtype)


def _yarn(
    inv_freq: torch.Tensor, theta: float, dim: int, scaling: RopeScaling
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than ``beta_slow`` times over the
    original context are divided by the factor, those turning more than ``beta_fast`` times
    are kept, a linear ramp between; cos and sin are scaled by the attention factor."""
    original = scaling.original_max_position_embeddings

    def dim_turning(rotations: float) -> float:  # the dim whose frequency turns so often
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_turning(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_turning(scaling.beta_slow)), dim - 1)
    span = (high - low) or 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    kept = 1 - ramp
    inv_freq = inv_freq / scaling.factor * (1 - kept) + inv_freq * kept
    factor = scaling.attention_factor
    if factor is None:
        factor = 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
    return inv_freq, factor


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [tokens, heads, head_dim]; ``cos``/``sin``: [tokens, rotary dim]. Dims past the
    rotary dim pass through unchanged."""
    size = cos.shape[-1]
    if size == x.shape[-1]:
        return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
    turned, kept = x[..., :size], x[..., size:]
    turned = turned * cos[:, None, :] + _rotate_half(turned) * sin[:, None, :]
    return torch.cat((turned, kept), dim=-1)


def mrope_axes(section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """Which position (0 time, 1 height, 2 width) turns each of the first half's rotary
    frequencies: in sections (Qwen2.5-VL), or interleaved t, h, w, t, h, w... with the
    height and width ones ending after ``3 × section[axis]`` (Qwen3-VL)."""
    if not interleaved:
        return torch.cat([torch.full((size,), k % 3) for k, size in enumerate(section)])
    index = torch.arange(sum(section))
    axes = torch.zeros_like(index)
    for axis in (1, 2):
        axes[(index % 3 == axis) & (index < 3 * section[axis])] = axis
    return axes


def mrope_rotary(
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    section: tuple[int, ...],
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE's per-token cos and sin, ``[tokens, rotary dim]``, from the whole tables and
    ``positions`` ``[3, tokens]``: each rotary frequency turns by its axis's position
    (:func:`mrope_axes`), in both halves."""
    axes = mrope_axes(section, interleaved)
    axes = torch.cat((axes, axes)).to(positions.device)
    tokens = torch.arange(positions.shape[1], device=positions.device)
    rows = positions[axes[None, :], tokens[:, None]]  # [tokens, dim]: each dim's position
    dims = torch.arange(cos.shape[-1], device=positions.device)
    return cos[rows, dims], sin[rows, dims]


def without_scaling(config: ModelConfig) -> ModelConfig:
    from dataclasses import replace

    from slotserve.runners.pytorch.model.config import RopeScaling

    return replace(config, rope_scaling=RopeScaling())
