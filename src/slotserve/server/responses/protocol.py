"""The request body of ``POST /v1/responses``: the subset of OpenAI's Responses API a local,
text-only model can serve, wide enough for Codex CLI and the agent frameworks.

Like the chat request, unknown fields are refused so every accepted field is one we honour.
Some are accepted and change nothing here, because they only matter to a hosted service:
``prompt_cache_key`` (our prefix cache matches any shared prefix by itself), ``client_metadata``,
``safety_identifier``, ``service_tier``, ``text.verbosity``, ``max_tool_calls`` (it counts calls
to hosted tools, which never run here), ``reasoning.effort`` and ``reasoning.summary``. Output
items a client echoes back as input (``id``, ``status``, ``annotations``, ``phase``) are
accepted for the same reason: feeding ``response.output`` into the next request is the
documented pattern.

Tools: ``function`` and ``custom`` (free-form) tools, and ``namespace`` groups of them, are
offered to the model (``tools.py``); hosted tools the server cannot run are accepted and left
out of the prompt, as a model without them would never call them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag

from slotserve.engine.errors import InvalidRequestError
from slotserve.server.sampling_schema import sampled


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextContent(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalContent(_Strict):
    type: Literal["refusal"]
    refusal: str


class ImageContent(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None  # data:, or an http(s):// or file:// URL the server allows
    file_id: str | None = None  # refused: this server keeps no files
    detail: Literal["auto", "low", "high"] | None = None


Content = Annotated[TextContent | RefusalContent | ImageContent, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content]
    id: str | None = None
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return _joined(self.content)

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat message's: its text, or with images the parts in order."""
        if isinstance(self.content, str) or not any(
            isinstance(p, ImageContent) for p in self.content
        ):
            return self.text()
        parts: list[dict[str, Any]] = []
        for part in self.content:
            if isinstance(part, ImageContent):
                if part.image_url is None:
                    raise InvalidRequestError(
                        "an input_image needs an image_url: file_id is not supported",
                        param="input",
                    )
                parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
            else:
                parts.append({"type": "text", "text": _joined([part])})
        return parts


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # set when the function came from a namespace tool
    id: str | None = None
    status: str | None = None


class CustomToolCallItem(_Strict):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class _CallOutput(_Strict):
    call_id: str
    output: str | list[Content]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.output)


class FunctionCallOutputItem(_CallOutput):
    type: Literal["function_call_output"]
    # Codex also sends outputs that answer no call, named by the tool instead of a call id.
    call_id: str | None = None  # type: ignore[assignment]
    name: str | None = None
    namespace: str | None = None


class CustomToolCallOutputItem(_CallOutput):
    type: Literal["custom_tool_call_output"]


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _joined(content: str | list[Content]) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        p.text if isinstance(p, TextContent) else p.refusal
        for p in content
        if not isinstance(p, ImageContent)
    )


def _item_kind(value: Any) -> str:
    # A message item may leave out its "type"; the other items must name theirs.
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else "message"


INPUT_ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
)

InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_input_item",
        custom_error_message="an input item's type is one of " + ", ".join(INPUT_ITEM_TYPES),
    ),
]


class FunctionToolParam(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class GrammarFormat(_Strict):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str


class PlainTextFormat(_Strict):
    type: Literal["text"]


class CustomToolParam(_Strict):
    type: Literal["custom"]
    name: str
    description: str | None = None
    format: Annotated[GrammarFormat | PlainTextFormat, Field(discriminator="type")] | None = None


class NamespaceToolParam(_Strict):
    type: Literal["namespace"]
    name: str
    description: str
    tools: list[Annotated[FunctionToolParam | CustomToolParam, Field(discriminator="type")]]


# Tools OpenAI runs on its side (or, for computer use, that need a screen): a local text model
# cannot run them, so they are accepted and never shown to it. ``local_shell``, ``shell`` and
# ``apply_patch`` are run by the client but answered with their own item types, which this
# server does not produce; Codex offers its shell and patch tools as function and custom tools.
HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use_preview",
        "mcp",
        "tool_search",
        "programmatic_tool_calling",
        "local_shell",
        "shell",
        "apply_patch",
    }
)


class HostedToolParam(BaseModel):
    """A tool this server does not offer to the model; its settings are kept only to be echoed
    in the response's ``tools``."""

    model_config = ConfigDict(extra="allow")
    type: str


def _tool_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):  # an object or a list is no tool type (and unhashable)
        return None
    if kind in ("function", "custom", "namespace"):
        return kind
    return "hosted" if kind in HOSTED_TOOL_TYPES else None


ToolParam = Annotated[
    Annotated[FunctionToolParam, Tag("function")]
    | Annotated[CustomToolParam, Tag("custom")]
    | Annotated[NamespaceToolParam, Tag("namespace")]
    | Annotated[HostedToolParam, Tag("hosted")],
    Discriminator(
        _tool_kind,
        custom_error_type="invalid_tool",
        custom_error_message="a tool's type is 'function', 'custom', 'namespace' or one of "
        "the hosted tools (" + ", ".join(sorted(HOSTED_TOOL_TYPES)) + ")",
    ),
]


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class CustomChoice(_Strict):
    type: Literal["custom"]
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
    generate_summary: str | None = None  # the older name of ``summary``


class StreamOptions(_Strict):
    include_obfuscation: StrictBool | None = None  # no obfuscation padding is ever sent


# ``include`` values: the encrypted reasoning is implemented, the rest name items this server
# never produces (hosted tool results, images), so asking for them changes nothing.
Includable = Literal[
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]


class ResponsesRequest(_Strict):
    model: str | None = None
    keep_alive: float | str | None = None  # Ollama's, as on the chat path
    # vLLM's: the request's place in line under --schedule-policy priority (lower first).
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = sampled("max_tokens")
    temperature: float | None = sampled("temperature")
    top_p: float | None = sampled("top_p")
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | CustomChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: TextConfig | None = None
    store: StrictBool = True
    previous_response_id: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    background: Literal[False] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=128)
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's; not in OpenAI's published spec
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    seed: int | None = sampled("seed")
    reasoning: ReasoningConfig | None = None
    # "auto" differs from "disabled" only when the input overflows the context: we refuse
    # then (the error says truncation is not done here) rather than drop earlier turns.
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Includable] | None = None
    top_logprobs: int | None = sampled("logprobs")
    # vLLM-style extensions.
    top_k: int | None = sampled("top_k")
    min_p: float | None = sampled("min_p")
    repetition_penalty: float | None = sampled("repetition_penalty")

    def includes(self, value: str) -> bool:
        return value in (self.include or ())
