"""Renders chat messages with the model's own Jinja2 chat template.

Uses Jinja2's sandbox with the conventions HuggingFace templates expect (``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from slotserve.engine.errors import InvalidRequestError


class ChatTemplateError(InvalidRequestError):
    pass


def _raise(message: str) -> NoReturn:
    raise ChatTemplateError(f"The chat template refused the messages: {message}", param="messages")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.bos_token = bos_token
        self._template = env.from_string(source)
        self._eos_token = eos_token

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text. ``extra`` holds the request's ``chat_template_kwargs`` (e.g.
        Qwen3's ``enable_thinking``); ``continue_final_message`` cuts the text right after
        the last (assistant) message's content, so the model continues it."""
        variables = dict(extra or {})
        variables.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self._eos_token,
        )
        if tools is not None:
            variables["tools"] = tools
        try:
            text = self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"The chat template failed: {exc}", param="messages") from exc
        if continue_final_message:
            final = messages[-1].get("content") or ""
            cut = text.rfind(final) if final else -1
            if cut < 0:
                raise ChatTemplateError(
                    "The chat template did not render the final message's content, so it "
                    "cannot be continued.",
                    param="continue_final_message",
                )
            text = text[: cut + len(final)]
        return text
