"""The asyncio bridge: outputs arrive per request, and leaving a stream early aborts it."""

from __future__ import annotations

import asyncio
import contextlib

from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.config import EngineConfig
from slotserve.engine.engine_core import EngineCore
from slotserve.engine.errors import QueueFullError
from slotserve.engine.sampling_params import SamplingParams
from tests.fake_runner import FakeRunner


def test_generate_streams_outputs_of_concurrent_requests() -> None:
    runner = FakeRunner(replies={"Q1": b"first", "Q2": b"second!"})

    async def main() -> dict[str, str]:
        engine = AsyncEngine(EngineCore(runner, EngineConfig(num_slots=4)))
        engine.start()

        async def run(prompt: str) -> str:
            text = ""
            async for out in engine.generate(prompt, list(prompt.encode()), SamplingParams()):
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

    async def main() -> tuple[int, list[int]]:
        engine = AsyncEngine(EngineCore(runner, EngineConfig(num_slots=1, max_queue=0)))
        engine.start()
        try:
            stream = engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=200))
            async with contextlib.aclosing(stream):
                async for _ in stream:
                    break  # the client went away after the first output
            # The abort frees the slot in the engine's next step (polled, bounded).
            for _ in range(500):
                if engine.core.stats.slots[0].state == "free":
                    break
                await asyncio.sleep(0.01)
            # With no queue at all, a new request is admitted only because the slot is free.
            done = [o async for o in engine.generate("s", [4], SamplingParams(max_tokens=2))]
        finally:
            await engine.shutdown()
        return engine.core.stats.requests_aborted, [o.num_output_tokens for o in done]

    aborted, counts = asyncio.run(main())
    assert aborted == 1 and counts[-1] == 2
    assert runner.active == set()


def test_full_queue_is_refused_at_submission() -> None:
    async def main() -> None:
        engine = AsyncEngine(
            EngineCore(FakeRunner(num_slots=1), EngineConfig(num_slots=1, max_queue=0))
        )
        engine.start()
        try:
            with engine.submit("a", [1], SamplingParams(max_tokens=200)):
                try:
                    engine.submit("b", [1], SamplingParams(max_tokens=1))
                except QueueFullError:
                    return
                raise AssertionError("the second request should have been refused")
        finally:
            await engine.shutdown()

    asyncio.run(main())
