"""Each runner's options, declared once (``slotserve.options``): what every runner takes
(:class:`RunnerCommon`), the llama.cpp runner's (:class:`LlamaCppConfig`) and the PyTorch
runner's (:class:`TorchConfig`). ``serve`` parses them together (``hosting/config.py``:
``RunnerConfig``); each runner's recipe (``specs.py``) is its class of options with what the
server adds (the model, the engine's slots), so a default or a bound is written here alone.
Nothing here imports a backend."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from slotserve.options import option, parse_bytes, repeated_option

RUNNERS = ("auto", "llama.cpp", "torch")
# --repack: ggml's extra weight buffer types on, off, or on where they are safe
# (``llama_cpp/cpu.py``).
REPACK_CHOICES = ("auto", "on", "off")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
# --quantization: auto keeps a GGUF file's quantized types, or an AWQ, GPTQ or compressed-tensors
# folder's 4-bit weights, as stored (on CPU in bfloat16 with the kernels), none dequantizes them;
# awq, gptq and compressed-tensors say auto of such a folder; a type rounds every matrix of an
# HF checkpoint to it at load (gguf-py's quantizers: ``pytorch/quant/tensor.py``).
STORED_QUANTIZATIONS = ("awq", "gptq", "compressed-tensors")
# vLLM's names for its GPU kernels over the same checkpoints: here the method itself.
KERNEL_SPELLINGS = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
QUANTIZATIONS = (
    "auto", "none", *STORED_QUANTIZATIONS, *KERNEL_SPELLINGS, "Q8_0", "Q4_0", "Q4_1", "Q5_0",
    "Q5_1",
)  # fmt: skip
# --attention-backend: where the CPU kernels do not serve, the Triton kernels reading the paged
# KV pool in place (``pytorch/gpu_kernels.py``) or torch's operators over gathered K/V
# (``pytorch/model/attention.py``).
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# --kv-cache-dtype: the model's own type, or int8 rows with a scale each
# (``pytorch/model/kv_int8.py``).
KV_CACHE_DTYPES = ("auto", "int8")
# --cache-type-k / --cache-type-v: llama-server's KV cache types (``llama_cpp/metadata.py``).
KV_CACHE_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# --rope-scaling: llama-server's methods (``rope.py``).
ROPE_SCALINGS = ("none", "linear", "yarn")


def parse_json_object(text: str) -> str:
    """``text`` if it is a JSON object (kept as text: options stay plain and hashable)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return text


def parse_threads(text: str) -> int:
    """``--threads``: a count, or llama-server's -1 for every core (0 here)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"invalid int value: {text!r}") from None
    return 0 if value == -1 else value


@dataclass(frozen=True, kw_only=True)
class RunnerCommon:
    """What every runner takes: which runner, its threads, its recurrent-state snapshots, its
    adapters, and what it lays over the model's configuration (RoPE's settings above all:
    ``rope.py``)."""

    runner: str = option(
        "auto",
        choices=RUNNERS,
        help="auto: torch for an HF folder or cached model id, and for a .gguf file whose "
        "architecture and types its CPU kernels serve as stored (else llama.cpp)",
    )
    threads: int = option(
        0,
        ge=0,
        parse=parse_threads,
        aliases=("-t",),
        help="CPU threads for the runner (default 0, or llama-server's -1: all cores)",
    )
    prefix_cache_snapshots: int | None = option(
        None,
        ge=0,
        help="models with recurrent layers (Gated DeltaNet, hybrid GGUFs): recurrent-state "
        "snapshots the prefix cache may keep, each one sequence's state (its size is logged at "
        "load; default 4 per slot; 0: no prefix cache for such models)",
    )
    lora_modules: tuple[str, ...] = repeated_option(
        "NAME=PATH",
        help="LoRA adapters loaded with the model, each served as model NAME (vLLM's flag; a "
        "JSON object with name and path works too): PEFT folders on torch, GGUF adapter files "
        "on llama.cpp; more load at run time through POST /v1/load_lora_adapter",
    )
    hf_overrides: str | None = option(
        None,
        parse=parse_json_object,
        aliases=("--json-model-override-args",),
        metavar="JSON",
        help="a JSON object laid over the model's configuration before it is read (vLLM's "
        "flag; SGLang's --json-model-override-args), as HF's config.json names it (a GGUF's "
        'settings read as those names): \'{"rope_scaling": {"rope_type": "yarn", "factor": '
        "2.0}}' stretches RoPE past the trained context for a longer --max-model-len; the "
        "llama.cpp runner takes only rope_scaling (linear, yarn) and rope_theta",
    )
    rope_scaling: str | None = option(
        None,
        choices=ROPE_SCALINGS,
        help="RoPE scaling laid over the model's (llama-server's flag; in HF's words, "
        "--hf-overrides' rope_scaling): linear or yarn, stretching by --rope-scale; none: "
        "no scaling",
    )
    rope_scale: float = option(
        0.0, ge=0, help="the factor --rope-scaling stretches the context by (llama-server's flag)"
    )
    rope_freq_base: float = option(
        0.0, ge=0, help="RoPE's base frequency, theta (llama-server's flag; default: the model's)"
    )
    yarn_orig_ctx: int = option(
        0,
        ge=0,
        help="YaRN: the context the model was trained on (llama-server's flag; default: the "
        "model's own)",
    )
    max_loras: int = option(8, ge=1, help="LoRA adapters held at once (default 8)")
    max_lora_rank: int = option(
        64, ge=1, help="the largest LoRA rank an adapter may have (default 64)"
    )


@dataclass(frozen=True, kw_only=True)
class LlamaCppConfig(RunnerCommon):
    """How the llama.cpp runner is built (``hosting/launch.py``: ``llama_cpp_spec``)."""

    ctx_size: int = option(
        0,
        ge=0,
        aliases=("-c",),
        help="llama.cpp: KV cache tokens for all slots together; each slot gets "
        "ctx-size / slots (default: slots × min(trained context, 4096), or slots × "
        "--max-model-len); on the PyTorch runner it sets --max-model-len to ctx-size / slots",
    )
    flash_attn: bool = option(
        True, help="flash attention kernels (default on: faster batched decode on CPU)"
    )
    cache_type_k: str = option(
        "f16",
        short="-ctk",
        choices=KV_CACHE_TYPES,
        help="llama.cpp: the KV cache's type for keys (llama-server's flag; default f16); "
        "q8_0 takes about half of f16's memory, q4_0 about a quarter",
    )
    cache_type_v: str = option(
        "f16",
        short="-ctv",
        choices=KV_CACHE_TYPES,
        help="llama.cpp: the KV cache's type for values (llama-server's flag; default f16); a "
        "quantized one needs flash attention",
    )
    n_gpu_layers: int = option(
        0,
        short="-ngl",
        ge=-1,
        help="llama.cpp: layers to offload to the GPU (llama-server's flag; -1: all), with "
        "llama-cpp-python built for one (CMAKE_ARGS=-DGGML_CUDA=on); a CPU-only build refuses "
        "it (default 0)",
    )
    repack: str = option(
        "auto",
        choices=REPACK_CHOICES,
        help="llama.cpp: ggml's repacked CPU weight layouts, its extra buffer types "
        "(llama-server's --repack / --no-repack); auto: on, except where this llama.cpp build "
        "offers its AMX buffer, whose matmul crashes (Intel Xeon hosts)",
    )


@dataclass(frozen=True, kw_only=True)
class TorchConfig(RunnerCommon):
    """How the PyTorch runner is built (``hosting/launch.py``: ``torch_spec``)."""

    dtype: str = option(
        "auto",
        choices=DTYPES,
        help="torch: weight and KV type (auto: bfloat16, batch-invariant on CPU)",
    )
    device: str = option("auto", help="torch: cpu, cuda or cuda:N (auto: cuda when available)")
    load_format: str = option(
        "auto",
        choices=LOAD_FORMATS,
        help="torch: dummy builds random weights from the config (benchmarks)",
    )
    quantization: str = option(
        "auto",
        short="-q",
        choices=QUANTIZATIONS,
        help="torch on CPU: weights kept quantized in the CPU kernels' own formats (vLLM's "
        "flag); auto: a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrices as "
        "stored, a 4-bit AWQ, GPTQ or compressed-tensors checkpoint's as blocks that equal them "
        "(Q4_0, Q4_ZP, Q5_0), any other HF checkpoint dense; awq, gptq, compressed-tensors "
        "(or vLLM's awq_marlin, gptq_marlin): auto, for a checkpoint of that method; none: "
        "dequantized to --dtype; Q8_0, Q4_0, ...: "
        "an HF checkpoint's matrices rounded to that type at load (round-to-nearest, as "
        "llama.cpp)",
    )
    max_model_len: int = option(
        0,
        ge=0,
        aliases=("--context-length",),
        help="torch: tokens one sequence may hold (default: min(trained context, 4096), or "
        "--ctx-size / slots); on the llama.cpp runner it sets --ctx-size to slots × this",
    )
    kv_memory: int | None = option(
        None,
        parse=parse_bytes,
        aliases=("--kv-cache-memory-bytes",),
        wire=int | str,
        help="torch: memory for the paged KV cache (2GiB; default on CPU: every slot's "
        "max-model-len within a quarter of RAM; on GPU: --gpu-memory-fraction)",
    )
    gpu_memory_fraction: float = option(
        0.9,
        aliases=("--gpu-memory-utilization", "--mem-fraction-static"),
        help="torch on GPU: fraction of device memory weights and KV may use (default 0.9)",
    )
    block_size: int = option(16, ge=1, help="torch: positions per KV block (default 16)")
    kv_cache_dtype: str = option(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="torch on CPU: the paged KV cache's type (vLLM's flag); auto: --dtype; int8: each "
        "position's row of a KV head as 8-bit integers with a float32 scale (max |x| / 127): "
        "about half the memory, every invariance kept within the mode, replies that may differ "
        "from auto's, decode steps faster at long contexts; no fp8 (docs/runners.md)",
    )
    cpu_kernels: bool = option(
        True,
        help="torch on CPU in bfloat16: C++ kernels for attention, norms, rotary and SiLU "
        "(default on; compiled on first use; off: plain torch operators, the reference)",
    )
    attention_backend: str = option(
        "auto",
        choices=ATTENTION_BACKENDS,
        help="torch: attention where the CPU kernels do not serve: triton (kernels reading the "
        "paged KV pool in place, batch-invariant; decode steps replay CUDA graphs), torch "
        "(gathered, then SDPA on GPUs); auto: triton on a CUDA device with Triton installed, "
        "else torch",
    )
    batch_invariant: bool = option(
        False,
        help="torch on GPUs: every sequence's tokens independent of its batch (vLLM's "
        "VLLM_BATCH_INVARIANT): Triton attention and matmuls whose sums keep one order; dense "
        "models (the CPU path is batch-invariant already)",
    )
    enforce_eager: bool = option(
        False,
        aliases=("--disable-cuda-graph",),
        help="torch on GPUs: run decode steps operator by operator instead of replaying the "
        "CUDA graphs captured at load (vLLM's --enforce-eager; graphs come with the Triton "
        "attention, on dense models without tensor parallelism)",
    )
    classifier_from_token: tuple[str, ...] = repeated_option(
        "TOKEN",
        help="torch: serve a causal LM as a reranker (/v1/rerank, /v1/score), scored at the "
        "prompt's last token by these vocabulary tokens (vLLM's classifier_from_token): two, "
        "false then true, give sigmoid(logit true - logit false), as 'no yes' for "
        "Qwen3-Reranker; one gives the sigmoid of its logit",
    )
    tensor_parallel_size: int = option(
        1,
        short="-tp",
        aliases=("--tp-size", "--tp"),
        ge=1,
        help="torch: ranks that each hold a slice of every layer (one process each; NCCL with "
        "a GPU per rank, else gloo); --threads is then per rank (default 1)",
    )
