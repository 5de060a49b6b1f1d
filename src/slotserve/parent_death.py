"""Child processes that die with their parent (Linux's ``PR_SET_PDEATHSIG``).

``python -m slotserve.parent_death PARENT_PID MODULE [ARGS...]`` runs ``MODULE`` as
``python -m MODULE ARGS...`` would, after asking the kernel for SIGTERM when ``PARENT_PID``
dies; ``... PARENT_PID --exec PROGRAM [ARGS...]`` becomes ``PROGRAM`` (the request survives
``execve``). A replica's ``slotserve serve`` (Ray may kill its actor at any time), every
server a test spawns (the test process may die of a signal) and the servers a benchmark
compares then leave nothing running.

NOTE: the death signal is asked for here, in the new process, rather than by a
``preexec_fn``: a ``preexec_fn`` runs Python between ``fork`` and ``exec`` in a parent that may
hold other threads (a Ray actor's gRPC threads broke the child now and then at start-up);
without one, ``subprocess`` starts the child by ``vfork``/``posix_spawn`` and runs nothing of
the parent's in it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with(parent_pid: int, death_signal: int = signal.SIGTERM) -> None:
    """``death_signal`` to this process when ``parent_pid`` dies (Linux; elsewhere nothing);
    exits at once if the parent has already gone."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the death signal was set
        os._exit(1)


def command(module: str, *args: str) -> list[str]:
    """The command line running ``python -m module args`` as a child of this process that
    dies with it."""
    return [sys.executable, "-m", "slotserve.parent_death", str(os.getpid()), module, *args]


def exec_command(argv: list[str]) -> list[str]:
    """The command line running the program ``argv`` as a child of this process that dies
    with it."""
    return [sys.executable, "-m", "slotserve.parent_death", str(os.getpid()), "--exec", *argv]


if __name__ == "__main__":
    die_with(int(sys.argv[1]))
    if sys.argv[2] == "--exec":
        os.execvp(sys.argv[3], sys.argv[3:])
    module = sys.argv[2]
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
