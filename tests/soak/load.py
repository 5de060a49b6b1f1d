"""The soak's mixed load: chat and text completions, streaming and not, n of 1-2, stop strings,
seeds; 30% of the clients disconnect at a random point (before the first token, mid-stream, or
while a non-streaming request runs) and 10% send malformed requests. Every request has a
deadline; each ends in one :class:`Outcome`, with its times, for the test to judge against the
windows in which the engine was dead. A client told to come back later (a 5xx with Retry-After)
waits that long before its next request, as the OpenAI clients do."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

TOPICS = ["the sea", "a red fox", "batching", "tea", "mountains", "a lost key", "robots", "rain"]
# Shared by a third of the chat requests: long enough (~200 tokens) for the prefix cache to
# reuse, so its bookkeeping is soaked under disconnects too.
SYSTEM = (
    "You are a patient assistant for a small library. You answer in one or two short "
    "sentences, you never invent facts, and when you do not know you say so plainly. "
) * 4

MALFORMED: list[tuple[str, str, Any]] = [
    ("invalid JSON", "completions", b'{"prompt": "hi", '),
    ("wrong type", "chat/completions", {"messages": "hello"}),
    ("unknown field", "completions", {"prompt": "hi", "frobnicate": 1}),
    ("negative max_tokens", "completions", {"prompt": "hi", "max_tokens": -3}),
    ("over the context", "completions", {"prompt": "hi", "max_tokens": 10**6}),
    ("unknown model", "completions", {"model": "gpt-17", "prompt": "hi"}),
    (
        "bad logit_bias",
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": 1e9}},
    ),
    ("n above the slots", "completions", {"prompt": "hi", "n": 99}),
    ("empty messages", "chat/completions", {"messages": []}),
    ("prompt ids outside the vocabulary", "completions", {"prompt": [1, 2, 10**9]}),
    ("empty body", "chat/completions", b""),
    ("stream not a bool", "completions", {"prompt": "hi", "stream": "yes"}),
]


@dataclass
class Outcome:
    """How one request ended. ``kind``: completed, disconnect (how), malformed (refused with
    a 4xx), server error (a 5xx), stream error (an error event in a 200 stream), hang (no
    answer within the deadline), transport error, or bad (a wrong answer). ``started`` and
    ``ended``: monotonic seconds."""

    kind: str
    started: float
    ended: float
    status: int | None = None
    detail: str = ""
    code: str | None = None  # a 5xx's error code
    retry_after: float | None = None  # a 5xx's Retry-After, in seconds

    def overlaps(self, start: float, end: float) -> bool:
        return self.started <= end and self.ended >= start


@dataclass
class Load:
    """The load's size and where its outcomes go."""

    requests: int
    concurrency: int
    deadline_s: float  # a request still unanswered after this long hangs
    outcomes: list[Outcome] = field(default_factory=list)
    sent: int = 0

    def count(self, kind: str) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind)


def _valid_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    topic = rng.choice(TOPICS)
    body: dict[str, Any] = {
        "max_tokens": rng.randint(1, 32),
        "temperature": rng.choice([0.0, 0.7]),
        "seed": rng.randint(0, 1000),
        "n": rng.choice([1, 1, 1, 2]),
    }
    if rng.random() < 0.2:
        body["stop"] = [rng.choice([".", "\n", " the"])]
    if rng.random() < 0.5:
        messages = [{"role": "user", "content": f"Write a few words about {topic}."}]
        if rng.random() < 0.35:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        return "chat/completions", {**body, "messages": messages}
    return "completions", {**body, "prompt": f"A short note about {topic}:" * rng.randint(1, 4)}


class _Request:
    """One request's outcome as it is learnt: the first verdict stands."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.outcome: Outcome | None = None

    def end(
        self, kind: str, status: int | None = None, detail: str = "", code: str | None = None
    ) -> None:
        if self.outcome is None:
            self.outcome = Outcome(kind, self.started, time.monotonic(), status, detail, code)

    async def answered(self, response: httpx.Response, what: str) -> bool:
        """False (and the outcome set) when ``response`` is a 5xx."""
        if response.status_code < 500:
            return True
        body = (await response.aread()).decode(errors="replace")
        self.end("server error", response.status_code, f"{what}: {body[:300]}")
        assert self.outcome is not None
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            self.outcome.code = json.loads(body)["error"]["code"]
        with contextlib.suppress(KeyError, ValueError):
            self.outcome.retry_after = float(response.headers["retry-after"])
        return False


async def _malformed(http: httpx.AsyncClient, rng: random.Random, request: _Request) -> None:
    name, route, body = rng.choice(MALFORMED)
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = await http.post(f"/v1/{route}", **kwargs)
    if await request.answered(response, f"malformed ({name})"):
        if 400 <= response.status_code < 500:
            request.end("malformed", response.status_code)
        else:
            request.end("bad", response.status_code, f"malformed ({name}) got a success")


async def _disconnect(
    http: httpx.AsyncClient, rng: random.Random, route: str, body: dict[str, Any], r: _Request
) -> None:
    how = rng.choice(["before the first token", "mid-stream", "non-streaming"])
    body["max_tokens"] = 64  # long enough to still be running when the client leaves
    if how == "non-streaming":
        with contextlib.suppress(TimeoutError):  # the client gave up: a disconnect
            response = await asyncio.wait_for(
                http.post(f"/v1/{route}", json=body), timeout=rng.uniform(0.0, 0.6)
            )
            await r.answered(response, "non-streaming disconnect (finished first)")
        r.end(f"disconnect {how}")
        return
    async with http.stream("POST", f"/v1/{route}", json={**body, "stream": True}) as response:
        if not await r.answered(response, f"disconnect {how}"):
            return
        if how == "mid-stream":
            to_read = rng.randint(1, 12)
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    to_read -= 1
                    if to_read == 0:
                        break
        # Leaving the block closes the connection: the server must abort and free the slot.
    r.end(f"disconnect {how}")


async def _complete(
    http: httpx.AsyncClient, rng: random.Random, route: str, body: dict[str, Any], r: _Request
) -> None:
    n = body["n"]
    if rng.random() < 0.5:
        response = await http.post(f"/v1/{route}", json=body)
        if not await r.answered(response, f"valid {route}"):
            return
        if response.status_code != 200:
            r.end("bad", response.status_code, f"{route}: {response.text[:200]}")
            return
        reply = response.json()
        finish = [c["finish_reason"] for c in reply["choices"]]
        if len(finish) != n or not set(finish) <= {"stop", "length"}:
            r.end("bad", 200, f"{route} finish reasons {finish}")
        elif reply["usage"]["completion_tokens"] < n:
            r.end("bad", 200, f"{route} usage {reply['usage']}")
        else:
            r.end("completed", 200)
        return
    reasons: dict[int, str] = {}
    done = False
    async with http.stream("POST", f"/v1/{route}", json={**body, "stream": True}) as response:
        if not await r.answered(response, f"valid streaming {route}"):
            return
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    r.end("stream error", 200, str(error.get("message"))[:300], error.get("code"))
                for choice in event.get("choices", []):
                    if choice.get("finish_reason"):
                        reasons[choice["index"]] = choice["finish_reason"]
    if response.status_code != 200 or not done:
        r.end("bad", response.status_code, f"stream {route}: done={done} reasons={reasons}")
    elif len(reasons) != n or not set(reasons.values()) <= {"stop", "length"}:
        r.end("bad", 200, f"stream {route}: reasons {reasons}")
    else:
        r.end("completed", 200)


async def _send(http: httpx.AsyncClient, rng: random.Random, load: Load) -> Outcome:
    request = _Request()
    roll = rng.random()
    try:
        async with asyncio.timeout(load.deadline_s):
            if roll < 0.10:
                await _malformed(http, rng, request)
            else:
                route, body = _valid_body(rng)
                if roll < 0.40:  # 30% of all requests
                    await _disconnect(http, rng, route, body, request)
                else:
                    await _complete(http, rng, route, body, request)
    except (TimeoutError, httpx.TimeoutException) as exc:
        request.end("hang", None, f"no answer within {load.deadline_s:g} s ({exc!r})")
    except httpx.TransportError as exc:
        request.end("transport error", None, repr(exc))
    request.end("bad", None, "no verdict")  # a branch above forgot one
    assert request.outcome is not None
    load.outcomes.append(request.outcome)
    return request.outcome


async def run_load(base_url: str, load: Load) -> None:
    """Sends ``load.requests`` requests from ``load.concurrency`` clients."""
    rng = random.Random(20261123)
    seeds = [rng.random() for _ in range(load.requests)]
    queue: asyncio.Queue[float] = asyncio.Queue()
    for seed in seeds:
        queue.put_nowait(seed)
    limits = httpx.Limits(
        max_connections=load.concurrency + 4, max_keepalive_connections=load.concurrency
    )
    timeout = httpx.Timeout(load.deadline_s)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:

        async def worker() -> None:
            while not queue.empty():
                seed = queue.get_nowait()
                load.sent += 1
                outcome = await _send(http, random.Random(seed), load)
                if outcome.retry_after is not None:
                    # As the OpenAI clients do: this client waits as long as it was told.
                    await asyncio.sleep(outcome.retry_after)

        await asyncio.gather(*(worker() for _ in range(load.concurrency)))
