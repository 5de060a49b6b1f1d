"""The packages import one another in one direction only (``docs/architecture.md``, "What
may import what"): checked statically over every module of every sub-package, and by importing
the engine in a clean interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import slotserve

SRC = Path(slotserve.__file__).parent
BACKENDS = ("torch", "llama_cpp")
HTTP = ("fastapi", "starlette", "uvicorn")

# Engine modules directly in ``engine/``: the vocabulary every part shares.
ENGINE_BASE = "slotserve.engine"

# What the models, the server and the commands are built from: no lower package imports them.
UPPER = tuple(f"slotserve.{name}" for name in ("hosting", "server", "chat", "bench", "replicas"))
# The engine's core and its clients: runners and the text protocol stay below them.
ENGINE_TOP = ("slotserve.engine.core", "slotserve.engine.client")
# The APIs' packages: each turns its wire format into a chat prompt and renders the events.
SERVER_APIS = tuple(f"slotserve.server.{api}" for api in ("openai", "responses", "anthropic"))
# The generation pipeline and what it is built from: they know no API's request.
PIPELINE = tuple(
    f"slotserve.server.{name}"
    for name in ("pipeline", "tool_plan", "events", "generation", "reply_parser")
)

# package → slotserve packages it must not import (a prefix forbids its sub-packages too).
FORBIDDEN_SLOTSERVE = {
    "slotserve.engine": ("slotserve.runners", "slotserve.protocol", *UPPER),
    "slotserve.engine.prefix_cache": ("slotserve.engine.decoding", *ENGINE_TOP),
    "slotserve.engine.decoding": ("slotserve.engine.prefix_cache", *ENGINE_TOP),
    "slotserve.engine.core": ("slotserve.engine.client",),
    "slotserve.runners": (*ENGINE_TOP, "slotserve.protocol", *UPPER),
    "slotserve.protocol": (*ENGINE_TOP, "slotserve.runners", *UPPER),
    "slotserve.hosting": ("slotserve.server", "slotserve.chat", "slotserve.bench"),
    "slotserve.server": ("slotserve.runners", "slotserve.chat", "slotserve.bench"),
    **{module: SERVER_APIS for module in PIPELINE},
}
# The PyTorch runner's layers, bottom up: the quantized weights' formats, the shared decoder
# and its layers (which call the CPU and GPU kernels), the families that map checkpoints onto
# it, the readers that load those checkpoints; the runner's top-level modules stand above.
# package → what of ``slotserve.runners.pytorch`` it may import (its own modules included).
TORCH = "slotserve.runners.pytorch"
TORCH_LAYERS = {
    f"{TORCH}.quant": (f"{TORCH}.quant",),
    f"{TORCH}.model": (
        f"{TORCH}.model",
        f"{TORCH}.quant",
        f"{TORCH}.cpu_kernels",
        f"{TORCH}.gpu_kernels",
        f"{TORCH}.gpu_matmul",
    ),
    f"{TORCH}.families": (f"{TORCH}.families", f"{TORCH}.model"),
    f"{TORCH}.load": (
        f"{TORCH}.load",
        f"{TORCH}.families",
        f"{TORCH}.model",
        f"{TORCH}.quant",
        f"{TORCH}.cpu_kernels",
    ),
}
# package → third-party modules it must not import.
FORBIDDEN_EXTERNAL = {
    "slotserve.engine": BACKENDS + HTTP,
    "slotserve.protocol": BACKENDS + HTTP,
    "slotserve.hosting": HTTP,
    "slotserve.runners": HTTP,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def engine_base_module(module: str) -> bool:
    """A module directly in ``engine/`` (not a sub-package, not ``engine/__init__``)."""
    parts = module.split(".")
    return (
        len(parts) == 3
        and within(module, ENGINE_BASE)
        and (SRC / "engine" / f"{parts[2]}.py").is_file()
    )


def test_every_package_imports_only_what_lies_below_it() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        module = module_name(path)
        for imported in imported_modules(path):
            for package, banned in FORBIDDEN_SLOTSERVE.items():
                if within(module, package):
                    offenders += [
                        f"{module} imports {imported}" for b in banned if within(imported, b)
                    ]
            for package, allowed in TORCH_LAYERS.items():
                if (
                    within(module, package)
                    and within(imported, TORCH)
                    and not any(within(imported, a) for a in allowed)
                ):
                    offenders.append(f"{module} imports {imported}")
            for package, banned in FORBIDDEN_EXTERNAL.items():
                if within(module, package) and imported.split(".")[0] in banned:
                    offenders.append(f"{module} imports {imported}")
            # The shared vocabulary imports no part of the engine built on it.
            if (
                engine_base_module(module)
                and within(imported, ENGINE_BASE)
                and not engine_base_module(imported)
                and imported != ENGINE_BASE
            ):
                offenders.append(f"{module} imports {imported}")
    assert sorted(set(offenders)) == []


def test_no_module_imports_itself_back_through_a_cycle() -> None:
    """Imports, wherever they stand (in functions and ``TYPE_CHECKING`` blocks too), form no
    cycle between modules."""
    trees = {module_name(path): ast.parse(path.read_text()) for path in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, tree in trees.items():
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from package import submodule`` needs the submodule, not the package's names.
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    edges.add(submodule if submodule in trees else node.module)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[module] = {e for e in edges if e in trees and e != module}

    cycles = []
    state: dict[str, int] = {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                cycles.append(" → ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_importing_the_engine_loads_no_backend() -> None:
    engine = SRC / "engine"
    modules = [module_name(p) for p in sorted(engine.rglob("*.py"))]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {BACKENDS + HTTP!r}]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
