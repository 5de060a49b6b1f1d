"""How a chat request's ``tools`` and ``tool_choice`` shape the prompt, the constraint on the
output and the parsing of calls.

* ``none`` (or no tools): the template gets no tools; the reply is plain content.
* ``auto``: the template gets the tools; the reply is parsed in the format the template
  teaches (``--tool-call-parser`` overrides): calls become ``tool_calls``, anything that does
  not parse stays content.
* ``required`` / a named function: constrained decoding against a grammar of the allowed calls
  (``tool_parsers``), so the call always parses and matches its parameters' schema.

The plan is :class:`slotserve.server.tool_plan.ToolPlan`, which the pipeline follows.

A template that knows nothing of tools gets the ``generic`` format, as llama.cpp's generic
handler does: the tools are described in a system message and the output is one JSON object,
constrained for ``auto`` too (either calls or ``{"response": ...}``).
"""

from __future__ import annotations

import json
from typing import Any

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.sampling_params import StructuredOutput
from slotserve.protocol.chat_template import ChatTemplate
from slotserve.protocol.tool_parsers import (
    FunctionTool,
    generic_system_prompt,
    get_tool_parser,
    parser_for_template,
)
from slotserve.server.openai.protocol import ChatCompletionRequest, ImagePart, TextPart
from slotserve.server.tool_plan import NO_TOOLS, ToolPlan


def plan_tools(
    body: ChatCompletionRequest, template: ChatTemplate, parser_name: str | None
) -> ToolPlan:
    """The plan for ``body``; ``InvalidRequestError`` for inconsistent tool fields."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError(
                "'tool_choice' is only allowed when 'tools' are given.", param="tool_choice"
            )
        return NO_TOOLS
    tools = [
        FunctionTool(t.function.name, t.function.description, dict(t.function.parameters or {}))
        for t in body.tools
    ]
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("Tool names must be unique.", param="tools")
    if choice == "none":
        return NO_TOOLS
    parser = get_tool_parser(parser_name) if parser_name else parser_for_template(template.source)
    generic = parser.name == "generic"
    parallel = body.parallel_tool_calls is not False
    named = not isinstance(choice, str) and choice is not None
    if named:
        assert choice is not None and not isinstance(choice, str)
        wanted = [tool for tool in tools if tool.name == choice.function.name]
        if not wanted:
            raise InvalidRequestError(
                f"tool_choice names '{choice.function.name}', which is not among the tools "
                f"({', '.join(names)}).",
                param="tool_choice",
            )
        grammar = parser.grammar(wanted, required=True, parallel=False)
    elif choice == "required":
        grammar = parser.grammar(tools, required=True, parallel=parallel)
    elif generic:  # auto, on a template without tools: calls or an answer, as JSON
        grammar = parser.grammar(tools, required=False, parallel=parallel)
    else:
        grammar = None
    return ToolPlan(
        parser=parser,
        constraint=StructuredOutput("lark", grammar, "tools") if grammar else None,
        template_tools=None if generic else [t.model_dump(exclude_none=True) for t in body.tools],
        system_prompt=generic_system_prompt(tools, required=choice == "required" or named)
        if generic
        else None,
        named=named,
    )


def template_messages(body: ChatCompletionRequest, plan: ToolPlan) -> list[dict[str, Any]]:
    """The request's messages as the chat template reads them: text parts joined, earlier
    thinking as ``reasoning_content``, tool-call arguments decoded to mappings (templates would
    double-encode a JSON string), and for the generic format calls and results written as the
    JSON the model is asked for."""
    messages: list[dict[str, Any]] = []
    for message in body.messages:
        content: Any = message.content
        if isinstance(content, list) and any(isinstance(p, ImagePart) for p in content):
            # The template writes its image placeholder where each image stands.
            content = [
                {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in content
            ]
        elif isinstance(content, list):
            content = "".join(part.text for part in content if isinstance(part, TextPart))
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.role == "assistant" and message.reasoning_content:
            # Templates of thinking models read it (most show only the latest turn's);
            # the others ignore the key.
            entry["reasoning_content"] = message.reasoning_content
        if message.role == "assistant" and message.tool_calls:
            calls = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
            if plan.generic:
                wire = [c["function"] for c in calls]
                entry["content"] = json.dumps({"tool_calls": wire}, ensure_ascii=False)
            else:
                entry["tool_calls"] = calls
        if message.role == "tool":
            if plan.generic:  # a template without tools may know no "tool" role
                result = {"tool_call_id": message.tool_call_id, "content": content}
                entry = {"role": "user", "content": json.dumps({"tool_response": result})}
            else:
                entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    if plan.system_prompt:
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{plan.system_prompt}"
        else:
            messages.insert(0, {"role": "system", "content": plan.system_prompt})
    return messages


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequestError(
            f"A tool call's arguments must be JSON text; got {text[:80]!r}.", param="messages"
        ) from None
