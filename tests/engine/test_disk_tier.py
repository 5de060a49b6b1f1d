"""The prefix cache's disk tier on its own: round trips, restarts, a shared directory, the byte
budget, and a failing disk (damaged and vanished files are in test_disk_tier_damage.py)."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from array import array
from pathlib import Path

import pytest

from slotserve.engine.prefix_cache import disk_tier
from slotserve.engine.prefix_cache.disk_tier import DiskTier
from slotserve.engine.prefix_cache.state_directory import DiskEntry
from tests.engine.disk_tier_helpers import (
    FINGERPRINT,
    LOGGER,
    OTHER_FINGERPRINT,
    _path,
    _payload,
    _state_files,
    _temp_files,
    _warnings,
)


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture(autouse=True)
def _capture(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)


# ---- round trip and restart -------------------------------------------------------------------


def test_a_written_state_reads_back_and_takes_its_file_size(directory: Path) -> None:
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    data = _payload(5000)
    entry = tier.write(_path(0), data)
    assert entry is not None
    assert (entry.tokens, entry.payload_bytes) == (tuple(_path(0)), 5000)
    assert entry.path.parent == directory and entry.path.stat().st_size == entry.file_bytes
    assert tier.bytes == entry.file_bytes and len(tier) == 1
    assert tier.get(_path(0)) is entry and tier.get(_path(1)) is None
    assert _temp_files(directory) == []
    got = tier.read(entry)
    assert isinstance(got, bytearray) and got == data
    c = tier.counters
    assert (c.writes, c.written_bytes, c.reads, c.read_bytes) == (1, 5000, 1, 5000)
    assert c.write_seconds > 0 and c.read_seconds > 0


def test_any_contiguous_buffer_is_written_as_its_bytes(directory: Path) -> None:
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    words = array("i", range(1000))
    entry = tier.write(_path(0), memoryview(words))
    assert entry is not None and entry.payload_bytes == 4000
    assert tier.read(entry) == bytearray(words.tobytes())


def test_an_empty_state_round_trips(directory: Path) -> None:
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    entry = tier.write([7], b"")
    assert entry is not None
    assert DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20).read(entry) == bytearray()


def test_a_server_started_later_finds_the_states(directory: Path) -> None:
    first = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    written = {start: _payload(1000 + start, seed=start) for start in (0, 100, 200)}
    for start, data in written.items():
        assert first.write(_path(start), data) is not None
    later = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    assert [e.tokens for e in later.entries()] == [tuple(_path(s)) for s in written]
    assert later.bytes == first.bytes
    for entry, (start, data) in zip(later.entries(), written.items(), strict=True):
        assert entry.payload_bytes == len(data)
        assert later.read(entry) == data, start


def test_writing_the_same_tokens_again_replaces_the_state(directory: Path) -> None:
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    assert tier.write(_path(0), _payload(1000, seed=1)) is not None
    entry = tier.write(_path(0), _payload(3000, seed=2))
    assert entry is not None and len(tier) == 1 and tier.bytes == entry.file_bytes
    assert len(_state_files(directory)) == 1
    assert tier.read(entry) == _payload(3000, seed=2)


# ---- a shared directory -----------------------------------------------------------------------


def test_another_models_states_are_neither_indexed_nor_deleted(
    directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ours = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    assert ours.write(_path(0), _payload(1000)) is not None
    theirs = DiskTier(directory, OTHER_FINGERPRINT, budget_bytes=1 << 20)
    assert theirs.entries() == [] and theirs.bytes == 0
    theirs_entry = theirs.write(_path(0), _payload(2000))  # the same tokens: another file
    assert theirs_entry is not None
    assert len(_state_files(directory)) == 2
    # Even a budget that fits none of ours leaves their file alone, and clear too.
    assert DiskTier(directory, FINGERPRINT, budget_bytes=0).entries() == []
    assert DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20).clear() == 0
    assert _state_files(directory) == [theirs_entry.path]
    assert theirs.read(theirs_entry) == _payload(2000)
    assert _warnings(caplog) == []


def test_two_servers_writing_the_same_tokens_leave_one_whole_file(directory: Path) -> None:
    tiers = [DiskTier(directory, FINGERPRINT, budget_bytes=1 << 26) for _ in range(2)]
    payloads = [_payload(4 << 20, seed=s) for s in range(2)]
    for _ in range(3):
        barrier = threading.Barrier(2)
        results: list[DiskEntry | None] = [None, None]

        def write(
            i: int,
            barrier: threading.Barrier = barrier,
            results: list[DiskEntry | None] = results,
        ) -> None:
            barrier.wait()
            results[i] = tiers[i].write(_path(0), payloads[i])

        threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(r is not None for r in results)
        assert len(_state_files(directory)) == 1 and _temp_files(directory) == []
        # Whichever rename came last won; each server reads that one through its own entry.
        winner = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 26)
        (entry,) = winner.entries()
        data = winner.read(entry)
        assert data in payloads
        for tier in tiers:
            own = tier.get(_path(0))
            assert own is not None and tier.read(own) == data


def test_clear_deletes_the_states_another_server_wrote_since_the_scan(directory: Path) -> None:
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    other = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    assert tier.write(_path(0), _payload(100)) is not None
    assert other.write(_path(100), _payload(100)) is not None
    assert DiskTier(directory, OTHER_FINGERPRINT, budget_bytes=1 << 20).write(
        _path(0), _payload(100)
    )
    assert tier.clear() == 2
    assert (len(tier), tier.bytes) == (0, 0)
    assert len(_state_files(directory)) == 1  # the other model's


def test_remove_deletes_the_file_and_a_removed_entry_reads_as_a_quiet_miss(
    directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    entry = tier.write(_path(0), _payload(100))
    assert entry is not None
    tier.remove(entry)
    assert not entry.path.exists() and (len(tier), tier.bytes) == (0, 0)
    tier.remove(entry)  # twice is harmless
    assert tier.read(entry) is None
    assert _warnings(caplog) == []


def test_stale_temp_files_of_this_model_are_removed_and_live_ones_kept(
    directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    entry = tier.write(_path(0), _payload(100))
    assert entry is not None
    stale = directory / f".{entry.path.name}.123.0badc0de.tmp"
    live = directory / f".{entry.path.name}.456.0123abcd.tmp"
    theirs = directory / f".{'0' * 16}-{'1' * 32}.kvstate.789.00000000.tmp"
    for path in (stale, live, theirs):
        path.write_bytes(b"partial")
    long_ago = time.time() - 2 * 3600
    for path in (stale, theirs):
        os.utime(path, (long_ago, long_ago))
    assert len(DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)) == 1
    assert not stale.exists() and live.exists() and theirs.exists()
    assert _warnings(caplog) == []


# ---- the budget -------------------------------------------------------------------------------


def test_the_least_recently_used_states_are_evicted_and_a_read_refreshes(
    directory: Path,
) -> None:
    dropped: list[DiskEntry] = []
    probe = DiskTier(directory.parent / "probe", FINGERPRINT, budget_bytes=1 << 20)
    size = probe.write(_path(0), _payload(1000))
    assert size is not None
    budget = 3 * size.file_bytes + size.file_bytes // 2  # room for three states
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=budget, on_drop=dropped.append)
    a, b, c = (tier.write(_path(s), _payload(1000, seed=s)) for s in (0, 100, 200))
    assert a is not None and b is not None and c is not None
    assert tier.read(a) is not None  # a becomes the most recently used: b goes first
    d = tier.write(_path(300), _payload(1000))
    assert d is not None
    assert dropped == [b] and not b.path.exists()
    assert tier.entries() == [c, a, d] and tier.counters.evictions == 1
    assert tier.bytes <= budget
    assert tier.bytes == sum(p.stat().st_size for p in _state_files(directory))

    # The order survives a restart, and a smaller budget there evicts from its old end.
    later = DiskTier(directory, FINGERPRINT, budget_bytes=budget)
    assert [e.tokens for e in later.entries()] == [c.tokens, a.tokens, d.tokens]
    smaller = DiskTier(directory, FINGERPRINT, budget_bytes=2 * size.file_bytes + 100)
    assert [e.tokens for e in smaller.entries()] == [a.tokens, d.tokens]
    assert not c.path.exists() and smaller.counters.evictions == 1


def test_a_rewrite_of_the_same_tokens_is_not_evicted_to_make_its_own_room(
    directory: Path,
) -> None:
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=5000)
    a = tier.write(_path(0), _payload(2000))
    b = tier.write(_path(100), _payload(2000))
    assert a is not None and b is not None
    again = tier.write(_path(0), _payload(3000))
    assert again is not None and tier.entries() == [again]
    assert not b.path.exists() and tier.bytes == again.file_bytes <= 5000


def test_a_state_over_the_whole_budget_is_not_written(directory: Path) -> None:
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=3000)
    kept = tier.write(_path(0), _payload(1000))
    assert kept is not None
    assert tier.write(_path(100), _payload(3000)) is None
    assert tier.entries() == [kept] and _state_files(directory) == [kept.path]
    assert tier.counters.evictions == 0


# ---- a failing disk ---------------------------------------------------------------------------


def _no_space(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fail(patch: pytest.MonkeyPatch, name: str) -> None:
    """Makes ``name`` fail as on a full disk: the creation of the temporary file (the module's
    ``open``), or its sync or rename (in ``os``)."""
    if name == "open":
        patch.setattr(disk_tier, "open", _no_space, raising=False)
    else:
        patch.setattr(os, name, _no_space)


@pytest.mark.parametrize("failing", ["open", "fsync", "replace"])
def test_a_failing_write_returns_none_leaves_no_temp_file_and_warns_once(
    directory: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    failing: str,
) -> None:
    tier = DiskTier(directory, FINGERPRINT, budget_bytes=1 << 20)
    kept = tier.write(_path(0), _payload(1000))
    assert kept is not None
    with monkeypatch.context() as patch:
        _fail(patch, failing)
        assert tier.write(_path(100), _payload(1000)) is None
        assert tier.write(_path(200), _payload(1000)) is None
        assert tier.write(_path(0), _payload(500)) is None  # a failed rewrite keeps the old
    assert _temp_files(directory) == [] and _state_files(directory) == [kept.path]
    (message,) = _warnings(caplog)
    assert "No space left on device" in message and str(directory) in message
    assert tier.entries() == [kept] and tier.read(kept) == _payload(1000)

    # A success ends the failure; the next failure is warned about again.
    assert tier.write(_path(300), _payload(1000)) is not None
    with monkeypatch.context() as patch:
        _fail(patch, failing)
        assert tier.write(_path(400), _payload(1000)) is None
    assert len([m for m in _warnings(caplog) if "No space" in m]) == 2


def test_a_directory_that_cannot_be_made_disables_the_tier_without_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tier = DiskTier(blocker / "kv", FINGERPRINT, budget_bytes=1 << 20)
    assert tier.entries() == []
    assert tier.write(_path(0), _payload(100)) is None
    assert tier.write(_path(100), _payload(100)) is None
    assert tier.clear() == 0
    assert len(_warnings(caplog)) == 3  # cannot create, cannot list, cannot write (once)
