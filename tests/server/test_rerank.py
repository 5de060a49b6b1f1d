"""POST /v1/rerank and /v1/score with raw HTTP against a spawned server: a random-weight BERT
cross-encoder (``tests/runner/cross_encoder_folder.py``) on the PyTorch runner, its scores
against sentence-transformers' ``CrossEncoder``; and the embedded generative model, refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess, start_server, stop_server
from tests.runner.cross_encoder_folder import write_cross_encoder

QUERY = "what is a cat"
DOCUMENTS = [
    "a cat is a small domesticated carnivorous mammal",
    "the stock market fell sharply on monday",
    "cats purr when they are content",
    "paris is the capital of france",
    "q",
]
# float32 on both sides; the attention kernels and the reference's padding differ (see
# tests/runner/test_cross_encoder.py), and JSON carries the float exactly.
ATOL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


@pytest.fixture(scope="module")
def reranker_server(
    tmp_path_factory: pytest.TempPathFactory, folder: Path
) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("reranker-server"), str(folder), "--runner", "torch", "--slots", "4"
    )
    yield proc
    stop_server(proc)


def expected(folder: Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return np.asarray(CrossEncoder(str(folder), device="cpu").predict(pairs))


def post(server: ServerProcess, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_rerank_sorts_documents_by_the_cross_encoders_score(
    reranker_server: ServerProcess, folder: Path
) -> None:
    reference = expected(folder, [(QUERY, d) for d in DOCUMENTS])
    reply = post(reranker_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"] and body["model"] == folder.name
    assert body["usage"]["total_tokens"] > len(DOCUMENTS)
    results = body["results"]
    assert [r["index"] for r in results] == list(np.argsort(-reference, kind="stable"))
    for result in results:
        assert abs(result["relevance_score"] - reference[result["index"]]) < ATOL
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_top_n_and_return_documents_and_the_aliases(
    reranker_server: ServerProcess, path: str
) -> None:
    full = post(reranker_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
    reply = post(reranker_server, path, body)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert results == [
        {"index": r["index"], "relevance_score": r["relevance_score"]} for r in full["results"][:2]
    ]


def test_score_one_against_many_and_pairwise(reranker_server: ServerProcess, folder: Path) -> None:
    one_to_many = post(reranker_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert one_to_many.status_code == 200, one_to_many.text
    body = one_to_many.json()
    assert body["object"] == "list" and body["model"] == folder.name
    assert isinstance(body["created"], int) and body["usage"]["total_tokens"] > 0
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert all(d["object"] == "score" for d in body["data"])
    got = np.array([d["score"] for d in body["data"]])
    np.testing.assert_allclose(got, expected(folder, [(QUERY, d) for d in DOCUMENTS]), atol=ATOL)

    firsts = ["what is a cat", "where is paris", "hello"]
    seconds = DOCUMENTS[:3]
    pairwise = post(reranker_server, "/score", {"text_1": firsts, "text_2": seconds})
    assert pairwise.status_code == 200, pairwise.text
    got = np.array([d["score"] for d in pairwise.json()["data"]])
    reference = expected(folder, list(zip(firsts, seconds, strict=True)))
    np.testing.assert_allclose(got, reference, atol=ATOL)

    one = post(reranker_server, "/v1/score", {"text_1": [QUERY], "text_2": DOCUMENTS[0]})
    assert one.status_code == 200, one.text
    assert len(one.json()["data"]) == 1


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, None),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "rank_fields": ["x"]}, None),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1"),
        ("/v1/embeddings", {"input": "a"}, "model"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 2}, None),
    ],
)
def test_bad_requests_get_a_400_in_openai_shape(
    reranker_server: ServerProcess, path: str, body: dict[str, object], param: str | None
) -> None:
    reply = post(reranker_server, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_models_list_rerank_and_score(reranker_server: ServerProcess) -> None:
    (card,) = httpx.get(f"{reranker_server.api_url}/models").json()["data"]
    assert card["capabilities"] == ["rerank", "score"]


def test_a_generative_model_is_refused_naming_what_it_is(server: ServerProcess) -> None:
    requests: list[tuple[str, dict[str, object]]] = [
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    ]
    for path, body in requests:
        reply = post(server, path, body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "model" and "not a cross-encoder" in error["message"]
        assert "generation" in error["message"]
