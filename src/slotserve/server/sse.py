"""Server-sent event frames, as the streaming answers write them: compact JSON, non-ASCII text
as it is."""

from __future__ import annotations

import json
from typing import Any


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    """One ``data:`` frame, after an ``event:`` line when ``event`` is given."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n" if event is None else f"event: {event}\ndata: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"
