"""The sampling values a request gets for the fields it leaves out.

Four layers, the first that sets a field wins: the request's own field, the server's flag
(``--temperature``, ``--top-p``, ``--top-k``, ``--min-p``, ``--repeat-penalty``), the model's
own recommendation (an HF folder's ``generation_config.json``, a GGUF's ``general.sampling.*``
keys), and the defaults its format's users know (llama-server's for a GGUF file on either
runner, vLLM's neutral ones for an HF folder). The runner joins the last two into
``ModelInfo.sampling_defaults``; the model host puts the flags over them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slotserve.engine.sampling_fields import SamplingField
from slotserve.engine.sampling_params import SAMPLING_FIELDS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults for the sampling fields a server's option may set (declared with ``option``
    in ``SamplingParams``); None leaves a field to the layer below."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def over(self, *below: SamplingDefaults) -> SamplingDefaults:
        """Each field from the first of this and ``below`` that sets it."""
        values = {}
        for f in dataclasses.fields(self):
            layers = (self, *below)
            values[f.name] = next(
                (v for v in (getattr(layer, f.name) for layer in layers) if v is not None), None
            )
        return SamplingDefaults(**values)

    @classmethod
    def taken_from(cls, source: object) -> SamplingDefaults:
        """The fields of a request (or anything with attributes of the fields' names)."""
        return cls(**{name: getattr(source, name) for name in DEFAULTED})

    def as_dict(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)

    def params(self, *below: SamplingDefaults) -> dict[str, Any]:
        """``SamplingParams``' keyword arguments for these fields: each from this, else the
        first of ``below`` that sets it, else the neutral value."""
        return self.over(*below, NEUTRAL).as_dict()

    def out_of_range(self) -> list[str]:
        """The fields set to a value no request could carry."""
        return [
            name
            for name, value in self.as_dict().items()
            if value is not None and not DEFAULTED[name].accepts(value)
        ]


# llama-server's own (common/common.h): what users of a GGUF on llama.cpp expect.
LLAMA_SERVER = SamplingDefaults(
    temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.0
)
# The fields a server option may default: those SamplingParams declares with an ``option``.
DEFAULTED: dict[str, SamplingField] = {
    name: declared for name, declared in SAMPLING_FIELDS.items() if declared.option is not None
}
# vLLM's and OpenAI's: the model's distribution as it is (SamplingParams' own defaults).
NEUTRAL = SamplingDefaults(**{name: declared.default for name, declared in DEFAULTED.items()})

# The keys llama.cpp's convert script writes from a model's generation_config.json.
GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}
_HF_KEYS = {name: name for name in GGUF_KEYS}


def _read(get: Callable[[str], Any], keys: Mapping[str, str], source: str) -> SamplingDefaults:
    values: dict[str, Any] = {}
    for name, key in keys.items():
        raw = get(key)
        if raw is None:
            continue
        try:
            value = float(raw)
        except (TypeError, ValueError):
            value = math.nan
        # Out of range, the value would turn every request that omits the field into a 400
        # the client cannot understand: it is dropped.
        if not DEFAULTED[name].accepts(value):
            logger.warning("ignoring %s %s=%r: out of range", source, key, raw)
            continue
        values[name] = DEFAULTED[name].kind(value)  # top_k: 40.0 in a file is 40
    return SamplingDefaults(**values)


def from_generation_config(config: Mapping[str, Any]) -> SamplingDefaults:
    """The sampling fields of an HF ``generation_config.json`` (already parsed)."""
    return _read(config.get, _HF_KEYS, "generation_config.json")


def from_gguf(get: Callable[[str], Any]) -> SamplingDefaults:
    """The ``general.sampling.*`` keys of a GGUF, ``get`` reading one key's value (None when
    absent)."""
    return _read(get, GGUF_KEYS, "GGUF")
