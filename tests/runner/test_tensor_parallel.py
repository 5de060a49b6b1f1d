"""R3: tensor parallelism in the PyTorch runner, real ranks over gloo on loopback (one thread
each, float32): greedy tokens at TP=2 and TP=3 equal TP=1, with the paged KV pool, prefix-cache
hits and preemption in play; what cannot be split is refused with the reason."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.model.config import UnsupportedModelError
from slotserve.runners.pytorch.runner import TorchRunner
from tests.conftest import start_server, stop_server, wait_until
from tests.prompts import PROMPTS
from tests.runner.engine_runs import generate, greedy
from tests.runner.hf_checkpoint import tiny_random_checkpoint

SHARED = "You are a careful assistant. Answer briefly and cite the rule you used. " * 3


@pytest.fixture(scope="module")
def tiny_folders(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Heads divisible by 2: Qwen2 (q/k/v biases, tied embeddings) and Qwen3-MoE (a dense
    layer, experts; a vocabulary of 49155, so the last rank's share is padded)."""
    root = tmp_path_factory.mktemp("tp")
    return {
        "qwen2": tiny_random_checkpoint("qwen2", hf_checkpoint, root / "qwen2"),
        "qwen3_moe": tiny_random_checkpoint(
            "qwen3_moe", hf_checkpoint, root / "qwen3_moe", vocab_size=49155
        ),
    }


def _runner(path: Path, ranks: int, **settings: object) -> TorchRunner:
    load = TorchLoadConfig(
        path,
        dtype="float32",
        threads=1,
        tensor_parallel_size=ranks,
        **settings,  # type: ignore[arg-type]
    )
    return TorchRunner(load)


def _greedy_runs(runner: TorchRunner, config: EngineConfig) -> dict[str, list[int]]:
    """Every prompt alone, then the shared-prefix ones together (cache hits), in one core."""
    core = EngineCore(runner, config)
    encode = runner.tokenizer.encode
    jobs = {f"p{i}": (encode(p), greedy(24)) for i, p in enumerate(PROMPTS)}
    shared = {f"s{i}": (encode(SHARED + p), greedy(16)) for i, p in enumerate(PROMPTS[:4])}
    out = generate(core, jobs)
    out |= generate(core, {"s0": shared.pop("s0")})  # caches the shared prefix
    out |= generate(core, shared)
    if config.prefix_cache:
        assert core.snapshot().prefix_cache.hits >= 3, "the shared-prefix prompts hit the cache"
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_tp2_equals_tp1_on_a_tiny_random_model(tiny_folders: dict[str, Path], family: str) -> None:
    config = EngineConfig(num_slots=4, max_batch_tokens=64, prefill_chunk=32)
    outputs = []
    for ranks in (1, 2):
        runner = _runner(tiny_folders[family], ranks, num_slots=4)
        try:
            outputs.append(_greedy_runs(runner, config))
        finally:
            runner.close()
    assert outputs[1] == outputs[0]


def test_tp2_preempts_and_recomputes_as_tp1(tiny_folders: dict[str, Path]) -> None:
    """A pool of 12 blocks for four sequences: the engine preempts at both sizes alike."""
    config = EngineConfig(num_slots=4, prefix_cache=False)
    outputs, preemptions = [], []
    for ranks in (1, 2):
        runner = _runner(tiny_folders["qwen2"], ranks, num_slots=4, max_model_len=128)
        runner_kv = 12 * 16 * runner.shard.kv_bytes_per_token
        runner.close()
        runner = _runner(
            tiny_folders["qwen2"], ranks, num_slots=4, max_model_len=128, kv_memory=runner_kv
        )
        try:
            core = EngineCore(runner, config)
            prompts = [runner.tokenizer.encode(p) for p in PROMPTS[:4]]
            outputs.append(
                generate(core, {f"p{i}": (p, greedy(60)) for i, p in enumerate(prompts)})
            )
            preemptions.append(core.snapshot().preemptions)
        finally:
            runner.close()
    assert preemptions[0] > 0 and preemptions[1] > 0
    assert outputs[1] == outputs[0]


def test_tp3_on_the_embedded_model(model_path: Path) -> None:
    """SmolLM2-135M: 9 query heads and 3 KV heads, three ranks of 3 and 1; 49152 rows of
    vocabulary, 16384 each."""
    config = EngineConfig(num_slots=4)
    outputs = []
    for ranks in (1, 3):
        runner = _runner(model_path, ranks, num_slots=4, max_model_len=512)
        try:
            outputs.append(_greedy_runs(runner, config))
        finally:
            runner.close()
    assert outputs[1] == outputs[0]


def test_heads_that_do_not_divide_are_refused_before_any_rank_starts(model_path: Path) -> None:
    before = _children()
    with pytest.raises(UnsupportedModelError, match=r"9 attention heads .* do not divide"):
        _runner(model_path, 2)
    assert _children() == before


def test_a_dead_rank_fails_the_step_with_a_clear_error(tiny_folders: dict[str, Path]) -> None:
    runner = _runner(tiny_folders["qwen2"], 2, num_slots=2)
    try:
        assert runner.ranks is not None
        worker = runner.ranks.ranks[0].process
        worker.kill()
        worker.wait()
        core = EngineCore(runner, EngineConfig(num_slots=2))
        core.add_request(EngineCoreRequest("r", runner.tokenizer.encode("Hello"), greedy(4)))
        errors = [out.error for out in core.step() if out.finished]
        assert errors and "tensor-parallel rank 1 exited" in str(errors[0])
    finally:
        runner.close()


def test_served_with_tensor_parallel_over_http(
    tiny_folders: dict[str, Path], tmp_path: Path
) -> None:
    """``slotserve serve --tensor-parallel-size 2``: the engine process starts rank 1, the
    OpenAI client gets rank 0's greedy tokens, and stopping the server ends every rank."""
    server = start_server(
        tmp_path,
        str(tiny_folders["qwen2"]),
        *("--tensor-parallel-size", "2", "--dtype", "float32", "--threads", "1"),
        *("--slots", "2", "--max-model-len", "256"),
    )
    try:
        engine_processes = _children(server.process.pid)
        ranks = set().union(*(_children(pid) for pid in engine_processes))
        assert len(ranks) == 1, "the engine process runs rank 0 and started rank 1"
        client = OpenAI(base_url=server.api_url, api_key="unused")
        reply = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=PROMPTS[0],
            max_tokens=8,
            temperature=0,
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 8
        info = httpx.get(f"{server.base_url}/server_info", timeout=10).json()
        assert info["tp_size"] == 2, "what the SGLang Model Gateway reads"
    finally:
        stop_server(server)
    assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in ranks), 20)


def test_a_dead_rank_restarts_the_whole_engine_by_itself(
    tiny_folders: dict[str, Path], tmp_path: Path
) -> None:
    """A killed rank fails the step it was part of; the server then rebuilds the engine with
    every rank (no reload asked for) and serves again, counting the restart."""
    server = start_server(
        tmp_path,
        str(tiny_folders["qwen2"]),
        *("--tensor-parallel-size", "2", "--dtype", "float32", "--threads", "1"),
        *("--slots", "2", "--max-model-len", "256"),
    )
    try:
        engine = int(server.slots()["engine_pid"])
        (rank,) = _children(engine)
        os.kill(rank, signal.SIGKILL)
        model = httpx.get(f"{server.api_url}/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}

        def served() -> bool:
            reply = httpx.post(f"{server.api_url}/completions", json=body, timeout=60)
            return reply.status_code == 200

        first = httpx.post(f"{server.api_url}/completions", json=body, timeout=60)
        assert first.status_code in (500, 503), first.text  # its step met the dead rank
        assert wait_until(served, 120), "serving again without a reload"
        new_engine = int(server.slots()["engine_pid"])
        assert new_engine != engine and len(_children(new_engine)) == 1, "every rank anew"
        assert not Path(f"/proc/{engine}").exists() and not Path(f"/proc/{rank}").exists()
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert re.search(r"^slotserve:engine_restarts_total\{[^}]*\} 1\.0$", metrics, re.M)
    finally:
        stop_server(server)


def test_the_llama_cpp_runner_refuses_tensor_parallel(model_path: Path) -> None:
    serve = [sys.executable, "-m", "slotserve.cli", "serve", str(model_path)]
    result = subprocess.run(
        [*serve, "-tp", "2", "--runner", "llama.cpp"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "--tensor-parallel-size: a PyTorch runner setting" in result.stderr


def _children(parent: int | None = None) -> set[int]:
    """PIDs of ``parent``'s (default: this process's) children (Linux /proc)."""
    me = str(parent or os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[1] == me:
                        found.add(int(entry))
            except OSError:
                continue
    return found
