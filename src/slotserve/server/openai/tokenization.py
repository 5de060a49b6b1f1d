"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes: a text or a chat turned into
the token ids the model would read, and token ids back into text.

The chat form renders its messages with the chat pipeline's own code
(``chat_prompt.render_chat_off_loop``), so its ``count`` is the ``prompt_tokens`` a chat
completion with the same messages reports.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.requests import Request

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.runner_interface import Tokenizer
from slotserve.server.openai.chat_prompt import render_chat_off_loop
from slotserve.server.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTool
from slotserve.server.serving import ServingContext, large_body


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeCompletionRequest(_Strict):
    """A text, tokenized as ``/v1/completions`` tokenizes a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True  # the BOS token, when the model's vocabulary adds one
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(_Strict):
    """Messages (and tools), rendered with the chat template as ``/v1/chat/completions``
    renders them."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's default is false, which is what its chat route does; ours is what our chat route
    # does (the BOS token unless the template writes it), so null keeps the count equal to a
    # chat completion's prompt_tokens.
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool | None = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Strict):
    prompt: str


async def tokenize(ctx: ServingContext, body: TokenizeRequest, raw: Request) -> TokenizeResponse:
    host, model = await ctx.acquire(body.model, raw)
    if isinstance(body, TokenizeChatRequest):
        chat = ChatCompletionRequest(
            model=body.model,
            messages=body.messages,
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        chat.reject_unsupported()  # the chat route's checks of the template controls
        tokens, _, _ = await render_chat_off_loop(
            host, model, chat, large_body(raw), body.add_special_tokens, check_length=False
        )
    else:
        tokens = await host.off_loop(
            model,
            large_body(raw),
            model.tokenizer.encode,
            body.prompt,
            add_special_tokens=body.add_special_tokens,
        )
    token_strs = None
    if body.return_token_strs:
        token_strs = [model.tokenizer.token_text(t) for t in tokens]
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=model.info.max_seq_len,
        tokens=tokens,
        token_strs=token_strs,
    )


async def detokenize(
    ctx: ServingContext, body: DetokenizeRequest, raw: Request
) -> DetokenizeResponse:
    host, model = await ctx.acquire(body.model, raw)
    vocab_size = model.info.vocab_size
    for i, token_id in enumerate(body.tokens):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"tokens[{i}] = {token_id} is not a token id of this model "
                f"(0 to {vocab_size - 1}).",
                param="tokens",
            )
    text = await host.off_loop(model, large_body(raw), detokenized, model.tokenizer, body.tokens)
    return DetokenizeResponse(prompt=text)


def detokenized(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The text of ``tokens``, special tokens written out (``<|im_start|>``), so that the text
    of a tokenized chat prompt tokenizes back to the same ids."""
    # Special tokens have no output bytes (a reply never shows them); their markup is their text.
    pieces = [tokenizer.token_bytes(t) or tokenizer.token_text(t).encode() for t in tokens]
    return b"".join(pieces).decode("utf-8", errors="replace")
