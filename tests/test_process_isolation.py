"""Nothing a test starts outlives it, and a crash fails a test, not the run: the children the
tests spawn die with their parent (``slotserve.parent_death``), and ``make test`` runs the
suite in a worker process that is replaced when native code kills it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[1]


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for whoever adopted it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def test_a_child_started_through_parent_death_dies_with_its_parent() -> None:
    parent_code = textwrap.dedent(
        """
        import subprocess, sys, time
        from slotserve import parent_death
        child = subprocess.Popen(parent_death.command("http.server", "0", "--bind", "127.0.0.1"),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert not _gone(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_until(lambda: _gone(child_pid), timeout=10), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait()


def test_a_program_started_through_parent_death_dies_with_its_parent() -> None:
    parent_code = textwrap.dedent(
        """
        import subprocess, sys, time
        from slotserve import parent_death
        child = subprocess.Popen(parent_death.exec_command(["sleep", "120"]))
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        cmdline = Path(f"/proc/{child_pid}/cmdline")
        assert wait_until(lambda: cmdline.read_text().split("\0")[0] == "sleep")  # exec'd
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_until(lambda: _gone(child_pid), timeout=10), "the program outlived its parent"
    finally:
        parent.kill()
        parent.wait()


def test_a_crashing_test_fails_alone_and_the_run_goes_on(tmp_path: Path) -> None:
    """The Makefile's own pytest flags, over a test that dies of SIGSEGV between two others."""
    flags = re.search(r"^PYTEST_ISOLATED := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert flags, "the Makefile runs the tests without PYTEST_ISOLATED"
    (tmp_path / "test_crash.py").write_text(
        textwrap.dedent(
            """
            import os, signal

            def test_before(): pass
            def test_crash(): os.kill(os.getpid(), signal.SIGSEGV)
            def test_after(): pass
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *flags[1].split()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "1 failed, 2 passed" in done.stdout, done.stdout + done.stderr
    assert "crashed while running 'test_crash.py::test_crash'" in done.stdout
