"""A chat completion request made into what the pipeline runs: the prompt rendered with the chat
template (``protocol/chat_template.py``), the tool plan (``tool_calling.py``) and the sampling
parameters (``params.py``), made into the engine's request and submitted
(``pipeline.submit_chat``). The Responses and Messages APIs translate their requests into a
chat completion request and start here too."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.requests import Request

from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.images import ImageInput
from slotserve.engine.sampling_params import SamplingParams
from slotserve.hosting.host import ModelHost
from slotserve.hosting.served import LoadedModel
from slotserve.protocol.media_fetch import fetch_images
from slotserve.server.openai.chat_images import (
    accepted_image_urls,
    expand_image_text,
    place_images,
    read_images,
)
from slotserve.server.openai.params import sampling_params_of, structured_output_of
from slotserve.server.openai.protocol import ChatCompletionRequest
from slotserve.server.openai.tool_calling import plan_tools, template_messages
from slotserve.server.pipeline import ChatGeneration, submit_chat
from slotserve.server.prompt_bound import check_prompt_chars
from slotserve.server.serving import (
    engine_request_id,
    large_body,
    request_adapter,
    require_chat_template,
)
from slotserve.server.tool_plan import ToolPlan


async def start_chat(
    host: ModelHost,
    model: LoadedModel,
    body: ChatCompletionRequest,
    raw: Request,
    http_request_id: str,
) -> ChatGeneration:
    """Renders, plans and submits ``body`` on ``model`` (acquired by the caller);
    ``InvalidRequestError`` naming the chat field at fault. The rendering runs off the event
    loop; the model is checked again after it, and nothing awaits from there to the
    submission, so the model cannot be unloaded in between."""
    prompt, plan, images = await render_chat_off_loop(host, model, body, large_body(raw))
    model = host.require_same(model)
    request_id = engine_request_id(model, "chatcmpl", http_request_id)
    params = _sampling_params(body, plan, model)
    adapter = request_adapter(raw)
    request = EngineCoreRequest(request_id, prompt, params, body.priority, adapter, tuple(images))
    return submit_chat(host, model, raw, request, plan)


async def render_chat_off_loop(
    host: ModelHost,
    model: LoadedModel,
    body: ChatCompletionRequest,
    large: bool,
    add_special_tokens: bool | None = None,
    check_length: bool = True,
) -> tuple[list[int], ToolPlan, list[ImageInput]]:
    """:func:`render_chat` on the preparation threads (those of large requests where
    ``large``), once the request's http(s) images are fetched here, on the event loop, within
    the media policy's deadline."""
    policy = host.launch.media
    fetched = await fetch_images(accepted_image_urls(model, policy, body), policy)
    model = host.require_same(model)  # nothing awaits from here until off_loop leases it
    return await host.off_loop(
        model, large, render_chat, host, model, body, fetched, add_special_tokens, check_length
    )


def render_chat(
    host: ModelHost,
    model: LoadedModel,
    body: ChatCompletionRequest,
    fetched: Mapping[str, bytes],
    add_special_tokens: bool | None = None,
    check_length: bool = True,
) -> tuple[list[int], ToolPlan, list[ImageInput]]:
    """The prompt's token ids as :func:`start_chat` submits them, the tool plan and the
    images (read and placed: ``chat_images.py``; ``fetched``: the bodies of its http(s)
    images); also what counting a request's tokens reads, so a count and a run cannot
    disagree. ``add_special_tokens`` None: the BOS token unless the template writes it itself
    (a second one would change the prompt). ``check_length``: refuse a prompt whose
    characters alone cannot fit the context before tokenizing it (counting routes count it
    anyway). Slow for a long conversation: :func:`render_chat_off_loop` runs it off the
    event loop."""
    template = require_chat_template(model)
    plan = plan_tools(body, template, host.launch.tool_call_parser)
    images = read_images(model, host.launch.media, body, fetched)
    prompt_text = template.render(
        template_messages(body, plan),
        add_generation_prompt=body.add_generation_prompt,
        tools=plan.template_tools,
        extra=body.chat_template_kwargs,
        continue_final_message=body.continue_final_message,
    )
    add_bos = not (template.bos_token and prompt_text.startswith(template.bos_token))
    if add_special_tokens is not None:
        add_bos = add_special_tokens
    if check_length:
        check_prompt_chars(model, prompt_text, "messages")
    prompt_text = expand_image_text(model, prompt_text, images)
    tokens = model.tokenizer.encode(prompt_text, add_special_tokens=add_bos)
    tokens, images = place_images(model, tokens, images)
    return tokens, plan, images


def _sampling_params(
    body: ChatCompletionRequest, plan: ToolPlan, model: LoadedModel
) -> SamplingParams:
    constraint = structured_output_of(body)
    if plan.constraint is not None:
        if constraint is not None:
            raise InvalidRequestError(
                "An output constraint cannot be combined with a forced tool call "
                "(tool_choice 'required' or a named function).",
                param=constraint.param,
            )
        constraint = plan.constraint
    return sampling_params_of(
        body,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        structured_output=constraint,
        defaults=model.sampling_defaults,
    )
