"""What the /v1/responses tests share: the model, the question, the default request, and
create/stream calls through the ``openai`` client."""

from __future__ import annotations

from typing import Any

import openai
from openai.types.responses import Response, ResponseStreamEvent

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = "What is the capital of France?"


DEFAULTS: dict[str, Any] = {
    "model": MODEL,
    "input": QUESTION,
    "max_output_tokens": 16,
    "temperature": 0,
}


def _create(client: openai.OpenAI, **kwargs: Any) -> Response:
    params: dict[str, Any] = DEFAULTS | kwargs
    response: Response = client.responses.create(**params)
    return response


def _stream(client: openai.OpenAI, **kwargs: Any) -> list[ResponseStreamEvent]:
    params: dict[str, Any] = DEFAULTS | kwargs
    return list(client.responses.create(stream=True, **params))
