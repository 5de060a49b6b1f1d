"""``slotserve chat`` (SPEC C1): the session and its commands with a fake backend, and the
command-line checks that need no terminal; the real command in a pseudo-terminal is in
test_chat_terminal.py."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rich.console import Console

from slotserve.chat.backend import ChatBackendError, GenerationOptions, Message, Usage, api_base
from slotserve.chat.session import Action, ChatSession, ReplyStats
from slotserve.chat.terminal import Interrupts, Screen, act
from slotserve.cli import main

# ---- the session, without a model ---------------------------------------------------------


class FakeBackend:
    """Replies "reply N" in two pieces; ``hang`` keeps the stream open after the first piece
    (an endless reply), ``fail`` raises the backend's error instead."""

    model_name = "fake"

    def __init__(self) -> None:
        self.calls: list[list[Message]] = []
        self.hang = False
        self.fail = False
        self.first_piece_sent = asyncio.Event()

    async def stream(
        self, messages: list[Message], options: GenerationOptions
    ) -> AsyncIterator[str | Usage]:
        self.calls.append(messages)
        if self.fail:
            raise ChatBackendError("the server said no")
        yield "reply "
        self.first_piece_sent.set()
        if self.hang:
            await asyncio.Event().wait()
        yield str(len(self.calls))
        yield Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=4)

    async def close(self) -> None:
        pass


class Sink:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text


def _session(system: str | None = None) -> tuple[ChatSession, FakeBackend]:
    backend = FakeBackend()
    return ChatSession(backend, system), backend


def test_send_streams_into_the_history() -> None:
    session, backend = _session("be brief")
    sink = Sink()
    stats = asyncio.run(session.send("hi", sink))
    assert sink.text == "reply 1"
    assert backend.calls[0] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert session.messages()[-1] == {"role": "assistant", "content": "reply 1"}
    assert stats.usage == Usage(10, 2, 4)
    assert stats.pieces == 2
    assert "2 tokens" in stats.describe() and "4 cached" in stats.describe()


def test_system_sets_the_prompt_and_clears_the_history() -> None:
    session, _ = _session("old")
    asyncio.run(session.send("hi", Sink()))
    outcome = session.handle("/system You are a pirate.")
    assert outcome.action is Action.INFO
    assert session.messages() == [{"role": "system", "content": "You are a pirate."}]
    assert session.handle("/system").action is Action.INFO
    assert session.messages() == []


def test_clear_keeps_the_system_prompt() -> None:
    session, _ = _session("sys")
    asyncio.run(session.send("hi", Sink()))
    assert session.handle("/clear").action is Action.INFO
    assert session.messages() == [{"role": "system", "content": "sys"}]


def test_regen_replaces_the_last_reply() -> None:
    session, backend = _session()
    assert session.handle("/regen").action is Action.ERROR  # nothing to regenerate yet
    asyncio.run(session.send("hi", Sink()))
    assert session.handle("/regen").action is Action.REGENERATE
    sink = Sink()
    asyncio.run(session.regenerate(sink))
    assert backend.calls[1] == [{"role": "user", "content": "hi"}]  # the old reply is gone
    assert sink.text == "reply 2"
    assert session.messages() == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "reply 2"},
    ]


def test_save_round_trip(tmp_path: Path) -> None:
    session, _ = _session("sys")
    asyncio.run(session.send("hi", Sink()))
    asyncio.run(session.send("again", Sink()))
    path = tmp_path / "chat.json"
    outcome = session.handle(f"/save {path}")
    assert outcome.action is Action.INFO and "5 messages" in outcome.text
    assert json.loads(path.read_text()) == session.messages()
    assert session.handle(f"/save {tmp_path}/missing/dir/x.json").action is Action.ERROR


def test_read_sends_a_file(tmp_path: Path) -> None:
    session, _ = _session()
    path = tmp_path / "question.txt"
    path.write_text("line one\nline two\n")
    outcome = session.handle(f"/read {path}")
    assert (outcome.action, outcome.text) == (Action.SEND, "line one\nline two\n")
    assert session.handle(f"/read {tmp_path / 'nope.txt'}").action is Action.ERROR
    assert session.handle("/read").action is Action.ERROR


def test_other_lines() -> None:
    session, _ = _session()
    assert session.handle("   ").action is Action.NOTHING
    assert session.handle("/exit").action is Action.EXIT
    assert session.handle("/help").text.count("\n/") >= 6
    assert session.handle("/nope").action is Action.ERROR
    assert (session.handle("//etc is a folder").text) == "/etc is a folder"


def test_an_interrupted_reply_is_kept_and_marked(tmp_path: Path) -> None:
    session, backend = _session()
    backend.hang = True

    async def interrupt() -> None:
        task = asyncio.create_task(session.send("tell me", Sink()))
        await backend.first_piece_sent.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupt())
    assert session.turns[-1].content == "reply " and session.turns[-1].interrupted
    assert session.last_reply is not None and "interrupted" in session.last_reply.describe()
    session.handle(f"/save {tmp_path / 'c.json'}")
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved[-1] == {"role": "assistant", "content": "reply ", "interrupted": True}


def test_a_failed_reply_leaves_the_history_as_it_was() -> None:
    session, backend = _session()
    asyncio.run(session.send("hi", Sink()))
    before = session.messages()
    backend.fail = True
    with pytest.raises(ChatBackendError):
        asyncio.run(session.send("again", Sink()))
    assert session.messages() == before
    with pytest.raises(ChatBackendError):
        asyncio.run(session.regenerate(Sink()))
    assert session.messages() == before  # the old reply is back


def test_act_prints_reply_status_and_errors() -> None:
    out, notes = io.StringIO(), io.StringIO()
    screen = Screen(Console(file=out, markup=False), Console(file=notes, markup=False))
    session, backend = _session()

    async def run(line: str) -> int | None:
        with Interrupts() as interrupts:
            return await act(session, session.handle(line), screen, interrupts, False)

    assert asyncio.run(run("hi")) is None
    assert out.getvalue() == "reply 1\n"
    assert "2 tokens" in notes.getvalue()
    backend.fail = True
    assert asyncio.run(run("hi")) == 1
    assert "the server said no" in notes.getvalue()


def test_status_line_speed() -> None:
    stats = ReplyStats(started=0.0, first_text=1.0, last_text=2.0, pieces=11)
    assert stats.describe() == "~11 tokens · 10.0 tok/s · first token 1.00 s"


def test_api_base() -> None:
    assert api_base("http://h:1") == "http://h:1/v1"
    assert api_base("http://h:1/v1/") == "http://h:1/v1"


def test_model_and_url_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "model.gguf", "--url", "http://127.0.0.1:1"]) == 2
    assert "not both" in capsys.readouterr().err
