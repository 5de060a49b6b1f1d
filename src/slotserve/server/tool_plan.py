"""What a chat request's tools make of one generation: the parser its reply is read with, the
grammar a forced call is constrained by, what the chat template is given, and whether a forced
named function finishes with ``stop``. The pipeline follows a plan whatever API the request
came in by; how an OpenAI chat request's ``tools`` and ``tool_choice`` become one:
``openai/tool_calling.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotserve.engine.sampling_params import StructuredOutput
from slotserve.protocol.tool_parsers import ToolParser


@dataclass(frozen=True)
class ToolPlan:
    parser: ToolParser | None  # None: replies are plain content
    constraint: StructuredOutput | None  # the grammar of the allowed calls, when forced
    template_tools: list[dict[str, Any]] | None  # what the chat template's ``tools`` gets
    system_prompt: str | None  # the generic format's description of the tools
    named: bool  # a named function was forced: OpenAI then finishes with "stop"

    @property
    def generic(self) -> bool:
        return self.system_prompt is not None


NO_TOOLS = ToolPlan(None, None, None, None, False)
