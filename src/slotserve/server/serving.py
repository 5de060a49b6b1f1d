"""State shared by the routes: the model host, the metrics, the served model's name."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from slotserve.engine.errors import InvalidRequestError
from slotserve.server.chat_template import ChatTemplate
from slotserve.server.errors import ModelNotFoundError
from slotserve.server.metrics import ServerMetrics
from slotserve.server.model_host import LoadedModel, ModelHost
from slotserve.server.reasoning import ReasoningParser


@dataclass
class ServingContext:
    host: ModelHost
    metrics: ServerMetrics
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # --tool-call-parser (None: chosen from the chat template) and --reasoning-parser.
    tool_call_parser: str | None = None
    reasoning_parser: ReasoningParser | None = None

    @property
    def model_name(self) -> str:
        return self.host.name

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise ModelNotFoundError(requested, self.model_name)


def require_chat_template(model: LoadedModel) -> ChatTemplate:
    if model.chat_template is None:
        raise InvalidRequestError(
            "This model has no chat template, so /v1/chat/completions cannot format "
            "messages. Start the server with --chat-template FILE, or use /v1/completions.",
            param="messages",
        )
    return model.chat_template


def engine_request_id(
    model: LoadedModel, prefix: str, http_request_id: str, num_prompts: int = 1
) -> str:
    """``chatcmpl-<x-request-id>``: the engine's id names the HTTP request in its log lines.
    Two clients may send the same ``x-request-id``; the second gets a suffix. A request with
    several prompts holds ``<id>-0``, ``<id>-1``, ... in the engine, so those are checked too."""
    request_id = f"{prefix}-{http_request_id}"
    held = [request_id] if num_prompts == 1 else [f"{request_id}-{k}" for k in range(num_prompts)]
    if any(model.engine.has_request(rid) for rid in held):
        request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
    return request_id
