"""What the disk-tier tests share: the fingerprints, the logger, payloads, token paths, and the
files and warnings to look at."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from slotserve.engine.prefix_cache import disk_tier

FINGERPRINT = "smollm2-135m|llama.cpp|f16|kv-layout-1"
OTHER_FINGERPRINT = "gemma3-270m|llama.cpp|f16|kv-layout-1"
LOGGER = disk_tier.__name__


def _payload(n: int, seed: int = 0) -> bytearray:
    return bytearray(random.Random(seed).randbytes(n))


def _path(start: int, n: int = 20) -> list[int]:
    return list(range(start, start + n))


def _state_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kvstate"))


def _temp_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(".*.tmp"))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
