"""The engine must not depend on any backend or on HTTP (the project's conventions, in
``shared/STYLE.md`` beside the repository: "engine/ imports neither torch nor llama_cpp";
ARCHITECTURE.md, "Data flow"); checked both statically and by importing it in a clean
interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import slotserve.engine

FORBIDDEN = ("torch", "llama_cpp", "fastapi", "starlette", "uvicorn")
ENGINE_DIR = Path(slotserve.engine.__file__).parent


def test_engine_sources_import_no_backend_or_http_module() -> None:
    offenders = []
    for path in ENGINE_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_importing_the_engine_loads_no_backend() -> None:
    modules = [f"slotserve.engine.{p.stem}" for p in ENGINE_DIR.glob("*.py")]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
