"""The disk tier's directory (``disk_tier.py``), which servers may share: how a state's file is
named (:class:`StateNames`: a hash of the model fingerprint, then one of the fingerprint and
the token path, so that the same prefix saved by two servers is one file), and the scan at
start that indexes one fingerprint's files reading only their headers (:func:`scan_states`).
Other models' files, and files being written by other servers, are left alone."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from slotserve.engine.prefix_cache.state_file import (
    CorruptFile,
    OtherVersion,
    read_header,
    same_file,
)

logger = logging.getLogger(__name__)

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


class StateNames:
    """The file names of one fingerprint's states."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self._fingerprint_bytes = fingerprint.encode()
        # Every file name of this fingerprint's states starts with it.
        self.prefix = hashlib.blake2b(self._fingerprint_bytes, digest_size=8).hexdigest()

    def file_name(self, tokens: Sequence[int]) -> str:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(self._fingerprint_bytes)
        digest.update(b"\0")
        digest.update(",".join(map(str, tokens)).encode())
        return f"{self.prefix}-{digest.hexdigest()}{_SUFFIX}"

    def is_state(self, name: str) -> bool:
        """Whether ``name`` is that of a state file of this fingerprint."""
        found = _STATE_NAME.fullmatch(name)
        return found is not None and found["fp"] == self.prefix


def scan_states(directory: Path, names: StateNames) -> tuple[list[DiskEntry], int]:
    """The valid state files of ``names``' fingerprint in ``directory``, least recently used
    first, and how many files were ignored as bad (each with a warning; a damaged one of this
    fingerprint is deleted, and so is a temporary file its writer left long ago)."""
    try:
        with os.scandir(directory) as listing:
            items = list(listing)
    except OSError as exc:
        logger.warning("disk prefix cache: cannot list %s (%s)", directory, exc)
        return [], 0
    found: list[tuple[int, DiskEntry]] = []
    bad_files = 0
    for item in items:
        state = _STATE_NAME.fullmatch(item.name)
        if state is not None:
            if state["fp"] == names.prefix:
                loaded = _load(Path(item.path), names)
                if loaded is None:
                    bad_files += 1
                else:
                    found.append(loaded)
            continue  # another model's state
        temp = _TEMP_NAME.fullmatch(item.name)
        if temp is not None:
            if temp["fp"] == names.prefix:
                _remove_if_stale(Path(item.path))
            continue  # being written by another server, or another model's
        bad_files += 1
        logger.warning("disk prefix cache: ignoring %s: not a saved state's file", item.path)
    return [entry for _, entry in sorted(found, key=lambda pair: pair[0])], bad_files


def _load(path: Path, names: StateNames) -> tuple[int, DiskEntry] | None:
    """The entry for the state file at ``path`` and its modification time in ns, or None
    (with a warning, and the file deleted when it is damaged)."""
    try:
        with open(path, "rb", buffering=0) as f:
            stat = os.fstat(f.fileno())
            try:
                header = read_header(f, stat.st_size)
                tokens = tuple(header.tokens)
                if header.fingerprint != names.fingerprint:
                    raise CorruptFile("another fingerprint under this one's name")
                if path.name != names.file_name(tokens):
                    raise CorruptFile("its tokens do not match its name")
            except CorruptFile as exc:
                if same_file(path, f):
                    with suppress(OSError):
                        path.unlink()
                _ignore(path, f"{exc}; deleted")
                return None
    except (OSError, OtherVersion) as exc:
        _ignore(path, str(exc))
        return None
    entry = DiskEntry(tokens, header.payload_bytes, stat.st_size, path, stat.st_mtime)
    return stat.st_mtime_ns, entry


def _remove_if_stale(temp: Path) -> None:
    with suppress(OSError):
        if time.time() - temp.stat().st_mtime > _STALE_TEMP_SECONDS:
            temp.unlink()


def _ignore(path: Path, reason: str) -> None:
    logger.warning("disk prefix cache: ignoring %s: %s", path, reason)
