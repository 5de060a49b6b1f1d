"""The request body of ``POST /v1/responses``: the subset of OpenAI's Responses API that vLLM
and SGLang serve, for a text-only model.

Like the chat request, unknown fields are refused so every accepted field is one
we honour; the exceptions (``reasoning``, ``include``) are accepted and ignored because clients
send them by default and ignoring them changes nothing a client can observe here. Output items a
client echoes back as input (``id``, ``status``, ``annotations``) are accepted for the same
reason: feeding ``response.output`` into the next request is the documented pattern.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextContent(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.output)


def _joined(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _item_kind(value: Any) -> str:
    # A message item may leave out its "type"; the other items must name theirs.
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_input_item",
        custom_error_message="an input item's type is 'message', 'function_call' or "
        "'function_call_output'",
    ),
]


class FunctionToolParam(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormatPlain(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatPlain | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class TextConfig(_Strict):
    format: TextFormat = Field(default_factory=lambda: TextFormatPlain(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Strict):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    keep_alive: float | str | None = None  # Ollama's, as on the chat path
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    store: StrictBool = True
    previous_response_id: str | None = None
    stream: StrictBool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    # vLLM-style extensions.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
