from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.outputs import RequestOutput
from slotserve.engine.request import Request
from slotserve.engine.sampling_params import SamplingParams
from tests.fake_runner import FakeRunner


def make_core(runner: FakeRunner | None = None, **config: Any) -> tuple[EngineCore, FakeRunner]:
    runner = runner or FakeRunner()
    config.setdefault("num_slots", runner.num_slots)
    return EngineCore(runner, EngineConfig(**config)), runner


def submit(core: EngineCore, request_id: str, prompt: str, **params: object) -> Request:
    request = EngineCoreRequest(
        request_id,
        list(prompt.encode("utf-8")),
        SamplingParams(**params),  # type: ignore[arg-type]
    )
    core.validate(request)
    return core.add_request(request)


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Steps until no work is left; returns every output, grouped by request id."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
        if not core.has_work:
            return outputs
    raise AssertionError("engine did not finish")


def text_of(outputs: list[RequestOutput], index: int = 0) -> str:
    return "".join(d.text for o in outputs for d in o.deltas if d.index == index)


def texts_in_waves(
    core: EngineCore,
    requests: Sequence[tuple[str, str, int, int]],
    after_step: Callable[[], None],
    waves: int = 5,
) -> dict[str, str]:
    """Runs ``requests`` (prefix, own text, max tokens, wave) wave by wave, each wave once the
    last is done, calling ``after_step`` after every step; returns each request's text, by
    ``r<index>``."""
    texts: dict[str, str] = {}
    for wave in range(waves):
        for i, (prefix, own, max_tokens, when) in enumerate(requests):
            if when == wave:
                submit(core, f"r{i}", prefix + own, max_tokens=max_tokens)
        while core.has_work:
            for output in core.step():
                texts[output.request_id] = texts.get(output.request_id, "") + "".join(
                    d.text for d in output.deltas
                )
            after_step()
    return texts
