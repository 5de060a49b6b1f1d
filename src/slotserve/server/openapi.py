"""The OpenAPI document served at ``/openapi.json``: FastAPI's, with what clients and fuzzers
(schemathesis) read beyond the shapes. Validation errors are 400s in OpenAI's shape, so
FastAPI's 422 is dropped; each body-taking route shows an example request (the examples
phase sends it); and links say where an id a response gives is used next (the stateful phase
follows them): a model id from the model list, a response id from ``/v1/responses``, token
ids from ``/tokenize``. ``/models/unload`` and ``/admin/reload`` are left unlinked on purpose:
a chain that unloads or reloads the model would end the requests of every other chain."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_HI = [{"role": "user", "content": "Say hi."}]

# (method, path) → an example body (the model left out: the server's default model serves it).
EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/chat/completions"): {"messages": _HI, "max_tokens": 8},
    ("post", "/v1/completions"): {"prompt": "The capital of France is", "max_tokens": 8},
    ("post", "/v1/embeddings"): {"input": "The sea is calm today."},
    ("post", "/v1/responses"): {"input": "Say hi.", "max_output_tokens": 8},
    ("post", "/v1/messages"): {"messages": _HI, "max_tokens": 8},
    ("post", "/v1/messages/count_tokens"): {"messages": _HI},
    ("post", "/tokenize"): {"prompt": "Hello there"},
    ("post", "/detokenize"): {"tokens": [1, 2, 3]},
}

MODEL_ID = "$response.body#/data/0/id"  # the first model of a model list


@dataclass(frozen=True)
class Link:
    """An OpenAPI link from ``source``'s 200 to ``target``: ``parameters`` as
    ``location.name`` → runtime expression, ``body``: fields merged into the target's body."""

    name: str
    source: tuple[str, str]
    target: tuple[str, str]
    parameters: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None


def _model_links(source: tuple[str, str]) -> list[Link]:
    """The routes that take the model a model list names."""
    body_routes = {
        "Chat": "/v1/chat/completions",
        "Complete": "/v1/completions",
        "Message": "/v1/messages",
        "Respond": "/v1/responses",
        "Embed": "/v1/embeddings",
        "Tokenize": "/tokenize",
    }
    query_routes = {
        "Slots": "/v1/slots",
        "PrefixCache": "/v1/prefix_cache_stats",
        "Ready": "/ready",
    }
    return [
        Link("GetModel", source, ("get", "/v1/models/{model_id}"), {"path.model_id": MODEL_ID}),
        *(Link(n, source, ("post", p), body={"model": MODEL_ID}) for n, p in body_routes.items()),
        *(Link(n, source, ("get", p), {"query.model": MODEL_ID}) for n, p in query_routes.items()),
    ]


LINKS: list[Link] = [
    *_model_links(("get", "/v1/models")),
    *_model_links(("get", "/models")),
    Link(
        "GetResponse",
        ("post", "/v1/responses"),
        ("get", "/v1/responses/{response_id}"),
        {"path.response_id": "$response.body#/id"},
    ),
    Link(
        "ContinueResponse",
        ("post", "/v1/responses"),
        ("post", "/v1/responses"),
        body={"previous_response_id": "$response.body#/id"},
    ),
    Link(
        "Detokenize",
        ("post", "/tokenize"),
        ("post", "/detokenize"),
        body={"tokens": "$response.body#/tokens"},
    ),
    Link(
        "CompleteTokens",
        ("post", "/tokenize"),
        ("post", "/v1/completions"),
        body={"prompt": "$response.body#/tokens"},
    ),
]


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document for ``app``, with the examples and links above."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    paths: dict[str, dict[str, Any]] = schema.get("paths", {})
    for operations in paths.values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for (method, path), example in EXAMPLES.items():
        content = paths[path][method]["requestBody"]["content"]["application/json"]
        content["examples"] = {"default": {"value": example}}
    for link in LINKS:
        target = paths[link.target[1]][link.target[0]]
        definition: dict[str, Any] = {"operationId": target["operationId"]}
        if link.parameters:
            definition["parameters"] = link.parameters
        if link.body is not None:
            definition["requestBody"] = link.body
        responses = paths[link.source[1]][link.source[0]]["responses"]
        responses["200"].setdefault("links", {})[link.name] = definition
    return schema
