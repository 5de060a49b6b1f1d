"""Finished responses kept for ``GET /v1/responses/{id}`` and ``previous_response_id``.

Bounded and in memory: a server restart or enough newer responses forget a response, and the
client then gets a 404, as from OpenAI after a response expires. Only the event loop touches
the store, so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1000


@dataclass(frozen=True)
class StoredResponse:
    """A response object as the client received it, and the chat conversation that produced
    it: every earlier turn and this one's input and output, but not its ``instructions``
    (OpenAI does not carry those over to the next turn)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """Least recently used responses go first; reading one (a GET or a follow-up turn) keeps
    it."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError("a response store must hold at least one response")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        response_id = str(stored.response["id"])
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored
