"""Renders chat messages with the model's own Jinja2 chat template (SPEC E9).

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

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self._eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"The chat template failed: {exc}", param="messages") from exc
