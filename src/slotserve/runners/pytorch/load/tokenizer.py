"""The HF tokenizer behind the engine's ``Tokenizer`` protocol, from an HF folder
(``tokenizer.json`` + ``tokenizer_config.json``) or a GGUF file's metadata (transformers
converts it).

The detokenizer needs each token's raw bytes: byte-level BPE vocabularies (GPT-2 style: Llama 3,
SmolLM2, Qwen) spell bytes with printable stand-in characters, SentencePiece ones (Gemma,
Llama 2) spell a space as "▁" and keep bytes as ``<0xNN>`` tokens. Both are mapped back once,
at load.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from slotserve.engine.images import ImagePreparer

# Special tokens that end a turn in the chat templates of the supported families.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|endoftext|>")

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def converted_folder(gguf: Path) -> Path:
    """Where a GGUF file's converted tokenizer is kept: ``SLOTSERVE_TOKENIZER_CACHE``, else
    ``~/.cache/slotserve/tokenizers``, by the file's path, size and modification time (and
    transformers' version, whose conversion it is)."""
    import transformers

    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    root = os.environ.get("SLOTSERVE_TOKENIZER_CACHE")
    folder = Path(root) if root else Path.home() / ".cache" / "slotserve" / "tokenizers"
    return folder / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save(tokenizer: Any, saved: Path) -> None:
    """Written beside, then renamed into place: a reader never sees half a folder, and of two
    loads saving at once one folder stays."""
    saved.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=saved.parent))
    try:
        tokenizer.save_pretrained(str(partial))
        partial.rename(saved)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class HfTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.vocab_size = len(tokenizer)
        special = {int(i) for i in tokenizer.all_special_ids}
        for token_id, added in tokenizer.added_tokens_decoder.items():
            if added.special:
                special.add(int(token_id))
        self.special_ids = frozenset(special)
        pieces = tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        byte_level = type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"
        self._bytes = [
            b"" if i in special or piece is None else _piece_bytes(piece, byte_level)
            for i, piece in enumerate(pieces)
        ]
        self._pieces = [piece or "" for piece in pieces]
        # A vision-language model's (``HfFolder.tokenizer``): an image → its patches and
        # placeholder tokens.
        self.image_preparer: ImagePreparer | None = None

    @classmethod
    def from_folder(cls, folder: Path) -> HfTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(folder)))

    @classmethod
    def from_gguf(cls, path: Path) -> HfTokenizer:
        """transformers' conversion of the file's vocabulary takes seconds: it is saved once
        (``converted_folder``) and read from there by every later load, a restarted engine's
        included."""
        from transformers import AutoTokenizer

        saved = converted_folder(path)
        if (saved / "tokenizer_config.json").is_file():
            try:
                return cls(AutoTokenizer.from_pretrained(str(saved)))
            except Exception:  # unreadable, whatever the reason: converted again
                shutil.rmtree(saved, ignore_errors=True)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        with contextlib.suppress(OSError):  # a read-only cache: converted every time
            _save(tokenizer, saved)
        return cls(tokenizer)

    @property
    def chat_template(self) -> str | None:
        template = self._tok.chat_template
        return template if isinstance(template, str) else None

    @property
    def bos_token(self) -> str:
        return str(self._tok.bos_token or "")

    @property
    def eos_token(self) -> str:
        return str(self._tok.eos_token or "")

    def end_of_generation_ids(self, configured: tuple[int, ...]) -> frozenset[int]:
        """The model's EOS ids, the tokenizer's, and the special tokens that end a turn."""
        ids = set(configured)
        if self._tok.eos_token_id is not None:
            ids.add(int(self._tok.eos_token_id))
        for token_id in self.special_ids:
            if self._pieces[token_id] in END_OF_TURN:
                ids.add(token_id)
        return frozenset(i for i in ids if 0 <= i < self.vocab_size)

    @property
    def sep_token_id(self) -> int | None:
        """BERT's segment separator ([SEP]); None for a tokenizer without one."""
        sep = self._tok.sep_token_id
        return None if sep is None else int(sep)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_pair(self, first: str, second: str) -> list[int]:
        return list(self._tok(first, second)["input_ids"])

    def vocabulary_id(self, token: str) -> int | None:
        """The id of one whole token of the vocabulary, spelled as the vocabulary spells it
        (``convert_tokens_to_ids``); None when there is no such token."""
        token_id = self._tok.convert_tokens_to_ids(token)
        if token_id is None or token_id == self._tok.unk_token_id:
            return None
        return int(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < self.vocab_size else b""

    def token_text(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:
            return ""
        if token_id in self.special_ids:
            return self._pieces[token_id]
        return self._bytes[token_id].decode("utf-8", errors="replace")


def _piece_bytes(piece: str, byte_level: bool) -> bytes:
    if byte_level:
        decoder = _byte_decoder()
        if all(ch in decoder for ch in piece):
            return bytes(decoder[ch] for ch in piece)
        return piece.encode("utf-8")  # an added, non-special token spelled plainly
    match = _BYTE_TOKEN.match(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace("▁", " ").encode("utf-8")
