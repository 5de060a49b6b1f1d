"""``slotserve bench model-file``: GGUF files of the sizes users run, offline: random weights of a
real model's shapes (``model_shapes.CPU_SHAPES``) with SmolLM2's vocabulary, written in F16 and
quantized by llama.cpp's own quantizer (``llama_model_quantize``: Q4_K_M mixes Q4_K with Q6_K as
llama.cpp decides), cached on disk (``SLOTSERVE_MODEL_CACHE``, default
``~/.cache/slotserve/models``). Both runners and llama-server then read the same file. AWQ,
GPTQ and W4A16 are HF folders of the F16 file's weights in those 4-bit layouts (groups of 128;
GPTQ and W4A16 symmetric, as their tools' defaults: ``int4_folders.py``), for the PyTorch runner.

    slotserve bench model-file llama-3.2-1b --quant Q4_K_M   # prints the file's path
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from slotserve.bench.model_shapes import CPU_SHAPES

# llama.cpp's file types, by the names its quantize tool gives them; then the HF folders'.
FOLDERS = {"AWQ": "awq", "GPTQ": "gptq-sym", "W4A16": "compressed-sym"}
QUANTS = ("F16", "Q8_0", "Q4_K_M", "Q4_0", *FOLDERS)
WEIGHT_STD = 0.02  # random weights' spread: a model whose activations stay finite


def cache_folder() -> Path:
    folder = os.environ.get("SLOTSERVE_MODEL_CACHE")
    return Path(folder) if folder else Path.home() / ".cache" / "slotserve" / "models"


def model_file(shape: str, quant: str, folder: Path | None = None) -> Path:
    """The cached file of ``shape`` in ``quant``, made first if missing (minutes for 8B)."""
    if shape not in CPU_SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(CPU_SHAPES)}")
    if quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r}: one of {', '.join(QUANTS)}")
    folder = folder or cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f"{shape}-{quant}" if quant in FOLDERS else f"{shape}-{quant}.gguf")
    if path.exists():
        return path
    f16 = folder / f"{shape}-F16.gguf"
    if not f16.is_file():
        _write_random(shape, f16.with_suffix(".partial"))
        f16.with_suffix(".partial").rename(f16)
    if quant in FOLDERS:
        _int4_folder(f16, path, FOLDERS[quant])
    elif quant != "F16":
        _quantize(f16, path.with_suffix(".partial"), quant)
        path.with_suffix(".partial").rename(path)
    return path


def _int4_folder(source: Path, out: Path, method: str) -> None:
    """``source`` as an HF folder of ``method``'s 4-bit weights, through a bfloat16 one."""
    import shutil
    import tempfile

    from slotserve.bench.hf_reference import convert_gguf_to_hf
    from slotserve.bench.int4_folders import int4_checkpoint

    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        dense = convert_gguf_to_hf(source, Path(scratch) / "bf16", dtype="bfloat16")
        partial = Path(scratch) / "int4"
        int4_checkpoint(dense, partial, method, group=128)
        shutil.move(partial, out)


def _tensors(arch: str, hp: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Each tensor's GGUF name and shape (rows, columns), in llama.cpp's converter's order."""
    hidden, ffn, vocab = hp["hidden_size"], hp["intermediate_size"], hp["vocab_size"]
    head, heads, kv_heads = hp["head_dim"], hp["num_attention_heads"], hp["num_key_value_heads"]
    yield "token_embd.weight", (vocab, hidden)
    for i in range(hp["num_hidden_layers"]):
        block = f"blk.{i}"
        yield f"{block}.attn_norm.weight", (hidden,)
        yield f"{block}.attn_q.weight", (heads * head, hidden)
        yield f"{block}.attn_k.weight", (kv_heads * head, hidden)
        yield f"{block}.attn_v.weight", (kv_heads * head, hidden)
        yield f"{block}.attn_output.weight", (hidden, heads * head)
        if arch == "qwen3":
            yield f"{block}.attn_q_norm.weight", (head,)
            yield f"{block}.attn_k_norm.weight", (head,)
        yield f"{block}.ffn_norm.weight", (hidden,)
        yield f"{block}.ffn_gate.weight", (ffn, hidden)
        yield f"{block}.ffn_up.weight", (ffn, hidden)
        yield f"{block}.ffn_down.weight", (hidden, ffn)
    yield "output_norm.weight", (hidden,)
    if not hp["tie_word_embeddings"]:
        yield "output.weight", (vocab, hidden)


def _write_random(shape: str, path: Path) -> None:
    """Random F16 matrices (norms of ones, in float32) streamed one at a time, with the
    embedded model's vocabulary and chat template."""
    import gguf

    from slotserve.bench.hf_gguf import copy_vocabulary, gguf_writer
    from slotserve.hosting.source import embedded_model_path

    arch, hp = CPU_SHAPES[shape]
    writer = gguf_writer(path, arch, hp)
    writer.add_name(f"random {shape}")
    writer.add_rope_dimension_count(hp["head_dim"])
    writer.add_rope_freq_base(hp["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_vocabulary(gguf.GGUFReader(str(embedded_model_path())), writer)
    specs = list(_tensors(arch, hp))
    for name, dims in specs:
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(
            name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _, dims in specs:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        rows = np.empty(dims, dtype=np.float16)
        for start in range(0, dims[0], 4096):  # a chunk at a time: float32 only for a chunk
            chunk = rng.standard_normal((min(4096, dims[0] - start), dims[1]), np.float32)
            rows[start : start + len(chunk)] = chunk * WEIGHT_STD
        writer.write_tensor_data(rows)
    writer.close()


def _quantize(source: Path, out: Path, quant: str) -> None:
    import llama_cpp as llama

    from slotserve.runners.llama_cpp.backend import init_llama_backend

    init_llama_backend()  # its log goes to ours
    params = llama.llama_model_quantize_default_params()
    params.ftype = getattr(llama, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = os.cpu_count() or 1
    status = llama.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize returned {status} for {source} → {quant}")


def add_model_file_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shape", choices=list(CPU_SHAPES))
    parser.add_argument("--quant", choices=QUANTS, default="Q4_K_M")
    parser.add_argument("--cache", type=Path, help="folder (default: SLOTSERVE_MODEL_CACHE)")


def main_model_file(args: argparse.Namespace) -> int:
    print(model_file(args.shape, args.quant, args.cache))
    return 0
