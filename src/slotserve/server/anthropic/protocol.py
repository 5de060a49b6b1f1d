"""The request bodies of ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``:
Anthropic's Messages API for a text-only model.

As on the OpenAI routes, unknown fields are refused so that every accepted field is one we
honour. Fields that change nothing a client can observe here are accepted and ignored:
``cache_control`` on any block or the request (the prefix cache is automatic), ``citations``,
``service_tier`` (one tier), ``output_config.effort`` (a hint, like the Responses API's
``reasoning.effort``), ``thinking.display`` other than ``omitted``, and ``context_management``
edits that clear thinking (earlier turns' thinking never reaches the prompt). What we cannot
honour is refused by :meth:`MessagesRequest.reject_unsupported` or by the block models: images,
documents, MCP servers, containers, tool-use clearing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from slotserve.engine.errors import InvalidRequestError
from slotserve.server.sampling_schema import sampled


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(BaseModel):
    # Accepted and ignored; Anthropic keeps adding fields here (ttl, ...).
    model_config = ConfigDict(extra="allow")
    type: Literal["ephemeral"]


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(_Strict):
    type: Literal["url"]
    url: str


class ImageBlock(BaseModel):
    """An image (read by a vision-language model); a document is refused by name."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")] | None = None
    cache_control: CacheControl | None = None

    @property
    def url(self) -> str:
        """The image as an OpenAI image URL (a data: URL for base64 data)."""
        source = self.source
        assert source is not None, "checked by reject_unsupported"
        if isinstance(source, UrlSource):
            return source.url
        return f"data:{source.media_type};base64,{source.data}"


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content if isinstance(block, TextBlock))


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str
    cache_control: CacheControl | None = None


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Strict):
    # "system" turns inside the conversation are what Claude Code sends beside the top-level
    # system prompt; they become chat system messages in place.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    """A client tool. ``defer_loading`` tools stay out of the prompt, as Anthropic's tool
    search keeps them out of the context until searched for."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    defer_loading: StrictBool | None = None
    strict: StrictBool | None = None
    input_examples: list[dict[str, Any]] | None = None


class ServerTool(BaseModel):
    """A tool Anthropic runs on its side (web search, bash, text editor, ...): we cannot run
    it, so it is left out of the prompt rather than refused, as clients send them by default."""

    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class Metadata(_Strict):
    user_id: str | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "max"] | None = None
    format: JsonOutputFormat | None = None


class ContextEdit(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ContextManagement(_Strict):
    edits: list[ContextEdit] | None = None


class CountTokensRequest(_Strict):
    """The body of ``count_tokens``: a Messages request without the generation settings."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool | ServerTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    mcp_servers: list[dict[str, Any]] | None = None

    def reject_unsupported(self) -> None:
        if self.mcp_servers:
            raise InvalidRequestError("'mcp_servers' are not supported.", param="mcp_servers")
        for edit in (self.context_management.edits or []) if self.context_management else []:
            if not edit.type.startswith("clear_thinking_"):
                raise InvalidRequestError(
                    f"context_management edit '{edit.type}' is not supported (only thinking "
                    "clearing, which this server always applies).",
                    param="context_management.edits",
                )
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise InvalidRequestError(
                "tool_choice of type 'tool' needs a 'name'.", param="tool_choice.name"
            )
        if choice is not None and choice.type != "tool" and choice.name is not None:
            raise InvalidRequestError(
                f"tool_choice of type '{choice.type}' takes no 'name'.", param="tool_choice.name"
            )
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.content if isinstance(message.content, list) else []):
                _reject_block(block, f"messages.{i}.content.{j}", message.role)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = sampled("max_tokens", ...)
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    # Anthropic's own ranges are narrower than the engine's.
    temperature: float | None = sampled("temperature", le=1.0)
    top_p: float | None = sampled("top_p")
    top_k: int | None = sampled("top_k", ge=1)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Anthropic's automatic caching switch: the prefix cache is always on here.
    cache_control: CacheControl | None = None
    container: str | dict[str, Any] | None = None
    # Ollama's, as on the chat path: how long the model stays loaded once idle.
    keep_alive: float | str | None = None
    # vLLM's: the request's place in line under --schedule-policy priority (lower first).
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if self.container is not None:
            raise InvalidRequestError("'container' is not supported.", param="container")
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled":
            # Anthropic's own bounds; the budget itself is not enforced apart from max_tokens.
            budget = thinking.budget_tokens
            if budget is None or budget < 1024 or budget >= self.max_tokens:
                raise InvalidRequestError(
                    "thinking.budget_tokens must be at least 1024 and less than max_tokens.",
                    param="thinking.budget_tokens",
                )


def _reject_block(block: Any, where: str, role: str) -> None:
    if (isinstance(block, ImageBlock) and (block.type == "document" or block.source is None)) or (
        isinstance(block, ToolResultBlock)
        and not isinstance(block.content, str)
        and any(isinstance(part, ImageBlock) for part in block.content)
    ):
        raise InvalidRequestError(
            f"'{where}': document blocks, and images inside tool results, are not supported.",
            param=where,
        )
    allowed = {
        "user": (TextBlock, ToolResultBlock, ImageBlock),
        "assistant": (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock),
        "system": (TextBlock,),
    }[role]
    if not isinstance(block, allowed):
        raise InvalidRequestError(
            f"'{where}': a {role} message cannot hold a '{block.type}' block.", param=where
        )
