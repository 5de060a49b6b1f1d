"""What ggml's CPU backend runs with here: its CPU features, and which weight layouts are safe.

ggml may serve a model's weights from "extra buffer types" of its CPU backend: ``CPU_REPACK``
(Q4_0, Q4_K, IQ4_NL... interleaved for AVX2/AVX-512 dot products) and, when llama.cpp was built
on a CPU with AMX-INT8 (``-march=native`` on a Sapphire Rapids host), ``AMX``, which the
weights' matmuls then run in with tile instructions. That AMX path crashes on such hosts
(SIGSEGV in ``ggml_backend_amx_mul_mat`` on the first batch of more than one token; upstream
llama.cpp issue 20824). The cause, read in the vendored source: ``ggml_tile_config_init`` fills
a 64-byte tile configuration and hands it to ``_tile_loadconfig``, which GCC 12 and older
implement as inline assembly declaring an 8-byte memory operand; GCC then drops the stores of
the tiles' rows and column bytes as dead, and ``LDTILECFG`` loads a configuration of empty or
garbage tiles (a general-protection fault, delivered as SIGSEGV). The Makefile's build leaves
AMX out (``-mno-amx-int8``); a llama.cpp built elsewhere may still carry it, so the runner
checks at load.

llama.cpp has one switch for every extra buffer type (``use_extra_bufts``, llama-server's
``--repack`` / ``--no-repack``), so ``auto`` turns them all off only where ``AMX`` is among
them: repacking is kept wherever it is safe.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as llama

from slotserve.runners.options import REPACK_CHOICES

_GGML_BACKEND_DEVICE_TYPE_CPU = 0
_FEATURE = re.compile(r"(\w+) = 1")
_BUFFER_LINE = re.compile(r"(\S+) model buffer size")


@functools.cache
def cpu_features() -> tuple[str, ...]:
    """The CPU features ggml's kernels were compiled for and run with (``AVX2``,
    ``AVX512_BF16``, ``AMX_INT8``...), as ``llama_print_system_info`` names them."""
    info = llama.llama_print_system_info().decode("utf-8", errors="replace")
    cpu_part = info.split("CPU :", 1)[-1].split("\n", 1)[0]
    return tuple(_FEATURE.findall(cpu_part))


@functools.cache
def extra_buffer_types() -> tuple[str, ...]:
    """The names of the extra buffer types ggml's CPU backend offers for weights, highest
    priority first (``AMX``, ``CPU_REPACK``); read through ggml's backend registry."""
    try:
        lib = ctypes.CDLL(str(Path(llama.__file__).parent / "lib" / "libggml.so"))
    except OSError:  # another platform's library names: judge by the compiled features
        return ("AMX",) if "AMX_INT8" in cpu_features() else ()
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_buft_name.restype = ctypes.c_char_p
    lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    device = lib.ggml_backend_dev_by_type(_GGML_BACKEND_DEVICE_TYPE_CPU)
    registry = lib.ggml_backend_dev_backend_reg(device) if device else None
    address = (
        lib.ggml_backend_reg_get_proc_address(registry, b"ggml_backend_dev_get_extra_bufts")
        if registry
        else None
    )
    if not address:
        return ()
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)
    listed = get_extra(device)
    names = []
    for i in range(64):  # a NULL-terminated list of a few entries
        if not listed or not listed[i]:
            break
        names.append(lib.ggml_backend_buft_name(listed[i]).decode())
    return tuple(names)


@dataclass(frozen=True)
class WeightLayout:
    """Whether ggml may use its extra buffer types for the weights, and why."""

    use_extra_buffers: bool
    reason: str


def choose_weight_layout(repack: str, offered: tuple[str, ...]) -> WeightLayout:
    """``--repack``: ``on`` and ``off`` as llama-server's ``--repack`` / ``--no-repack``;
    ``auto`` is on unless ggml's AMX buffer type is ``offered`` (it crashes, see above)."""
    if repack not in REPACK_CHOICES:
        raise ValueError(f"--repack must be one of {', '.join(REPACK_CHOICES)}, not {repack!r}")
    if repack == "on":
        return WeightLayout(True, "--repack on")
    if repack == "off":
        return WeightLayout(False, "--repack off")
    if "AMX" in offered:
        return WeightLayout(
            False,
            "auto: this llama.cpp build offers ggml's AMX weight buffer, whose matmul crashes "
            "(llama.cpp issue 20824); --repack on forces it",
        )
    return WeightLayout(True, "auto")


class BufferLog:
    """Collects the buffer types llama.cpp reports while loading weights ("CPU_REPACK model
    buffer size = ..."): which layouts actually serve the model."""

    def __init__(self) -> None:
        self.names: list[str] | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[str]]:
        self.names = []
        try:
            yield self.names
        finally:
            self.names = None

    def feed(self, line: str) -> None:
        if self.names is not None:
            match = _BUFFER_LINE.search(line)
            if match and match.group(1) not in self.names:
                self.names.append(match.group(1))


BUFFER_LOG = BufferLog()
