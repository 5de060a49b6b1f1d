"""A GGUF file's tokenizer, converted by transformers once and read back from the cache by
every later load: the same tokens, special tokens and chat template either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.runners.pytorch.load.tokenizer import HfTokenizer, converted_folder

TEXTS = ["Hello, world!", " ünïcödé  spaces\tand\nlines 123", "<|im_start|>user\nhi<|im_end|>"]


def _seen(tokenizer: HfTokenizer) -> tuple[object, ...]:
    return (
        [tokenizer.encode(text) for text in TEXTS],
        tokenizer.vocab_size,
        tokenizer.chat_template,
        tokenizer.bos_token,
        tokenizer.eos_token,
        sorted(tokenizer.special_ids),
        tokenizer.end_of_generation_ids(()),
    )


def test_a_gguf_tokenizer_is_converted_once_and_read_back_the_same(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOTSERVE_TOKENIZER_CACHE", str(tmp_path))
    saved = converted_folder(model_path)
    assert saved.parent == tmp_path and not saved.exists()
    converted = HfTokenizer.from_gguf(model_path)
    assert (saved / "tokenizer_config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [saved.name]  # no partial folder left
    assert _seen(HfTokenizer.from_gguf(model_path)) == _seen(converted)


def test_an_unreadable_cache_is_converted_again(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOTSERVE_TOKENIZER_CACHE", str(tmp_path))
    saved = converted_folder(model_path)
    saved.mkdir()
    (saved / "tokenizer_config.json").write_text("{not json")
    tokenizer = HfTokenizer.from_gguf(model_path)
    assert tokenizer.encode(TEXTS[0])
    assert "not json" not in (saved / "tokenizer_config.json").read_text()
