"""What identifies a model's weights cheaply: saved KV states (the prefix cache's disk tier) are
only valid for the weights that computed them, and hashing every byte of a multi-gigabyte file
at each start would cost seconds. Two different checkpoints differ almost everywhere, so the
size, the head (a GGUF's metadata and tensor index) and evenly spaced samples of the rest tell
them apart."""

from __future__ import annotations

import hashlib
from pathlib import Path

HEAD_BYTES = 16 * 2**20
SAMPLES = 32
SAMPLE_BYTES = 2**20


def weights_fingerprint(path: Path) -> str:
    """A hex digest of ``path``'s size, head and samples (every file of a directory)."""
    digest = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(HEAD_BYTES))
            for i in range(1, SAMPLES + 1):
                f.seek(size * i // (SAMPLES + 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()
