"""slotserve as a worker of the SGLang Model Gateway (``sglang-router``): the routes the gateway
calls, in SGLang's shapes, against real servers; then the real gateway (``cache_aware``) in
front of two real workers, with a multi-prefix workload sent through it by the openai client.

The first worker runs its engine in a process (the default), the second on a thread of the
server (``--no-engine-process``), so both ways a flush reaches the engine core are exercised
(``tests/engine/test_flush_prefix_cache.py`` checks them without a model).
"""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from slotserve import parent_death
from tests.conftest import ServerProcess, _free_port, start_server, stop_server, wait_until

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SLOTS, CTX = 2, 4096
# llama.cpp workers: a prefix cache whose hits come in whole grains of 64, so prompts that
# share only a chat template's first tokens share nothing the lookups below would count.
WORKER_ARGS: tuple[str, ...] = ("--runner", "llama.cpp", "--slots", str(SLOTS))
WORKER_ARGS += ("--ctx-size", str(CTX), "--threads", "1")
needs_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (it is in the `test` extra: pip install -e '.[test]')",
)

# What the gateway sends a worker for a plain openai-client request (captured from 0.3.2): it
# re-serialises the body with SGLang's fields at their defaults.
ROUTER_CHAT_EXTRAS = {
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
_SHARED = ("no_stop_trim", "ignore_eos", "skip_special_tokens", "return_hidden_states")
ROUTER_COMPLETION_EXTRAS = {"echo": False} | {k: ROUTER_CHAT_EXTRAS[k] for k in _SHARED}


def _long_prompt(topic: str, rules: int = 14) -> str:
    return f"You are an expert in {topic}. " + " ".join(
        f"{topic.capitalize()} rule {i}: stay on {topic}, be precise, explain the basics."
        for i in range(rules)
    )


def _get(server: ServerProcess, path: str) -> Any:
    response = httpx.get(f"{server.base_url}{path}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _cache(server: ServerProcess) -> dict[str, Any]:
    return dict(_get(server, "/v1/prefix_cache_stats"))


def _lookups(server: ServerProcess) -> int:
    stats = _cache(server)
    return int(stats["hits"]) + int(stats["misses"])


@pytest.fixture(scope="module")
def workers(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> Iterator[list[ServerProcess]]:
    tmp = tmp_path_factory.mktemp("workers")
    started: list[ServerProcess] = []
    try:
        started.append(start_server(tmp, *WORKER_ARGS))
        started.append(start_server(tmp, *WORKER_ARGS, "--no-engine-process"))
        yield started
    finally:
        for worker in started:
            stop_server(worker)


@pytest.fixture(scope="module")
def router(
    workers: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """``python -m sglang_router.launch_router`` on loopback, once it has registered both
    workers (the gateway answers ``/workers`` before their registration is done)."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    command = parent_death.command("sglang_router.launch_router", "--worker-urls")
    command += [w.base_url for w in workers]
    command += f"--policy cache_aware --host 127.0.0.1 --port {port} --log-level warn".split()
    # Its default metrics port (29000) would collide with another router's.
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    proc = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)

    def registered() -> bool:
        if process.poll() is not None:
            return True  # reported below
        try:
            listing = httpx.get(f"{proc.base_url}/workers", timeout=2).json()
        except (httpx.TransportError, ValueError):
            return False
        return listing.get("total") == len(workers) and all(
            w["is_healthy"] for w in listing["workers"]
        )

    try:
        if not wait_until(registered, timeout=90, interval=0.2) or process.poll() is not None:
            raise RuntimeError(f"the router did not register the workers:\n{log_path.read_text()}")
        yield proc
    finally:
        stop_server(proc)  # terminate, wait, kill after 20 s


# ---- the worker routes, raw HTTP against a real server ------------------------------------


@pytest.mark.model
def test_health_is_200_when_ready(workers: list[ServerProcess]) -> None:
    for worker in workers:
        assert _get(worker, "/health") == {"status": "ok"}


@pytest.mark.model
def test_server_info_has_sglangs_fields_under_both_names(
    workers: list[ServerProcess], model_path: Path
) -> None:
    info = _get(workers[0], "/server_info")
    assert _get(workers[0], "/get_server_info") == info
    assert info["model_path"] == info["tokenizer_path"] == str(model_path)
    assert info["served_model_name"] == MODEL
    assert (info["tp_size"], info["dp_size"]) == (1, 1)
    assert info["context_length"] == info["max_model_len"] == CTX // SLOTS
    assert info["max_total_num_tokens"] == CTX
    assert info["max_running_requests"] == SLOTS
    for key in ("chunked_prefill_size", "max_prefill_tokens", "max_queued_requests"):
        assert isinstance(info[key], int) and info[key] > 0, key
    assert info["disable_radix_cache"] is False
    assert isinstance(info["version"], str) and info["state"] == "ready"
    # The gateway reads "model" as an alias of "model_id": both present fails its parse.
    assert not {"model", "model_id"} <= info.keys()


@pytest.mark.model
def test_model_info_under_both_names(workers: list[ServerProcess], model_path: Path) -> None:
    info = _get(workers[1], "/model_info")
    assert _get(workers[1], "/get_model_info") == info
    assert info["is_generation"] is True
    assert info["has_image_understanding"] is False  # a text model
    assert info["model_path"] == str(model_path)
    assert info["served_model_name"] == MODEL
    assert info["architectures"] is None or isinstance(info["architectures"], list)


@pytest.mark.model
def test_an_unknown_model_is_an_openai_404(workers: list[ServerProcess]) -> None:
    for method, path in (("GET", "/server_info"), ("GET", "/model_info"), ("POST", "/flush_cache")):
        response = httpx.request(method, f"{workers[0].base_url}{path}?model=nope", timeout=10)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.model
def test_get_load_is_one_rank_of_integers(workers: list[ServerProcess]) -> None:
    load = _get(workers[0], "/get_load")
    assert isinstance(load, list) and len(load) == 1
    assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    assert load[0]["dp_rank"] == 0
    assert all(isinstance(v, int) and v >= 0 for v in load[0].values())


@pytest.mark.parametrize("index", [0, 1], ids=["engine-process", "engine-thread"])
@pytest.mark.model
def test_flush_cache_empties_the_prefix_cache(workers: list[ServerProcess], index: int) -> None:
    worker = workers[index]
    prompt = _long_prompt(f"flushing {index}") + " Question: what comes first?"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    url = f"{worker.base_url}/v1/completions"
    assert httpx.post(url, json=body, timeout=120).status_code == 200
    before = _cache(worker)
    assert before["cached_tokens"] > 0

    flushed = httpx.post(f"{worker.base_url}/flush_cache", timeout=60)
    assert flushed.status_code == 200, flushed.text
    answer = flushed.json()
    assert answer["success"] is True
    assert answer["models"][MODEL] == {
        "prefix_cache": True,
        "freed_tokens": before["cached_tokens"],
        "cached_tokens": 0,
    }
    after = _cache(worker)
    assert after["cached_tokens"] == after["evictable_tokens"] == after["nodes"] == 0
    assert after["evicted_tokens"] == before["evicted_tokens"] + before["cached_tokens"]
    assert after["integrity_failures"] == 0
    again = httpx.post(url, json=body, timeout=120).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "really gone"


@pytest.mark.model
def test_flush_while_a_request_runs_keeps_its_prefix(workers: list[ServerProcess]) -> None:
    """Only prefixes no running request uses go; the load shows the running request."""
    worker = workers[0]
    body = {
        "model": MODEL,
        "prompt": _long_prompt("running") + " Tell a long story.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{worker.base_url}/v1/completions", json=body, timeout=120) as s:
        lines = s.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # it generates
        assert wait_until(lambda: _get(worker, "/get_load")[0]["num_reqs"] == 1, timeout=10)
        assert _get(worker, "/get_load")[0]["num_tokens"] > 0
        flushed = httpx.post(f"{worker.base_url}/flush_cache", timeout=60)
        assert flushed.status_code == 200, flushed.text
        assert flushed.json()["models"][MODEL]["cached_tokens"] > 0, "the running prompt stays"
        assert _cache(worker)["evictable_tokens"] == 0
    assert wait_until(lambda: _get(worker, "/get_load")[0]["num_reqs"] == 0, timeout=30)
    assert _cache(worker)["integrity_failures"] == 0


@pytest.mark.model
def test_the_fields_the_router_adds_are_accepted_at_their_defaults(
    workers: list[ServerProcess],
) -> None:
    base = workers[1].base_url
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "model": MODEL,
        "max_completion_tokens": 2,
        "stream": False,
        "temperature": 0.0,
        **ROUTER_CHAT_EXTRAS,
    }
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": False}
    completion |= ROUTER_COMPLETION_EXTRAS
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        response = httpx.post(f"{base}{path}", json=body, timeout=60)
        assert response.status_code == 200, response.text
        refused = httpx.post(f"{base}{path}", json=body | {"no_stop_trim": True}, timeout=60)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "no_stop_trim"


# ---- the real gateway in front of both workers --------------------------------------------


@pytest.mark.model
@needs_router
def test_the_router_registers_both_workers_with_their_metadata(
    router: ServerProcess, workers: list[ServerProcess], model_path: Path
) -> None:
    listing = _get(router, "/workers")
    assert sorted(w["url"] for w in listing["workers"]) == sorted(w.base_url for w in workers)
    for entry in listing["workers"]:
        assert entry["model_id"] == MODEL and entry["connection_mode"] == "HTTP"
        metadata = entry["metadata"]
        assert metadata["served_model_name"] == MODEL
        assert metadata["model_path"] == str(model_path)
        assert (metadata["dp_size"], metadata["tp_size"]) == ("1", "1")
    assert [m["id"] for m in _get(router, "/v1/models")["data"]] == [MODEL]
    assert _get(router, "/get_model_info")["is_generation"] is True  # proxied to a worker


@pytest.mark.model
@needs_router
def test_router_fans_out_flush_and_reads_loads(
    router: ServerProcess, workers: list[ServerProcess]
) -> None:
    flushed = httpx.post(f"{router.base_url}/flush_cache", timeout=60).json()
    assert flushed["status"] == "success" and flushed["workers_flushed"] == len(workers)
    for worker in workers:
        assert _cache(worker)["cached_tokens"] == 0
    loads = _get(router, "/get_loads")["workers"]
    assert sorted(entry["worker"] for entry in loads) == sorted(w.base_url for w in workers)
    assert all(entry["load"] >= 0 for entry in loads), "-1: the router could not read /get_load"


@pytest.mark.model
@needs_router
def test_streaming_and_text_completions_through_the_router(router: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    finishes = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finishes[-1] in ("stop", "length")
    completion = client.completions.create(
        model=MODEL, prompt="One, two,", max_tokens=3, temperature=0
    )
    assert completion.choices[0].finish_reason in ("stop", "length")


@pytest.mark.model
@needs_router
def test_requests_sharing_a_prefix_land_on_the_same_worker(
    router: ServerProcess, workers: list[ServerProcess]
) -> None:
    """Three long system prompts × three users. The first user of each prompt arrives at once
    (the gateway spreads what matches nothing by load); then users two and three, one at a
    time, so each request's worker is the one whose lookup count moved: each prompt's later
    users must go where its first user went, and reuse the prefix cached there."""
    assert httpx.post(f"{router.base_url}/flush_cache", timeout=60).status_code == 200
    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="unused", max_retries=0)
    topics = ["astronomy", "cooking", "sailing"]

    def ask(topic: str, user: int) -> int:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": _long_prompt(topic)},
                {"role": "user", "content": f"User {user} asks about {topic}."},
            ],
            max_tokens=4,
            temperature=0,
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    before = [_lookups(w) for w in workers]
    hits_before = sum(_cache(w)["hits"] for w in workers)
    with ThreadPoolExecutor(len(topics)) as pool:
        first_cached = list(pool.map(ask, topics, [1] * len(topics)))
    assert first_cached == [0, 0, 0], "nothing was cached for these prompts yet"
    spread = [_lookups(w) - b for w, b in zip(workers, before, strict=True)]
    assert sorted(spread) == [1, 2], f"the first users went {spread}: not spread by load"

    landed: dict[str, set[int]] = {topic: set() for topic in topics}
    for user in (2, 3):
        for topic in topics:
            counts = [_lookups(w) for w in workers]
            cached = ask(topic, user)
            moved = [i for i, w in enumerate(workers) if _lookups(w) > counts[i]]
            assert len(moved) == 1, moved
            landed[topic].add(moved[0])
            assert cached > 0, f"{topic} user {user} found no cached prefix on worker {moved[0]}"
    assert all(len(where) == 1 for where in landed.values()), landed
    assert sum(_cache(w)["hits"] for w in workers) - hits_before == 2 * len(topics)
