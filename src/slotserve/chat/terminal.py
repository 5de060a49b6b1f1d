"""The chat's input and output: prompt_toolkit at a terminal, lines from a pipe, one ``-q``
message; replies streamed through rich (plain text when stdout is not a terminal).

Ctrl-C: while a reply streams, SIGINT cancels the task that streams it (the backend then
aborts the request) and the prompt comes back; a second SIGINT before the reply has wound
down, or Ctrl-C at an empty prompt, leaves with status 130. At the prompt, prompt_toolkit reads
Ctrl-C as a key (the terminal is in raw mode), so no signal is involved there.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console

from slotserve.chat.backend import ChatBackendError
from slotserve.chat.session import Action, ChatSession, Outcome, ReplyStats

if TYPE_CHECKING:
    from prompt_toolkit.key_binding import KeyBindings

EXIT_INTERRUPTED = 130  # the shell's convention for "ended by SIGINT"


class Screen:
    """Replies go to stdout; notes (status lines, errors) too when it is a terminal, else to
    stderr, so that ``slotserve chat -q ... > file`` keeps only the reply."""

    def __init__(self, out: Console, notes: Console) -> None:
        self.out = out
        self.notes = notes
        self._mid_line = False
        self._wrote = False

    @classmethod
    def for_stdio(cls) -> Screen:
        # Model text is shown as it is: no markup, emoji codes or highlighting.
        out = Console(markup=False, emoji=False, highlight=False)
        notes = out if out.is_terminal else Console(stderr=True, markup=False, emoji=False)
        return cls(out, notes)

    @property
    def is_terminal(self) -> bool:
        return self.out.is_terminal

    def write(self, text: str) -> None:
        self.out.print(text, end="", soft_wrap=True)
        self._mid_line = not text.endswith("\n")
        self._wrote = True

    def finish_line(self) -> None:
        if self._mid_line:
            self.out.print()
        self._mid_line = self._wrote = False

    def end_reply(self, stats: ReplyStats | None) -> None:
        if not self._wrote and not self.is_terminal:
            self.out.print()  # piped, every reply is one line at least, even an empty one
        self.finish_line()
        if stats is not None:
            self.notes.print(stats.describe(), style="dim", soft_wrap=True)

    def info(self, text: str) -> None:
        self.notes.print(text, style="cyan")

    def error(self, text: str) -> None:
        self.notes.print(text, style="red", soft_wrap=True)


class Interrupts:
    """Owns SIGINT while active (a context manager on the running loop)."""

    def __init__(self) -> None:
        self.exit_requested = False
        # Called when SIGINT arrives with no reply streaming (a signal sent from outside
        # while the prompt waits: the prompt has to be told to stop).
        self.on_exit_request: Callable[[], None] | None = None
        self._reply: asyncio.Task[ReplyStats] | None = None
        self._cuts = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> Interrupts:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # Windows, not main thread
            loop.add_signal_handler(signal.SIGINT, self._on_sigint)
            self._loop = loop
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGINT)
            self._loop = None

    def _on_sigint(self) -> None:
        reply = self._reply
        if reply is not None and not reply.done():
            self._cuts += 1
            if self._cuts > 1:
                self.exit_requested = True
            reply.cancel()
            return
        self.exit_requested = True
        if self.on_exit_request is not None:
            self.on_exit_request()

    async def reply(self, work: Coroutine[Any, Any, ReplyStats]) -> ReplyStats | None:
        """Runs one reply; None when SIGINT cut it short. Raises what the reply raised."""
        task = asyncio.ensure_future(work)
        self._reply, self._cuts = task, 0
        try:
            await asyncio.wait([task])
        finally:
            self._reply = None
            if not task.done():  # we were cancelled ourselves
                task.cancel()
        if task.cancelled():
            return None
        return task.result()


async def act(
    session: ChatSession, outcome: Outcome, screen: Screen, interrupts: Interrupts, keep_going: bool
) -> int | None:
    """Does what a line asked for; an exit status when the chat should end, else None.
    ``keep_going``: at the prompt a failed or interrupted reply is not the end."""
    action = outcome.action
    if action is Action.NOTHING:
        return None
    if action is Action.EXIT:
        return 0
    if action is Action.INFO:
        screen.info(outcome.text)
        return None
    if action is Action.ERROR:
        screen.error(outcome.text)
        return None if keep_going else 1
    work = (
        session.send(outcome.text, screen) if action is Action.SEND else session.regenerate(screen)
    )
    try:
        stats = await interrupts.reply(work)
    except ChatBackendError as exc:
        screen.finish_line()
        screen.error(f"error: {exc}")
        return None if keep_going else 1
    if stats is None:  # interrupted: what streamed is kept (see session.py)
        screen.end_reply(session.last_reply)
        if interrupts.exit_requested or not keep_going:
            return EXIT_INTERRUPTED
        return None
    screen.end_reply(stats)
    return None


async def run_quick(session: ChatSession, message: str, screen: Screen) -> int:
    """``-q``: one message, its reply, done. The message is sent as it is (no commands)."""
    with Interrupts() as interrupts:
        code = await act(session, Outcome(Action.SEND, message), screen, interrupts, False)
    return code or 0


async def run_lines(session: ChatSession, stdin: TextIO, screen: Screen) -> int:
    """stdin is not a terminal: each non-empty line is one user turn (slash commands work);
    ends at EOF, or at the first failed reply (status 1)."""
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    _read_lines(stdin, lines)
    with Interrupts() as interrupts:
        # Ctrl-C while waiting for a line: the reading thread may block forever on the pipe.
        interrupts.on_exit_request = lambda: lines.put_nowait(None)
        while (line := await lines.get()) is not None:
            code = await act(
                session, session.handle(line.rstrip("\r\n")), screen, interrupts, False
            )
            if code is not None:
                return code
        if interrupts.exit_requested:
            return EXIT_INTERRUPTED
    return 0


def _read_lines(stdin: TextIO, lines: asyncio.Queue[str | None]) -> None:
    """Feeds the lines of a pipe or a file to the loop, then None. A daemon thread reads, as
    the loop must go on seeing SIGINT, and a read blocked on an idle pipe must not keep the
    process alive at exit."""
    loop = asyncio.get_running_loop()

    def read() -> None:
        try:
            for line in stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is gone
                loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read, name="slotserve-chat-stdin", daemon=True).start()


async def run_interactive(session: ChatSession, screen: Screen) -> int:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory

    prompt: PromptSession[str] = PromptSession(
        history=InMemoryHistory(),
        key_bindings=_key_bindings(),
        prompt_continuation=lambda width, line, wrap: "." * (width - 1) + " ",
    )
    screen.info(f"{session.backend.model_name} · /help for commands · Ctrl-D or /exit to leave")
    if session.system_prompt:
        screen.info(f"system prompt: {session.system_prompt}")

    def stop_prompt() -> None:
        future = prompt.app.future  # set once the prompt can be told to exit
        if future is not None and not future.done():
            prompt.app.exit(exception=KeyboardInterrupt())

    with Interrupts() as interrupts:
        interrupts.on_exit_request = stop_prompt

        def leave_if_asked() -> None:  # SIGINT came while the prompt was starting
            if interrupts.exit_requested:
                stop_prompt()

        while not interrupts.exit_requested:
            try:
                # The prompt reads Ctrl-C as a key; SIGINT stays ours (see Interrupts).
                line = await prompt.prompt_async("> ", handle_sigint=False, pre_run=leave_if_asked)
            except EOFError:
                return 0
            except KeyboardInterrupt:
                return EXIT_INTERRUPTED
            code = await act(session, session.handle(line), screen, interrupts, True)
            if code is not None:
                return code
    return EXIT_INTERRUPTED


def _key_bindings() -> KeyBindings:
    from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

    bindings = KeyBindings()

    @bindings.add("escape", "enter")  # Alt-Enter arrives as Esc then Enter
    def _newline(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    @bindings.add("c-c")
    def _interrupt(event: KeyPressEvent) -> None:
        # Like a shell: Ctrl-C drops what was typed; at an empty prompt it leaves.
        if event.current_buffer.text:
            event.current_buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt())

    return bindings
