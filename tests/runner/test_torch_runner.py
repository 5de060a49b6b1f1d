"""The PyTorch runner against HF transformers itself (SPEC R2): greedy parity on the real
SmolLM2 weights, logit parity for a tiny random model of every supported family, the loaders
(HF folder, shards, GGUF, dummy), configuration errors, and the paged KV's block sharing."""

from __future__ import annotations

import json
import logging
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.runner_interface import ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.pytorch.families.registry import config_from_gguf
from slotserve.runners.pytorch.load.checkpoint import read_model_config
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.model.config import UnsupportedModelError
from slotserve.runners.pytorch.runner import TorchRunner
from tests.prompts import PROMPTS
from tests.runner.engine_runs import alone_then_together, generate, greedy
from tests.runner.hf_checkpoint import qwen3_moe_gguf, tiny_random_checkpoint

PARITY_TOKENS = 32
# Float32, CPU: our attention (bmm, float32 softmax) and HF's SDPA sum in different orders;
# measured differences stay far below this.
LOGPROB_TOLERANCE = 2e-4


def _runner(path: Path, **options: object) -> TorchRunner:
    options.setdefault("num_slots", 8)
    options.setdefault("max_model_len", 1024)
    return TorchRunner(TorchLoadConfig(path, **options))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fp32_runner(hf_checkpoint: Path) -> Iterator[TorchRunner]:
    runner = _runner(hf_checkpoint, dtype="float32")
    yield runner
    runner.close()


def _hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.train(False)
    return model


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def _hf_top_logprobs(
    model: torch.nn.Module, tokens: list[int], first: int, k: int
) -> list[list[tuple[int, float]]]:
    """HF's top-``k`` log-probabilities for every position from ``first - 1`` on."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    result = []
    for position in range(first - 1, len(tokens) - 1):
        values, ids = logprobs[position].topk(k)
        result.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
    return result


def _our_top_logprobs(
    runner: TorchRunner, prompt: list[int], n: int, k: int
) -> tuple[list[int], list[list[tuple[int, float]]]]:
    core = EngineCore(runner, EngineConfig(num_slots=runner.model_info.num_slots))
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=k)
    core.add_request(EngineCoreRequest("r", prompt, params))
    tokens: list[int] = []
    tops: list[list[tuple[int, float]]] = []
    while core.scheduler.has_work or not tokens:
        for out in core.step():
            for delta in out.deltas:
                tokens.extend(delta.token_ids)
                tops.extend(list(t.top_logprobs) for t in delta.logprobs or [])
    return tokens, tops


def _assert_close(
    ours: list[list[tuple[int, float]]], theirs: list[list[tuple[int, float]]]
) -> None:
    assert len(ours) == len(theirs)
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a[0][0] == b[0][0], f"step {step}: top token {a[0][0]} vs HF {b[0][0]}"
        theirs_by_id = dict(b)
        for token, value in a[:5]:
            if token in theirs_by_id:
                worst = max(worst, abs(value - theirs_by_id[token]))
    assert worst < LOGPROB_TOLERANCE, f"log-probabilities differ by up to {worst:.2e}"


def test_greedy_parity_with_hf_generate_on_smollm2(
    fp32_runner: TorchRunner, hf_checkpoint: Path
) -> None:
    model = _hf_model(hf_checkpoint)
    core = EngineCore(fp32_runner, EngineConfig(num_slots=8))
    prompts = [fp32_runner.tokenizer.encode(p) for p in PROMPTS]
    ours = generate(core, {f"p{i}": (p, greedy(PARITY_TOKENS)) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        assert ours[f"p{i}"] == _hf_greedy(model, prompt, PARITY_TOKENS), f"prompt {i}"


def test_logprobs_match_hf_within_tolerance(fp32_runner: TorchRunner, hf_checkpoint: Path) -> None:
    model = _hf_model(hf_checkpoint)
    prompt = fp32_runner.tokenizer.encode(PROMPTS[3])
    tokens, tops = _our_top_logprobs(fp32_runner, prompt, 16, 5)
    _assert_close(tops, _hf_top_logprobs(model, prompt + tokens, len(prompt), 5))


@pytest.mark.parametrize(
    "family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text"]
)
def test_every_family_matches_hf_on_a_tiny_random_model(
    family: str, hf_checkpoint: Path, tmp_path: Path
) -> None:
    folder = tiny_random_checkpoint(family, hf_checkpoint, tmp_path / family)
    runner = _runner(folder, dtype="float32", num_slots=2)
    assert runner.config.model_type == family
    model = _hf_model(folder)
    # Long enough that Gemma's 16-token sliding window cuts into the context.
    prompt = runner.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[5] + " " + PROMPTS[7])
    tokens, tops = _our_top_logprobs(runner, prompt, 12, 5)
    assert tokens == _hf_greedy(model, prompt, 12)
    _assert_close(tops, _hf_top_logprobs(model, prompt + tokens, len(prompt), 5))
    runner.close()


def test_mixture_of_experts_is_batch_invariant_in_bfloat16(
    hf_checkpoint: Path, tmp_path: Path
) -> None:
    """Tokens routed to the same expert share its matmul; each token's result must not
    depend on who else was routed there (bfloat16 on CPU is the batch-invariant mode)."""
    folder = tiny_random_checkpoint("qwen3_moe", hf_checkpoint, tmp_path / "moe")
    runner = _runner(folder, num_slots=8)
    assert runner.config.sparse_layers == (False, True, True, True)
    core = EngineCore(runner, EngineConfig(num_slots=8, prefix_cache=False))
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS]
    alone, together = alone_then_together(core, prompts, greedy(16))
    assert together == alone
    assert len({tuple(t) for t in alone.values()}) > 1
    runner.close()


def test_qwen3_moe_gguf_stacked_experts_load_as_the_hf_folder(
    hf_checkpoint: Path, tmp_path: Path
) -> None:
    from slotserve.runners.pytorch.load.gguf_file import gguf_metadata, gguf_tensors
    from slotserve.runners.pytorch.load.gguf_header import GgufHeader
    from slotserve.runners.pytorch.load.hf_folder import safetensors_tensors
    from slotserve.runners.pytorch.load.weights import load_into
    from slotserve.runners.pytorch.model.decoder import Decoder

    # llama.cpp makes every qwen3moe layer sparse and renormalises the top-k weights.
    folder = tiny_random_checkpoint(
        "qwen3_moe", hf_checkpoint, tmp_path / "moe", mlp_only_layers=[], norm_topk_prob=True
    )
    header = GgufHeader(qwen3_moe_gguf(folder, tmp_path / "moe.gguf"))
    from_gguf = config_from_gguf(gguf_metadata(header), "moe")
    from_hf = read_model_config(folder)
    assert from_gguf.model_type == "qwen3_moe"
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "sparse_layers"):
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    assert from_gguf.norm_topk_prob and from_gguf.qk_norm
    models = []
    for tensors in (safetensors_tensors(folder), gguf_tensors(header, from_gguf)):
        model = Decoder(from_hf, torch.float32, 64)
        load_into(model, tensors)
        models.append(model.state_dict())
    assert models[0].keys() == models[1].keys()
    for name, value in models[0].items():
        assert torch.equal(value, models[1][name]), name


def test_sharded_folder_gguf_and_folder_load_the_same_weights(
    hf_checkpoint: Path, model_path: Path, fp32_runner: TorchRunner, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(hf_checkpoint)).save_pretrained(
        sharded, max_shard_size="100MB"
    )
    AutoTokenizer.from_pretrained(str(hf_checkpoint)).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompt = fp32_runner.tokenizer.encode(PROMPTS[6])
    reference = generate(
        EngineCore(fp32_runner, EngineConfig(num_slots=8)), {"r": (prompt, greedy(16))}
    )
    for path in (sharded, model_path):
        other = _runner(path, dtype="float32")
        assert other.tokenizer.encode(PROMPTS[6]) == prompt
        core = EngineCore(other, EngineConfig(num_slots=8))
        assert generate(core, {"r": (prompt, greedy(16))}) == reference, path.name
        other.close()


def test_dummy_weights_need_only_the_config(hf_checkpoint: Path, tmp_path: Path) -> None:
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    for name in hf_checkpoint.iterdir():
        if not name.name.endswith(".safetensors"):
            shutil.copy(name, config_only / name.name)
    runner = _runner(config_only, load_format="dummy", num_slots=2)
    core = EngineCore(runner, EngineConfig(num_slots=2))
    out = generate(core, {"r": (runner.tokenizer.encode("Hi"), greedy(8))})["r"]
    assert len(out) == 8 and all(0 <= t < runner.config.vocab_size for t in out)
    # Closing gives the KV pool back while the engine still holds the runner (an unloaded
    # model's GPU memory must be free for the next one).
    keys = weakref.ref(runner.shard.pool.layers[0][0])
    runner.close()
    assert keys() is None


def test_a_cpu_runner_states_where_a_prompts_attention_outweighs_its_projections(
    torch_runner: TorchRunner,
) -> None:
    """SmolLM2-135M: attention spends 2 x 30 layers x 9 heads x 64 multiply-adds per earlier
    position, the projections ~106 M per token; weighted by the CPU kernels' rates, a prefill
    chunk from ~1.8k positions on is mostly attention (scheduler invariant 2)."""
    assert torch_runner.device.type == "cpu"
    assert 1700 < 1 / torch_runner.model_info.context_cost < 1900


def test_unsupported_model_type_is_refused_before_any_weight(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(UnsupportedModelError) as error:
        read_model_config(tmp_path)
    message = str(error.value)
    assert "'bert'" in message and tmp_path.name in message
    assert all(t in message for t in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text"))


def test_malformed_config_names_the_missing_field(hf_checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((hf_checkpoint / "config.json").read_text())
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'hidden_size'"):
        read_model_config(tmp_path)
    config["hidden_size"] = 576
    config["num_key_value_heads"] = 4  # 9 heads cannot be grouped over 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="multiple of num_key_value_heads"):
        read_model_config(tmp_path)


def test_blocks_are_freed_on_finish_and_on_cancel(torch_runner: TorchRunner) -> None:
    tables = torch_runner.pool.tables
    core = EngineCore(torch_runner, EngineConfig(num_slots=8, prefix_cache=False))
    assert tables.num_free == tables.num_blocks
    prompt = torch_runner.tokenizer.encode(PROMPTS[0] * 3)
    generate(core, {"done": (prompt, greedy(20))})
    assert tables.num_free == tables.num_blocks, "a finished sequence gave its blocks back"
    core.add_request(EngineCoreRequest("gone", prompt, greedy(200)))
    while core.snapshot().generated_tokens < 25:
        core.step()
    assert tables.num_free < tables.num_blocks
    core.abort("gone")
    core.step()
    assert tables.num_free == tables.num_blocks, "a cancelled sequence gave its blocks back"
    tables.check_integrity()


def test_shared_blocks_survive_their_first_owners_end(torch_runner: TorchRunner) -> None:
    EngineCore(torch_runner, EngineConfig(num_slots=8))  # empties every slot
    runner, tables = torch_runner, torch_runner.pool.tables
    prompt = runner.tokenizer.encode(" ".join(PROMPTS))
    assert len(prompt) > 3 * runner.pool.block_size
    params = SamplingParams(temperature=0.0)

    def decode(slot: int, first: int, steps: int) -> list[int]:
        out, position, token = [], len(prompt), first
        for _ in range(steps):
            assert runner.reserve_kv(slot, position + 1)
            token = runner.execute([ScheduledChunk(slot, [token], position, True)])[slot][
                0
            ].token_id
            out.append(token)
            position += 1
        return out

    runner.add_sequence(0, params, prompt, None)
    assert runner.reserve_kv(0, len(prompt))
    first = runner.execute([ScheduledChunk(0, prompt, 0, True)])[0][0].token_id
    runner.copy_kv(0, 1, len(prompt) - 5)  # a cache hit: shares blocks, the last one partly
    shared = set(tables.tables[0]) & set(tables.tables[1])
    assert len(shared) == -(-(len(prompt) - 5) // runner.pool.block_size)
    expected = decode(0, first, 6)
    runner.remove_sequence(0)
    runner.trim_kv(0, 0)  # the first owner ends
    assert shared <= set(tables.tables[1]), "the blocks live on in the second slot"
    assert tables.num_free == tables.num_blocks - len(tables.tables[1])
    runner.add_sequence(1, params, prompt, None)
    tail = prompt[len(prompt) - 5 :]
    assert runner.reserve_kv(1, len(prompt))  # writes into the shared last block: a copy
    again = runner.execute([ScheduledChunk(1, tail, len(prompt) - 5, True)])[1][0].token_id
    assert again == first and decode(1, again, 6) == expected
    runner.remove_sequence(1)
    runner.trim_kv(1, 0)
    assert tables.num_free == tables.num_blocks
    tables.check_integrity()


def test_a_small_kv_pool_preempts_and_outputs_stay_those_of_each_request_alone(
    model_path: Path,
) -> None:
    # 4 sequences of ~60 + 64 tokens need ~32 blocks of 16; the pool has 14 blocks.
    runner = _runner(model_path, num_slots=4, max_model_len=224, kv_memory=14 * 16 * 23040)
    assert runner.model_info.kv_capacity_tokens == 14 * 16
    core = EngineCore(runner, EngineConfig(num_slots=4))
    prompts = [
        runner.tokenizer.encode(p + " " + PROMPTS[(i + 3) % 8]) for i, p in enumerate(PROMPTS[:4])
    ]
    alone, together = alone_then_together(core, prompts, greedy(64))
    assert core.snapshot().preemptions > 0, "the pool was too small for all four at once"
    assert together == alone
    core.check_integrity()
    runner.close()


def test_cached_prefixes_outlive_the_slots_in_the_pool_and_give_way_under_pressure(
    model_path: Path,
) -> None:
    # Two slots over a pool of 26 blocks of 16 positions: the radix tree holds cached prefixes'
    # blocks itself, so a prefix survives both slots running other work, and a pool that runs
    # short evicts it instead of preempting anyone.
    runner = _runner(model_path, num_slots=2, max_model_len=320, kv_memory=26 * 16 * 23040)
    encode = runner.tokenizer.encode
    system = encode(" ".join(PROMPTS[:4]))
    question = system + encode(" What comes next?")
    busy = {f"busy{i}": (encode(PROMPTS[4 + i]), greedy(24)) for i in range(2)}
    big = {
        f"big{i}": (encode(" ".join(PROMPTS[i:] + PROMPTS[:i]) * 2), greedy(72)) for i in range(2)
    }

    def run(core: EngineCore, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
        core.add_request(EngineCoreRequest(request_id, prompt, greedy(12)))
        tokens, cached = [], -1
        while core.has_work:
            for out in core.step():
                tokens += [t for d in out.deltas for t in d.token_ids]
                cached = out.num_cached_tokens
        return tokens, cached

    blocks = [-(-(len(p) + 72) // 16) for p, _ in big.values()]
    # Both fit the pool, but not beside the cache (prompts only: the question's blocks, two of
    # them the first big prompt's too, and each busy prompt's one).
    assert 23 < sum(blocks) <= 26, blocks
    reference = EngineCore(runner, EngineConfig(num_slots=2, prefix_cache=False))
    alone, _ = run(reference, "alone", question)
    big_alone = generate(reference, big)
    core = EngineCore(runner, EngineConfig(num_slots=2))
    run(core, "first", question)
    generate(core, busy)  # both slots run (and then hold nothing of) other prompts
    again, cached = run(core, "again", question)
    assert cached == len(question) - 1, "the prefix outlived both slots' other work"
    big_cached = generate(core, big)
    assert again == alone and big_cached == big_alone
    stats = core.snapshot()
    assert stats.prefix_cache.evictions > 0 and stats.preemptions == 0
    core.check_integrity()
    runner.close()


def test_a_max_model_len_past_the_trained_context_is_served_with_a_warning(
    model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As llama.cpp allows a context past the trained one (SmolLM2: 8,192), an explicit
    --max-model-len beyond it is taken, and the load says what that risks."""
    with caplog.at_level(logging.WARNING):
        runner = _runner(model_path, num_slots=1, max_model_len=9000)
    try:
        assert runner.max_seq_len == 9000 and runner.model_info.max_seq_len == 9000
        assert "--max-model-len 9000 is past the 8192 positions" in caplog.text
    finally:
        runner.close()
