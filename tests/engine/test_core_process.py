"""The engine core in a process of its own (``engine/core_process.py``), driven through the same
``AsyncEngine`` the server uses, over a fake runner built in that process: outputs equal the
in-thread engine's, leaving a stream frees the slot, the 429 decision counts requests in
transit, and a load failure, a crash of the loop and a killed process each end every request
with an error instead of leaving a stream waiting."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest

from slotserve.engine.client.async_engine import AsyncEngine, OutputListener
from slotserve.engine.client.engine_process import EngineProcessError
from slotserve.engine.client.mp_client import MPClient
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from slotserve.engine.outputs import FailureKind, RequestOutput
from slotserve.engine.sampling_params import SamplingParams, StructuredOutput
from tests.fake_runner import FakeRunner, FakeSpec

REPLIES = {"Q1": b"first", "Q2": b"second!"}


async def launch_process(
    spec: FakeSpec, config: EngineConfig, on_outputs: OutputListener | None = None
) -> AsyncEngine:
    return await AsyncEngine.connect(
        lambda deliver: MPClient.launch(spec, config, deliver), on_outputs
    )


def engine_pid(engine: AsyncEngine) -> int:
    client = engine.client
    assert isinstance(client, MPClient) and client.pid is not None
    return client.pid


async def collect(engine: AsyncEngine, request_id: str, prompt: str, **params: Any) -> list[Any]:
    """(text, token ids, finish reasons) of one request."""
    text, tokens, reasons = "", [], []
    async for out in engine.generate(
        EngineCoreRequest(request_id, list(prompt.encode()), SamplingParams(**params))
    ):
        for delta in out.deltas:
            text += delta.text
            tokens += delta.token_ids
            if delta.finish_reason:
                reasons.append(delta.finish_reason)
    return [text, tokens, reasons]


def run_both(options: dict[str, Any], config: EngineConfig) -> tuple[list[Any], list[Any]]:
    async def workload(engine: AsyncEngine) -> list[Any]:
        try:
            return list(
                await asyncio.gather(
                    collect(engine, "a", "Q1"),
                    collect(engine, "b", "Q2"),
                    collect(engine, "c", "xyz", max_tokens=40, stop=["mn"]),
                    collect(engine, "d", "hello", max_tokens=7),
                )
            )
        finally:
            await engine.shutdown()

    async def in_thread() -> list[Any]:
        runner = FakeRunner(**options)
        return await workload(await AsyncEngine.launch(lambda: EngineCore(runner, config)))

    async def in_process() -> list[Any]:
        return await workload(await launch_process(FakeSpec(options), config))

    return asyncio.run(in_thread()), asyncio.run(in_process())


def test_outputs_equal_the_in_thread_engine() -> None:
    threaded, process = run_both({"replies": REPLIES}, EngineConfig(num_slots=4))
    assert process == threaded
    assert process[0] == ["first", [*b"first", 256], ["stop"]]
    assert process[2][0].endswith("jkl") and process[2][2] == ["stop"]  # cut at the stop string


def test_validation_happens_in_the_api_process() -> None:
    async def main() -> None:
        engine = await launch_process(FakeSpec(), EngineConfig(num_slots=2))
        try:
            with pytest.raises(InvalidRequestError, match="maximum context length"):
                engine.submit(EngineCoreRequest("a", [1] * 300, SamplingParams()))
            grammar = StructuredOutput("regex", "a(b")
            with pytest.raises(InvalidRequestError, match="unclosed group"):
                engine.submit(
                    EngineCoreRequest("b", [1], SamplingParams(structured_output=grammar))
                )
            assert engine.model_info.name == "fake" and engine.tokenizer.encode("hi") == [104, 105]
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_leaving_a_stream_early_frees_the_slot() -> None:
    spec = FakeSpec({"num_slots": 1, "forward_seconds_per_step": 0.005})

    async def main() -> tuple[int, str, list[int]]:
        ended = asyncio.Event()

        def watch(outputs: list[RequestOutput]) -> None:
            if any(o.request_id == "r" and o.finished for o in outputs):
                ended.set()

        engine = await launch_process(spec, EngineConfig(num_slots=1, max_queue=0), watch)
        try:
            with engine.submit(
                EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=200))
            ) as stream:
                await anext(stream)  # the client goes away after the first output
            await asyncio.wait_for(ended.wait(), timeout=30)
            stats = engine.stats  # published with the abort's final output
            done = [
                o
                async for o in engine.generate(
                    EngineCoreRequest("s", [4], SamplingParams(max_tokens=2))
                )
            ]
            return stats.requests_aborted, stats.slots[0].state, [o.num_output_tokens for o in done]
        finally:
            await engine.shutdown()

    aborted, state, counts = asyncio.run(main())
    assert aborted == 1 and state == "free" and counts[-1] == 2


def test_requests_in_transit_count_towards_the_queue_limit() -> None:
    spec = FakeSpec({"num_slots": 1, "forward_seconds_per_step": 0.005})

    async def main() -> None:
        engine = await launch_process(spec, EngineConfig(num_slots=1, max_queue=1))
        try:
            # Sent back to back, before the engine process has seen any: one runs, one
            # waits, the third is refused without waiting for the engine to say so.
            with (
                engine.submit(EngineCoreRequest("a", [1], SamplingParams(max_tokens=100))),
                engine.submit(EngineCoreRequest("b", [1], SamplingParams(max_tokens=100))),
                pytest.raises(QueueFullError),
            ):
                engine.submit(EngineCoreRequest("c", [1], SamplingParams(max_tokens=1)))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_load_failure_is_raised_by_launch() -> None:
    async def main() -> None:
        await launch_process(FakeSpec(load_error="no such weights"), EngineConfig(num_slots=1))

    with pytest.raises(EngineProcessError, match="RuntimeError: no such weights"):
        asyncio.run(main())


async def finals_of(streams: list[Any]) -> list[RequestOutput]:
    finals = []
    for stream in streams:
        with stream:
            async for output in stream:
                last = output
            finals.append(last)
    return finals


def test_a_killed_engine_process_ends_every_request_with_an_error() -> None:
    spec = FakeSpec({"num_slots": 2, "forward_seconds_per_step": 0.005, "max_seq_len": 20_000})

    async def main() -> tuple[list[RequestOutput], str | None, float]:
        engine = await launch_process(spec, EngineConfig(num_slots=2))
        try:
            streams = [
                engine.submit(EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=10_000)))
                for rid in "ab"
            ]
            first = [await anext(stream) for stream in streams]
            assert not any(output.finished for output in first)
            loop = asyncio.get_running_loop()
            killed = loop.time()
            os.kill(engine_pid(engine), signal.SIGKILL)
            finals = await asyncio.wait_for(finals_of(streams), timeout=10)
            took = loop.time() - killed
            with pytest.raises(EngineDeadError, match="died"):
                engine.submit(EngineCoreRequest("c", [1], SamplingParams(max_tokens=1)))
            return finals, engine.unhealthy, took
        finally:
            await asyncio.wait_for(engine.shutdown(), timeout=30)

    finals, unhealthy, took = asyncio.run(main())
    assert unhealthy is not None and "killed by signal 9" in unhealthy
    assert took < 5.0
    for final in finals:
        assert final.finished and final.failure is FailureKind.MODEL_UNHEALTHY
        assert final.error is not None and "died" in final.error


def test_a_crash_of_the_loop_in_the_engine_process_ends_every_request() -> None:
    # Step 3 returns no token for a sampling chunk: the step breaks outside the runner call.
    spec = FakeSpec({"num_slots": 2, "drop_samples_at_step": 3})

    async def main() -> tuple[list[RequestOutput], str | None]:
        engine = await launch_process(spec, EngineConfig(num_slots=2))
        try:
            streams = [
                engine.submit(EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=200)))
                for rid in "ab"
            ]
            finals = await asyncio.wait_for(finals_of(streams), timeout=30)
            return finals, engine.unhealthy
        finally:
            await asyncio.wait_for(engine.shutdown(), timeout=30)

    finals, unhealthy = asyncio.run(main())
    assert unhealthy is not None and "engine loop crashed: KeyError" in unhealthy
    for final in finals:
        assert final.failure is FailureKind.MODEL_UNHEALTHY
        assert final.error is not None and "engine loop crashed" in final.error


def test_a_runner_failure_poisons_the_engine_across_the_process_boundary() -> None:
    spec = FakeSpec({"num_slots": 1, "fail_on_execute": True})

    async def main() -> tuple[RequestOutput, str | None]:
        engine = await launch_process(spec, EngineConfig(num_slots=1))
        try:
            outputs = [
                o
                async for o in engine.generate(
                    EngineCoreRequest("a", [1], SamplingParams(max_tokens=3))
                )
            ]
            with pytest.raises(EngineDeadError, match="simulated device failure"):
                engine.submit(EngineCoreRequest("b", [1], SamplingParams(max_tokens=1)))
            return outputs[-1], engine.unhealthy
        finally:
            await engine.shutdown()

    final, unhealthy = asyncio.run(main())
    assert final.failure is FailureKind.MODEL_UNHEALTHY
    assert unhealthy is not None and "simulated device failure" in unhealthy


def test_shutdown_ends_requests_still_running() -> None:
    spec = FakeSpec({"num_slots": 1, "forward_seconds_per_step": 0.005, "max_seq_len": 20_000})

    async def main() -> tuple[RequestOutput, bool]:
        engine = await launch_process(spec, EngineConfig(num_slots=1))
        stream = engine.submit(EngineCoreRequest("a", [1], SamplingParams(max_tokens=10_000)))
        await anext(stream)
        pid = engine_pid(engine)
        await asyncio.wait_for(engine.shutdown(), timeout=30)
        final = await asyncio.wait_for(finals_of([stream]), timeout=5)
        return final[0], _alive(pid)

    final, alive = asyncio.run(main())
    assert final.failure is FailureKind.ENGINE_STOPPED and not alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_messages_round_trip_the_engines_own_types() -> None:
    from slotserve.engine.client import wire
    from slotserve.engine.core.stats import EngineStats
    from slotserve.engine.outputs import SampledToken, SequenceDelta

    logprobs = [SampledToken(7, -0.5, ((7, -0.5), (9, -1.25)))]
    outputs = [
        RequestOutput("a", [SequenceDelta(0, "hé", [7], logprobs, "stop", "</s>")], True, 3),
        RequestOutput("b", [SequenceDelta(1, "", [], None, "stop", 2)], finished=True),
        RequestOutput("c", finished=True, error="boom", failure=FailureKind.TIMED_OUT),
    ]
    message = wire.StepOutputs(outputs, EngineStats(steps=4, num_waiting=2), 5, 1.5)
    assert wire.decode_from_engine(wire.encode(message)) == message
    params = SamplingParams(
        max_tokens=3,
        stop=("x",),
        logit_bias=((1, 2.0),),
        structured_output=StructuredOutput("grammar", 'root ::= "a"'),
    )
    request = EngineCoreRequest("r", [1, 2], params, arrival_time=12.5)
    assert wire.decode_to_engine(wire.encode(request)) == request
