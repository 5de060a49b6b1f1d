"""Another git revision's CPU kernels, built beside this checkout's for the A/B benchmarks
(``attention_ab.py``, ``quant_ab.py``): only the files that revision has."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from slotserve.runners.pytorch.cpu_kernels import SOURCES, compile_module


def build_revision(rev: str, folder: Path, name: str) -> Any:
    """The kernels' sources at ``rev``, compiled in ``folder`` as a module named ``name``."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    sources = folder / "csrc"
    sources.mkdir()
    folder_at_rev = SOURCES.relative_to(root).as_posix()
    listed = subprocess.check_output(
        ["git", "ls-tree", "--name-only", rev, folder_at_rev + "/"], cwd=root, text=True
    )
    for relative in listed.split():
        text = subprocess.check_output(["git", "show", f"{rev}:{relative}"], cwd=root)
        (sources / Path(relative).name).write_bytes(text)
    build = folder / "build"
    build.mkdir()
    return compile_module(sources, name, build)
