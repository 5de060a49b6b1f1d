"""``--repack``'s choices, in a module that imports nothing: the recipe (``runners/specs.py``)
and the serve options name them without loading llama.cpp, and ``cpu.py``, which judges them,
imports them from here rather than from the recipe that loads it."""

from __future__ import annotations

# ggml's extra weight buffer types on, off, or on where they are safe (cpu.py).
REPACK_CHOICES = ("auto", "on", "off")
