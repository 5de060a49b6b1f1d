"""The GGUF header reader gives what the ``gguf`` package's reader gives, and a clear error
for a file that is not a whole GGUF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from slotserve.runners.pytorch.load.gguf_header import GgufHeader


def test_fields_and_tensors_match_the_gguf_package(model_path: Path) -> None:
    header = GgufHeader(model_path)
    reference = GGUFReader(str(model_path))
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert dict(header.fields) == expected
    assert header.array_length("tokenizer.ggml.tokens") == len(expected["tokenizer.ggml.tokens"])
    assert header.array_length("no.such.key") is None
    assert len(header.tensors) == len(reference.tensors)
    for ours, theirs in zip(header.tensors, reference.tensors, strict=True):
        assert ours.name == theirs.name
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data), ours.name


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GgufHeader(path)


def test_a_cut_short_file_is_refused(model_path: Path, tmp_path: Path) -> None:
    whole = model_path.read_bytes()
    for size in (4096, len(whole) // 2):  # inside the vocabulary; inside the tensors' data
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(whole[:size])
        with pytest.raises(ValueError, match=r"cut short|past the end"):
            GgufHeader(path)
