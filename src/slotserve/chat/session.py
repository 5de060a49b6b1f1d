"""The conversation and its slash commands, apart from any terminal (tests drive it directly).

A reply cut short (Ctrl-C: the task running :meth:`ChatSession.send` is cancelled) stays in
the history with the text it had, marked ``interrupted``: the model sees it as its answer in
the next turn, ``/regen`` replaces it, ``/save`` writes it with ``"interrupted": true``. A
reply cancelled before any text, and a request that failed, leave the history as it was
before the message (the message itself is still in the prompt's input history).
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from slotserve.chat.backend import ChatBackend, GenerationOptions, Message, Usage

HELP = """\
/system TEXT   set the system prompt and clear the history (/system alone removes it)
/clear         clear the history (the system prompt stays)
/regen         drop the last reply and generate it again
/read FILE     send the text of FILE as your message
/save FILE     write the conversation to FILE as JSON messages
/help          this list
/exit          leave (so do Ctrl-D, and Ctrl-C at an empty prompt)
//TEXT         send /TEXT, a message that begins with a slash
Enter sends; Alt-Enter (or Esc then Enter) starts a new line; Ctrl-C stops a reply."""


class ReplySink(Protocol):
    def write(self, text: str) -> None:
        """Shows a piece of the reply as it arrives."""
        ...


@dataclass
class Turn:
    role: Literal["user", "assistant"]
    content: str
    interrupted: bool = False


@dataclass
class ReplyStats:
    """What the status line shows. ``pieces`` counts text pieces as they streamed (about one
    token each); the usage, when the reply finished, has the exact counts."""

    started: float = field(default_factory=time.monotonic)
    first_text: float | None = None
    last_text: float | None = None
    ended: float | None = None
    pieces: int = 0
    usage: Usage | None = None
    interrupted: bool = False

    @property
    def tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else self.pieces

    def describe(self) -> str:
        tokens = self.tokens
        approx = "" if self.usage is not None else "~"
        parts = [f"{approx}{tokens} token{'' if tokens == 1 else 's'}"]
        if self.first_text is not None and self.last_text is not None and tokens > 1:
            # Decode speed: the time to the first token is prompt work, shown apart.
            span = self.last_text - self.first_text
            if span > 0:
                parts.append(f"{(tokens - 1) / span:.1f} tok/s")
        if self.usage is not None:
            parts.append(
                f"prompt {self.usage.prompt_tokens} tokens, {self.usage.cached_tokens} cached"
            )
        if self.first_text is not None:
            parts.append(f"first token {self.first_text - self.started:.2f} s")
        if self.interrupted:
            parts.append("interrupted")
        return " · ".join(parts)


class Action(enum.Enum):
    NOTHING = "nothing"  # an empty line
    SEND = "send"  # generate a reply to ``text``
    REGENERATE = "regenerate"
    INFO = "info"  # show ``text``
    ERROR = "error"  # show ``text`` as a mistake
    EXIT = "exit"


@dataclass(frozen=True)
class Outcome:
    action: Action
    text: str = ""


class ChatSession:
    def __init__(
        self,
        backend: ChatBackend,
        system_prompt: str | None = None,
        options: GenerationOptions | None = None,
    ) -> None:
        self.backend = backend
        self.system_prompt = system_prompt or None
        self.options = options or GenerationOptions()
        self.turns: list[Turn] = []
        self.last_reply: ReplyStats | None = None

    def messages(self) -> list[Message]:
        """What the model is sent: the system prompt, then the turns."""
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.extend({"role": t.role, "content": t.content} for t in self.turns)
        return messages

    def handle(self, line: str) -> Outcome:
        """What a line typed at the prompt asks for; commands that need no reply are done here."""
        if not line.strip():
            return Outcome(Action.NOTHING)
        if line.startswith("//"):  # a message that itself begins with a slash
            return Outcome(Action.SEND, line[1:])
        if not line.startswith("/"):
            return Outcome(Action.SEND, line)
        name, *more = line.split(maxsplit=1)
        rest = more[0].strip() if more else ""
        if name == "/system":
            self.system_prompt = rest or None
            self.turns.clear()
            said = "system prompt set" if rest else "system prompt removed"
            return Outcome(Action.INFO, f"{said}; history cleared")
        if name == "/clear":
            self.turns.clear()
            return Outcome(Action.INFO, "history cleared")
        if name == "/regen":
            if not self.turns or self.turns[-1].role != "assistant":
                return Outcome(Action.ERROR, "no reply to regenerate")
            return Outcome(Action.REGENERATE)
        if name == "/read":
            return self._read(rest)
        if name == "/save":
            return self._save(rest)
        if name == "/help":
            return Outcome(Action.INFO, HELP)
        if name in ("/exit", "/quit"):
            return Outcome(Action.EXIT)
        return Outcome(Action.ERROR, f"unknown command {name}; /help lists them")

    def _read(self, path: str) -> Outcome:
        if not path:
            return Outcome(Action.ERROR, "usage: /read FILE")
        try:
            text = Path(path).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as exc:
            return Outcome(Action.ERROR, f"cannot read {path}: {exc}")
        if not text.strip():
            return Outcome(Action.ERROR, f"{path} is empty")
        return Outcome(Action.SEND, text)

    def _save(self, path: str) -> Outcome:
        if not path:
            return Outcome(Action.ERROR, "usage: /save FILE")
        messages: list[dict[str, Any]] = [dict(m) for m in self.messages()]
        offset = 1 if self.system_prompt else 0
        for turn, message in zip(self.turns, messages[offset:], strict=True):
            if turn.interrupted:
                message["interrupted"] = True
        try:
            Path(path).expanduser().write_text(json.dumps(messages, indent=2, ensure_ascii=False))
        except OSError as exc:
            return Outcome(Action.ERROR, f"cannot write {path}: {exc}")
        return Outcome(Action.INFO, f"saved {len(messages)} messages to {path}")

    async def send(self, text: str, sink: ReplySink) -> ReplyStats:
        """Adds the user's message and streams the model's reply into the history.

        Raises ``ChatBackendError`` (the history is left as it was) and ``CancelledError``
        (see the module's docstring)."""
        before = list(self.turns)
        self.turns.append(Turn("user", text))
        return await self._generate(sink, before)

    async def regenerate(self, sink: ReplySink) -> ReplyStats:
        """Replaces the last reply with a new one; on failure the old one is kept."""
        before = list(self.turns)
        if self.turns and self.turns[-1].role == "assistant":
            self.turns.pop()
        return await self._generate(sink, before)

    async def _generate(self, sink: ReplySink, before: list[Turn]) -> ReplyStats:
        stats = self.last_reply = ReplyStats()
        messages = self.messages()
        reply = Turn("assistant", "")
        self.turns.append(reply)
        try:
            async for event in self.backend.stream(messages, self.options):
                if isinstance(event, Usage):
                    stats.usage = event
                    continue
                now = time.monotonic()
                if stats.first_text is None:
                    stats.first_text = now
                stats.last_text = now
                stats.pieces += 1
                reply.content += event
                sink.write(event)
        except asyncio.CancelledError:
            stats.interrupted = reply.interrupted = True
            if not reply.content:
                self.turns[:] = before
            raise
        except BaseException:
            self.turns[:] = before
            raise
        finally:
            stats.ended = time.monotonic()
        return stats
