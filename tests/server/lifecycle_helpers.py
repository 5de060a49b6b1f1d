"""What the served-model lifecycle tests share: the model, a long prompt length, /metrics scrapes,
the server's idle, slot and ready states, a greedy completion, an OpenAI-error check, and a
stream read on a thread."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# Long enough that a stream is still generating whatever the machine's speed when the test acts
# on it (several seconds of decoding on the 2-core CI machine), short of every slot's context.
LONG = 3000

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(base_url: str) -> tuple[Samples, dict[str, str]]:
    """Every sample of ``/metrics`` keyed by name and sorted labels, and each sample name's
    family type (counter, gauge, histogram)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples: Samples = {}
    kinds: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
            kinds[sample.name] = family.type
    return samples, kinds


def metric(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    return float(samples.get(key, 0.0))


def idle(server: ServerProcess) -> bool:
    """No request anywhere in the engine: every slot free and holding no request, none queued."""
    slots = server.slots()
    return (
        slots["state"] == "ready"
        and slots["num_running"] == 0
        and slots["num_waiting"] == 0
        and all(s["state"] == "free" and s["request_id"] is None for s in slots["slots"])
    )


def running_request_ids(server: ServerProcess) -> set[str]:
    return {s["request_id"] for s in server.slots()["slots"] if s["state"] == "generating"}


def ready_status(server: ServerProcess) -> int:
    try:
        return httpx.get(f"{server.base_url}/ready", timeout=2).status_code
    except httpx.TransportError:
        return -1


def greedy_text(server: ServerProcess, prompt: str, max_tokens: int = 8) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.api_url}/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def assert_openai_error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"], error
    return error


class StreamReader:
    """A streaming completion read to its end on a thread; ``lines`` are its non-empty SSE
    lines so far, ``first_chunk`` is set once a generated chunk arrived, ``done`` at the end."""

    def __init__(self, server: ServerProcess, body: dict[str, Any], **headers: str) -> None:
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.status: int | None = None
        self.first_chunk = threading.Event()
        self.done = threading.Event()
        self._leave = threading.Event()
        self._thread = threading.Thread(
            target=self._read, args=(server, {**body, "stream": True}, headers), daemon=True
        )
        self._thread.start()

    def _read(self, server: ServerProcess, body: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            with httpx.stream(
                "POST", f"{server.api_url}/completions", json=body, headers=headers, timeout=300
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if self._leave.is_set():
                        return  # leaving the block closes the connection: a disconnect
                    if line:
                        self.lines.append(line)
                        if line.startswith("data: {") and '"choices":[{' in line:
                            self.first_chunk.set()
        except BaseException as exc:  # the test thread reports it
            self.error = exc
        finally:
            self.first_chunk.set()  # never leave a waiter hanging on a stream that failed
            self.done.set()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line[6:]) for line in self.lines if line.startswith("data: {")]

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout)

    def leave(self, timeout: float = 30) -> None:
        """The client disconnects (at its next line) and the thread ends."""
        self._leave.set()
        assert self.wait(timeout), "the reader thread did not end"


def choices_by_index(events: list[dict[str, Any]]) -> tuple[dict[int, str], dict[int, list[str]]]:
    """Text and every non-null finish reason per choice index of a completion stream."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for event in events:
        for choice in event.get("choices", []):
            index = choice["index"]
            texts[index] = texts.get(index, "") + choice["text"]
            finishes.setdefault(index, [])
            if choice["finish_reason"] is not None:
                finishes[index].append(choice["finish_reason"])
    return texts, finishes
