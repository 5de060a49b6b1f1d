"""One call written as a JSON object, ``{"name": "f", "arguments": {...}}``, read as it arrives.

The call's first delta goes out as soon as its name is read; an arguments *object* is then
passed on character by character, so the fragments are its raw text. Arguments given as a
JSON string holding an object, as ``null``, or left out are only known at the end and go out
in one fragment (the decoded string, or ``{}``).
"""

from __future__ import annotations

import json
from enum import Enum

from slotserve.protocol.tool_parsers.events import EventSink
from slotserve.protocol.tool_parsers.json_scan import Member, ObjectScanner

ARGUMENT_KEYS = ("arguments", "parameters")


class CallStatus(Enum):
    MORE = "more"
    DONE = "done"
    FAILED = "failed"


class JsonCallReader:
    """Fed the call object's characters from its ``{``; stop feeding at DONE or FAILED."""

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink
        self._scan = ObjectScanner()
        self._index: int | None = None
        self._sent = 0

    def push(self, c: str) -> CallStatus:
        scan = self._scan
        scan.push(c)
        if scan.failed:
            return CallStatus.FAILED
        if self._index is None and not scan.done:
            self._try_header()
        if self._index is not None:
            self._stream_arguments()
        if not scan.done:
            return CallStatus.MORE
        call = call_from_object(scan)
        if call is None:
            return CallStatus.FAILED
        name, arguments = call
        if self._index is None:
            self._index = self._sink.start_call(name)
        if self._raw_arguments() is not None:
            self._stream_arguments()
        else:
            self._sink.arguments(self._index, arguments)
        return CallStatus.DONE

    def _try_header(self) -> None:
        member = self._scan.member("name")
        if member is None or member.value_start is None or member.value_end is None:
            return
        raw = self._scan.text(member.value_start, member.value_end)
        if not raw.startswith('"'):
            return
        try:
            name = json.loads(raw)
        except ValueError:
            return
        if name:
            self._index = self._sink.start_call(name)

    def _raw_arguments(self) -> Member | None:
        """The arguments member when its value is an object (sent as raw text)."""
        for member in self._scan.members:
            if member.key in ARGUMENT_KEYS:
                start = member.value_start
                return member if start is not None and self._scan.chars[start] == "{" else None
        return None

    def _stream_arguments(self) -> None:
        member = self._raw_arguments()
        if member is None or member.value_start is None or self._index is None:
            return
        end = member.value_end if member.value_end is not None else len(self._scan.chars)
        start = member.value_start + self._sent
        if end > start:
            self._sink.arguments(self._index, self._scan.text(start, end))
            self._sent = end - member.value_start


def call_from_object(scan: ObjectScanner) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a complete call object, or None if it is not a call."""
    try:
        obj = json.loads(scan.text())
    except (ValueError, RecursionError):  # deep nesting ends in RecursionError
        return None
    keys = [m.key for m in scan.members]
    name = obj.get("name") if isinstance(obj, dict) else None
    if len(set(keys)) != len(keys) or not isinstance(name, str) or not name:
        return None
    present = [m for m in scan.members if m.key in ARGUMENT_KEYS]
    if not present:
        return name, "{}"
    if len(present) > 1:
        return None
    member = present[0]
    value = obj[member.key]
    if value is None:
        return name, "{}"
    if isinstance(value, dict) and member.value_start is not None:
        return name, scan.text(member.value_start, member.value_end)
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except (ValueError, RecursionError):
            return None
        return (name, value.strip()) if isinstance(decoded, dict) else None
    return None
