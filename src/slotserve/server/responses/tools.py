"""The Responses tools as the chat pipeline's function tools, and the model's calls back as
the items the client expects.

The pipeline (templates, tool-call parsers, forced-call grammars) knows one kind of tool: a
function taking a JSON object. So:

* a ``function`` tool is one as it is;
* a ``namespace`` tool's functions are offered as ``<namespace>__<name>`` (the double
  underscore is the convention MCP bridges use, and valid in every tool-name pattern), the
  namespace's description leading each one's; a call comes back as the function's own name
  with ``namespace`` set, as OpenAI returns it;
* a ``custom`` (free-form) tool is a function of one string parameter ``input``, its format
  (a grammar or plain text) told in that parameter's description; a call comes back as a
  ``custom_tool_call`` whose ``input`` is that string. The grammar is described, not enforced:
  a forced call is constrained to the JSON wrapper, and a Lark grammar inside a JSON string
  would need escaping rules llguidance cannot express;
* hosted tools are left out (``protocol.HOSTED_TOOL_TYPES``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from slotserve.engine.errors import InvalidRequestError
from slotserve.server.responses.protocol import (
    CustomChoice,
    CustomToolParam,
    FunctionChoice,
    FunctionToolParam,
    NamespaceToolParam,
    ResponsesRequest,
)

NAMESPACE_SEPARATOR = "__"


@dataclass(frozen=True)
class ToolRef:
    """What a name the model sees stands for."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None = None


@dataclass
class ToolNames:
    """The model-facing name of every offered tool, and back."""

    refs: dict[str, ToolRef] = field(default_factory=dict)

    def ref(self, flat: str) -> ToolRef:
        """What a called name stands for; a name no tool has (a call the parser let through)
        is taken as a plain function."""
        return self.refs.get(flat) or ToolRef("function", flat)


def flat_name(name: str, namespace: str | None) -> str:
    """The name the model knows a tool by."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def chat_tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]], ToolNames]:
    """The chat ``tools`` for the request's tools; ``InvalidRequestError`` when two offered
    tools would reach the model under one name."""
    names = ToolNames()
    tools: list[dict[str, Any]] = []

    def offer(
        tool: FunctionToolParam | CustomToolParam, namespace: NamespaceToolParam | None
    ) -> None:
        flat = flat_name(tool.name, namespace.name if namespace else None)
        if flat in names.refs:
            raise InvalidRequestError(
                f"Tool name '{flat}' is given twice (namespace tools are offered to the model "
                f"as '<namespace>{NAMESPACE_SEPARATOR}<name>').",
                param="tools",
            )
        names.refs[flat] = ToolRef(tool.type, tool.name, namespace.name if namespace else None)
        description = tool.description
        if namespace is not None:
            description = "\n".join(filter(None, [namespace.description, description]))
        function: dict[str, Any] = {"name": flat}
        if description:
            function["description"] = description
        if isinstance(tool, FunctionToolParam):
            if tool.parameters is not None:
                function["parameters"] = tool.parameters
            if tool.strict is not None:
                function["strict"] = tool.strict
        else:
            function["parameters"] = _custom_parameters(tool)
        tools.append({"type": "function", "function": function})

    for tool in body.tools or []:
        if isinstance(tool, NamespaceToolParam):
            for inner in tool.tools:
                offer(inner, tool)
        elif isinstance(tool, FunctionToolParam | CustomToolParam):
            offer(tool, None)
    return tools, names


def _custom_parameters(tool: CustomToolParam) -> dict[str, Any]:
    fmt = tool.format
    if fmt is None or fmt.type == "text":
        hint = "The tool's input, as free-form text."
    else:
        what = "Lark grammar" if fmt.syntax == "lark" else "regular expression"
        hint = f"The tool's input, as text matching this {what}:\n{fmt.definition}"
    return {
        "type": "object",
        "properties": {"input": {"type": "string", "description": hint}},
        "required": ["input"],
        "additionalProperties": False,
    }


def chat_tool_choice(
    body: ResponsesRequest, tools: list[dict[str, Any]]
) -> str | dict[str, Any] | None:
    """The chat ``tool_choice``. With only hosted tools nothing is offered, so ``auto`` means
    no tools; forcing a call then cannot be honoured."""
    choice = body.tool_choice
    if not tools:
        if choice == "required" or isinstance(choice, FunctionChoice | CustomChoice):
            raise InvalidRequestError(
                "tool_choice asks for a tool call, but none of 'tools' can run on this server "
                "(hosted tools such as web_search are accepted and left out).",
                param="tool_choice",
            )
        return None
    if isinstance(choice, FunctionChoice | CustomChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def call_input(arguments: str) -> str:
    """A custom tool's input from the JSON wrapper the model wrote; text that is not the
    wrapper is taken as the input itself, rather than lost."""
    try:
        wrapper = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(wrapper, dict) and isinstance(wrapper.get("input"), str):
        return str(wrapper["input"])
    return arguments


def wrapped_input(text: str) -> str:
    """A custom tool call's input as the arguments the model wrote it as."""
    return json.dumps({"input": text}, ensure_ascii=False)
