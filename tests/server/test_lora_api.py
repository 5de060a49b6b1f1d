"""LoRA adapters through the server (SPEC S11), with the real clients: an adapter given at
start (``--lora-modules``) or loaded at run time is a model of its own in ``/v1/models`` and
in every API; bad adapters are refused in the API's shape while the server keeps serving; an
unloaded adapter is gone; the llama.cpp runner serves GGUF adapters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from slotserve.bench.hf_reference import convert_gguf_to_hf
from slotserve.bench.lora_adapters import random_adapter, random_gguf_adapter
from tests.conftest import ServerProcess, start_server, stop_server

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def folders(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-api")
    base = convert_gguf_to_hf(model_path, root / "base")
    return {
        "base": base,
        "first": random_adapter(base, root / "first", seed=11),
        "second": random_adapter(base, root / "second", seed=12, rank=4),
    }


@pytest.fixture(scope="module")
def lora_server(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("lora-server"),
        str(folders["base"]),
        "--served-model-name", "base",
        "--runner", "torch",
        "--slots", "4",
        "--max-model-len", "512",
        "--lora-modules", f"first={folders['first']}",
    )  # fmt: skip
    yield proc
    stop_server(proc)


def _complete(client: openai.OpenAI, model: str) -> tuple[str, list[float]]:
    """Greedy text and its tokens' log-probabilities: an adapter may leave the text as the
    base model's, never its log-probabilities."""
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    return choice.text, [float(value or 0.0) for value in choice.logprobs.token_logprobs]


def test_a_start_up_adapter_is_listed_and_served_in_every_api(lora_server: ServerProcess) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{lora_server.api_url}/models").json()["data"]}
    assert cards["first"]["parent"] == "base" and cards["first"]["lora_rank"] == 8
    client = openai.OpenAI(base_url=lora_server.api_url, api_key="none")
    assert _complete(client, "first") != _complete(client, "base")
    assert _complete(client, "first") == _complete(client, "first")
    chat = client.chat.completions.create(
        model="first", messages=[{"role": "user", "content": PROMPT}], max_tokens=8
    )
    assert chat.choices[0].message.content and chat.model == "first"
    messages = anthropic.Anthropic(base_url=lora_server.base_url, api_key="none")
    reply = messages.messages.create(
        model="first", max_tokens=8, messages=[{"role": "user", "content": PROMPT}]
    )
    assert reply.content and reply.model == "first"


def test_adapters_load_and_unload_at_run_time(
    lora_server: ServerProcess, folders: dict[str, Path]
) -> None:
    client = openai.OpenAI(base_url=lora_server.api_url, api_key="none")
    load = {"lora_name": "second", "lora_path": str(folders["second"])}
    answer = httpx.post(f"{lora_server.api_url}/load_lora_adapter", json=load, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"]["parent"] == "base"
    models = [m.id for m in client.models.list().data]
    assert "second" in models
    assert _complete(client, "second") != _complete(client, "first")
    again = httpx.post(f"{lora_server.api_url}/load_lora_adapter", json=load, timeout=60)
    assert again.status_code == 400 and "taken" in again.json()["error"]["message"]
    unload = {"lora_name": "second"}
    assert httpx.post(f"{lora_server.api_url}/unload_lora_adapter", json=unload).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "second")
    gone = httpx.post(f"{lora_server.api_url}/unload_lora_adapter", json=unload)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("adapter", "message"),
    [("missing", "not a folder"), ("base", "no adapter_config.json")],
)
def test_a_bad_adapter_is_a_400_and_the_server_keeps_serving(
    lora_server: ServerProcess, folders: dict[str, Path], adapter: str, message: str
) -> None:
    path = folders.get(adapter, folders["base"] / adapter)
    body = {"lora_name": "bad", "lora_path": str(path)}
    answer = httpx.post(f"{lora_server.api_url}/load_lora_adapter", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]["message"]
    client = openai.OpenAI(base_url=lora_server.api_url, api_key="none")
    assert _complete(client, "first")
    with pytest.raises(openai.NotFoundError):
        _complete(client, "bad")


@pytest.fixture(scope="module")
def llama_cpp_server(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("llama-cpp"), "--runner", "llama.cpp", "--slots", "2"
    )
    yield proc
    stop_server(proc)


def test_the_llama_cpp_runner_serves_gguf_adapters(
    llama_cpp_server: ServerProcess, folders: dict[str, Path], model_path: Path, tmp_path: Path
) -> None:
    """A PEFT folder is refused naming what it takes, a GGUF adapter serves, and is unloaded
    again."""
    server = llama_cpp_server
    client = openai.OpenAI(base_url=server.api_url, api_key="none")
    (base,) = [m.id for m in client.models.list().data]
    load = f"{server.api_url}/load_lora_adapter"
    body = {"lora_name": "peft", "lora_path": str(folders["first"])}
    answer = httpx.post(load, json=body, timeout=60)
    assert answer.status_code == 400
    assert "not a .gguf file" in answer.json()["error"]["message"]
    adapter = random_gguf_adapter(model_path, tmp_path / "adapter.gguf", seed=7)
    answer = httpx.post(load, json={"lora_name": "gguf", "lora_path": str(adapter)}, timeout=60)
    assert answer.status_code == 200, answer.text
    try:
        assert answer.json()["model"]["parent"] == base
        assert _complete(client, "gguf") != _complete(client, base)
        assert _complete(client, "gguf") == _complete(client, "gguf")
    finally:
        unload = {"lora_name": "gguf"}
        assert httpx.post(f"{server.api_url}/unload_lora_adapter", json=unload).status_code == 200


@pytest.mark.parametrize("path", ["a\u0000b", "~no-such-user/adapter", "x" * 5000])
def test_a_path_the_system_refuses_is_a_400_naming_it(server: ServerProcess, path: str) -> None:
    """What the fuzzer sent: a path with a NUL byte, an unknown ~user, a name too long."""
    body = {"lora_name": "bad", "lora_path": path}
    answer = httpx.post(f"{server.api_url}/load_lora_adapter", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "lora_path"
