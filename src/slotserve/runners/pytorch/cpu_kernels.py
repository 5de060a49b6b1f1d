"""The PyTorch runner's C++ CPU kernels (``csrc/``): built once with the installed torch's
``cpp_extension`` (cached by torch in ``TORCH_EXTENSIONS_DIR``, ``~/.cache/torch_extensions``
by default), loaded on first use, and typed here.

What they replace and why (docs/design/pytorch-runner.md): attention reads the paged KV pool
in place instead of gathering every sequence's K/V into a padded tensor per layer, and the
small operators around the projections (residual add + RMSNorm, q/k norm + rotary + the K/V
write, SiLU·mul) run as one pass per row, and a GEMM of ours serves the projections (AMX tiles,
AVX512-BF16 dot products, or the same dot products in two fused steps on AVX-512 and AVX2).
Every kernel computes a row from that row's inputs in an order fixed by the row's own length and
position: batch-invariant by construction, whatever the thread count. The plain-torch path
(``layers.py``, ``attention.py``, ``rotary.py``) is the fallback and the reference the kernel
tests compare against.

The instruction set is chosen at load from the CPU (AVX512-BF16, AVX-512, else AVX2 with FMA;
the same bits on each), or AVX2 where torch is told so (``ATEN_CPU_CAPABILITY=avx2``: what an
AVX2-only CPU would run, measured on this one); a machine without a compiler, an x86 CPU or any
of them gets a one-line warning and the torch path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slotserve.engine.runner_interface import ComputePath
from slotserve.runners.pytorch.quant.formats import FORMATS, QuantFormat, QuantKind

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
# Compiler flags for every CPU: the instruction sets are chosen per function in the source
# (``#pragma GCC target``) and at run time from the CPU, never from the build machine.
CFLAGS = ("-O3", "-std=c++17", "-Wno-psabi", "-fno-math-errno", "-fopenmp")
# Without OpenMP, ``at::parallel_for`` compiles to a serial loop. The library it links is
# found at run time by its soname, libgomp.so.1, which torch has already loaded (its own copy
# on Linux wheels): one thread pool, torch's, sized by ``torch.set_num_threads``.
LDFLAGS = ("-fopenmp",)


class CpuKernels:
    """Typed calls into the extension (bfloat16 CPU tensors; int32 index tensors)."""

    def __init__(self, module: Any) -> None:
        self._m = module
        self.isa: str = module.isa()
        # The projections' own GEMM: on every CPU the kernels run on.
        self.has_gemm: bool = module.has_gemm()
        # Which of ours: "amx" (csrc/gemm_amx.h: tiles, on CPUs with AMX-BF16 that give their
        # documented bits), else "avx512bf16", "avx512" or "avx2" (csrc/gemm_vec.h: the same
        # bits, the dot products in two fused steps where vdpbf16ps is missing).
        self.gemm: str = module.gemm() if self.has_gemm else "none"
        # Attention's arithmetic: "amx" (csrc/attend_amx.h: the tiles', where the unit gives its
        # documented bits; lone rows in vector code) or "vector" (csrc/attention.h, the same bits
        # on every instruction set).
        self.attention: str = module.attention()
        # Where quantized projections sum steps of 64 rows or more (csrc/quant_amx.h): "amx"
        # where the unit gives its emulation's sums, else "none" (also an older build's, as
        # benchmarks/quant_ab.py loads); the same bits either way.
        self.quant_tiles: str = module.quant_tiles() if hasattr(module, "quant_tiles") else "none"

    def select_isa(self, isa: str) -> None:
        """Runs the kernels compiled for ``isa`` (avx512bf16, avx512, avx2) from now on, if the
        CPU runs it (the tests' way to the narrower builds on one machine, and
        ``ATEN_CPU_CAPABILITY=avx2``'s)."""
        self.isa = self._m.select_isa(isa)

    def select_attention(self, arithmetic: str) -> None:
        """Attention runs in ``arithmetic`` from now on: ``amx``, ``vector``, or ``amx-emulated``
        (the tile code over tiles emulated in scalar code, on any CPU with AVX512-BF16; tests
        only), if this CPU runs it."""
        self.attention = self._m.select_attention(arithmetic)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool
    ) -> torch.Tensor:
        return self._m.rms_norm(x, weight, eps, plus_one)  # type: ignore[no-any-return]

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        plus_one: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum rounded to bfloat16 first."""
        return self._m.add_rms_norm(x, residual, weight, eps, plus_one)  # type: ignore[no-any-return]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for rows ``[gate | up]``."""
        return self._m.silu_mul(gate_up)  # type: ignore[no-any-return]

    def rotary_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache_rows: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        gated: bool,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        plus_one: bool,
    ) -> torch.Tensor:
        """The queries ``[tokens, heads, head_dim]`` (normed, rotated); the keys (normed,
        rotated) and values written into the pool at ``cache_rows``."""
        return self._m.rotary_write(  # type: ignore[no-any-return]
            qkv, cos, sin, positions, cache_rows, key_cache, value_cache, heads, kv_heads,
            head_dim, gated, q_norm, k_norm, eps, plus_one,
        )  # fmt: skip

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A ``[out, in]`` bfloat16 weight in the layout :meth:`linear` reads."""
        return self._m.pack_weight(weight)  # type: ignore[no-any-return]

    def huge_page_buffer(self, nbytes: int) -> torch.Tensor:
        """Uninitialised uint8 memory for what a step streams (packed weights, the KV pool), on
        huge pages where Linux grants them (csrc/huge_pages.cpp says why)."""
        return self._m.huge_page_buffer(nbytes)  # type: ignore[no-any-return]

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` in bfloat16, each output summed over the inputs in an order
        fixed by the GEMM (:attr:`gemm`) and the layer's shape: a row's bits do not depend on
        the other rows or the thread count."""
        return self._m.linear(x, packed, bias, out_features)  # type: ignore[no-any-return]

    def linear_on(
        self,
        gemm: str,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
    ) -> torch.Tensor:
        """:meth:`linear` on a named GEMM: ``avx512bf16``, ``avx512``, ``avx2``, ``amx``, or
        ``amx-emulated`` (the AMX kernel over tiles emulated in scalar code, on any CPU; tests
        only)."""
        return self._m.linear_on(x, packed, bias, out_features, gemm)  # type: ignore[no-any-return]

    def select_gemm(self, gemm: str) -> None:
        """The projections run on ``gemm`` (``amx``, ``avx512bf16``, ``avx512``, ``avx2``) from
        now on, if this CPU runs it (the tests' way to the other paths on one host, and
        ``ATEN_CPU_CAPABILITY=avx2``'s)."""
        self.gemm = self._m.select_gemm(gemm)

    def quant_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        format: QuantFormat,
        out_features: int,
        bias: torch.Tensor | None,
        tiles: str = "",
        prompt_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` in bfloat16, the weight ``packed`` by :meth:`quant_pack`:
        rows marked in ``prompt_rows`` on the dequantized weight and :attr:`gemm`, the others as
        csrc/quant_gemm.h sums; a row's bits depend on neither the other rows, the threads, the
        instruction set nor ``tiles`` (``amx``, ``none``, ``amx-emulated``; :attr:`quant_tiles`)."""
        f = format
        return self._m.quant_linear(  # type: ignore[no-any-return]
            x, packed, out_features, f.bits, f.offset, f.has_min, f.sub, f.super, bias, tiles,
            prompt_rows)  # fmt: skip

    def quant_rows(
        self, packed: torch.Tensor, rows: torch.Tensor, format: QuantFormat, n: int, k: int
    ) -> torch.Tensor:
        """Rows ``rows`` of a weight kept quantized, as bfloat16 (an embedding's lookups): the
        values the dequantized path holds."""
        f = format
        return self._m.quant_rows(  # type: ignore[no-any-return]
            packed, rows, n, k, f.bits, f.offset, f.has_min, f.sub, f.super
        )

    def quant_pack(
        self,
        kind: QuantKind,
        raw: np.ndarray,
        k: int,
        out: torch.Tensor | None = None,
        order: np.ndarray | None = None,
    ) -> torch.Tensor:
        """A GGUF tensor of ``kind`` (``raw``: [rows, k / block · type size] uint8, one row of
        blocks per output, as gguf-py reads it; ``order``: which row each output is, by default
        all in order) as the records :meth:`quant_linear` reads (csrc/quant_pack.cpp), written
        into ``out`` (flat uint8 of the format's ``packed_bytes``; by default a new tensor); a
        last group's missing outputs are zeros."""
        f = FORMATS[kind]
        with warnings.catch_warnings():
            # A file's mapping is read-only; the packer only reads it.
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            blocks = torch.from_numpy(np.ascontiguousarray(raw))
        rows = None if order is None else torch.from_numpy(np.asarray(order, dtype=np.int64))
        outputs = blocks.shape[0] if rows is None else len(rows)
        if out is None:
            out = self.huge_page_buffer(f.packed_bytes(outputs, k))
        self._m.quant_pack(
            blocks, rows, int(kind), k, f.bits, f.offset, f.has_min, f.sub, f.super, out
        )
        return out

    def layer_stack(
        self,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        plus_one: bool,
        scale: float,
        activation: int,
    ) -> Any:
        """An empty chain of decoder layers over these kernels (csrc/layer_stack.h: its
        ``add_layer``, ``add_part`` and ``run``; ``activation``: its StackActivation), filled by
        ``model/layer_stack.py``."""
        return self._m.LayerStack(heads, kv_heads, head_dim, eps, plus_one, scale, activation)

    def paged_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        token_seq: torch.Tensor,
        positions: torch.Tensor,
        block_size: int,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of each token over its sequence's positions up to its own
        (``window`` > 0: the last ``window`` of them), ``[tokens, heads * head_dim]``."""
        return self._m.paged_attention(  # type: ignore[no-any-return]
            q, key_cache, value_cache, block_tables, token_seq, positions, block_size, window,
            scale,
        )  # fmt: skip


# The CPU features that decide which kernels serve, as /proc/cpuinfo names them.
_KERNEL_FEATURES = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
)


@functools.cache
def cpu_features() -> tuple[str, ...]:
    """Which of the features the kernels (and oneDNN) choose by this CPU has (Linux; else
    none known)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ()
    flags = next((set(line.split()) for line in lines if line.startswith("flags")), set())
    return tuple(f.upper() for f in _KERNEL_FEATURES if f in flags)


def compute_path(
    device: torch.device, dtype: torch.dtype, kernels: CpuKernels | None
) -> ComputePath:
    """What serves a decoder on ``device`` in ``dtype`` with ``kernels`` (None: plain torch),
    and whether it is batch-invariant: our kernels are by construction (any GEMM); oneDNN's
    bfloat16 matmuls were measured so on CPUs without AMX, while with AMX oneDNN picks its
    kernels by shape and a row can take other bits in a batch than alone (the LM head at 64
    rows); float32 and GPUs make no claim (docs/runners.md)."""
    if device.type != "cpu":
        return ComputePath(str(device), (), "torch (SDPA attention)", batch_invariant=False)
    features = cpu_features()
    if dtype != torch.bfloat16:
        return ComputePath("cpu", features, f"torch ops ({dtype})", batch_invariant=False)
    if kernels is not None and kernels.has_gemm:
        served = f"{kernels.gemm} GEMM, {kernels.attention} attention"
        return ComputePath("cpu", features, f"slotserve CPU kernels ({kernels.isa}), {served}")
    onednn = "oneDNN projections (prepacked, split-K)"
    if kernels is not None:
        return ComputePath("cpu", features, f"slotserve CPU kernels ({kernels.isa}), {onednn}")
    return ComputePath(
        "cpu", features, f"torch ops, {onednn}", batch_invariant="AMX_BF16" not in features
    )


def build_directory() -> Path:
    """Where the kernels are built and cached: ``TORCH_EXTENSIONS_DIR`` (torch's own setting,
    default ``~/.cache/torch_extensions``), one folder per source text, source folder and torch
    version (torch keys its cache on the .cpp file alone, so the headers' text and the flags go
    into the name; ninja rebuilds whenever the compile command changes, and the command names
    the sources' path, so two checkouts sharing a folder would rebuild each other's)."""
    digest = hashlib.sha256(
        b"".join(path.read_bytes() for path in sorted(SOURCES.glob("*.[ch]*")))
        + str(SOURCES.resolve()).encode()
        + torch.__version__.encode()
        + " ".join(CFLAGS + LDFLAGS).encode()
    ).hexdigest()[:12]
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    directory = Path(base) / f"slotserve_cpu_kernels_{digest}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def compile_module(sources: Path, name: str, directory: Path) -> Any:
    """The extension built from ``sources`` (a folder like :data:`SOURCES`) as module ``name``
    in ``directory``, with the project's flags."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=name,
        # Every translation unit the folder holds (one per instruction set, then the bindings),
        # compiled in parallel by torch's ninja build.
        sources=[str(path) for path in sorted(sources.glob("*.cpp"))],
        extra_include_paths=[str(sources)],
        extra_cflags=list(CFLAGS),  # torch appends to the lists it is given
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        verbose=False,
    )


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One build at a time per folder, under a lock the kernel drops when its holder dies.
    NOTE: torch's own build lock is a plain file, left behind by a build that was killed (a
    Ctrl-C at the first start), after which every later load waits for ever; holding ours, no
    live build can own it, so it is removed."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    with open(directory / "slotserve.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("CPU kernels: removing %s, left by a build that was stopped", stale)
            stale.unlink(missing_ok=True)
        yield


@functools.cache
def load_cpu_kernels() -> CpuKernels | None:
    """The kernels, compiled on the first call on this machine (a log line says so); None, after
    one warning, where they cannot run."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        logger.warning("CPU kernels: x86-64 only; the PyTorch runner uses plain torch")
        return None
    directory = build_directory()
    started = time.monotonic()
    logger.info("CPU kernels: loading (compiled once per torch version, ~1 minute)")
    try:
        with _build_lock(directory):
            module = compile_module(SOURCES, directory.name, directory)
    except Exception as exc:  # no compiler, no headers, a failed build: run without them
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        logger.warning("CPU kernels unavailable (%s); the PyTorch runner uses plain torch", reason)
        return None
    kernels = CpuKernels(module)
    if kernels.isa == "none":
        logger.warning("CPU kernels: this CPU has neither AVX-512 nor AVX2; using plain torch")
        return None
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
        # torch's own switch to its AVX2 code holds ours there too, the GEMM included (attention
        # has no AMX tiles in the AVX2 set)
        kernels.select_isa("avx2")
        kernels.select_gemm("avx2")
    logger.info("CPU kernels: %s, ready in %.1f s", kernels.isa, time.monotonic() - started)
    return kernels


def main() -> None:
    """``python -m slotserve.runners.pytorch.cpu_kernels``: build (or find) the kernels now."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernels = load_cpu_kernels()
    print(f"CPU kernels: {kernels.isa if kernels is not None else 'unavailable'}")


if __name__ == "__main__":
    main()
