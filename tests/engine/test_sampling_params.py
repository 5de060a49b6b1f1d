from __future__ import annotations

import pytest

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -1.0),
        ("top_k", -2),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("n", 0),
        ("n", 100),
        ("logprobs", 21),
        ("logit_bias", ((5, 101.0),)),
        ("logit_bias", ((-1, 1.0),)),
        ("stop", ("",)),
        ("stop_token_ids", (-3,)),
    ],
)
def test_out_of_range_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert err.value.param == field


def test_greedy_without_extras_needs_no_sampler_chain() -> None:
    assert not SamplingParams(temperature=0).needs_sampler_chain
    assert SamplingParams(temperature=0, repetition_penalty=1.1).needs_sampler_chain
    assert SamplingParams(temperature=0.7).needs_sampler_chain


def test_token_ids_must_exist_in_the_vocabulary() -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(logit_bias=((1000, 1.0),)).validate_against_vocab(100)
