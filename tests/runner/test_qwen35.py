"""Qwen3.5 (Gated DeltaNet + gated full attention, dense and MoE) on the PyTorch runner:
tiny random models saved by transformers itself are the reference (float32), prompts cut into
several chunks so the recurrent state is carried between them; batch invariance in bfloat16;
preemption recomputes the state; speculation off (and the prefix cache without snapshots)
with the reason; the server with the real ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import torch

from slotserve.engine.config import EngineConfig, SpeculativeConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.runner_interface import RECURRENT_STATE_NO_ROLLBACK
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.llama_cpp.runner import LlamaCppRunner
from slotserve.runners.pytorch.families.registry import config_from_gguf
from slotserve.runners.pytorch.load.checkpoint import read_model_config
from slotserve.runners.pytorch.load.gguf_file import gguf_metadata, gguf_tensors
from slotserve.runners.pytorch.load.gguf_header import GgufHeader
from slotserve.runners.pytorch.load.hf_folder import safetensors_tensors
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.load.tokenizer import HfTokenizer
from slotserve.runners.pytorch.load.weights import load_into
from slotserve.runners.pytorch.model.config import UnsupportedModelError
from slotserve.runners.pytorch.model.decoder import Decoder
from slotserve.runners.pytorch.model.deltanet import BLOCK
from slotserve.runners.pytorch.runner import TorchRunner
from tests.conftest import start_server, stop_server
from tests.prompts import PROMPTS
from tests.runner.engine_runs import alone_then_together, generate, greedy
from tests.runner.hf_checkpoint import qwen35_gguf, tiny_random_checkpoint

FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text"]
LOGPROB_TOLERANCE = 2e-4  # float32: chunked delta rule and summation orders vs transformers'
LONG_PROMPT = " ".join(PROMPTS * 3)  # ~180 tokens: 3 chunks of the 64-token grain


@pytest.fixture(scope="module")
def folders(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen35")
    return {f: tiny_random_checkpoint(f, hf_checkpoint, root / f) for f in FAMILIES}


def _runner(path: Path, **options: object) -> TorchRunner:
    options.setdefault("num_slots", 4)
    options.setdefault("max_model_len", 512)
    return TorchRunner(TorchLoadConfig(path, **options))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def bf16_runner(folders: dict[str, Path]) -> Iterator[TorchRunner]:
    runner = _runner(folders["qwen3_5_moe_text"], num_slots=8)
    yield runner
    runner.close()


def _hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.train(False)


def _run_one(
    core: EngineCore, prompt: list[int], params: SamplingParams
) -> tuple[list[int], list[dict[int, float]], list[dict[int, float]]]:
    """Tokens, their top log-probabilities, and the prompt's (from position 1)."""
    core.add_request(EngineCoreRequest("r", prompt, params))
    tokens: list[int] = []
    tops: list[dict[int, float]] = []
    prompt_tops: list[dict[int, float]] = []
    while core.scheduler.has_work or not tokens:
        for out in core.step():
            for delta in out.deltas:
                prompt_tops.extend(dict(t.top_logprobs) for t in delta.prompt_logprobs or [])
                tokens.extend(delta.token_ids)
                tops.extend(dict(t.top_logprobs) for t in delta.logprobs or [])
    return tokens, tops, prompt_tops


def _worst_gap(ours: list[dict[int, float]], theirs: torch.Tensor) -> float:
    """Largest difference of our top log-probabilities from HF's rows ``theirs``."""
    assert len(ours) == theirs.shape[0]
    return max(
        abs(value - float(theirs[row, token]))
        for row, top in enumerate(ours)
        for token, value in top.items()
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_qwen3_5_matches_transformers_at_every_prompt_position_and_in_generate(
    family: str, folders: dict[str, Path]
) -> None:
    runner = _runner(folders[family], dtype="float32")
    assert runner.config.linear_layers == (True, False, True, False)
    hf = _hf(folders[family])
    prompt = runner.tokenizer.encode(LONG_PROMPT)
    assert len(prompt) > 2 * BLOCK  # three chunks: the state crosses two chunk boundaries
    core = EngineCore(runner, EngineConfig(num_slots=4, prefill_chunk=BLOCK))
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    tokens, tops, prompt_tops = _run_one(core, prompt, params)

    with torch.no_grad():
        expected = hf.generate(  # type: ignore[operator]
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
        )[0, len(prompt) :].tolist()
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    assert tokens == expected
    logprobs = torch.log_softmax(logits, dim=-1)
    assert _worst_gap(prompt_tops, logprobs[: len(prompt) - 1]) < LOGPROB_TOLERANCE
    assert _worst_gap(tops, logprobs[len(prompt) - 1 : -1]) < LOGPROB_TOLERANCE
    runner.close()


def test_outputs_are_identical_alone_and_batched_in_bfloat16(bf16_runner: TorchRunner) -> None:
    """Decode steps batch the recurrent update across sequences and prompts are cut wherever
    the step budget falls (on the 64-token grain): each sequence's tokens must not change."""
    config = EngineConfig(num_slots=8, max_batch_tokens=200, prefill_chunk=128)
    core = EngineCore(bf16_runner, config)
    prompts = [
        bf16_runner.tokenizer.encode(p + " " + LONG_PROMPT[: 40 * i]) for i, p in enumerate(PROMPTS)
    ]
    alone, together = alone_then_together(core, prompts, greedy(16))
    assert together == alone
    assert len({tuple(t) for t in alone.values()}) > 1
    core.check_integrity()


def test_preemption_recomputes_the_state(folders: dict[str, Path]) -> None:
    """A pool too small for every sequence preempts; the preempted ones start their state
    again from zero and recompute prompt and output, giving the tokens each gets alone."""
    folder = folders["qwen3_5_text"]
    per_token = read_model_config(folder).kv_bytes_per_token(4)  # float32
    runner = _runner(
        folder, dtype="float32", num_slots=4, max_model_len=256, kv_memory=20 * 16 * per_token
    )
    core = EngineCore(runner, EngineConfig(num_slots=4))
    prompts = [
        runner.tokenizer.encode(p + " " + PROMPTS[(i + 3) % 8]) for i, p in enumerate(PROMPTS[:4])
    ]
    alone, together = alone_then_together(core, prompts, greedy(96))
    assert core.snapshot().preemptions > 0, "the pool was too small for all four at once"
    assert together == alone
    core.check_integrity()
    runner.close()


def test_prefix_cache_and_speculation_are_off_with_the_reason(bf16_runner: TorchRunner) -> None:
    info = bf16_runner.model_info
    assert info.chunk_policy.grain == BLOCK
    config = EngineConfig(
        num_slots=8, speculative=SpeculativeConfig.from_json('{"method": "ngram"}')
    )
    core = EngineCore(bf16_runner, config)
    assert core.speculator is None
    stats = core.prefix_cache.stats()
    assert not stats.enabled and "recurrent state" in (stats.disabled_reason or "")
    assert info.speculative_unsupported == RECURRENT_STATE_NO_ROLLBACK
    # A rollback request is refused rather than leaving a wrong state behind.
    tokens = bf16_runner.tokenizer.encode(PROMPTS[0])
    generate(core, {"a": (tokens, greedy(4))})
    bf16_runner.reserve_kv(0, len(tokens))
    bf16_runner.pool.tables.commit(0, len(tokens))
    with pytest.raises(RuntimeError, match="roll"):
        bf16_runner.trim_kv(0, 3)
    bf16_runner.trim_kv(0, 0)


def test_a_multimodal_checkpoint_serves_its_text_model(hf_checkpoint: Path, tmp_path: Path) -> None:
    """``qwen3_5`` folders hold ``text_config`` and a vision tower: the text model loads, the
    tower's tensors are skipped, tokens equal the text model's."""
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = json.loads(
        (
            tiny_random_checkpoint("qwen3_5_text", hf_checkpoint, tmp_path / "text") / "config.json"
        ).read_text()
    )
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text["hidden_size"],
        "patch_size": 16,
        "num_position_embeddings": 16,
    }
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = Qwen3_5ForConditionalGeneration(config).train(False)
    model.save_pretrained(tmp_path / "vl")
    AutoTokenizer.from_pretrained(str(hf_checkpoint)).save_pretrained(tmp_path / "vl")
    runner = _runner(tmp_path / "vl", dtype="float32")
    assert runner.config.model_type == "qwen3_5_text" and runner.config.linear_layers
    prompt = runner.tokenizer.encode(PROMPTS[2])
    core = EngineCore(runner, EngineConfig(num_slots=4))
    ours = generate(core, {"p": (prompt, greedy(8))})["p"]
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )[0, len(prompt) :].tolist()
    assert ours == theirs
    runner.close()


def test_a_hybrid_config_without_full_attention_is_refused(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    raw = json.loads((folders["qwen3_5_text"] / "config.json").read_text())
    raw["layer_types"] = ["linear_attention"] * raw["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="full attention"):
        TorchRunner(TorchLoadConfig(tmp_path))


def test_served_through_the_openai_client_as_transformers_generates(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = folders["qwen3_5_moe_text"]
    server = start_server(
        tmp_path,
        str(folder),
        "--runner",
        "torch",
        "--dtype",
        "float32",
        "--slots",
        "2",
        "--max-model-len",
        "512",
    )
    try:
        client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
        reply = client.completions.create(
            model=folder.name,
            prompt=LONG_PROMPT,
            max_tokens=10,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        stats = client.get("/prefix_cache_stats", cast_to=object)
    finally:
        stop_server(server)
    runner_tokens = HfTokenizer.from_folder(folder).encode(LONG_PROMPT)
    with torch.no_grad():
        expected = (
            _hf(folder)
            .generate(  # type: ignore[operator]
                torch.tensor([runner_tokens]), max_new_tokens=10, min_new_tokens=10, do_sample=False
            )[0, len(runner_tokens) :]
            .tolist()
        )
    assert reply.choices[0].logprobs is not None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert reply.choices[0].text == tokenizer.decode(expected, clean_up_tokenization_spaces=False)
    # The prefix cache is on, through recurrent-state snapshots (test_qwen35_prefix_cache.py).
    assert isinstance(stats, dict) and stats["enabled"]
    assert stats["tiers"]["state_snapshots"]["capacity"] == 8  # 4 per slot


def test_a_gguf_as_llama_cpp_converts_it_loads_the_folders_weights_and_runs_on_llama_cpp(
    hf_checkpoint: Path, model_path: Path, tmp_path: Path
) -> None:
    """The converter's ``qwen35moe`` layout (value heads tiled, ``-exp(A_log)``, norms + 1):
    the torch runner reads back exactly the folder's weights, and llama.cpp itself runs the
    same file to transformers' greedy tokens (so the file is what llama.cpp expects), with
    prefix cache and speculation off there too. llama.cpp wants value heads as wide as key
    heads (as every Qwen3.5 has them)."""
    folder = tiny_random_checkpoint(
        "qwen3_5_moe_text", hf_checkpoint, tmp_path / "moe", linear_value_head_dim=32
    )
    path = qwen35_gguf(folder, tmp_path / "qwen35moe.gguf", model_path)
    from_hf = read_model_config(folder)
    from_gguf = config_from_gguf(gguf_metadata(GgufHeader(path)), folder.name)
    assert from_gguf.model_type == "qwen3_5_moe_text"
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)  # stored as float32
    assert replace(from_gguf, rms_norm_eps=from_hf.rms_norm_eps) == from_hf
    loaded = []
    for tensors in (safetensors_tensors(folder), gguf_tensors(GgufHeader(path), from_gguf)):
        model = Decoder(from_hf, torch.float32, 64)
        load_into(model, tensors)
        loaded.append(model.state_dict())
    assert loaded[0].keys() == loaded[1].keys()
    for name, value in loaded[0].items():
        torch.testing.assert_close(loaded[1][name], value, rtol=1e-6, atol=1e-6, msg=name)

    runner = LlamaCppRunner(path, num_slots=2, ctx_size=1024, max_batch_tokens=256)
    try:
        assert runner.model_info.speculative_unsupported == RECURRENT_STATE_NO_ROLLBACK
        assert runner.model_info.prefix_cache_unsupported is not None
        prompt = runner.tokenizer.encode(PROMPTS[1])
        core = EngineCore(runner, EngineConfig(num_slots=2))
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=20)
        tokens, tops, _ = _run_one(core, prompt, params)
    finally:
        runner.close()
    # llama.cpp keeps K/V in float16 and so differs from transformers by up to ~0.05 in log-prob;
    # on a random model's nearly flat distribution that can swap close tokens, so compare
    # distributions along llama.cpp's own tokens: a wrong layout shares no top tokens.
    with torch.no_grad():
        logits = _hf(folder)(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    for row, top in enumerate(tops):
        theirs = set(logprobs[row].topk(20).indices.tolist())
        assert len(theirs & set(top)) >= 15, f"step {row}: top-20 overlap {len(theirs & set(top))}"
    assert _worst_gap(tops, logprobs) < 0.1  # measured 0.054
