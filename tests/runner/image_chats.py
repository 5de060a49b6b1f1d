"""An image question a vision-language server is asked twice through the openai client, by the
image tests of each family (``test_image_server.py``, ``test_gemma3_vision.py``)."""

from __future__ import annotations

from typing import Any


def image_question(url: str) -> Any:
    """The chat messages of "What is in" and the image at ``url``."""
    content = [
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return [{"role": "user", "content": content}]


def ask_twice(client: Any, messages: Any) -> tuple[Any, int]:
    """The same greedy request twice (the same text, both with usage): the first completion,
    and the prompt tokens the second took from the prefix cache."""
    first, again = (
        client.chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=0)
        for _ in range(2)
    )
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None
    return first, details.cached_tokens or 0
