"""RoPE settings a command line lays over a model's, in either spelling: llama-server's flags
(``--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 32768``) or vLLM's ``--hf-overrides``
(``{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, ...}}``). The PyTorch runner reads
HF's names, so the flags join its overrides (:func:`torch_overrides`); the llama.cpp runner
sets its context's RoPE parameters (:func:`llama_cpp_rope`), and refuses what else an
override names, since it cannot lay that over a GGUF file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slotserve.runners.options import RunnerCommon

# The HF rope_type each --rope-scaling names.
HF_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}
# What the llama.cpp runner takes of an --hf-overrides rope_scaling, by its HF name.
_LLAMA_CPP_SCALING_KEYS = {
    "rope_type",
    "type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
}


@dataclass(frozen=True)
class RopeSettings:
    """What replaces the model's own RoPE settings; each field unset (None) keeps the model's."""

    scaling: str | None = None  # a --rope-scaling choice: none, linear, yarn
    factor: float | None = None  # how many times the context is stretched
    original_context: int | None = None  # YaRN: the context the model was trained on
    theta: float | None = None  # the base frequency
    beta_fast: float | None = None  # YaRN's ramp, in rotations
    beta_slow: float | None = None

    def __str__(self) -> str:
        """The settings given, for the start-up log: ``yarn, factor 4.0, ...``."""
        given = [f"{name} {value}" for name, value in vars(self).items() if value is not None]
        return ", ".join(given).removeprefix("scaling ") or "the model's own"


# Nothing laid over: the model's own settings.
MODEL_ROPE = RopeSettings()


def _flag_settings(common: RunnerCommon) -> RopeSettings:
    """The llama-server flags as given; a stretch without a method is a usage error."""
    if (common.rope_scale or common.yarn_orig_ctx) and common.rope_scaling in (None, "none"):
        raise ValueError("--rope-scale and --yarn-orig-ctx need --rope-scaling linear or yarn")
    if common.rope_scaling in ("linear", "yarn") and not common.rope_scale:
        raise ValueError(f"--rope-scaling {common.rope_scaling} needs --rope-scale (a factor)")
    return RopeSettings(
        scaling=common.rope_scaling,
        factor=common.rope_scale or None,
        original_context=common.yarn_orig_ctx or None,
        theta=common.rope_freq_base or None,
    )


def _joined(common: RunnerCommon) -> dict[str, Any]:
    """``--hf-overrides`` with the llama-server flags joined as HF names; both saying the same
    thing is a usage error."""
    flags = _flag_settings(common)
    overrides = dict(json.loads(common.hf_overrides)) if common.hf_overrides else {}
    for given, key, flag in (
        (flags.scaling, "rope_scaling", "--rope-scaling"),
        (flags.theta, "rope_theta", "--rope-freq-base"),
    ):
        if given is not None and key in overrides:
            raise ValueError(f"{flag} and --hf-overrides' {key}: give one")
    if flags.scaling is not None:
        scaling: dict[str, Any] = {"rope_type": HF_ROPE_TYPES[flags.scaling]}
        if flags.factor is not None:
            scaling["factor"] = flags.factor
        if flags.original_context is not None:
            scaling["original_max_position_embeddings"] = flags.original_context
        overrides["rope_scaling"] = scaling
    if flags.theta is not None:
        overrides["rope_theta"] = flags.theta
    return overrides


def torch_overrides(common: RunnerCommon) -> str | None:
    """What the PyTorch runner lays over the model's configuration: :func:`_joined`, as the
    JSON text ``--hf-overrides`` takes (None: nothing)."""
    overrides = _joined(common)
    return json.dumps(overrides) if overrides else None


def llama_cpp_rope(common: RunnerCommon) -> RopeSettings:
    """What the llama.cpp runner lays over the file's RoPE settings: the flags, or the
    ``rope_scaling`` and ``rope_theta`` of ``--hf-overrides``; any other override is refused."""
    overrides = _joined(common)
    others = sorted(set(overrides) - {"rope_scaling", "rope_theta"})
    if others:
        raise ValueError(
            f"--hf-overrides {', '.join(others)}: the llama.cpp runner lays only rope_scaling "
            "and rope_theta over a GGUF file's settings (add --runner torch)"
        )
    scaling = overrides.get("rope_scaling") or {}
    unknown = sorted(set(scaling) - _LLAMA_CPP_SCALING_KEYS)
    kind = scaling.get("rope_type", scaling.get("type"))
    by_hf_name = {hf: ours for ours, hf in HF_ROPE_TYPES.items()}
    if unknown or (scaling and kind not in by_hf_name):
        what = ", ".join(unknown) if unknown else f"rope_type {kind!r}"
        raise ValueError(
            f"--hf-overrides rope_scaling {what}: the llama.cpp runner takes rope_type "
            "default, linear or yarn, with factor, original_max_position_embeddings, beta_fast "
            "and beta_slow"
        )
    if kind in ("linear", "yarn") and not scaling.get("factor"):
        raise ValueError(f"--hf-overrides rope_scaling {kind} needs a factor")

    def number(key: str) -> float | None:
        return float(scaling[key]) if key in scaling else None

    original = scaling.get("original_max_position_embeddings")
    theta = overrides.get("rope_theta")
    return RopeSettings(
        scaling=by_hf_name[str(kind)] if scaling else None,
        factor=number("factor"),
        original_context=int(original) if original is not None else None,
        theta=float(theta) if theta is not None else None,
        beta_fast=number("beta_fast"),
        beta_slow=number("beta_slow"),
    )
