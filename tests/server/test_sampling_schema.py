"""The request models' sampling fields carry the ranges and docs ``SamplingParams`` declares,
and ``docs/sampling.md`` is written from both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slotserve.engine.sampling_params import SAMPLING_FIELDS
from slotserve.sampling_docs import APIS, COMMAND, render
from slotserve.server.sampling_schema import sampled

DOCS = Path(__file__).parents[2] / "docs" / "sampling.md"
JSON_SCHEMA_BOUNDS = {
    "ge": "minimum",
    "gt": "exclusiveMinimum",
    "le": "maximum",
    "lt": "exclusiveMaximum",
}


def schema_bounds(prop: dict[str, Any]) -> dict[str, float]:
    found: dict[str, float] = {}
    for branch in prop.get("anyOf", [prop]):
        found |= {k: v for k, v in branch.items() if k in JSON_SCHEMA_BOUNDS.values()}
    return found


@pytest.mark.parametrize(("api", "model"), APIS)
def test_each_api_publishes_the_declared_range(api: str, model: Any) -> None:
    by_doc = {declared.doc: declared for declared in SAMPLING_FIELDS.values()}
    narrower = {("Messages", "temperature"), ("Messages", "top_k")}
    checked = set()
    for name, prop in model.model_json_schema(by_alias=True)["properties"].items():
        declared = by_doc.get(prop.get("description"))
        if declared is None or (api, name) in narrower:
            continue
        declared_bounds = {JSON_SCHEMA_BOUNDS[k]: v for k, v in declared.bounds.items()}
        assert schema_bounds(prop) == declared_bounds, (api, name)
        checked.add(declared.name)
    assert {"max_tokens", "top_p"} <= checked


def test_anthropic_narrows_temperature_and_top_k() -> None:
    (_, messages) = APIS[-1]
    properties = messages.model_json_schema()["properties"]
    assert schema_bounds(properties["temperature"]) == {"minimum": 0.0, "maximum": 1.0}
    assert schema_bounds(properties["top_k"])["minimum"] == 1


def test_an_api_cannot_widen_a_range() -> None:
    with pytest.raises(ValueError, match="outside the declared range"):
        sampled("temperature", le=3.0)


def test_the_sampling_doc_is_current() -> None:
    assert DOCS.read_text() == render(), f"docs/sampling.md is stale: run {COMMAND}"
