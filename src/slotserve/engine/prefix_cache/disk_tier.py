"""The prefix cache's disk tier: saved sequence states kept as files, beneath the host-RAM tier.

A state is the runner's opaque bytes for positions ``0 .. n-1`` of one token path, as the host
tier keeps them; here each one is a file in one directory, named after a hash of the model
fingerprint and the path, so that the same prefix saved by two servers is one file. States the
host tier evicts, and everything cached at shutdown, are written here; a server started later
with the same fingerprint (model weights, runner, dtype, KV layout) finds them by scanning the
directory, reading only the file headers. The file format: ``state_file.py``.

The directory may be shared: by servers of other models (their files carry another fingerprint
and are left alone) and by servers of the same model (each keeps its own index and budget, so
together they may hold more than one budget; a file one of them evicts is gone for all). Files
appear whole or not at all (written to a temporary file, synced, then renamed over the name),
and every read checks the file against its header and checksum, so a file deleted, replaced or
damaged at any time costs a miss, never a wrong state or an exception.

Recency is a file's modification time: a write and every read set it, so the order survives a
restart and is shared between servers; the least recently used files go first. The files'
names and the scan: ``state_directory.py``.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from slotserve.engine.prefix_cache.state_directory import DiskEntry, StateNames, scan_states
from slotserve.engine.prefix_cache.state_file import (
    CorruptFile,
    OtherVersion,
    encode,
    read_payload,
    same_file,
)

logger = logging.getLogger(__name__)


@dataclass
class DiskTierCounters:
    """Totals since start, for the prefix cache's statistics."""

    reads: int = 0  # states read and verified
    read_bytes: int = 0
    read_seconds: float = 0.0
    writes: int = 0  # states written
    written_bytes: int = 0
    write_seconds: float = 0.0
    evictions: int = 0  # files deleted to keep within the budget
    bad_files: int = 0  # files ignored at the scan or dropped on a failed read


class DiskTier:
    """Engine-thread only. Never raises for the disk's or the files' faults: a failed write
    returns None and a failed read a miss, each with a warning."""

    def __init__(
        self,
        directory: Path,
        fingerprint: str,
        budget_bytes: int,
        *,
        on_drop: Callable[[DiskEntry], None] | None = None,
    ) -> None:
        """Indexes the directory's states of ``fingerprint`` (creating the directory if need
        be), evicting the least recently used beyond ``budget_bytes``. ``on_drop`` is called
        with every entry the tier drops on its own: evicted to make room, or found bad on a
        read; not for ``remove``, ``clear`` or a write replacing the same tokens' state."""
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.bytes = 0  # the indexed files' sizes
        self.counters = DiskTierCounters()
        self._on_drop = on_drop
        self._names = StateNames(fingerprint)
        # Least recently used first.
        self._entries: OrderedDict[tuple[int, ...], DiskEntry] = OrderedDict()
        self._last_stamp_ns = 0
        self._write_failing = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("disk prefix cache: cannot create %s (%s)", self.directory, exc)
        found, bad_files = scan_states(self.directory, self._names)
        for entry in found:  # least recently used first
            self._entries[entry.tokens] = entry
            self.bytes += entry.file_bytes
        self.counters.bad_files += bad_files
        self._evict_to(self.budget_bytes)

    # ---- lookup -------------------------------------------------------------------------------

    def entries(self) -> list[DiskEntry]:
        """The indexed states, least recently used first."""
        return list(self._entries.values())

    def get(self, tokens: Sequence[int]) -> DiskEntry | None:
        """The indexed state of exactly ``tokens``, if any."""
        return self._entries.get(tuple(int(t) for t in tokens))

    def __len__(self) -> int:
        return len(self._entries)

    # ---- reading and writing ------------------------------------------------------------------

    def read(self, entry: DiskEntry) -> bytearray | None:
        """The state's payload, verified against its file's header and checksum, and marked
        recently used; None (with a warning, the entry dropped) when the file is gone or bad,
        and None when ``entry`` is no longer indexed."""
        current = self._entries.get(entry.tokens)
        if current is None:
            return None
        started = time.perf_counter()
        try:
            with open(current.path, "rb", buffering=0) as f:
                try:
                    data, file_bytes = read_payload(f, self.fingerprint, current.tokens)
                except CorruptFile as exc:
                    if same_file(current.path, f):
                        with suppress(OSError):
                            current.path.unlink()
                    self._drop_unreadable(current, f"{exc}; deleted")
                    return None
                stamp = self._stamp_ns()
                with suppress(OSError):  # a read-only directory keeps its order, nothing worse
                    os.utime(f.fileno(), ns=(stamp, stamp))
        except (OSError, OtherVersion) as exc:
            self._drop_unreadable(current, str(exc))
            return None
        # Another server may have replaced the file with its own state of the same tokens.
        self.bytes += file_bytes - current.file_bytes
        current.payload_bytes, current.file_bytes = len(data), file_bytes
        current.last_used = stamp / 1e9
        self._entries.move_to_end(current.tokens)
        self.counters.reads += 1
        self.counters.read_bytes += len(data)
        self.counters.read_seconds += time.perf_counter() - started
        if self.bytes > self.budget_bytes:
            self._evict_to(self.budget_bytes, keep=current.tokens)
        return data

    def write(
        self, tokens: Sequence[int], data: bytes | bytearray | memoryview
    ) -> DiskEntry | None:
        """Saves ``data`` as the state of ``tokens`` (replacing one saved for the same tokens),
        evicting the least recently used states to stay within the budget. None when the state
        alone is over the budget, or when the disk fails (warned once until a write succeeds)."""
        started = time.perf_counter()
        key = tuple(int(t) for t in tokens)
        payload = memoryview(data).cast("B")
        prefix, header = encode(self.fingerprint, list(key), payload)
        file_bytes = len(prefix) + len(header) + len(payload)
        if file_bytes > self.budget_bytes:
            return None
        old = self._entries.get(key)
        if old is not None:
            # Its file is replaced, not deleted: its bytes make room, and it must not be evicted.
            self._entries.move_to_end(key)
            self._evict_to(self.budget_bytes - file_bytes + old.file_bytes, keep=key)
        else:
            self._evict_to(self.budget_bytes - file_bytes)
        name = self._names.file_name(key)
        path = self.directory / name
        temp = self.directory / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        stamp = self._stamp_ns()
        try:
            with open(temp, "xb") as f:
                f.write(prefix)
                f.write(header)
                f.write(payload)
                f.flush()
                with suppress(OSError):  # only the order after a restart depends on it
                    os.utime(f.fileno(), ns=(stamp, stamp))
                # Synced before the rename, so that a crash leaves the old file or the whole new
                # one under the name, never an empty one. The directory is not synced: losing
                # the rename itself only loses a cache entry.
                os.fsync(f.fileno())
            os.replace(temp, path)
        except OSError as exc:
            with suppress(OSError):
                temp.unlink()
            if not self._write_failing:
                logger.warning(
                    "disk prefix cache: cannot write %s (%s); states are not saved to disk until "
                    "a write succeeds",
                    path,
                    exc,
                )
                self._write_failing = True
            return None
        if self._write_failing:
            logger.info("disk prefix cache: writing to %s works again", self.directory)
            self._write_failing = False
        if old is not None:
            self._forget(old)
        entry = DiskEntry(key, len(payload), file_bytes, path, stamp / 1e9)
        self._entries[key] = entry
        self.bytes += file_bytes
        self.counters.writes += 1
        self.counters.written_bytes += len(payload)
        self.counters.write_seconds += time.perf_counter() - started
        return entry

    # ---- removal ------------------------------------------------------------------------------

    def remove(self, entry: DiskEntry) -> None:
        """Drops the state of ``entry.tokens`` and deletes its file."""
        current = self._entries.get(entry.tokens)
        if current is not None:
            self._forget(current)
            self._unlink(current.path)

    def clear(self) -> int:
        """Deletes every state file of this fingerprint in the directory, indexed or not (one
        another server wrote since the scan); returns how many."""
        paths = {entry.path for entry in self._entries.values()}
        self._entries.clear()
        self.bytes = 0
        with suppress(OSError), os.scandir(self.directory) as listing:
            for item in listing:
                if self._names.is_state(item.name):
                    paths.add(Path(item.path))
        return sum(self._unlink(path) for path in paths)

    # ---- internals ----------------------------------------------------------------------------

    def _stamp_ns(self) -> int:
        """Now, as a modification time; strictly increasing within this process, so that the
        order of states used within one clock tick survives a restart."""
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def _drop_unreadable(self, entry: DiskEntry, reason: str) -> None:
        self.counters.bad_files += 1
        logger.warning("disk prefix cache: dropping %s: %s", entry.path, reason)
        self._forget(entry)
        if self._on_drop is not None:
            self._on_drop(entry)

    def _forget(self, entry: DiskEntry) -> None:
        del self._entries[entry.tokens]
        self.bytes -= entry.file_bytes

    def _unlink(self, path: Path) -> bool:
        """Deletes ``path``; False when it was not there (another server deleted it) or cannot
        be deleted (then it stays, out of the budget's count)."""
        try:
            path.unlink()
        except OSError:
            return False
        return True

    def _evict_to(self, limit: int, keep: tuple[int, ...] | None = None) -> None:
        """Deletes the least recently used states until they take at most ``limit`` bytes,
        never ``keep`` (which the caller made the most recently used)."""
        while self.bytes > limit and self._entries:
            tokens, entry = next(iter(self._entries.items()))
            if tokens == keep:
                break
            self._forget(entry)
            self._unlink(entry.path)
            self.counters.evictions += 1
            if self._on_drop is not None:
                self._on_drop(entry)
