"""``slotserve chat`` (SPEC C1), the real command: in a pseudo-terminal against a spawned server
and with the engine in-process, piped stdin, and an unreachable server."""

from __future__ import annotations

import fcntl
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
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ServerProcess, _free_port, start_server, stop_server, wait_until

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
def test_ctrl_c_in_process_aborts_the_reply_and_the_chat_goes_on(
    spawn: list[PtyProcess], model_path: Path
) -> None:
    # One slot (chat's default): the next reply can only start once the cut one is aborted.
    child = _spawn(spawn, *IN_PROCESS, "--temperature", "0", "--max-tokens", "400")
    child.expect("/help", timeout=120)
    child.expect(PROMPT)
    child.send("Write a very long story about a dragon.\r")
    child.expect(r"dragon\.\n[^>\n]{30}", timeout=60)
    child.send("\x03")
    status = child.expect(STATUS + r"[^\n]*interrupted", timeout=10).group(0)
    assert not status.startswith("400 ")
    child.expect(PROMPT)
    child.send("Say hi\r")
    status = child.expect(r"Say hi\n.+?(" + STATUS + r"[^\n]*)", timeout=60).group(1)
    assert "interrupted" not in status
    child.expect(PROMPT)
    child.send("/exit\r")
    assert child.wait() == 0
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
