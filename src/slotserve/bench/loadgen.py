"""Sends a workload to an OpenAI-compatible server and times every streamed chunk."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import httpx

from slotserve.bench.datasets import Conversation
from slotserve.bench.metrics import RequestResult


@dataclass(frozen=True)
class LoadConfig:
    base_url: str  # up to and including /v1
    model: str | None = None
    endpoint: str = "chat"  # "chat" or "completions"
    concurrency: int = 1
    request_rate: float = float("inf")  # requests/s of a Poisson process; inf = all at once
    duration_s: float | None = None  # keep sending for this long instead of a fixed count
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None


@dataclass
class LoadRun:
    """What a load measured: the workload's results over ``duration`` seconds, and apart from
    them those of the background traffic sent meanwhile."""

    results: list[RequestResult]
    duration: float
    background: list[RequestResult] = field(default_factory=list)
    # Every conversation as sent, by the id its results carry (with the replies it got), so
    # that any of its requests can be sent again.
    sent: dict[str, Conversation] = field(default_factory=dict)


class LoadOptions(TypedDict, total=False):
    """How requests are sent, beyond where to and how many at once: ``LoadConfig``'s fields
    that the workload flags set."""

    endpoint: str
    temperature: float
    ignore_eos: bool
    seed: int


def poisson_gaps(rate: float, seed: int) -> Iterator[float]:
    """Seconds between arrivals of a Poisson process with ``rate`` requests/s (0 gaps: inf)."""
    rng = random.Random(seed)
    while True:
        yield 0.0 if rate == float("inf") else rng.expovariate(rate)


async def resolve_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def resolve_model_sync(config: LoadConfig) -> str:
    """The first model the server lists (``config.model`` when set)."""
    if config.model is not None:
        return config.model
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    response = httpx.get(f"{config.base_url}/models", headers=headers, timeout=60)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def _body(config: LoadConfig, model: str, conv: Conversation, turn: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": conv.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = conv.messages(turn)
    else:
        body["prompt"] = conv.prompt(turn)
    return body


async def send_one(
    client: httpx.AsyncClient, config: LoadConfig, model: str, conv: Conversation, turn: int
) -> RequestResult:
    """One streaming request; the result records chunk timings and the server's usage."""
    result = RequestResult(
        f"{conv.conversation_id}/{turn}", turn=turn, temperature=config.temperature
    )
    route = "/chat/completions" if config.endpoint == "chat" else "/completions"
    pieces: list[str] = []
    last = start = time.perf_counter()
    result.start = start
    try:
        async with client.stream("POST", route, json=_body(config, model, conv, turn)) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
                    result.output_tokens = int(chunk["usage"]["completion_tokens"])
                for choice in chunk.get("choices", []):
                    piece = _content(choice)
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if not pieces:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    pieces.append(piece)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.text = "".join(pieces)
    if not pieces and not result.output_tokens:
        result.error = "the response carried no content"
        return result
    if not result.output_tokens:
        # A server without stream_options.include_usage (llama-cpp-python's): one content
        # chunk per token is the best estimate left; the report counts such requests.
        result.output_tokens = len(pieces)
        result.usage_estimated = True
    result.success = True
    return result


def _content(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")


def nth(conversations: Sequence[Conversation], index: int) -> Conversation:
    """The index-th conversation, fresh; past the list's end it repeats with a new id."""
    source = conversations[index % len(conversations)]
    lap = index // len(conversations)
    name = source.conversation_id + (f"#{lap}" if lap else "")
    return Conversation(name, source.user_turns, source.max_tokens, source.system)


async def run_load(
    config: LoadConfig,
    conversations: list[Conversation],
    warmup: int = 0,
    on_result: Callable[[RequestResult], None] | None = None,
    *,
    background: Sequence[Conversation] = (),
    background_streams: int = 0,
) -> LoadRun:
    """Runs the workload; returns the counted results and the measured duration in seconds.

    Conversations start in order, each when a concurrency slot is free and, with a finite
    ``request_rate``, after a Poisson-distributed gap; a conversation's turns run in sequence.
    ``warmup`` single requests (the first prompts, with a different opening) run before the
    clock starts and are not counted. ``background_streams`` more requests, outside the
    concurrency limit, send the ``background`` prompts one after another in each stream until
    the workload is done; those still running then are cancelled.
    """
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency + background_streams + 4)
    async with httpx.AsyncClient(
        base_url=config.base_url, timeout=config.timeout_s, limits=limits, headers=headers
    ) as client:
        model = config.model or await resolve_model(client)
        for k, conv in enumerate(conversations[:warmup]):
            # A different first word: a server's prompt cache must not get a head start on the
            # requests that are measured.
            probe = Conversation(
                f"warmup-{k}", [f"Warm-up {k}: {conv.user_turns[0]}"], conv.max_tokens
            )
            await send_one(client, config, model, probe, 0)
        gate = asyncio.Semaphore(config.concurrency)
        gaps = poisson_gaps(config.request_rate, config.seed)
        run = LoadRun([], 0.0)

        async def keep_busy(stream: int) -> None:
            # Streams take turns through the prompts, so no two send the same one at once.
            index = stream
            while True:
                conv = nth(background, index)
                run.sent[conv.conversation_id] = conv
                result = await send_one(client, config, model, conv, 0)
                run.background.append(result)
                if not result.success:
                    return  # a server refusing everything must not be hammered in a loop
                index += background_streams

        # Scheduled first, so the workload's first requests meet a server already busy.
        streams = background_streams if background else 0
        busy = [asyncio.ensure_future(keep_busy(s)) for s in range(streams)]
        started = time.perf_counter()
        deadline = None if config.duration_s is None else started + config.duration_s

        async def converse(conv: Conversation) -> None:
            run.sent[conv.conversation_id] = conv
            async with gate:
                for turn in range(len(conv.user_turns)):
                    if deadline is not None and time.perf_counter() >= deadline:
                        return
                    result = await send_one(client, config, model, conv, turn)
                    run.results.append(result)
                    if on_result is not None:
                        on_result(result)
                    if not result.success:
                        return
                    conv.replies.append(result.text)

        tasks: list[asyncio.Future[None]] = []
        if deadline is not None and config.request_rate == float("inf"):
            counter = iter(range(10**9))

            async def worker() -> None:  # duration mode: each worker keeps one slot busy
                while time.perf_counter() < deadline:
                    await converse(nth(conversations, next(counter)))

            tasks = [asyncio.ensure_future(worker()) for _ in range(config.concurrency)]
        else:
            index = 0
            while index < len(conversations) or deadline is not None:
                if deadline is not None and time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.ensure_future(converse(nth(conversations, index))))
                index += 1
                gap = next(gaps)
                if gap:
                    await asyncio.sleep(gap)
        await asyncio.gather(*tasks)
        run.duration = time.perf_counter() - started
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
    return run


async def resend_alone(
    config: LoadConfig, run: LoadRun, prompt_ids: Sequence[str]
) -> dict[str, RequestResult]:
    """Sends the requests ``prompt_ids`` of ``run`` again, one at a time (nothing else in
    flight): what each returns by itself, by prompt id."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with httpx.AsyncClient(
        base_url=config.base_url, timeout=config.timeout_s, headers=headers
    ) as client:
        model = config.model or await resolve_model(client)
        alone = {}
        for prompt_id in prompt_ids:
            conversation_id, turn = prompt_id.rsplit("/", 1)
            conv = run.sent[conversation_id]
            alone[prompt_id] = await send_one(client, config, model, conv, int(turn))
    return alone
