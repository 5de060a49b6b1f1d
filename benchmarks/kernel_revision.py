"""Another git revision's CPU kernels, built beside this checkout's for the A/B benchmarks
(``attention_ab.py``, ``quant_ab.py``): only the files that revision has; and its packing of
quantized weights, whose records its kernels read."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from slotserve.runners.pytorch.cpu_kernels import SOURCES, compile_module
from slotserve.runners.pytorch.quant import formats


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


def quant_modules_at(rev: str, folder: Path, names: tuple[str, ...]) -> dict[str, ModuleType]:
    """``quant/<name>.py`` as each was at ``rev`` (``formats``, and ``packing`` where the
    revision packed in numpy), a later one importing the revision's ``formats``."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    package = Path(formats.__file__).parent.relative_to(root / "src").as_posix()
    formats_name = formats.__name__
    modules = {}
    saved = sys.modules[formats_name]
    try:
        for name in names:
            path = folder / f"{name}_at_rev.py"
            path.write_bytes(
                subprocess.check_output(["git", "show", f"{rev}:src/{package}/{name}.py"], cwd=root)
            )
            spec = importlib.util.spec_from_file_location(f"{name}_at_rev", path)
            assert spec is not None and spec.loader is not None
            modules[name] = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = modules[name]  # dataclasses look their module up
            spec.loader.exec_module(modules[name])
            if name == "formats":  # what the revision's packing.py imports
                sys.modules[formats_name] = modules[name]
    finally:
        sys.modules[formats_name] = saved
    return modules
