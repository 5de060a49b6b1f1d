"""Checks a request against the model's limits before any device work, so that a request that
cannot fit is refused before it is queued.

Messages follow OpenAI's ``context_length_exceeded`` wording, so clients that parse it (to
trim a chat history, say) keep working.
"""

from __future__ import annotations

from slotserve.engine.config import EngineConfig
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.decoding.structured_output import check_structured_output
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.images import check_images
from slotserve.engine.runner_interface import ModelInfo, RequestChecker
from slotserve.engine.sampling_params import SamplingParams

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def check_request(
    info: ModelInfo, config: EngineConfig, prompt_token_ids: list[int], params: SamplingParams
) -> int:
    """Raises ``InvalidRequestError`` when the request cannot be served; returns the room left
    for output (``max_seq_len`` minus the prompt)."""
    if not prompt_token_ids:
        raise InvalidRequestError("The prompt must not be empty.", param="prompt")
    if any(t < 0 or t >= info.vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(
            f"Prompt token ids must be in [0, {info.vocab_size}).", param="prompt"
        )
    limit = info.max_seq_len
    num_prompt = len(prompt_token_ids)
    if params.embed:
        return _check_embedding(info, config, num_prompt)
    if not info.can_generate:
        raise InvalidRequestError(
            f"The model {info.name} is {info.routes_served}.",
            param="model",
        )
    if num_prompt >= limit:
        # One position must be left to generate into.
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"resulted in {num_prompt} tokens, and at least one more is needed for the "
            f"completion. Please reduce the length of the prompt.",
            param="prompt",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    room = limit - num_prompt
    if params.max_tokens is not None and params.max_tokens > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
            f"{params.max_tokens} for the completion). Please reduce the length of the prompt "
            f"or the completion (at most {room} completion tokens fit).",
            param="max_tokens",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    if params.n > config.num_slots:
        raise InvalidRequestError(
            f"'n' must not exceed the number of slots ({config.num_slots}).", param="n"
        )
    params.validate_against_vocab(info.vocab_size)
    return room


def _check_embedding(info: ModelInfo, config: EngineConfig, num_prompt: int) -> int:
    if not info.can_embed:
        raise InvalidRequestError(
            f"The model {info.name} does not serve embeddings.", param="model"
        )
    # An encoder runs a prompt in one chunk (scheduler invariant 10); the whole context
    # otherwise: an embedding generates nothing, so it may fill it.
    limit = (
        min(info.max_seq_len, config.max_batch_tokens) if info.bidirectional else info.max_seq_len
    )
    if num_prompt > limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, your input "
            f"resulted in {num_prompt} tokens. Please reduce the length of the input.",
            param="input",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    return 0


def validate_request(
    checker: RequestChecker, config: EngineConfig, request: EngineCoreRequest
) -> None:
    """Raises ``InvalidRequestError`` when the request cannot be served, structured-output
    spec included. Any thread: it only reads what the runner (or the API process's frontend)
    fixed at load time."""
    priority, params = request.priority, request.params
    if priority != 0 and config.schedule_policy != "priority":
        raise InvalidRequestError(
            f"'priority' is {priority}, but this server schedules {config.schedule_policy}: "
            "start it with --schedule-policy priority to order requests by it.",
            param="priority",
        )
    if request.adapter and checker.model_info.lora_unsupported:
        raise InvalidRequestError(checker.model_info.lora_unsupported, param="model")
    info = checker.model_info
    prompt = request.prompt_token_ids
    whole = min(config.prefill_chunk, config.max_batch_tokens - config.num_slots)
    check_images(request.images, prompt, info.accepts_images, whole if info.whole_images else None)
    check_request(checker.model_info, config, prompt, params)
    if params.structured_output is not None:
        check_structured_output(params.structured_output)
