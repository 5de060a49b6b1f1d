"""The system text that teaches a tool-unaware model the generic parser's output format."""

from __future__ import annotations

import json

from slotserve.protocol.tool_parsers.base import FunctionTool


def generic_system_prompt(tools: list[FunctionTool], required: bool) -> str:
    lines = ["You can call these tools:", ""]
    for tool in tools:
        lines.append(f"- {tool.name}" + (f": {tool.description}" if tool.description else ""))
        schema = json.dumps(tool.parameters, ensure_ascii=False)
        lines.append(f"  parameters (JSON schema): {schema}")
    lines += ["", "Reply with exactly one JSON object and nothing else."]
    calls = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
    if required:
        lines += [
            "You must call at least one tool, in this form:",
            calls,
        ]
    else:
        lines += [
            "To call one or more tools:",
            calls,
            "To answer without a tool:",
            '{"response": "<your answer>"}',
        ]
    lines.append("The arguments must follow the tool's parameters schema.")
    return "\n".join(lines)
