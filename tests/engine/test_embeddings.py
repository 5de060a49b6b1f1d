"""Embedding requests through the engine (``SamplingParams.embed``, scheduler invariant 10),
with the fake runner, whose vector is [positions pooled, their token sum, the last token]."""

from __future__ import annotations

import msgspec
import pytest

from slotserve.engine.client import wire
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.outputs import RequestOutput
from slotserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run_to_completion, submit, text_of
from tests.fake_runner import FakeRunner

PROMPT = "the quick brown fox jumps over the lazy dog"


def expected_vector(prompt: str) -> list[float]:
    tokens = list(prompt.encode())
    return [float(len(tokens)), float(sum(tokens)), float(tokens[-1])]


def final(outputs: list[RequestOutput]) -> RequestOutput:
    assert outputs[-1].finished
    return outputs[-1]


def test_embedding_batches_with_generation_and_leaves_its_tokens_alone() -> None:
    alone_core, _ = make_core(FakeRunner(pooling="mean"), prefix_cache=False)
    submit(alone_core, "gen", "hello there", max_tokens=12, temperature=0.0)
    alone = text_of(run_to_completion(alone_core)["gen"])

    core, runner = make_core(FakeRunner(pooling="mean"), prefix_cache=False)
    submit(core, "gen", "hello there", max_tokens=12, temperature=0.0)
    first = core.step()  # the generation is decoding when the embedding arrives
    submit(core, "emb", PROMPT, embed=True)
    outputs = run_to_completion(core)

    assert text_of(first + outputs["gen"]) == alone
    embedded = final(outputs["emb"])
    assert embedded.embedding == expected_vector(PROMPT)
    assert embedded.num_prompt_tokens == len(PROMPT)
    assert embedded.num_output_tokens == 0
    assert [d.finish_reason for o in outputs["emb"] for d in o.deltas] == ["stop"]
    shared = [b for b in runner.batches if {c.embed for c in b} == {True, False}]
    assert shared, "the embedding ran in the same forward pass as the decode"
    assert not any(c.sample for b in runner.batches for c in b if c.embed)
    assert not core.scheduler.has_work


def test_a_chunked_prompt_pools_every_position() -> None:
    core, runner = make_core(
        FakeRunner(pooling="mean"), prefill_chunk=8, max_batch_tokens=16, prefix_cache=False
    )
    submit(core, "emb", PROMPT, embed=True)
    outputs = run_to_completion(core)
    assert final(outputs["emb"]).embedding == expected_vector(PROMPT)
    chunks = [c for b in runner.batches for c in b]
    assert len(chunks) > 1 and [c.embed_last for c in chunks].count(True) == 1
    assert chunks[-1].embed_last


@pytest.mark.parametrize(("pooling", "hit"), [("last", True), ("mean", False), ("cls", False)])
def test_only_last_token_pooling_takes_a_cache_hit(pooling: str, hit: bool) -> None:
    core, _ = make_core(FakeRunner(pooling=pooling, max_seq_len=512))
    submit(core, "first", PROMPT, embed=True)
    run_to_completion(core)
    submit(core, "again", PROMPT, embed=True)
    again = final(run_to_completion(core)["again"])
    assert (again.num_cached_tokens > 0) is hit
    if not hit:
        assert again.embedding == expected_vector(PROMPT)
    else:
        assert again.embedding is not None and again.embedding[2] == PROMPT.encode()[-1]
    core.check_integrity()


def test_generation_reuses_the_prefix_an_embedding_computed() -> None:
    core, _ = make_core(FakeRunner(pooling="last", max_seq_len=512))
    submit(core, "emb", PROMPT, embed=True)
    run_to_completion(core)
    submit(core, "gen", PROMPT + " and", max_tokens=3, temperature=0.0)
    assert final(run_to_completion(core)["gen"]).num_cached_tokens > 0


def test_an_encoder_runs_each_prompt_whole_and_refuses_generation() -> None:
    runner = FakeRunner(pooling="mean", can_generate=False, bidirectional=True, max_seq_len=64)
    core, _ = make_core(runner, prefill_chunk=8, max_batch_tokens=48)
    for i in range(3):
        submit(core, f"e{i}", PROMPT[: 20 + i], embed=True)
    outputs = run_to_completion(core)
    for i in range(3):
        assert final(outputs[f"e{i}"]).embedding == expected_vector(PROMPT[: 20 + i])
    assert all(c.start_pos == 0 and c.embed_last for b in runner.batches for c in b)
    with pytest.raises(InvalidRequestError, match="embedding model"):
        submit(core, "gen", "hi", max_tokens=2)
    with pytest.raises(InvalidRequestError, match="maximum context length is 48"):
        submit(core, "long", "x" * 49, embed=True)


def test_embedding_limits() -> None:
    core, _ = make_core(FakeRunner(pooling=None))
    with pytest.raises(InvalidRequestError, match="does not serve embeddings"):
        submit(core, "emb", PROMPT, embed=True)
    core, _ = make_core(FakeRunner(max_seq_len=64))
    submit(core, "full", "x" * 64, embed=True)  # nothing is generated: the context may be full
    assert final(run_to_completion(core)["full"]).embedding is not None
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        submit(core, "over", "x" * 65, embed=True)
    with pytest.raises(InvalidRequestError, match="'n'"):
        SamplingParams(embed=True, n=2)


def test_the_vector_crosses_the_process_boundary() -> None:
    output = RequestOutput("r", finished=True, embedding=[0.25, -1.5, 3.0])
    stats = make_core()[0].snapshot()
    frame = wire.encode(wire.StepOutputs([output], stats, 1, 0.0))
    decoded = wire.decode_from_engine(frame)
    assert isinstance(decoded, wire.StepOutputs)
    assert decoded.outputs[0].embedding == [0.25, -1.5, 3.0]
    params = msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(embed=True)))
    assert params["embed"] is True
