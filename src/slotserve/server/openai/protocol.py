"""Request bodies of the OpenAI API, as pydantic models.

Unknown fields are refused (``extra="forbid"``) so that every accepted field is one we
implement; the error handler turns pydantic's report into a 400 naming the field. Fields that
OpenAI defines but we cannot honour are declared and refused by ``reject_unsupported``.
Beyond OpenAI we accept vLLM's common extensions: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``; and SGLang's fields that the SGLang
Model Gateway (``sglang-router``) adds to every request it forwards (``no_stop_trim``,
``skip_special_tokens``, ``return_hidden_states``; chat: ``separate_reasoning``,
``stream_reasoning``), at the values we implement: what the gateway sends by default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from slotserve.engine.errors import InvalidRequestError
from slotserve.server.sampling_schema import sampled


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: str  # data:image/...;base64,... or an http(s):// or file:// URL the server allows
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


Content = str | list[TextPart]
# A user's content may hold images (read by a vision-language model; others refuse them).
UserContent = str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


class SystemMessage(_Strict):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: UserContent
    name: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class AssistantToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    reasoning_content: str | None = None  # vLLM's field; the template gets it


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None
    # Ollama's: how long the model stays loaded once idle (seconds or "5m"; 0 unloads).
    keep_alive: float | str | None = None
    # vLLM's: the request's place in line under --schedule-policy priority (lower first).
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    temperature: float | None = sampled("temperature")
    top_p: float | None = sampled("top_p")
    n: int = sampled("n", 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = sampled("presence_penalty")
    frequency_penalty: float | None = sampled("frequency_penalty")
    logit_bias: dict[str, float] | None = None
    seed: int | None = sampled("seed")
    user: str | None = None
    # vLLM-style extensions.
    top_k: int | None = sampled("top_k")
    min_p: float | None = sampled("min_p")
    repetition_penalty: float | None = sampled("repetition_penalty")
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = sampled("prompt_logprobs")
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, SGLang's regex
    # and ebnf (server/params.py admits one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    regex: str | None = None
    ebnf: str | None = None
    # SGLang's: the SGLang Model Gateway re-serialises requests with these, at these values.
    no_stop_trim: StrictBool = False
    skip_special_tokens: StrictBool = True
    return_hidden_states: StrictBool = False

    @property
    def include_usage(self) -> bool:
        """The stream ends with a usage chunk (and every chunk has ``usage``, null)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def reject_sglang_extensions(self, **implemented: bool) -> None:
        """SGLang's switches accepted only at the value we implement (``implemented`` adds the
        endpoint's own): a stop string is trimmed, special tokens are not output, no hidden
        states are returned."""
        wanted = {
            "no_stop_trim": False,
            "skip_special_tokens": True,
            "return_hidden_states": False,
            **implemented,
        }
        for name, value in wanted.items():
            if getattr(self, name) is not value:
                raise InvalidRequestError(
                    f"'{name}': only {str(value).lower()} is supported.", param=name
                )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = sampled("max_tokens")
    max_completion_tokens: int | None = sampled("max_tokens")
    logprobs: StrictBool = False
    top_logprobs: int | None = sampled("logprobs")
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's chat-template controls.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's: reasoning (with a reasoning parser) goes to reasoning_content, streamed too.
    separate_reasoning: StrictBool = True
    stream_reasoning: StrictBool = True

    def reject_unsupported(self) -> None:
        self.reject_sglang_extensions(separate_reasoning=True, stream_reasoning=True)
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError(
                "'continue_final_message' needs 'add_generation_prompt' set to false.",
                param="continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidRequestError(
                "'continue_final_message' needs the last message to be the assistant's.",
                param="continue_final_message",
            )
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError(
                "'prompt_logprobs' is not available with streaming chat completions.",
                param="prompt_logprobs",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs"
            )
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
            )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = sampled("max_tokens", 16)
    logprobs: int | None = sampled("logprobs")
    echo: StrictBool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def reject_unsupported(self) -> None:
        self.reject_sglang_extensions()
        if self.suffix:
            raise InvalidRequestError(
                "'suffix' (fill-in-the-middle) is not supported.", param="suffix"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("'best_of' must equal 'n' when given.", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
            )
