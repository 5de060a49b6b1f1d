"""The prefix cache's disk tier: saved sequence states kept as files, beneath the host-RAM tier.

A state is the runner's opaque bytes for positions ``0 .. n-1`` of one token path, as the host
tier keeps them; here each one is a file in one directory, named after a hash of the model
fingerprint and the path, so that the same prefix saved by two servers is one file. States the
host tier evicts, and everything cached at shutdown, are written here; a server started later
with the same fingerprint (model weights, runner, dtype, KV layout) finds them by scanning the
directory, reading only the file headers.

The directory may be shared: by servers of other models (their files carry another fingerprint
and are left alone) and by servers of the same model (each keeps its own index and budget, so
together they may hold more than one budget; a file one of them evicts is gone for all). Files
appear whole or not at all (written to a temporary file, synced, then renamed over the name),
and every read checks the file against its header and checksum, so a file deleted, replaced or
damaged at any time costs a miss, never a wrong state or an exception.

File format (``<name>`` is ``<fingerprint hash>-<path hash>.kvstate``, both blake2b in hex)::

    magic     8 bytes   b"SSKVSTAT"
    version   uint32 LE  1
    length    uint32 LE  of the header
    header    JSON object: {"fingerprint": str, "tokens": [int, ...],
                            "payload_bytes": int, "crc32": int}
    payload   payload_bytes bytes, whose zlib.crc32 is "crc32"

The checksum guards against damage, not against forgery: anyone who can write the directory
can feed the server a state anyway. CRC-32 is the fastest checksum the standard library has
(zlib's, with no hardware requirement), and the payload is checked on every read.

Recency is a file's modification time: a write and every read set it, so the order survives a
restart and is shared between servers; the least recently used files go first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from io import FileIO
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)

MAGIC = b"SSKVSTAT"
VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
# A longer header is damage: it would hold millions of tokens.
_MAX_HEADER_BYTES = 64 * 2**20
# Reading and checksumming in pieces keeps each piece in cache between the two.
_READ_CHUNK = 8 * 2**20
# A temporary file this old belongs to a writer that died: a live one renames it in seconds.
_STALE_TEMP_SECONDS = 3600.0

_SUFFIX = ".kvstate"
_STATE_NAME = re.compile(r"(?P<fp>[0-9a-f]{16})-[0-9a-f]{32}\.kvstate")
_TEMP_NAME = re.compile(r"\.(?P<fp>[0-9a-f]{16})-[0-9a-f]{32}\.kvstate\.\d+\.[0-9a-f]{8}\.tmp")


@dataclass(eq=False)
class DiskEntry:
    """One state file in the index; entries are identified by their ``tokens``."""

    tokens: tuple[int, ...]
    payload_bytes: int  # the state's bytes, as ``read`` returns them
    file_bytes: int  # what the file takes, header included; the budget counts these
    path: Path
    last_used: float  # seconds since the epoch, as ``time.time()``


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


@dataclass
class _Header:
    fingerprint: str
    tokens: list[int]
    payload_bytes: int
    crc32: int


class _CorruptFile(Exception):
    """The file is not a whole state file of this format: it can only be damage or junk."""


class _OtherVersion(Exception):
    """The file is a state file of another format version: another release's to keep."""


def _read_exact(f: FileIO, n: int, what: str) -> bytes:
    data = f.read(n)
    while len(data) < n:  # a raw read may return less than asked before the end
        more = f.read(n - len(data))
        if not more:
            raise _CorruptFile(f"truncated in the {what}")
        data += more
    return data


def _read_header(f: FileIO, file_size: int) -> _Header:
    """Parses and checks the header of the file at the start of ``f`` (of ``file_size`` bytes),
    leaving ``f`` at the payload."""
    magic, version, length = _PREFIX.unpack(_read_exact(f, _PREFIX.size, "magic"))
    if magic != MAGIC:
        raise _CorruptFile("not a saved state (wrong magic)")
    if version != VERSION:
        raise _OtherVersion(f"format version {version}, this release reads {VERSION}")
    if length > _MAX_HEADER_BYTES:
        raise _CorruptFile(f"header length {length} is implausible")
    try:
        header = msgspec.json.decode(_read_exact(f, length, "header"), type=_Header)
    except msgspec.DecodeError as exc:
        raise _CorruptFile(f"bad header ({exc})") from None
    expected = _PREFIX.size + length + header.payload_bytes
    if header.payload_bytes < 0 or file_size != expected:
        raise _CorruptFile(f"{file_size} bytes where the header says {expected}")
    return header


def _same_file(path: Path, f: FileIO) -> bool:
    """Whether ``path`` still names the file open as ``f`` (another server may have renamed a
    new one over it, which must not be deleted for the old one's faults)."""
    try:
        named, opened = os.stat(path), os.fstat(f.fileno())
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


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
        self._fingerprint_bytes = fingerprint.encode()
        self._name_prefix = hashlib.blake2b(self._fingerprint_bytes, digest_size=8).hexdigest()
        # Least recently used first.
        self._entries: OrderedDict[tuple[int, ...], DiskEntry] = OrderedDict()
        self._last_stamp_ns = 0
        self._write_failing = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("disk prefix cache: cannot create %s (%s)", self.directory, exc)
        self._scan()
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
                    data, file_bytes = self._read_payload(f, current)
                except _CorruptFile as exc:
                    if _same_file(current.path, f):
                        with suppress(OSError):
                            current.path.unlink()
                    self._drop_unreadable(current, f"{exc}; deleted")
                    return None
                stamp = self._stamp_ns()
                with suppress(OSError):  # a read-only directory keeps its order, nothing worse
                    os.utime(f.fileno(), ns=(stamp, stamp))
        except (OSError, _OtherVersion) as exc:
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
        header = msgspec.json.encode(
            _Header(self.fingerprint, list(key), len(payload), zlib.crc32(payload))
        )
        prefix = _PREFIX.pack(MAGIC, VERSION, len(header))
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
        name = self._file_name(key)
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
                found = _STATE_NAME.fullmatch(item.name)
                if found is not None and found["fp"] == self._name_prefix:
                    paths.add(Path(item.path))
        return sum(self._unlink(path) for path in paths)

    # ---- internals ----------------------------------------------------------------------------

    def _file_name(self, tokens: Sequence[int]) -> str:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(self._fingerprint_bytes)
        digest.update(b"\0")
        digest.update(",".join(map(str, tokens)).encode())
        return f"{self._name_prefix}-{digest.hexdigest()}{_SUFFIX}"

    def _stamp_ns(self) -> int:
        """Now, as a modification time; strictly increasing within this process, so that the
        order of states used within one clock tick survives a restart."""
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def _scan(self) -> None:
        """Indexes this fingerprint's valid files, least recently used first."""
        try:
            with os.scandir(self.directory) as listing:
                items = list(listing)
        except OSError as exc:
            logger.warning("disk prefix cache: cannot list %s (%s)", self.directory, exc)
            return
        found: list[tuple[int, DiskEntry]] = []
        for item in items:
            state = _STATE_NAME.fullmatch(item.name)
            if state is not None:
                if state["fp"] == self._name_prefix:
                    loaded = self._load(Path(item.path))
                    if loaded is not None:
                        found.append(loaded)
                continue  # another model's state
            temp = _TEMP_NAME.fullmatch(item.name)
            if temp is not None:
                if temp["fp"] == self._name_prefix:
                    self._remove_if_stale(Path(item.path))
                continue  # being written by another server, or another model's
            self.counters.bad_files += 1
            logger.warning("disk prefix cache: ignoring %s: not a saved state's file", item.path)
        for _, entry in sorted(found, key=lambda pair: pair[0]):
            self._entries[entry.tokens] = entry
            self.bytes += entry.file_bytes

    def _load(self, path: Path) -> tuple[int, DiskEntry] | None:
        """The entry for the state file at ``path`` and its modification time in ns, or None
        (with a warning, and the file deleted when it is damaged)."""
        try:
            with open(path, "rb", buffering=0) as f:
                stat = os.fstat(f.fileno())
                try:
                    header = _read_header(f, stat.st_size)
                    tokens = tuple(header.tokens)
                    if header.fingerprint != self.fingerprint:
                        raise _CorruptFile("another fingerprint under this one's name")
                    if path.name != self._file_name(tokens):
                        raise _CorruptFile("its tokens do not match its name")
                except _CorruptFile as exc:
                    if _same_file(path, f):
                        with suppress(OSError):
                            path.unlink()
                    self._ignore(path, f"{exc}; deleted")
                    return None
        except (OSError, _OtherVersion) as exc:
            self._ignore(path, str(exc))
            return None
        entry = DiskEntry(tokens, header.payload_bytes, stat.st_size, path, stat.st_mtime)
        return stat.st_mtime_ns, entry

    def _read_payload(self, f: FileIO, entry: DiskEntry) -> tuple[bytearray, int]:
        """The payload of the state file open as ``f``, checked against its header and
        ``entry``, and the file's size."""
        file_bytes = os.fstat(f.fileno()).st_size
        header = _read_header(f, file_bytes)
        if header.fingerprint != self.fingerprint or tuple(header.tokens) != entry.tokens:
            raise _CorruptFile("it holds another state than its name says")
        data = bytearray(header.payload_bytes)
        view = memoryview(data)
        crc = 0
        pos = 0
        while pos < len(data):
            got = f.readinto(view[pos : pos + _READ_CHUNK])
            if not got:
                raise _CorruptFile("truncated in the payload")
            crc = zlib.crc32(view[pos : pos + got], crc)
            pos += got
        if crc != header.crc32:
            raise _CorruptFile("payload checksum mismatch")
        return data, file_bytes

    def _remove_if_stale(self, temp: Path) -> None:
        with suppress(OSError):
            if time.time() - temp.stat().st_mtime > _STALE_TEMP_SECONDS:
                temp.unlink()

    def _ignore(self, path: Path, reason: str) -> None:
        self.counters.bad_files += 1
        logger.warning("disk prefix cache: ignoring %s: %s", path, reason)

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
