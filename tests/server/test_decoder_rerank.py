"""A decoder reranker through the server, as vLLM users serve Qwen3-Reranker: a random-weight
Qwen3 causal LM with ``--classifier-from-token no yes`` and Qwen3-Reranker's prompt as the
chat template (the ``query`` and ``document`` roles). /v1/rerank and /v1/score equal
transformers' own recipe on the prompt transformers renders from that template; generation
routes refuse the model, naming the routes it serves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from slotserve.bench.hf_reference import convert_gguf_to_hf
from tests.conftest import ServerProcess, start_server, stop_server
from tests.prompts import QWEN3_RERANKER
from tests.runner.hf_checkpoint import tiny_random_checkpoint

QUERY = "what is a cat"
DOCUMENTS = [
    "a cat is a small domesticated carnivorous mammal",
    "the stock market fell sharply on monday",
    "cats purr when they are content",
    "d",
]


@pytest.fixture(scope="module")
def folder(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decoder-reranker")
    tokenizer = convert_gguf_to_hf(model_path, root / "smollm2")
    return tiny_random_checkpoint("qwen3", tokenizer, root / "reranker")


@pytest.fixture(scope="module")
def reranker_server(
    tmp_path_factory: pytest.TempPathFactory, folder: Path
) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("decoder-reranker-server")
    template = root / "qwen3_reranker.jinja"
    template.write_text(QWEN3_RERANKER)
    proc = start_server(
        root,
        str(folder),
        "--served-model-name", "reranker",
        "--runner", "torch",
        "--dtype", "float32",
        "--slots", "4",
        "--max-model-len", "512",
        "--classifier-from-token", "no", "yes",
        "--chat-template", str(template),
    )  # fmt: skip
    yield proc
    stop_server(proc)


def expected(folder: Path, documents: list[str]) -> np.ndarray:
    """Qwen3-Reranker's recipe: the prompt rendered by transformers from the template, the
    softmax of the "no" and "yes" logits at its last position."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    no, yes = (tokenizer.convert_tokens_to_ids(token) for token in ("no", "yes"))
    scores = []
    for document in documents:
        messages = [{"role": "query", "content": QUERY}, {"role": "document", "content": document}]
        text = tokenizer.apply_chat_template(messages, chat_template=QWEN3_RERANKER, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0, -1, [no, yes]].double()
        scores.append(float(torch.softmax(logits, 0)[1]))
    return np.asarray(scores)


def test_rerank_and_score_follow_the_yes_and_no_logits(
    reranker_server: ServerProcess, folder: Path
) -> None:
    reference = expected(folder, DOCUMENTS)
    assert np.ptp(reference) > 0.01
    url = reranker_server.base_url
    body = {"model": "reranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 3}
    reply = httpx.post(f"{url}/v1/rerank", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-reference)[:3])
    got = [r["relevance_score"] for r in results]
    np.testing.assert_allclose(got, np.sort(reference)[::-1][:3], rtol=0, atol=2e-5)
    body = {"model": "reranker", "text_1": QUERY, "text_2": DOCUMENTS}
    reply = httpx.post(f"{url}/v1/score", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    scores = [item["score"] for item in reply.json()["data"]]
    np.testing.assert_allclose(scores, reference, rtol=0, atol=2e-5)


def test_generation_is_refused_naming_the_routes_served(reranker_server: ServerProcess) -> None:
    url = reranker_server.api_url
    card = httpx.get(f"{url}/models").json()["data"][0]
    assert card["id"] == "reranker"
    messages = [{"role": "user", "content": "hello"}]
    body = {"model": "reranker", "messages": messages, "max_tokens": 4}
    reply = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert "/v1/rerank and /v1/score" in reply.json()["error"]["message"]
    reply = httpx.post(f"{url}/embeddings", json={"model": "reranker", "input": "x"}, timeout=60)
    assert reply.status_code == 400


def test_a_decoder_reranker_without_a_pair_template_is_warned_about(
    reranker_server: ServerProcess, folder: Path, tmp_path: Path
) -> None:
    """Started as above it is silent; with a chat template that drops the query and document
    roles (as Qwen3's own does, the one a Qwen3-Reranker folder carries) it scores the plain
    concatenation of each pair, and the start-up log says so."""
    assert "decoder reranker" not in reranker_server.log_path.read_text()
    qwen3_like = tmp_path / "drops_other_roles.jinja"
    qwen3_like.write_text(
        "{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    )
    bare = start_server(
        tmp_path,
        str(folder),
        "--runner", "torch", "--dtype", "float32", "--slots", "2", "--max-model-len", "256",
        "--classifier-from-token", "no", "yes", "--chat-template", str(qwen3_like),
    )  # fmt: skip
    try:
        log = bare.log_path.read_text()
    finally:
        stop_server(bare)
    assert "is a decoder reranker" in log and "--chat-template" in log
