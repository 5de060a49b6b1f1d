"""The real runners on the real SmolLM2 model, one of each per test session: the llama.cpp
runner on the GGUF, the PyTorch runner on the same GGUF (its quantized blocks through the CPU
kernels; dequantised, bfloat16, on the plain-torch reference), and an HF
safetensors folder converted from it for the PyTorch runner's HF-format and parity tests."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from slotserve.engine.runner_interface import Runner
from tests.runner.hf_checkpoint import convert_gguf_to_hf

if TYPE_CHECKING:  # imported where used: a GPU machine may run the CUDA tests without it
    from slotserve.runners.llama_cpp.runner import LlamaCppRunner
    from slotserve.runners.pytorch.cpu_kernels import CpuKernels

FLASH_ATTN = True  # the server's default; references must use the same attention kernel
# torch-reference: the PyTorch runner with its CPU kernels off, the plain-torch path they must
# agree with on every behaviour (and which machines without the kernels run).
RUNNER_KINDS = ["llama.cpp", "torch", "torch-reference", "torch-int8-kv"]
RUNNER_FIXTURES = {
    "llama.cpp": "llama_runner",
    "torch": "torch_runner",
    "torch-reference": "torch_reference_runner",
    "torch-int8-kv": "torch_int8_kv_runner",
}


@pytest.fixture(scope="session")
def llama_runner(model_path: Path) -> Iterator[LlamaCppRunner]:
    """One real llama.cpp runner for all runner tests (each test builds its own engine over
    it, which starts by emptying every slot's KV)."""
    from slotserve.runners.llama_cpp.runner import LlamaCppRunner

    r = LlamaCppRunner(
        model_path, num_slots=8, ctx_size=8 * 2048, max_batch_tokens=512, flash_attn=FLASH_ATTN
    )
    yield r
    r.close()


def llama_cpp_reference(model_path: Path, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> Any:
    """llama-cpp-python's own ``Llama`` on the model, one sequence (``settings``: more of its
    arguments, e.g. ``lora_path``): the reference for the llama.cpp runner's tokens."""
    import llama_cpp

    from slotserve.runners.llama_cpp.cpu import choose_weight_layout, extra_buffer_types

    # The reference loads its weights in the layout ours chose (never ggml's crashing AMX
    # buffer); llama_cpp.Llama takes no argument for it.
    default_params = llama_cpp.llama_cpp.llama_model_default_params
    layout = choose_weight_layout("auto", extra_buffer_types())

    def params() -> object:
        chosen = default_params()
        chosen.use_extra_bufts = layout.use_extra_buffers
        return chosen

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", params)
    return llama_cpp.Llama(
        model_path=str(model_path),
        n_ctx=2048,
        n_batch=512,
        n_ubatch=512,
        n_threads=2,
        flash_attn=FLASH_ATTN,
        verbose=False,
        **settings,
    )


def llama_cpp_greedy(reference: Any, prompt: list[int], tokens: int) -> list[int]:
    """The reference's first ``tokens`` greedy tokens after ``prompt``, from a fresh state."""
    out: list[int] = []
    for token in reference.generate(prompt, temp=0.0, reset=True):
        out.append(token)
        if len(out) == tokens:
            break
    return out


@pytest.fixture
def runner(llama_runner: LlamaCppRunner) -> LlamaCppRunner:
    """The llama.cpp runner, for its own tests."""
    return llama_runner


def _torch_runner(model_path: Path, cpu_kernels: bool, kv_cache_dtype: str = "auto") -> Runner:
    from slotserve.runners.pytorch.load.settings import TorchLoadConfig
    from slotserve.runners.pytorch.runner import TorchRunner

    return TorchRunner(
        TorchLoadConfig(
            model_path,
            num_slots=8,
            max_batch_tokens=512,
            max_model_len=2048,
            cpu_kernels=cpu_kernels,
            kv_cache_dtype=kv_cache_dtype,
        )
    )


@pytest.fixture(scope="session")
def torch_runner(model_path: Path) -> Iterator[Runner]:
    r = _torch_runner(model_path, cpu_kernels=True)
    yield r
    r.close()


@pytest.fixture(scope="session")
def torch_int8_kv_runner(model_path: Path) -> Iterator[Runner]:
    """The CPU kernels over an int8 KV pool (``--kv-cache-dtype int8``)."""
    r = _torch_runner(model_path, cpu_kernels=True, kv_cache_dtype="int8")
    yield r
    r.close()


@pytest.fixture(scope="session")
def torch_reference_runner(model_path: Path) -> Iterator[Runner]:
    r = _torch_runner(model_path, cpu_kernels=False)
    yield r
    r.close()


@pytest.fixture(params=RUNNER_KINDS)
def any_runner(request: pytest.FixtureRequest) -> Runner:
    """Each runner in turn, for the engine-level behaviour both must share."""
    runner: Runner = request.getfixturevalue(RUNNER_FIXTURES[request.param])
    return runner


@pytest.fixture(scope="session")
def hf_checkpoint(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped GGUF as an HF safetensors folder (float32, dequantised by transformers)."""
    return convert_gguf_to_hf(model_path, tmp_path_factory.mktemp("hf-smollm2"))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    """The PyTorch runner's CPU kernels; on an x86 Linux machine with AVX2 and FMA they must
    build and load (a failed build is a test failure there, not a skip)."""
    from slotserve.runners.pytorch.cpu_kernels import load_cpu_kernels

    loaded = load_cpu_kernels()
    if loaded is None:
        if platform.machine() == "x86_64" and {"avx2", "fma"} <= _cpu_flags():
            pytest.fail("the CPU kernels did not build or load on a CPU that runs them")
        pytest.skip("no x86-64 CPU with AVX2 and FMA: the kernels do not run here")
    return loaded


def instruction_sets(kernels: CpuKernels) -> list[str]:
    """The kernels' builds this CPU runs, widest first (avx512bf16, avx512, avx2)."""
    default, runs = kernels.isa, []
    for isa in ("avx512bf16", "avx512", "avx2"):
        try:
            kernels.select_isa(isa)
        except RuntimeError:
            continue
        runs.append(isa)
    kernels.select_isa(default)
    return runs


@contextlib.contextmanager
def instruction_set(kernels: CpuKernels, isa: str) -> Iterator[None]:
    """Runs the kernels' ``isa`` build inside the block, the default one after it."""
    default = kernels.isa
    kernels.select_isa(isa)
    try:
        yield
    finally:
        kernels.select_isa(default)


@contextlib.contextmanager
def attention_arithmetic(kernels: CpuKernels, arithmetic: str) -> Iterator[None]:
    """Runs attention in ``arithmetic`` inside the block, the default one after it."""
    default = kernels.attention
    kernels.select_attention(arithmetic)
    try:
        yield
    finally:
        kernels.select_attention(default)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's thread pool at 1, then 2 threads (the kernels' threads are torch's)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def require_batch_invariance(runner: Runner) -> None:
    """Skips a test that compares a sequence alone and batched on a path that states no batch
    invariance here: the plain-torch path on a CPU with AMX, where oneDNN chooses its matmul
    kernels by shape (the default path, the CPU kernels, states it on every CPU)."""
    compute = runner.model_info.compute
    if not compute.batch_invariant:
        pytest.skip(
            f"{compute.kernels} is not batch-invariant on this CPU ({compute.cpu_features})"
        )


@pytest.fixture(scope="session")
def vl_folder(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-VL folder on the SmolLM2 checkpoint's text weights."""
    from slotserve.bench.vision_model import qwen_vl_folder

    return qwen_vl_folder(hf_checkpoint, tmp_path_factory.mktemp("qwen-vl"))
