"""POST /flush_cache's path to the engine core, over the fake runner with either kind of
prefix cache: from a core on the server's thread and from one in its own process, the flush
empties the cache, and once the engine has stopped it is refused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from slotserve.engine.client.async_engine import AsyncEngine
from slotserve.engine.client.mp_client import MPClient
from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import EngineDeadError
from slotserve.engine.sampling_params import SamplingParams
from tests.fake_runner import FakeRunner, FakeSpec


@pytest.mark.parametrize("options", [{}, {"kv_pool_blocks": 64}], ids=["slot-streams", "paged"])
@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_flush_reaches_the_core_and_is_refused_once_it_stops(
    options: dict[str, Any], where: str
) -> None:
    config = EngineConfig(num_slots=2)

    async def main() -> tuple[int, int, int]:
        if where == "thread":
            runner = FakeRunner(**options)
            engine = await AsyncEngine.launch(lambda: EngineCore(runner, config))
        else:
            spec = FakeSpec(options)
            engine = await AsyncEngine.connect(
                lambda deliver: MPClient.launch(spec, config, deliver)
            )
        try:
            prompt = list(b"a prompt long enough to be worth caching")
            async for _ in engine.generate(
                EngineCoreRequest("a", prompt, SamplingParams(max_tokens=3))
            ):
                pass
            cached = engine.stats.prefix_cache.cached_tokens
            freed = await engine.flush_prefix_cache()
            left = engine.stats.prefix_cache.cached_tokens  # published before the answer
            assert engine.stats.integrity_failures == 0
        finally:
            await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await engine.flush_prefix_cache()
        return cached, freed, left

    cached, freed, left = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert cached > 0 and freed == cached and left == 0
