"""Fault injection (SPEC E11): the real llama.cpp runner, made to fail on command, turns the
model unhealthy; in-flight requests get an error, new ones a 503 naming the recovery; a reload
recovers and the model serves the same greedy text as before the fault.

Two faults: ``raise`` (an exception from the forward pass, as a device error would give) and
``nan`` (a control vector of NaNs added to the residual stream through llama.cpp's own API,
so the real forward pass produces non-finite logits and the runner's check catches them).
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import httpx
import llama_cpp as llama
import numpy as np
import openai
import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import Runner, ScheduledChunk
from slotserve.hosting.served import RestartPolicy
from slotserve.runners.llama_cpp.runner import LlamaCppRunner
from tests.conftest import wait_until
from tests.server.live import LiveServer, live_server


class FaultInjectingRunner:
    """The real runner, plus ``arm(kind)``: the next forward pass fails that way."""

    def __init__(self, inner: LlamaCppRunner) -> None:
        self.inner = inner
        self.armed: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def arm(self, kind: str) -> None:
        self.armed = kind

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, list[SampledToken]]:
        kind, self.armed = self.armed, None
        if kind == "raise":
            raise RuntimeError("injected device fault")
        if kind == "nan":
            inner = self.inner
            n_embd = llama.llama_model_n_embd(inner._model)
            n_layer = llama.llama_model_n_layer(inner._model)
            poison = np.full(n_embd * n_layer, np.nan, dtype=np.float32)
            pointer = poison.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            status = llama.llama_set_adapter_cvec(
                inner._ctx, pointer, poison.size, n_embd, 1, n_layer
            )
            assert status == 0
        return self.inner.execute(chunks)


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[tuple[LiveServer, list[FaultInjectingRunner]]]:
    built: list[FaultInjectingRunner] = []

    def build() -> Runner:
        runner = FaultInjectingRunner(
            LlamaCppRunner(model_path, num_slots=4, ctx_size=4 * 1024, max_batch_tokens=256)
        )
        built.append(runner)
        return cast(Runner, runner)

    # Not restarted by itself: this is the unhealthy state and the reload that ends it.
    never = RestartPolicy(enabled=False)
    config = EngineConfig(num_slots=4, max_batch_tokens=256)
    with live_server(build, config, "smol", restart=never) as live:
        yield live, built


PROMPT = "The capital of France is"


def _greedy(client: openai.OpenAI) -> str:
    reply = client.completions.create(model="smol", prompt=PROMPT, max_tokens=12, temperature=0)
    return reply.choices[0].text


@pytest.mark.parametrize("kind", ["raise", "nan"])
def test_fault_makes_the_model_unhealthy_and_reload_recovers(
    server: tuple[LiveServer, list[FaultInjectingRunner]], kind: str
) -> None:
    live, built = server
    client = openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0)
    before = _greedy(client)

    async def in_flight() -> tuple[str, Exception | None, int]:
        aclient = openai.AsyncOpenAI(base_url=live.api_url, api_key="x", max_retries=0)
        stream = await aclient.completions.create(
            model="smol",
            prompt="Count: one, two,",
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, error = "", None
        try:
            async for chunk in stream:
                if not text:  # the stream is running: break the model now
                    built[-1].arm(kind)
                text += chunk.choices[0].text if chunk.choices else ""
        except openai.APIError as exc:
            error = exc
        # A non-streaming request sent after the fault is refused at once.
        late = await httpx.AsyncClient().post(
            f"{live.api_url}/completions", json={"prompt": "hi", "max_tokens": 3}
        )
        return text, error, late.status_code

    _, error, late_status = asyncio.run(in_flight())
    assert error is not None, "the stream in flight ended with an error event"
    assert "/admin/reload" in str(error)
    assert late_status == 503
    health = httpx.get(f"{live.base_url}/health")
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert httpx.get(f"{live.base_url}/ready").status_code == 503
    (entry,) = httpx.get(f"{live.api_url}/models").json()["data"]
    assert entry["state"] == "unhealthy"
    expected = "non-finite logits" if kind == "nan" else "injected device fault"
    assert expected in entry["reason"]
    with pytest.raises(openai.APIStatusError) as refused:
        _greedy(client)
    assert refused.value.status_code == 503 and "reload" in str(refused.value)

    loads = len(built)
    reload = httpx.post(f"{live.base_url}/admin/reload", timeout=120)
    assert reload.status_code == 200 and reload.json()["status"] == "ready"
    assert len(built) == loads + 1, "a fresh runner was built"
    assert httpx.get(f"{live.base_url}/health").json() == {"status": "ok"}
    assert _greedy(client) == before, "the reloaded model answers as before the fault"
    assert wait_until(lambda: live.host.model is not None and live.host.num_in_flight == 0)


def test_a_poisoned_runner_is_restarted_by_itself(model_path: Path) -> None:
    built: list[FaultInjectingRunner] = []

    def build() -> Runner:
        runner = FaultInjectingRunner(
            LlamaCppRunner(model_path, num_slots=2, ctx_size=2 * 1024, max_batch_tokens=256)
        )
        built.append(runner)
        return cast(Runner, runner)

    config = EngineConfig(num_slots=2, max_batch_tokens=256)
    with live_server(build, config, "smol", restart=RestartPolicy(limit=3)) as live:
        client = openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0)
        built[-1].arm("raise")
        with pytest.raises(openai.APIStatusError) as failed:
            _greedy(client)
        assert failed.value.status_code == 503 and "injected device fault" in str(failed.value)

        def restarted() -> bool:
            return httpx.get(f"{live.base_url}/ready", timeout=5).status_code == 200

        assert wait_until(restarted, timeout=60, interval=0.1)
        assert len(built) == 2 and live.host.restarts == 1
        assert _greedy(client)
