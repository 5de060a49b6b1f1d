"""A BERT cross-encoder on the PyTorch encoder runner under the engine: scores equal
sentence-transformers' ``CrossEncoder.predict`` on a random-weight folder, alone or batched."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.protocol.score_pairs import pair_prompt
from slotserve.runners.pytorch.encoder.runner import EncoderRunner
from slotserve.runners.pytorch.load.settings import TorchLoadConfig
from tests.runner.cross_encoder_folder import write_cross_encoder
from tests.runner.engine_runs import scores

PAIRS = [
    ("what is a cat", "a cat is a small domesticated carnivorous mammal"),
    ("what is a cat", "the stock market fell sharply on monday"),
    ("how tall is mount everest", "mount everest is 8,849 metres high"),
    ("how tall is mount everest", "paris is the capital of france"),
    ("q", "d"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


@pytest.fixture(scope="module")
def scorer(folder: Path) -> Iterator[EncoderRunner]:
    runner = EncoderRunner(TorchLoadConfig(folder, num_slots=4))
    yield runner
    runner.close()


def pair_ids(runner: EncoderRunner, query: str, document: str) -> list[int]:
    """What the routes send: the tokenizer's pair template, BERT's (``score_pairs.py``)."""
    return pair_prompt(runner.tokenizer, None, query, document)


def test_pairs_are_tokenized_as_the_hf_tokenizer_does(folder: Path, scorer: EncoderRunner) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    for query, document in PAIRS:
        assert pair_ids(scorer, query, document) == hf(query, document)["input_ids"]


def test_scores_equal_sentence_transformers_alone_and_batched(
    folder: Path, scorer: EncoderRunner
) -> None:
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(str(folder), device="cpu").predict(PAIRS)
    # Sigmoid outputs in (0, 1), spread enough that an order means something.
    assert expected.min() > 0 and expected.max() < 1 and np.ptp(expected) > 0.05
    core = EngineCore(scorer, EngineConfig(num_slots=4))
    prompts = {f"p{i}": pair_ids(scorer, q, d) for i, (q, d) in enumerate(PAIRS)}
    batched = scores(core, prompts)
    got = np.array([batched[f"p{i}"] for i in range(len(PAIRS))])
    # float32 both sides (``dtype auto`` on the encoder runner); what differs is the attention
    # kernel and the padding of the reference's batch: a few float32 ulps of a logit.
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    for i in range(len(PAIRS)):
        alone = scores(core, {f"a{i}": prompts[f"p{i}"]})[f"a{i}"]
        assert alone == batched[f"p{i}"]


def test_the_model_says_it_is_a_cross_encoder(scorer: EncoderRunner) -> None:
    info = scorer.model_info
    assert info.cross_encoder and not info.can_generate and info.bidirectional


def test_a_cross_encoder_with_several_labels_is_refused(folder: Path, tmp_path: Path) -> None:
    import json
    import shutil

    copy = Path(shutil.copytree(folder, tmp_path / "three-labels"))
    config = json.loads((copy / "config.json").read_text())
    config["id2label"] = {str(k): f"LABEL_{k}" for k in range(3)}
    config.pop("num_labels", None)
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="3 labels"):
        EncoderRunner(TorchLoadConfig(copy, num_slots=1))
