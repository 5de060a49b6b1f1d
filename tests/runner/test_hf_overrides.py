"""``--hf-overrides`` (vLLM's flag): a JSON object laid over a checkpoint's configuration before
the PyTorch runner reads it, an HF folder's or a GGUF file's alike; a bad one is a usage error;
YaRN laid over the embedded model serves a context past the one it was trained on
(test_rotary_scaling.py: how a rope_scaling joins transformers 5's rope_parameters)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.options import parse_json_object
from slotserve.runners.pytorch.load.checkpoint import open_checkpoint
from slotserve.runners.pytorch.model.config import RopeScaling, UnsupportedModelError
from slotserve.runners.pytorch.model.rotary import rotary_tables

YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}


def test_a_gguf_file_reads_the_overrides_by_hf_names(model_path: Path) -> None:
    plain = open_checkpoint(model_path).config
    stretched = open_checkpoint(model_path, json.dumps(YARN)).config
    assert plain.rope_scaling == RopeScaling()
    # YaRN's original context is the file's trained one unless the override names it.
    assert stretched.rope_scaling == RopeScaling(
        "yarn", 2.0, original_max_position_embeddings=plain.max_position_embeddings
    )
    assert stretched.rope_theta == plain.rope_theta and stretched.num_layers == plain.num_layers
    theta = open_checkpoint(model_path, '{"rope_theta": 50000.0}').config
    assert theta.rope_theta == 50000.0 and theta.rope_theta != plain.rope_theta
    plain_cos, _ = rotary_tables(plain, plain.rope_theta, 64, torch.float32)
    cos, _ = rotary_tables(stretched, stretched.rope_theta, 64, torch.float32)
    assert not torch.equal(cos, plain_cos)


def test_an_hf_folder_reads_them_too(hf_checkpoint: Path) -> None:
    config = open_checkpoint(hf_checkpoint, json.dumps(YARN)).config
    assert config.rope_scaling.kind == "yarn" and config.rope_scaling.factor == 2.0


def test_an_unknown_scaling_laid_over_is_refused_by_name(model_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="longrope"):
        _ = open_checkpoint(model_path, '{"rope_scaling": {"rope_type": "longrope"}}').config


@pytest.mark.parametrize("text", ["{rope", "[1, 2]", '"yarn"'])
def test_only_a_json_object_is_taken(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_json_object(text)


def test_yarn_serves_twice_the_trained_context(model_path: Path) -> None:
    """The embedded model (trained on 8,192 positions) with YaRN ×2 and --max-model-len 9,000:
    a 8,400-token prompt is admitted and answered."""
    from slotserve.runners.pytorch.load.settings import TorchLoadConfig
    from slotserve.runners.pytorch.runner import TorchRunner

    load = TorchLoadConfig(
        model_path,
        num_slots=1,
        max_batch_tokens=512,
        max_model_len=9000,
        hf_overrides=json.dumps(YARN),
    )
    runner = TorchRunner(load)
    try:
        assert runner.config.rope_scaling.kind == "yarn"
        assert runner.model_info.max_seq_len == 9000
        core = EngineCore(runner, EngineConfig(num_slots=1, max_batch_tokens=512))
        prompt = [(i * 7919) % 40000 + 100 for i in range(8400)]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        core.add_request(EngineCoreRequest("long", prompt, params))
        tokens: list[int] = []
        while core.has_work:
            for output in core.step():
                tokens += [t for d in output.deltas for t in d.token_ids]
        assert len(tokens) == 4
    finally:
        runner.close()
