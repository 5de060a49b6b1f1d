"""Several models in one server (SPEC S2): the embedded GGUF on llama.cpp and on the PyTorch
runner under two names, Gemma 3 270M (a second architecture, no chat template) loaded on
first use from ``--models-dir``; loading and unloading at run time, routing by ``model``,
per-model metrics, slots, failures and reloads; ``--models-max`` and ``keep_alive``."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from slotserve.bench.report import rss_bytes
from tests.conftest import ServerProcess, start_server, stop_server, wait_until

KEY = "sk-multi-model-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, gemma_path: Path) -> Path:
    directory = tmp_path_factory.mktemp("models")
    (directory / "gemma.gguf").symlink_to(gemma_path)
    return directory


@pytest.fixture(scope="module")
def multi(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, models_dir: Path
) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("multi"),
        "--model",
        f"{model_path}=smol-cpp",
        "--models-dir",
        str(models_dir),
        "--models-max",
        "4",
        "--runner",
        "llama.cpp",
        "--slots",
        "2",
        "--api-key",
        KEY,
    )
    yield proc
    stop_server(proc)


def post(server: ServerProcess, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=AUTH, timeout=300, **kw)


def get(server: ServerProcess, path: str) -> httpx.Response:
    return httpx.get(f"{server.base_url}{path}", headers=AUTH, timeout=30)


def cards(server: ServerProcess) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in get(server, "/v1/models").json()["data"]}


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=KEY, max_retries=0)


def load_smol(server: ServerProcess, name: str, model_path: Path, **options: Any) -> None:
    response = post(server, "/models/load", {"model": name, "path": str(model_path), **options})
    assert response.status_code == 200, response.text
    assert response.json()["success"] is True


def test_one_gguf_on_both_runners_under_two_names(multi: ServerProcess, model_path: Path) -> None:
    load_smol(multi, "smol-torch", model_path, runner="torch", slots=2)
    listed = cards(multi)
    assert listed["smol-cpp"]["runner"] == "llama.cpp" and listed["smol-torch"]["runner"] == "torch"
    # Each names what serves it: ggml (with its weights' buffers), or the PyTorch runner's CPU
    # kernels.
    assert listed["smol-cpp"]["compute"]["kernels"].startswith("ggml; weights in ")
    assert "extra buffer types" in listed["smol-cpp"]["compute"]["kernels"]
    assert listed["smol-torch"]["compute"]["kernels"].startswith("slotserve CPU kernels")
    assert listed["smol-torch"]["compute"]["batch_invariant"] is True
    for name in ("smol-cpp", "smol-torch"):
        assert listed[name]["state"] == "ready" and listed[name]["slots"] == 2
        assert listed[name]["max_model_len"] > 0
    assert listed["gemma"]["state"] == "unloaded"  # in the models dir, not loaded yet
    api = client(multi)
    for name in ("smol-cpp", "smol-torch"):
        chat = api.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8,
            temperature=0,
        )
        assert chat.model == name and chat.choices[0].message.content
        assert api.models.retrieve(name).id == name
    # Each model has its own slots, prefix cache and metrics series.
    slots = get(multi, "/v1/slots?model=smol-torch").json()
    assert slots["model"] == "smol-torch" and len(slots["slots"]) == 2
    assert get(multi, "/v1/prefix_cache_stats?model=smol-cpp").json()["model"] == "smol-cpp"
    assert get(multi, "/v1/slots?model=nope").status_code == 404
    metrics = get(multi, "/metrics").text
    for name in ("smol-cpp", "smol-torch"):
        assert f'slotserve:model_state{{model_name="{name}",state="ready"}} 1.0' in metrics
        generated = [
            line
            for line in metrics.splitlines()
            if line.startswith(f'vllm:generation_tokens_total{{model_name="{name}"}}')
        ]
        assert generated and float(generated[0].split()[-1]) > 0


def test_an_unknown_model_is_a_404_naming_the_loaded_ones(multi: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(multi).completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found"
    assert "'smol-cpp'" in error["message"] and "gemma" in error["message"]
    assert get(multi, "/v1/models/no-such-model").status_code == 404


def test_load_refusals_are_clear(multi: ServerProcess, model_path: Path) -> None:
    taken = post(multi, "/models/load", {"model": "smol-cpp", "path": str(model_path)})
    assert taken.status_code == 409 and "taken" in taken.json()["error"]["message"]
    unknown = post(multi, "/models/load", {"model": "x", "path": str(model_path), "bogus": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "bogus"
    bad_runner = post(multi, "/models/load", {"model": "x", "path": str(model_path), "runner": "?"})
    assert bad_runner.status_code == 400 and "runner" in bad_runner.json()["error"]["message"]
    missing = post(multi, "/models/load", {"model": "x", "path": "/no/such/model.gguf"})
    assert missing.status_code == 400
    not_in_dir = post(multi, "/models/load", {"model": "not-in-the-dir"})
    assert not_in_dir.status_code == 404
    # The memory pre-flight refuses before loading anything (never an OOM).
    too_big = post(
        multi,
        "/models/load",
        {"model": "huge", "path": str(model_path), "slots": 64, "ctx_size": 4_000_000},
    )
    assert too_big.status_code == 400, too_big.text
    message = too_big.json()["error"]["message"]
    assert "GiB" in message and "KV cache" in message and "free" in message
    assert "huge" not in cards(multi)
    # Loading and unloading need the API key.
    for path in ("/models/load", "/models/unload"):
        refused = httpx.post(f"{multi.base_url}{path}", json={"model": "gemma"}, timeout=30)
        assert refused.status_code == 401


def test_models_dir_loads_on_first_use_once(multi: ServerProcess) -> None:
    api = client(multi)

    def complete(_: int) -> str:
        out = api.completions.create(model="gemma", prompt="The sky is", max_tokens=6)
        assert out.model == "gemma"
        return out.choices[0].text

    with ThreadPoolExecutor(3) as pool:  # concurrent requests for an unloaded model
        texts = list(pool.map(complete, range(3)))
    assert all(isinstance(t, str) for t in texts)
    assert 'slotserve:model_loads_total{model_name="gemma"} 1.0' in get(multi, "/metrics").text
    assert cards(multi)["gemma"]["state"] == "ready"
    with pytest.raises(openai.BadRequestError, match="chat template"):  # a base model
        api.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def test_unload_lets_a_stream_finish_and_gives_memory_back(
    multi: ServerProcess, model_path: Path
) -> None:
    load_smol(multi, "smol-unload", model_path, runner="torch", slots=1)
    engine_pid = get(multi, "/v1/slots?model=smol-unload").json()["engine_pid"]
    assert engine_pid is not None
    before = rss_bytes(multi.process.pid)
    assert before is not None
    stream = client(multi).completions.create(
        model="smol-unload",
        prompt="Once upon a time",
        max_tokens=48,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},  # the stream must run to its length, not stop early
    )
    chunks = iter(stream)
    first = next(chunks)  # the request is in flight
    result: dict[str, Any] = {}
    unloading = threading.Thread(
        target=lambda: result.update(
            response=post(multi, "/models/unload", {"model": "smol-unload"})
        )
    )
    unloading.start()
    assert wait_until(lambda: cards(multi).get("smol-unload", {}).get("state") == "unloading")
    refused = httpx.post(
        f"{multi.api_url}/completions",
        json={"model": "smol-unload", "prompt": "hi", "max_tokens": 2},
        headers=AUTH,
        timeout=30,
    )
    assert refused.status_code == 503  # no new work while unloading
    rest = list(chunks)
    unloading.join(timeout=120)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    finish = [c.choices[0].finish_reason for c in rest if c.choices][-1]
    assert finish == "length" and text  # the stream in progress finished intact
    response = result["response"]
    assert response.status_code == 200 and response.json()["requests_cut_off"] == 0
    assert "smol-unload" not in cards(multi)
    assert not Path(f"/proc/{engine_pid}").exists()  # the engine process is gone
    after = rss_bytes(multi.process.pid)
    assert after is not None and after < before - 100 * 2**20


def test_force_unload_ends_streams_with_a_clear_error(
    multi: ServerProcess, model_path: Path
) -> None:
    load_smol(multi, "smol-force", model_path, slots=1)
    with httpx.stream(
        "POST",
        f"{multi.api_url}/completions",
        json={"model": "smol-force", "prompt": "Count: 1, 2,", "max_tokens": 1000, "stream": True},
        headers=AUTH,
        timeout=120,
    ) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        unload = post(multi, "/models/unload", {"model": "smol-force", "force": True})
        assert unload.status_code == 200 and unload.json()["requests_cut_off"] == 1
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "smol-force was unloaded" in error["message"] and "force" in error["message"]
    # The other models go on serving.
    out = client(multi).completions.create(model="smol-cpp", prompt="Hi", max_tokens=3)
    assert out.choices[0].text is not None


def test_one_models_failure_leaves_the_others_serving(
    multi: ServerProcess, model_path: Path
) -> None:
    # A per-model option: this one stays unhealthy until reloaded instead of restarting.
    load_smol(multi, "smol-fragile", model_path, slots=1, engine_restart="never")
    engine_pid = get(multi, "/v1/slots?model=smol-fragile").json()["engine_pid"]
    os.kill(engine_pid, signal.SIGKILL)  # the model's engine process dies
    assert wait_until(lambda: cards(multi)["smol-fragile"]["state"] == "unhealthy")
    with pytest.raises(openai.InternalServerError):  # 503 for that model only
        client(multi).completions.create(model="smol-fragile", prompt="Hi", max_tokens=2)
    assert client(multi).completions.create(model="smol-cpp", prompt="Hi", max_tokens=2)
    health = httpx.get(f"{multi.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert health.json()["models"]["smol-fragile"] == "unhealthy"
    reload = post(multi, "/admin/reload?model=smol-fragile", {})
    assert reload.status_code == 200 and reload.json()["model"] == "smol-fragile"
    out = client(multi).completions.create(model="smol-fragile", prompt="Hi", max_tokens=2)
    assert out.model == "smol-fragile"
    assert post(multi, "/models/unload", {"model": "smol-fragile"}).status_code == 200


def test_models_max_unloads_the_least_recently_used_and_keep_alive(
    tmp_path: Path, model_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "third.gguf").symlink_to(model_path)
    proc = start_server(
        tmp_path,
        "--model",
        f"{model_path}=first",
        "--model",
        f"{model_path}=second",
        "--models-dir",
        str(models),
        "--models-max",
        "2",
        "--slots",
        "1",
    )

    def states() -> dict[str, str]:
        listed = httpx.get(f"{proc.api_url}/models", timeout=30).json()["data"]
        return {m["id"]: m["state"] for m in listed}

    try:
        api = openai.OpenAI(base_url=proc.api_url, api_key="none", max_retries=0)
        api.completions.create(model="second", prompt="a", max_tokens=1)
        api.completions.create(model="first", prompt="a", max_tokens=1)  # second is now LRU
        # Loading a third model (on first use, from the models dir) unloads the LRU one.
        api.completions.create(
            model="third", prompt="a", max_tokens=1, extra_body={"keep_alive": "5m"}
        )
        assert states() == {"first": "ready", "third": "ready"}
        assert httpx.get(f"{proc.api_url}/models/third").json()["keep_alive"] == 300.0
        with pytest.raises(openai.BadRequestError, match="keep_alive"):
            api.completions.create(
                model="third", prompt="a", max_tokens=1, extra_body={"keep_alive": "soon"}
            )
        # A start-up model cannot be loaded again on demand: a client's keep_alive leaves it.
        api.completions.create(
            model="first", prompt="a", max_tokens=1, extra_body={"keep_alive": 0}
        )
        assert "keep_alive" not in httpx.get(f"{proc.api_url}/models/first").json()
        # Ollama's keep_alive 0: the model is unloaded once the request is done.
        api.completions.create(
            model="third", prompt="a", max_tokens=1, extra_body={"keep_alive": 0}
        )
        assert wait_until(lambda: states().get("third") == "unloaded", timeout=30)
        assert states()["first"] == "ready"
    finally:
        stop_server(proc)
