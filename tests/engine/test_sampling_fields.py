"""Each sampling field is declared once (``engine/sampling_fields.py``): its range is what
``SamplingParams`` checks and what a model's or a flag's default must lie in."""

from __future__ import annotations

import dataclasses

import pytest

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.sampling_defaults import DEFAULTED, NEUTRAL, SamplingDefaults
from slotserve.engine.sampling_params import SAMPLING_FIELDS, SamplingParams


@pytest.mark.parametrize("name", list(SAMPLING_FIELDS))
def test_each_range_is_checked_at_its_bounds(name: str) -> None:
    declared = SAMPLING_FIELDS[name]
    for inside in (declared.ge, declared.le, declared.default):
        if inside is not None:
            SamplingParams(**{name: declared.kind(inside)})
    for outside in (declared.gt, declared.lt):
        if outside is None:
            continue
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(**{name: declared.kind(outside)})
        assert (err.value.param, str(err.value)) == (name, f"'{name}' {declared.error}.")


def test_the_words_of_a_range() -> None:
    assert SAMPLING_FIELDS["temperature"].error == "must be between 0 and 2"
    assert SAMPLING_FIELDS["top_p"].error == "must be in (0, 1]"
    assert SAMPLING_FIELDS["max_tokens"].error == "must be >= 1"
    assert SAMPLING_FIELDS["seed"].range_text == "[-2**63, 2**64)"
    top_k = SAMPLING_FIELDS["top_k"]
    assert not top_k.accepts(40.5) and top_k.accepts(40.0) and not top_k.accepts(float("nan"))
    assert SAMPLING_FIELDS["seed"].accepts(2**64 - 1) and not SAMPLING_FIELDS["seed"].accepts(
        10**400
    )


def test_the_defaults_are_the_fields_an_option_sets() -> None:
    assert {f.name for f in dataclasses.fields(SamplingDefaults)} == set(DEFAULTED)
    assert NEUTRAL.as_dict() == {
        name: getattr(SamplingParams(), name) for name in NEUTRAL.as_dict()
    }
    assert SamplingDefaults(top_k=5, min_p=2.0, top_p=0.0).out_of_range() == ["top_p", "min_p"]
