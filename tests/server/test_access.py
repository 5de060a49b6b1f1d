"""Who may call what, through the real app (its middleware and routes) with an empty model
registry: a request the rules let through reaches its route, which answers 404 for the unknown
model. Admin routes without a key answer callers on this machine only (a loopback peer, no
forwarding header, a loopback Host, no other page's Origin); on a loopback bind every route
answers loopback Host names only; a browser Origin other than the server's own needs
``--allowed-origins``; every route but the probes' is behind the API key, and a walk of
``/openapi.json`` checks that no route is missing from the guard table."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from slotserve.hosting.registry import ModelRegistry
from slotserve.server.access import AccessPolicy, is_loopback, listed
from slotserve.server.app import create_app
from slotserve.server.metrics import ServerMetrics
from slotserve.server.route_guards import ROUTE_GUARDS, Guard, guard_of
from slotserve.server.serving import CorsRules, ServingContext
from tests.conftest import local_client

API_KEY, ADMIN_KEY = "sk-api-1111", "sk-admin-2222"
UNLOAD = ("/models/unload", {"model": "nothing-here"})
OWN = "http://127.0.0.1:8000"
PAGE = "http://127.0.0.1:9999"  # another local port: another origin


def _client(policy: AccessPolicy, cors: CorsRules | None = None, **kwargs: Any) -> TestClient:
    metrics = ServerMetrics()
    registry = ModelRegistry(None, on_outputs=metrics.observe)
    ctx = ServingContext(registry, metrics, access=policy, cors=cors)
    return local_client(create_app(ctx), **kwargs)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _unload(http: TestClient, **headers: str) -> int:
    return http.post(UNLOAD[0], json=UNLOAD[1], headers=headers).status_code


@pytest.mark.parametrize(
    ("policy", "rule"),
    [
        (AccessPolicy("127.0.0.1"), "local"),
        (AccessPolicy("0.0.0.0"), "local"),
        (AccessPolicy("0.0.0.0", admin_routes="open"), "open"),
        (AccessPolicy("0.0.0.0", API_KEY), "api key"),
        (AccessPolicy("0.0.0.0", API_KEY, ADMIN_KEY), "admin key"),
        (AccessPolicy("127.0.0.1", None, ADMIN_KEY, "open"), "admin key"),
        (AccessPolicy("127.0.0.1", API_KEY, ADMIN_KEY, "off"), "off"),
    ],
)
def test_the_admin_rule_follows_the_keys_not_the_bind(policy: AccessPolicy, rule: str) -> None:
    assert policy.admin_rule == rule


def test_a_local_caller_reaches_the_admin_routes_without_a_key() -> None:
    http = _client(AccessPolicy())
    assert _unload(http) == 404
    assert _unload(http, origin=OWN) == 404  # the server's own page (/docs)
    assert http.post("/flush_cache").status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": PAGE},  # a web page the local user opened
        {"origin": "null"},  # a sandboxed frame or a file:// page
        {"sec-fetch-site": "cross-site"},
        {"x-forwarded-for": "203.0.113.9"},  # a local reverse proxy relaying a caller
        {"forwarded": "for=203.0.113.9"},
        {"x-real-ip": "203.0.113.9"},
        {"x-forwarded-host": "models.example"},
        {"via": "1.1 proxy"},
    ],
)
def test_a_page_or_a_proxy_on_this_machine_is_refused_the_admin_routes(
    headers: dict[str, str],
) -> None:
    http = _client(AccessPolicy(allowed_origins=(PAGE,)))
    for path in ("/admin/reload", "/flush_cache", "/v1/load_lora_adapter"):
        refused = http.post(path, json={"lora_name": "x", "lora_path": "/x"}, headers=headers)
        assert refused.status_code == 403, (path, headers)
        error = refused.json()["error"]
        # A page's origin, where the Origin rule does not refuse it first, meets the admin rule.
        if error["code"] != "origin_not_allowed":
            assert error["code"] == "admin_routes_refused" and "--admin-api-key" in error["message"]
    assert _unload(http) == 404  # the same route, asked locally


def test_a_foreign_host_is_refused_everything_on_a_loopback_bind() -> None:
    http = _client(AccessPolicy())
    for path in ("/v1/models", "/health", "/metrics"):
        refused = http.get(path, headers={"host": "rebound.example:8000"})
        assert refused.status_code == 403, path
        assert "--allowed-hosts" in refused.json()["error"]["message"]
    assert _unload(http, host="rebound.example:8000") == 403
    for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "app.localhost"):
        assert http.get("/v1/models", headers={"host": host}).status_code == 200, host


def test_allowed_hosts_are_answered_but_stay_remote_for_the_admin_routes() -> None:
    http = _client(AccessPolicy(allowed_hosts=("models.lan",)))
    assert http.get("/v1/models", headers={"host": "models.lan:8000"}).status_code == 200
    assert http.get("/v1/models", headers={"host": "other.lan"}).status_code == 403
    assert _unload(http, host="models.lan:8000") == 403
    public = _client(AccessPolicy("0.0.0.0"))  # no Host rule on a public bind by default
    assert public.get("/v1/models", headers={"host": "models.lan"}).status_code == 200
    assert _unload(public, host="models.lan") == 403


def test_a_remote_caller_is_refused_the_admin_routes_on_a_public_bind() -> None:
    http = _client(AccessPolicy("0.0.0.0"), client=("203.0.113.9", 4000))
    assert _unload(http) == 403
    assert http.get("/v1/models").status_code == 200
    opened = _client(AccessPolicy("0.0.0.0", admin_routes="open"), client=("203.0.113.9", 4000))
    assert _unload(opened) == 404


def test_browser_origins_need_allowed_origins_and_get_cors_headers() -> None:
    closed = _client(AccessPolicy())
    refused = closed.get("/v1/models", headers={"origin": PAGE})
    assert refused.status_code == 403 and "--allowed-origins" in refused.text
    chat = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    assert (
        closed.post("/v1/chat/completions", json=chat, headers={"origin": PAGE}).status_code == 403
    )
    assert closed.get("/v1/models", headers={"origin": OWN}).status_code == 200

    opened = _client(AccessPolicy(allowed_origins=(PAGE,)), CorsRules())
    answer = opened.get("/v1/models", headers={"origin": PAGE})
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == PAGE
    preflight = {"origin": PAGE, "access-control-request-method": "POST"}
    assert opened.options("/v1/chat/completions", headers=preflight).status_code == 200
    other = {**preflight, "origin": "http://evil.example"}
    assert opened.options("/v1/chat/completions", headers=other).status_code in (400, 403)
    assert opened.get("/v1/models", headers={"origin": "http://evil.example"}).status_code == 403


def test_the_admin_key_decides_where_one_is_set() -> None:
    http = _client(AccessPolicy("0.0.0.0", API_KEY, ADMIN_KEY), client=("203.0.113.9", 4000))
    assert _unload(http) == 401
    with_api_key = http.post(UNLOAD[0], json=UNLOAD[1], headers=_bearer(API_KEY))
    assert with_api_key.status_code == 401
    assert "admin API key" in with_api_key.json()["error"]["message"]
    assert API_KEY not in with_api_key.text
    assert _unload(http, **{"x-api-key": ADMIN_KEY}) == 404
    assert _unload(http, **{"x-api-key": ADMIN_KEY, "x-forwarded-for": "198.51.100.1"}) == 404
    assert http.get("/v1/models", headers=_bearer(API_KEY)).status_code == 200
    assert http.get("/v1/models", headers=_bearer(ADMIN_KEY)).status_code == 401


def test_the_api_key_guards_every_state_changing_route_without_an_admin_key() -> None:
    http = _client(AccessPolicy("0.0.0.0", API_KEY))
    assert http.post("/flush_cache").status_code == 401
    assert http.post("/flush_cache", headers=_bearer(API_KEY)).status_code == 200
    assert _unload(http) == 401
    assert http.post(UNLOAD[0], json=UNLOAD[1], headers=_bearer(API_KEY)).status_code == 404


def test_off_refuses_the_admin_routes_whatever_the_keys() -> None:
    http = _client(AccessPolicy("127.0.0.1", API_KEY, ADMIN_KEY, "off"))
    for key in (API_KEY, ADMIN_KEY):
        refused = http.post(UNLOAD[0], json=UNLOAD[1], headers=_bearer(key))
        assert refused.status_code == 403 and "--admin-routes off" in refused.text


def _concrete(path: str) -> str:
    return path.replace("{model_id}", "org/model").replace("{response_id}", "resp_1")


def test_every_route_has_a_guard_and_the_api_key_applies_it() -> None:
    http = _client(AccessPolicy("0.0.0.0", API_KEY))
    paths = http.get("/openapi.json").json()["paths"]
    missing = sorted(set(paths) - set(ROUTE_GUARDS))
    assert not missing, f"routes without a row in route_guards.ROUTE_GUARDS: {missing}"
    for path, methods in paths.items():
        for method in methods:
            status = http.request(method, _concrete(path), json={}).status_code
            if ROUTE_GUARDS[path] is Guard.PUBLIC:
                assert status != 401, (method, path)
            else:
                assert status == 401, (method, path)
    assert guard_of("/v1/a-route-nobody-declared") is Guard.API
    assert guard_of("/admin/new-thing") is Guard.ADMIN


def test_lists_read_as_vllm_writes_them() -> None:
    assert listed(['["http://a:1", "http://b:2"]', "http://c:3,http://d:4"]) == (
        "http://a:1",
        "http://b:2",
        "http://c:3",
        "http://d:4",
    )
    with pytest.raises(ValueError, match="JSON list"):
        listed(["[1, 2]"])
    with pytest.raises(ValueError, match="not an origin"):
        AccessPolicy(allowed_origins=("localhost:3000",))


def test_loopback_is_recognised_by_name_and_address() -> None:
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert is_loopback("localhost") and is_loopback("LOCALHOST.") and is_loopback("a.localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("::")
    assert not is_loopback("localhost.example")
