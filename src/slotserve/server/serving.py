"""State shared by the routes: the engine, the tokenizer, the chat template, the model name."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.runner_interface import ModelInfo, Tokenizer
from slotserve.server.chat_template import ChatTemplate
from slotserve.server.errors import ModelNotFoundError


@dataclass
class ServingContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_info: ModelInfo
    model_name: str
    chat_template: ChatTemplate | None
    created: int = 0

    def __post_init__(self) -> None:
        self.created = int(time.time())

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise ModelNotFoundError(requested, self.model_name)

    def require_chat_template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise InvalidRequestError(
                "This model has no chat template, so /v1/chat/completions cannot format "
                "messages. Start the server with --chat-template FILE, or use /v1/completions.",
                param="messages",
            )
        return self.chat_template


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
