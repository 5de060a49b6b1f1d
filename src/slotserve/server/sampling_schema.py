"""The request models' sampling fields, built from ``SamplingParams``' declarations
(``engine/sampling_fields.py``): each API's field takes the declared range and doc, so a range
is written once and the OpenAPI schema shows it."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from slotserve.engine.sampling_params import SAMPLING_FIELDS


def sampled(name: str, default: Any = None, **narrower: float) -> Any:
    """A pydantic ``Field`` for ``SamplingParams.<name>``: its declared bounds and doc.
    ``default``: the request's (None: the field left to the model's default; ``...``:
    required); ``narrower``: bounds where an API's own range is narrower than the engine's
    (Anthropic's ``temperature`` stops at 1), each inside the declared range."""
    declared = SAMPLING_FIELDS[name]
    for bound, value in narrower.items():
        if bound not in ("ge", "gt", "le", "lt") or not declared.accepts(value):
            raise ValueError(f"{name}: {bound}={value} is outside the declared range")
    # Where the API narrows one side, its bound replaces the declared one of that side.
    bounds = {
        bound: value
        for bound, value in declared.bounds.items()
        if not any(_same_side(bound, given) for given in narrower)
    } | narrower
    return Field(
        default,
        description=declared.doc,
        ge=bounds.get("ge"),
        gt=bounds.get("gt"),
        le=bounds.get("le"),
        lt=bounds.get("lt"),
    )


def _same_side(a: str, b: str) -> bool:
    return a[0] == b[0]  # ge/gt bound from below, le/lt from above
