"""The prefix cache's disk tier with damaged, vanished, foreign and other-version files: each is a
warned miss or ignored, and this model's damaged ones are deleted."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from slotserve.engine.prefix_cache import state_file
from slotserve.engine.prefix_cache.disk_tier import DiskTier
from slotserve.engine.prefix_cache.state_directory import DiskEntry
from tests.engine.disk_tier_helpers import (
    FINGERPRINT,
    LOGGER,
    _path,
    _payload,
    _warnings,
)


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture(autouse=True)
def _capture(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def _flip_payload_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(raw)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _garbage(path: Path) -> None:
    path.write_bytes(_payload(path.stat().st_size, seed=99))


def _header_only(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 1000])


def _bad_json(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[16] = ord("[")
    path.write_bytes(raw)


def _tokens_of_another_state(path: Path) -> None:
    other = DiskTier(path.parent.parent / "elsewhere", FINGERPRINT, budget_bytes=1 << 20)
    entry = other.write(_path(500), _payload(1000))
    assert entry is not None
    os.replace(entry.path, path)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": _truncate,
    "payload byte flipped": _flip_payload_byte,
    "empty": _empty,
    "garbage": _garbage,
    "no payload": _header_only,
    "bad header": _bad_json,
    "another state": _tokens_of_another_state,
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_file_is_a_warned_miss_and_is_deleted(
    directory: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    dropped: list[DiskEntry] = []
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20, on_drop=dropped.append)
    entry = tier.write(_path(0), _payload(1000))
    kept = tier.write(_path(100), _payload(1000, seed=1))
    assert entry is not None and kept is not None
    DAMAGE[damage](entry.path)
    assert tier.read(entry) is None
    (message,) = _warnings(caplog)
    assert entry.path.name in message
    assert dropped == [entry] and tier.entries() == [kept] and tier.bytes == kept.file_bytes
    assert not entry.path.exists() and tier.counters.bad_files == 1
    assert tier.read(kept) == _payload(1000, seed=1)


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_file_found_at_start_is_ignored_with_a_warning(
    directory: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    first = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    entry = first.write(_path(0), _payload(1000))
    kept = first.write(_path(100), _payload(1000, seed=1))
    assert entry is not None and kept is not None
    DAMAGE[damage](entry.path)
    later = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    if damage == "payload byte flipped":
        # The scan reads headers only; the read catches the payload's damage.
        assert len(later) == 2 and _warnings(caplog) == []
        found = later.get(_path(0))
        assert found is not None and later.read(found) is None
    else:
        assert [e.tokens for e in later.entries()] == [kept.tokens]
    (message,) = _warnings(caplog)
    assert entry.path.name in message
    assert later.counters.bad_files == 1 and not entry.path.exists()
    assert later.bytes == kept.file_bytes


def test_a_file_deleted_behind_the_tiers_back_is_a_warned_miss(
    directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dropped: list[DiskEntry] = []
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20, on_drop=dropped.append)
    entry = tier.write(_path(0), _payload(1000))
    assert entry is not None
    entry.path.unlink()
    assert tier.read(entry) is None
    (message,) = _warnings(caplog)
    assert entry.path.name in message
    assert dropped == [entry] and (len(tier), tier.bytes) == (0, 0)
    assert tier.counters.bad_files == 1
    assert tier.write(_path(0), _payload(1000)) is not None  # and it can be saved again


def test_foreign_files_are_ignored_with_a_warning_each_and_kept(
    directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory.mkdir()
    junk = [directory / "notes.txt", directory / "state.kvstate", directory / "subdir"]
    junk[0].write_text("hello")
    junk[1].write_bytes(b"")
    junk[2].mkdir()
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    assert tier.entries() == [] and tier.counters.bad_files == 3
    messages = _warnings(caplog)
    assert len(messages) == 3
    for path in junk:
        assert path.exists()
        assert sum(path.name in m for m in messages) == 1


def test_a_state_file_of_another_format_version_is_ignored_and_kept(
    directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    entry = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20).write(_path(0), b"x" * 100)
    assert entry is not None
    raw = bytearray(entry.path.read_bytes())
    raw[8] = state_file.VERSION + 1
    entry.path.write_bytes(raw)
    assert DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20).entries() == []
    (message,) = _warnings(caplog)
    assert entry.path.name in message and "version" in message
    assert entry.path.exists()
