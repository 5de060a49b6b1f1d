"""The disk tier's state file (``disk_tier.py``): what one file holds, and how it is written
and read back checked, so that a damaged file is told from a whole one.

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
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from io import FileIO
from pathlib import Path

import msgspec

MAGIC = b"SSKVSTAT"
VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
# A longer header is damage: it would hold millions of tokens.
_MAX_HEADER_BYTES = 64 * 2**20
# Reading and checksumming in pieces keeps each piece in cache between the two.
_READ_CHUNK = 8 * 2**20


@dataclass
class Header:
    fingerprint: str
    tokens: list[int]
    payload_bytes: int
    crc32: int


class CorruptFile(Exception):
    """The file is not a whole state file of this format: it can only be damage or junk."""


class OtherVersion(Exception):
    """The file is a state file of another format version: another release's to keep."""


def _read_exact(f: FileIO, n: int, what: str) -> bytes:
    data = f.read(n)
    while len(data) < n:  # a raw read may return less than asked before the end
        more = f.read(n - len(data))
        if not more:
            raise CorruptFile(f"truncated in the {what}")
        data += more
    return data


def read_header(f: FileIO, file_size: int) -> Header:
    """Parses and checks the header of the file at the start of ``f`` (of ``file_size`` bytes),
    leaving ``f`` at the payload."""
    magic, version, length = _PREFIX.unpack(_read_exact(f, _PREFIX.size, "magic"))
    if magic != MAGIC:
        raise CorruptFile("not a saved state (wrong magic)")
    if version != VERSION:
        raise OtherVersion(f"format version {version}, this release reads {VERSION}")
    if length > _MAX_HEADER_BYTES:
        raise CorruptFile(f"header length {length} is implausible")
    try:
        header = msgspec.json.decode(_read_exact(f, length, "header"), type=Header)
    except msgspec.DecodeError as exc:
        raise CorruptFile(f"bad header ({exc})") from None
    expected = _PREFIX.size + length + header.payload_bytes
    if header.payload_bytes < 0 or file_size != expected:
        raise CorruptFile(f"{file_size} bytes where the header says {expected}")
    return header


def same_file(path: Path, f: FileIO) -> bool:
    """Whether ``path`` still names the file open as ``f`` (another server may have renamed a
    new one over it, which must not be deleted for the old one's faults)."""
    try:
        named, opened = os.stat(path), os.fstat(f.fileno())
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def encode(fingerprint: str, tokens: list[int], payload: memoryview) -> tuple[bytes, bytes]:
    """The prefix (magic, version, header length) and the header that precede ``payload`` in
    the file of the state of ``tokens``."""
    header = msgspec.json.encode(Header(fingerprint, tokens, len(payload), zlib.crc32(payload)))
    return _PREFIX.pack(MAGIC, VERSION, len(header)), header


def read_payload(f: FileIO, fingerprint: str, tokens: tuple[int, ...]) -> tuple[bytearray, int]:
    """The payload of the state file open as ``f``, checked against its header, the
    ``fingerprint`` and the ``tokens`` its name stands for, and the file's size."""
    file_bytes = os.fstat(f.fileno()).st_size
    header = read_header(f, file_bytes)
    if header.fingerprint != fingerprint or tuple(header.tokens) != tokens:
        raise CorruptFile("it holds another state than its name says")
    data = bytearray(header.payload_bytes)
    view = memoryview(data)
    crc = 0
    pos = 0
    while pos < len(data):
        got = f.readinto(view[pos : pos + _READ_CHUNK])
        if not got:
            raise CorruptFile("truncated in the payload")
        crc = zlib.crc32(view[pos : pos + got], crc)
        pos += got
    if crc != header.crc32:
        raise CorruptFile("payload checksum mismatch")
    return data, file_bytes
