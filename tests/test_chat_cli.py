"""``slotserve chat`` (SPEC C1): the session and its commands with a fake backend, then the
real command in a pseudo-terminal, against a spawned server and with the engine in-process."""

from __future__ import annotations

import asyncio
import fcntl
import io
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from rich.console import Console

from slotserve.chat.backend import ChatBackendError, GenerationOptions, Message, Usage, api_base
from slotserve.chat.session import Action, ChatSession, ReplyStats
from slotserve.chat.terminal import Interrupts, Screen, act
from slotserve.cli import main
from tests.conftest import ServerProcess, _free_port, start_server, stop_server, wait_until

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


# ---- the real command ---------------------------------------------------------------------

CHAT = [sys.executable, "-m", "slotserve.cli", "chat"]
# One thread: these tests share two cores with the server, and llama.cpp threads that wait on
# each other slow down by orders of magnitude when the cores are busy.
IN_PROCESS = [*CHAT, "--threads", "1"]
CHILD_ENV = {
    **os.environ,
    "TERM": "xterm",
    "PROMPT_TOOLKIT_NO_CPR": "1",  # no cursor-position query that nobody answers
    "PYTHONUNBUFFERED": "1",
}
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()=>78]|\r")
STATUS = r"\d+ tokens? · "
PROMPT = r"\n>"  # prompt_toolkit draws the space after it with cursor moves


def _take_terminal() -> None:
    """In the child, after setsid: the pty becomes its controlling terminal, so that ^C
    typed into it raises SIGINT as in a real terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class PtyProcess:
    """A child on a pseudo-terminal; ``expect`` waits, within a deadline, for output."""

    def __init__(self, args: list[str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.process = subprocess.Popen(
            args,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=CHILD_ENV,
            start_new_session=True,
            preexec_fn=_take_terminal,
        )
        os.close(slave)
        self.fd = master
        self.raw = b""
        self.cursor = 0
        self.eof = False

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace"))

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: every copy of the child's side is closed
            data = b""
        self.eof = not data
        self.raw += data

    def expect(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """The first match after the previous one."""
        regex = re.compile(pattern, re.DOTALL)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.text, self.cursor)
            if match:
                self.cursor = match.end()
                return match
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.eof:
                raise AssertionError(f"{pattern!r} not seen; output:\n{self.text[-3000:]}")
            self._read(min(remaining, 1.0))

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 30.0) -> int:
        """The exit status; reads on meanwhile, so the child never blocks on a full pty."""
        deadline = time.monotonic() + timeout
        while not self.eof and time.monotonic() < deadline:
            self._read(0.5)
        return self.process.wait(timeout=max(deadline - time.monotonic(), 1.0))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        os.close(self.fd)


@pytest.fixture
def spawn() -> Iterator[list[PtyProcess]]:
    children: list[PtyProcess] = []
    yield children
    for child in children:
        child.close()


def _spawn(children: list[PtyProcess], *args: str) -> PtyProcess:
    child = PtyProcess(list(args))
    children.append(child)
    return child


@pytest.fixture(scope="module")
def chat_server(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("chat"), "--slots", "2", "--threads", "1")
    yield server
    stop_server(server)


@pytest.mark.model
def test_terminal_chat_with_a_server(
    chat_server: ServerProcess, spawn: list[PtyProcess], tmp_path: Path
) -> None:
    child = _spawn(
        spawn, *CHAT, "--url", chat_server.base_url, "--temperature", "0", "--max-tokens", "12"
    )
    child.expect("/help")
    child.expect(PROMPT)  # typed before the prompt is up, keys would be echoed, not read
    child.send("Hello there\r")
    child.expect(r"Hello there\n(.+?)" + STATUS + r".*cached")
    child.expect(PROMPT)
    child.send("first line\x1b\rsecond line\r")  # Alt-Enter: a newline inside the message
    child.expect(STATUS)
    child.expect(PROMPT)
    saved = tmp_path / "chat.json"
    child.send(f"/save {saved}\r")
    child.expect("saved 4 messages")
    child.expect(PROMPT)
    messages = json.loads(saved.read_text())
    assert messages[2] == {"role": "user", "content": "first line\nsecond line"}
    assert messages[1]["role"] == "assistant" and messages[1]["content"]
    child.send("/exit\r")
    assert child.wait() == 0


@pytest.mark.model
def test_ctrl_c_stops_the_reply_then_exits(
    chat_server: ServerProcess, spawn: list[PtyProcess]
) -> None:
    child = _spawn(
        spawn, *CHAT, "--url", chat_server.base_url, "--temperature", "0", "--max-tokens", "400"
    )
    child.expect("/help")
    child.expect(PROMPT)
    # Greedy, this prompt runs to the 400-token limit: the reply is still streaming below.
    child.send("Write a very long story about a dragon.\r")
    # Streamed text is arriving: a line of it, not prompt_toolkit redrawing the input.
    child.expect(r"dragon\.\n[^>\n]{30}")
    child.send("\x03")
    status = child.expect(STATUS + r"[^\n]*interrupted").group(0)
    assert not status.startswith("400 ")
    child.expect(PROMPT)
    assert wait_until(lambda: chat_server.slots()["num_running"] == 0, timeout=10)
    child.send("\x03")  # at the empty prompt: leave
    assert child.wait() == 130
    assert "Traceback" not in child.text


@pytest.mark.model
def test_quick_in_process(spawn: list[PtyProcess], model_path: Path) -> None:
    child = _spawn(spawn, *IN_PROCESS, "-q", "Say hi", "--max-tokens", "8")
    reply = child.expect(r"loading [^\n]*\n(.+?)" + STATUS).group(1)
    assert reply.strip()
    assert child.wait() == 0


@pytest.mark.model
def test_piped_stdin_in_process(model_path: Path) -> None:
    result = subprocess.run(
        [*IN_PROCESS, "--max-tokens", "8", "--temperature", "0"],
        input="Hello!\n\nWhat is the capital of France?\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=CHILD_ENV,
    )
    assert result.returncode == 0, result.stderr
    assert len(re.findall(STATUS, result.stderr)) == 2, result.stderr  # two turns, two replies
    assert result.stdout.strip() and result.stdout.endswith("\n")
    assert "loading" not in result.stdout


def test_unreachable_server_is_one_line() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    result = subprocess.run(
        [*CHAT, "--url", url, "-q", "hi"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot reach {url}" in lines[0], result.stderr
    assert result.stdout == ""
