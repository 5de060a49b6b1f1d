"""A replica's ``slotserve serve`` (``python -m slotserve.replicas.child PARENT_PID serve ...``),
started by ``replica.py``: it asks the kernel for SIGTERM when the actor's process dies
(``PR_SET_PDEATHSIG``), then runs the command line.

NOTE: set here, in the new process, rather than by a ``preexec_fn``: a ``preexec_fn`` runs
Python between ``fork`` and ``exec`` in a Ray actor, whose gRPC threads then break the child
(it aborted now and then at start-up); without one, ``subprocess`` starts the child by
``vfork``/``posix_spawn`` and runs nothing of the parent's in it.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with(parent_pid: int) -> None:
    """SIGTERM when ``parent_pid`` dies (Linux); exits at once if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before the request took hold
        sys.exit(1)


if __name__ == "__main__":
    die_with(int(sys.argv[1]))
    # The command line as slotserve's own, without this module's name and the parent's pid.
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    runpy.run_module("slotserve.cli", run_name="__main__", alter_sys=True)
