"""``python -m slotserve.sampling_docs > docs/sampling.md``: the sampling fields' table, written
from their declarations (``SamplingParams``, ``engine/sampling_fields.py``) and from the request
models that carry them, so the page cannot drift from either."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from pydantic import BaseModel

from slotserve.engine.sampling_defaults import DEFAULTED, LLAMA_SERVER
from slotserve.engine.sampling_fields import SamplingField
from slotserve.engine.sampling_params import SAMPLING_FIELDS
from slotserve.server.anthropic.protocol import MessagesRequest
from slotserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from slotserve.server.responses.protocol import ResponsesRequest

COMMAND = "python -m slotserve.sampling_docs > docs/sampling.md"

# (column, request model) for each API.
APIS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("Chat", ChatCompletionRequest),
    ("Completions", CompletionRequest),
    ("Responses", ResponsesRequest),
    ("Messages", MessagesRequest),
)

INTRO = f"""\
# Sampling fields

<!-- Written by `{COMMAND}` from the sampling fields' declarations; edit those, not this file. -->

How each API's request picks the next token and when it stops, field by field: the range the
engine accepts (a value outside it is a 400 that names the field), the value when neither the
request, the server's option nor the model sets it, the server option that sets it for every
request of a model ([configuration.md](configuration.md); the layers:
[api.md](api.md#sampling-defaults)), and each API's name for it, with its range where the API's
own is narrower. The fields without a range (`stop`, `logit_bias`, `stop_token_ids`, ...) are in
[api.md](api.md#request-fields)."""


def render() -> str:
    head = ["Field", "Range", "Default", "Option"] + [title for title, _ in APIS] + ["About"]
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for declared in SAMPLING_FIELDS.values():
        option = f"`--{declared.option.replace('_', '-')}`" if declared.option else ""
        cells = [
            f"`{declared.name}`",
            declared.range_text,
            _default(declared),
            option,
            *(_api_cell(model, declared) for _, model in APIS),
            declared.doc,
        ]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return INTRO + "\n\n" + "\n".join(rows) + "\n"


def _default(declared: SamplingField) -> str:
    if declared.default is None:
        return "none"
    text = f"`{declared.default:g}`"
    if declared.name in DEFAULTED:  # llama.cpp models default as llama-server does
        text += f" (llama.cpp: `{getattr(LLAMA_SERVER, declared.name):g}`)"
    return text


def _api_cell(model: type[BaseModel], declared: SamplingField) -> str:
    """The API's fields built from the declaration (``server/sampling_schema.py`` gives them
    its doc), each with its range in the OpenAPI schema where that differs."""
    names = []
    for name, prop in model.model_json_schema()["properties"].items():
        if prop.get("description") != declared.doc:
            continue
        own = _bounds_of(prop, declared)
        narrower = f" ({own.range_text})" if own.range_text != declared.range_text else ""
        names.append(f"`{name}`{narrower}")
    return ", ".join(names) or "—"


# A JSON schema's keyword for each bound.
_SCHEMA_BOUNDS = {
    "ge": "minimum",
    "gt": "exclusiveMinimum",
    "le": "maximum",
    "lt": "exclusiveMaximum",
}


def _bounds_of(prop: dict[str, Any], declared: SamplingField) -> SamplingField:
    found: dict[str, float | None] = dict.fromkeys(_SCHEMA_BOUNDS)
    for branch in prop.get("anyOf", [prop]):  # an optional field: [{"type": ...}, null]
        found |= {b: branch[k] for b, k in _SCHEMA_BOUNDS.items() if k in branch}
    return dataclasses.replace(
        declared, ge=found["ge"], gt=found["gt"], le=found["le"], lt=found["lt"]
    )


if __name__ == "__main__":
    sys.stdout.write(render())
