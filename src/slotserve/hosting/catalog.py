"""The models of ``--models-dir``, named as llama-server's router names them: a GGUF file
directly in the folder by its name without ``.gguf`` (a split model by its first part), a
sub-folder by the folder's name (an HF model folder with ``config.json``, or a folder holding
one GGUF model)."""

from __future__ import annotations

import re
from pathlib import Path

# llama.cpp's split files: name-00001-of-00003.gguf
_SPLIT = re.compile(r"^(?P<name>.+)-(?P<part>\d{5})-of-\d{5}$")


def scan_models_dir(directory: Path) -> dict[str, Path]:
    """Name → path of every model in ``directory`` (sorted by name; missing folder: none)."""
    found: dict[str, Path] = {}
    if not directory.is_dir():
        return found
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            if (entry / "config.json").is_file():
                found[entry.name] = entry
                continue
            ggufs = _gguf_models(entry)
            if ggufs:
                found[entry.name] = next(iter(ggufs.values()))
        elif entry.suffix == ".gguf":
            found.update(_gguf_models(directory, only=entry))
    return dict(sorted(found.items()))


def _gguf_models(directory: Path, only: Path | None = None) -> dict[str, Path]:
    """The GGUF models of one folder: split models by their first part; projector files
    (``mmproj*``) are not models."""
    models: dict[str, Path] = {}
    files = [only] if only is not None else sorted(directory.glob("*.gguf"))
    for file in files:
        if file.name.startswith("mmproj") or not file.is_file():
            continue
        split = _SPLIT.match(file.stem)
        if split is None:
            models[file.stem] = file
        elif int(split["part"]) == 1:
            models[split["name"]] = file
    return models
