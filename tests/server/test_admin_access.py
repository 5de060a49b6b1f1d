"""The admin routes are safe by default: without a key they are open only on a loopback bind;
an admin key sets them apart from the API key; ``--admin-routes`` opens or closes them outright.
Through the real app (its middleware and routes) with an empty model registry: a request the
guard lets through reaches the route, which answers 404 for the unknown model."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from slotserve.hosting.registry import ModelRegistry
from slotserve.server.admin_access import admin_access, is_loopback
from slotserve.server.app import create_app
from slotserve.server.metrics import ServerMetrics
from slotserve.server.serving import ServingContext

API_KEY, ADMIN_KEY = "sk-api-1111", "sk-admin-2222"
UNLOAD = ("/models/unload", {"model": "nothing-here"})


def _client(host: str, api_key: str | None, admin_key: str | None, routes: str) -> TestClient:
    metrics = ServerMetrics()
    registry = ModelRegistry(None, on_outputs=metrics.observe)
    ctx = ServingContext(
        registry, metrics, api_key=api_key, admin=admin_access(host, api_key, admin_key, routes)
    )
    return TestClient(create_app(ctx), raise_server_exceptions=False)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("host", "api_key", "admin_key", "routes", "rule"),
    [
        ("127.0.0.1", None, None, "auto", "open"),
        ("::1", None, None, "auto", "open"),
        ("localhost", None, None, "auto", "open"),
        ("0.0.0.0", None, None, "auto", "refused"),
        ("my-host.example", None, None, "auto", "refused"),
        ("0.0.0.0", None, None, "open", "open"),
        ("0.0.0.0", API_KEY, None, "auto", "api key"),
        ("0.0.0.0", API_KEY, ADMIN_KEY, "auto", "admin key"),
        ("127.0.0.1", None, ADMIN_KEY, "open", "admin key"),
        ("127.0.0.1", API_KEY, ADMIN_KEY, "off", "off"),
    ],
)
def test_the_rule_follows_the_keys_and_the_bind(
    host: str, api_key: str | None, admin_key: str | None, routes: str, rule: str
) -> None:
    assert admin_access(host, api_key, admin_key, routes).rule == rule


def test_a_public_bind_without_a_key_refuses_admin_routes_and_serves_the_rest() -> None:
    http = _client("0.0.0.0", None, None, "auto")
    lora = {"lora_name": "x", "lora_path": "/x"}
    for path, body in (
        UNLOAD,
        ("/models/load", {"model": "x", "path": "/x"}),
        ("/v1/load_lora_adapter", lora),
        ("/v1/unload_lora_adapter", {"lora_name": "x"}),
    ):
        refused = http.post(path, json=body)
        assert refused.status_code == 403, path
        message = refused.json()["error"]["message"]
        assert "--admin-api-key" in message and "--admin-routes open" in message
    assert http.post("/admin/reload").status_code == 403
    assert http.post("/flush_cache").status_code == 403
    assert http.get("/v1/models").status_code == 200
    assert http.get("/health").status_code == 200


def test_a_loopback_bind_or_an_explicit_open_lets_them_through() -> None:
    for host, routes in (("127.0.0.1", "auto"), ("0.0.0.0", "open")):
        assert _client(host, None, None, routes).post(UNLOAD[0], json=UNLOAD[1]).status_code == 404


def test_the_admin_key_opens_the_admin_routes_and_the_api_key_does_not() -> None:
    http = _client("0.0.0.0", API_KEY, ADMIN_KEY, "auto")
    assert http.post(UNLOAD[0], json=UNLOAD[1]).status_code == 401
    with_api_key = http.post(UNLOAD[0], json=UNLOAD[1], headers=_bearer(API_KEY))
    assert with_api_key.status_code == 401
    assert "admin API key" in with_api_key.json()["error"]["message"]
    assert API_KEY not in with_api_key.text
    admitted = http.post(UNLOAD[0], json=UNLOAD[1], headers={"x-api-key": ADMIN_KEY})
    assert admitted.status_code == 404
    assert http.get("/v1/models", headers=_bearer(API_KEY)).status_code == 200
    assert http.get("/v1/models", headers=_bearer(ADMIN_KEY)).status_code == 401


def test_the_api_key_guards_admin_routes_when_no_admin_key_is_set() -> None:
    http = _client("0.0.0.0", API_KEY, None, "auto")
    assert http.post(UNLOAD[0], json=UNLOAD[1]).status_code == 401
    assert http.post(UNLOAD[0], json=UNLOAD[1], headers=_bearer(API_KEY)).status_code == 404


def test_off_refuses_them_whatever_the_keys() -> None:
    http = _client("127.0.0.1", API_KEY, ADMIN_KEY, "off")
    for key in (API_KEY, ADMIN_KEY):
        refused = http.post(UNLOAD[0], json=UNLOAD[1], headers=_bearer(key))
        assert refused.status_code == 403 and "--admin-routes off" in refused.text


def test_loopback_is_recognised_by_address() -> None:
    assert is_loopback("127.0.0.2") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("::")
