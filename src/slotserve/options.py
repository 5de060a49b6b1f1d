"""Flag helpers shared by the command line: ``SLOTSERVE_*`` environment defaults and sizes.

Every flag has a ``SLOTSERVE_*`` environment equivalent (``--ctx-size`` ↔
``SLOTSERVE_CTX_SIZE``); a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SLOTSERVE_{name}", default)


def env_int(name: str, default: int) -> int:
    value = env(name)
    return default if value is None else int(value)


def env_float(name: str, default: float) -> float:
    value = env(name)
    return default if value is None else float(value)


def env_bool(name: str, default: bool) -> bool:
    value = env(name)
    return default if value is None else value.lower() in ("1", "true", "yes", "on")


_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_cache_budget(text: str) -> tuple[int | None, int | None]:
    """``"20000"`` → (20000 tokens, None); ``"512MiB"`` → (None, 536870912 bytes)."""
    value = text.strip().lower().replace(" ", "")
    if value.isdigit():
        return int(value), None
    number = value.rstrip("bgikm")
    unit = value[len(number) :]
    try:
        if unit not in _BYTE_UNITS:
            raise ValueError(unit)
        return None, int(float(number) * _BYTE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid budget {text!r}: a token count (20000) or bytes with a unit (512MiB, 2GB)"
        ) from None


def parse_bytes(text: str) -> int:
    """``"2GiB"`` → 2147483648, ``"512MB"`` → 512000000; a plain number is bytes."""
    value = text.strip().lower().replace(" ", "")
    number = value.rstrip("bgikm")
    unit = value[len(number) :] or "b"
    try:
        if unit not in _BYTE_UNITS:
            raise ValueError(unit)
        return int(float(number) * _BYTE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: bytes, with a unit if you like (512MiB, 2GB)"
        ) from None
