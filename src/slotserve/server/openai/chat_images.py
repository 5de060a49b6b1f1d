"""The images of a chat request, read and made into what the model reads: each user image
part fetched or decoded (``protocol/media.py``, within the model's media policy), turned into
patches by the model's image processor, and its placeholder, which the chat template writes
once per image, repeated to the image's length in the token ids. Runs off the event loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.images import ImageInput, ImagePreparer, ImageTokenizer
from slotserve.hosting.served import LoadedModel
from slotserve.protocol.media import MediaPolicy, read_image
from slotserve.server.openai.protocol import ChatCompletionRequest, ImagePart

TEXT_ONLY = "this model reads text only: image content parts are not accepted"


def image_urls(body: ChatCompletionRequest) -> list[tuple[str, str]]:
    """The request's image URLs in prompt order, each with the field it came from."""
    found = []
    for m, message in enumerate(body.messages):
        if message.role == "user" and isinstance(message.content, list):
            for p, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    found.append((part.image_url.url, f"messages.{m}.content.{p}.image_url"))
    return found


def _preparer(model: LoadedModel) -> ImagePreparer:
    tokenizer = model.tokenizer
    preparer = tokenizer.image_preparer if isinstance(tokenizer, ImageTokenizer) else None
    if preparer is None or not model.info.accepts_images:
        raise InvalidRequestError(TEXT_ONLY, param="messages")
    return preparer


def accepted_image_urls(
    model: LoadedModel, policy: MediaPolicy, body: ChatCompletionRequest
) -> list[tuple[str, str]]:
    """The request's image URLs with their fields, refused before anything is read where the
    model reads no images or the request carries more than the policy takes."""
    urls = image_urls(body)
    if not urls:
        return []
    _preparer(model)
    if len(urls) > policy.max_images:
        raise InvalidRequestError(
            f"the request carries {len(urls)} images; this server takes at most "
            f"{policy.max_images} (--limit-mm-per-prompt)",
            param="messages",
        )
    return urls


def read_images(
    model: LoadedModel,
    policy: MediaPolicy,
    body: ChatCompletionRequest,
    fetched: Mapping[str, bytes],
) -> list[ImageInput]:
    """Every image of the request as the model reads it (offsets not yet set); ``fetched``:
    its http(s) images' bodies (``media_fetch.fetch_images``)."""
    urls = accepted_image_urls(model, policy, body)
    if not urls:
        return []
    preparer = _preparer(model)
    return [preparer.prepare(read_image(url, policy, param, fetched)) for url, param in urls]


def place_images(
    model: LoadedModel, tokens: list[int], images: list[ImageInput]
) -> tuple[list[int], list[ImageInput]]:
    """``tokens`` with each image's placeholder repeated to its length (a run of its length
    stays), and the images with their offsets; refused when the template did not write one
    placeholder per image."""
    if not images:
        return tokens, images
    placeholder = _preparer(model).image_token_id
    runs: list[tuple[int, int]] = []  # (start, length) of each run of placeholders
    for i, token in enumerate(tokens):
        if token != placeholder:
            continue
        if runs and sum(runs[-1]) == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    if len(runs) != len(images) or any(
        n not in (1, image.length) for (_, n), image in zip(runs, images, strict=False)
    ):
        raise InvalidRequestError(
            f"the chat template wrote {len(runs)} image placeholders for {len(images)} "
            "images (is it the model's own template?)",
            param="messages",
        )
    expanded: list[int] = []
    placed: list[ImageInput] = []
    done = 0
    for (at, n), image in zip(runs, images, strict=True):
        expanded += tokens[done:at]
        placed.append(dataclasses.replace(image, offset=len(expanded)))
        expanded += [placeholder] * image.length
        done = at + n
    return expanded + tokens[done:], placed


def expand_image_text(model: LoadedModel, text: str, images: list[ImageInput]) -> str:
    """The rendered prompt with each image's marker written out as the model reads it."""
    return _preparer(model).expand_text(text) if images else text
