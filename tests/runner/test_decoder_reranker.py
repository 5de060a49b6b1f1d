"""Decoder rerankers on the PyTorch runner under the engine
(``runners/pytorch/step/score_head.py``): a Qwen3 sequence classifier scores as
sentence-transformers' ``CrossEncoder`` does, a Qwen3 causal LM served with
``--classifier-from-token no yes`` as Qwen3-Reranker's own recipe (the softmax of the "no" and
"yes" logits at the last token), both on random weights; and a score is the same alone,
batched, and behind a prefix-cache hit."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.protocol.chat_template import ChatTemplate
from slotserve.protocol.score_pairs import carries_pair_roles, pair_prompt
from slotserve.runners.pytorch.cpu_kernels import CpuKernels
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from slotserve.runners.pytorch.runner import TorchRunner
from tests.runner.conftest import require_batch_invariance
from tests.runner.engine_runs import scores
from tests.runner.hf_checkpoint import tiny_random_checkpoint

QUERIES = ["what is a cat", "how tall is mount everest"]
DOCUMENTS = [
    "a cat is a small domesticated carnivorous mammal",
    "the stock market fell sharply on monday",
    "mount everest is 8,849 metres high",
    "d",
]
PAIRS = [(q, d) for q in QUERIES for d in DOCUMENTS]


@pytest.fixture(scope="module")
def classifier(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3-classifier")
    return tiny_random_checkpoint("qwen3", hf_checkpoint, out, sequence_classifier=True)


@pytest.fixture(scope="module")
def causal_lm(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_random_checkpoint("qwen3", hf_checkpoint, tmp_path_factory.mktemp("qwen3-lm"))


def open_runner(folder: Path, **settings: object) -> TorchRunner:
    return TorchRunner(TorchLoadConfig(folder, num_slots=4, max_model_len=256, **settings))  # type: ignore[arg-type]


@pytest.fixture
def float32_classifier(classifier: Path) -> Iterator[TorchRunner]:
    runner = open_runner(classifier, dtype="float32")
    yield runner
    runner.close()


def ordered_scores(core: EngineCore, prompts: list[list[int]]) -> list[float]:
    done = scores(core, {f"p{i}": prompt for i, prompt in enumerate(prompts)})
    return [done[f"p{i}"] for i in range(len(prompts))]


def pair_prompts(runner: TorchRunner) -> list[list[int]]:
    """What the routes send: the pair through the model's chat template (SmolLM2's ChatML
    carries the query and document roles), as ``CrossEncoder`` renders it."""
    info = runner.model_info
    assert info.chat_template is not None
    template = ChatTemplate(info.chat_template, info.bos_token, info.eos_token)
    assert carries_pair_roles(template)
    return [pair_prompt(runner.tokenizer, template, first, second) for first, second in PAIRS]


def test_a_sequence_classifier_scores_as_sentence_transformers(
    classifier: Path, float32_classifier: TorchRunner
) -> None:
    from sentence_transformers import CrossEncoder

    info = float32_classifier.model_info
    assert info.cross_encoder and not info.can_generate and info.pooling == "last"
    expected = CrossEncoder(str(classifier), device="cpu").predict(PAIRS)
    assert np.ptp(np.log(expected / (1 - expected))) > 0.1  # logits apart: an order to keep
    core = EngineCore(float32_classifier, EngineConfig(num_slots=4))
    got = ordered_scores(core, pair_prompts(float32_classifier))
    # float32 both sides; the attention kernels and the reference's padding differ.
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)


def yes_no_reference(
    folder: Path, prompts: list[list[int]], tokens: tuple[str, ...]
) -> list[float]:
    """Qwen3-Reranker's recipe on transformers: the last position's logits of the classifier
    tokens, the softmax of ("no", "yes") at "yes" (the sigmoid of one token's logit)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    out = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            logits = model(input_ids).logits[0, -1, ids].double()
        out.append(float(torch.softmax(logits, 0)[-1]) if len(ids) == 2 else float(logits[0]))
    if len(ids) == 1:
        out = [1 / (1 + math.exp(-logit)) for logit in out]
    return out


@pytest.mark.parametrize("tokens", [("no", "yes"), ("yes",)], ids=["no-yes", "yes"])
def test_a_causal_lm_scores_by_its_classifier_tokens_logits(
    causal_lm: Path, tokens: tuple[str, ...]
) -> None:
    runner = open_runner(causal_lm, dtype="float32", classifier_from_token=tokens)
    try:
        assert runner.model_info.cross_encoder and not runner.model_info.can_generate
        prompts = pair_prompts(runner)
        got = ordered_scores(EngineCore(runner, EngineConfig(num_slots=4)), prompts)
    finally:
        runner.close()
    expected = yes_no_reference(causal_lm, prompts, tokens)
    assert np.ptp(expected) > 0.01
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)


def test_a_score_is_the_same_alone_batched_and_behind_a_cache_hit(causal_lm: Path) -> None:
    """The default path (bfloat16, the CPU kernels): bit for bit, as every other output."""
    runner = open_runner(causal_lm, classifier_from_token=("no", "yes"))
    try:
        require_batch_invariance(runner)
        prompts = pair_prompts(runner)
        alone = EngineCore(runner, EngineConfig(num_slots=4, prefix_cache=False))
        solo = [ordered_scores(alone, [prompt])[0] for prompt in prompts]
        cached = EngineCore(runner, EngineConfig(num_slots=4))
        first = ordered_scores(cached, prompts)
        hits_before = cached.prefix_cache.stats().hit_tokens
        again = ordered_scores(cached, prompts)
        assert cached.prefix_cache.stats().hit_tokens > hits_before  # the query prefix, reused
    finally:
        runner.close()
    assert first == solo and again == solo


def test_quantized_classifier_rows_are_the_packed_heads_rows(
    causal_lm: Path, kernels: CpuKernels
) -> None:
    """With the LM head kept quantized (``--quantization Q8_0``), the classifier tokens' rows
    set aside are the rows the packed head gives for those tokens."""
    runner = open_runner(causal_lm, quantization="Q8_0", classifier_from_token=("no", "yes"))
    try:
        ids = torch.tensor([runner.tokenizer.vocabulary_id(t) for t in ("no", "yes")])
        parts = runner.shard.model.lm_head.quant_parts
        kept = runner.shard.lm_head_rows
    finally:
        runner.close()
    assert parts is not None and len(parts) == 1 and kept is not None
    head = parts[0]
    k = kept.shape[1]
    expected = kernels.quant_rows(head.packed, ids, head.format, head.rows, k).float()
    assert torch.equal(kept, expected)


def test_wrong_classifier_tokens_are_refused_before_the_weights_load(
    classifier: Path, causal_lm: Path
) -> None:
    with pytest.raises(ValueError, match="sequence classifier"):
        open_runner(classifier, classifier_from_token=("no", "yes"))
    with pytest.raises(ValueError, match="not a token"):
        open_runner(causal_lm, classifier_from_token=("no", "definitely-not-one-token"))
    with pytest.raises(ValueError, match="false then true"):
        open_runner(causal_lm, classifier_from_token=("no", "maybe", "yes"))
