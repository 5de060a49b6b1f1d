"""``python -m tests.server.gated_serve serve ...``: the real ``slotserve`` CLI whose model load
waits until the file named by ``$SLOTSERVE_TEST_LOAD_GATE`` exists, so a test can act while the
server listens with its model still loading (the window is otherwise about a second long).

Only the runner factory is wrapped: the server, its routes and its engine are the real ones.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotserve import cli
from slotserve.hosting import launch as model_launch

GATE_ENV = "SLOTSERVE_TEST_LOAD_GATE"
GATE_TIMEOUT_S = 120.0

_factory = model_launch.runner_factory


@dataclass(frozen=True)
class GatedSpec:
    """The real runner spec whose build first waits for the gate file; picklable, so it
    works in the engine process (which builds the runner) as on an engine thread."""

    inner: Any
    gate: Path

    def __call__(self) -> Any:
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not self.gate.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test never opened the load gate {self.gate}")
            time.sleep(0.02)  # polling the gate file (a state), bounded by the deadline
        return self.inner()

    def frontend(self) -> Any:
        return self.inner.frontend()

    def memory_needed(self) -> Any:
        return self.inner.memory_needed()


def _gated_factory(*args: Any, **kwargs: Any) -> GatedSpec:
    return GatedSpec(_factory(*args, **kwargs), Path(os.environ[GATE_ENV]))


model_launch.runner_factory = _gated_factory

if __name__ == "__main__":
    sys.exit(cli.main())
