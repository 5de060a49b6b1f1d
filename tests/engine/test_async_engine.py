"""The asyncio side and the engine thread behind it: outputs arrive per request, leaving a
stream early aborts it, a full queue is refused, and a crash of the loop itself ends every
request with an error instead of leaving its stream waiting."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from slotserve.engine.client.async_engine import AsyncEngine, OutputListener
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import EngineDeadError, QueueFullError
from slotserve.engine.outputs import FailureKind, RequestOutput
from slotserve.engine.sampling_params import SamplingParams
from tests.fake_runner import FakeRunner


async def launch(
    runner: FakeRunner, config: EngineConfig, on_outputs: OutputListener | None = None
) -> AsyncEngine:
    return await AsyncEngine.launch(lambda: EngineCore(runner, config), on_outputs)


def test_generate_streams_outputs_of_concurrent_requests() -> None:
    runner = FakeRunner(replies={"Q1": b"first", "Q2": b"second!"})

    async def main() -> dict[str, str]:
        engine = await launch(runner, EngineConfig(num_slots=4))

        async def run(prompt: str) -> str:
            text = ""
            async for out in engine.generate(
                EngineCoreRequest(prompt, list(prompt.encode()), SamplingParams())
            ):
                text += "".join(d.text for d in out.deltas)
            return text

        try:
            first, second = await asyncio.gather(run("Q1"), run("Q2"))
        finally:
            await engine.shutdown()
        return {"Q1": first, "Q2": second}

    assert asyncio.run(main()) == {"Q1": "first", "Q2": "second!"}


def test_leaving_a_stream_early_aborts_the_request() -> None:
    # 200 tokens at 5 ms a step: the request is still running when the abort arrives.
    runner = FakeRunner(num_slots=1, forward_seconds_per_step=0.005)

    async def main() -> tuple[int, list[int], str]:
        ended = asyncio.Event()

        def watch(outputs: list[RequestOutput]) -> None:
            if any(o.request_id == "r" and o.finished for o in outputs):
                ended.set()

        engine = await launch(runner, EngineConfig(num_slots=1, max_queue=0), watch)
        try:
            stream = engine.generate(
                EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=200))
            )
            async with contextlib.aclosing(stream):
                async for _ in stream:
                    break  # the client went away after the first output
            # The engine publishes its state before it hands a step's outputs over, so once
            # the abort's final output is seen the slot shows free.
            await asyncio.wait_for(ended.wait(), timeout=30)
            slot_state = engine.stats.slots[0].state
            # With no queue at all, a new request is admitted only because the slot is free.
            done = [
                o
                async for o in engine.generate(
                    EngineCoreRequest("s", [4], SamplingParams(max_tokens=2))
                )
            ]
        finally:
            await engine.shutdown()
        return engine.stats.requests_aborted, [o.num_output_tokens for o in done], slot_state

    aborted, counts, slot_state = asyncio.run(main())
    assert aborted == 1 and counts[-1] == 2 and slot_state == "free"
    assert runner.active == set()


def test_full_queue_is_refused_at_submission() -> None:
    async def main() -> None:
        engine = await launch(FakeRunner(num_slots=1), EngineConfig(num_slots=1, max_queue=0))
        try:
            with (
                engine.submit(EngineCoreRequest("a", [1], SamplingParams(max_tokens=200))),
                pytest.raises(QueueFullError),
            ):
                engine.submit(EngineCoreRequest("b", [1], SamplingParams(max_tokens=1)))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_crash_of_the_engine_loop_mid_step_ends_every_request_with_an_error() -> None:
    # A runner answer the engine cannot use (no token for a sampling chunk) breaks the step
    # outside the runner call: the loop itself dies, not just the model.
    runner = FakeRunner(num_slots=2, forward_seconds_per_step=0.002)

    async def main() -> tuple[list[RequestOutput], str | None]:
        engine = await launch(runner, EngineConfig(num_slots=2))
        try:
            streams = [
                engine.submit(EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=200)))
                for rid in ("a", "b")
            ]
            first = [await anext(stream) for stream in streams]  # both are running
            assert all(not o.finished for o in first)
            runner.drop_samples_once = True
            finals = []
            for stream in streams:
                with stream:
                    async for output in stream:
                        last = output
                    finals.append(last)
            with pytest.raises(EngineDeadError, match="engine loop crashed"):
                engine.submit(EngineCoreRequest("c", [1], SamplingParams(max_tokens=1)))
            return finals, engine.unhealthy
        finally:
            await asyncio.wait_for(engine.shutdown(), timeout=30)

    finals, unhealthy = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert unhealthy is not None and "KeyError" in unhealthy
    for final in finals:
        assert final.finished and final.failure is FailureKind.MODEL_UNHEALTHY
        assert final.error is not None and "engine loop crashed" in final.error
