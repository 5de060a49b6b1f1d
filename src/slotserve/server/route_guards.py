"""Who may call each route: the one table of the server's routes and their guards.

``PUBLIC`` routes answer anyone who reaches the port (probes, scrapers, the SGLang gateway's
read-only questions, the API's own documentation). ``API`` routes need ``--api-key`` when one
is set. ``ADMIN`` routes change what the server holds (models, adapters, the cache) and follow
:class:`~slotserve.server.access.AccessPolicy`'s admin rule. A path no row names is guarded as
``API``: a route added without a row is closed, never open, and a test walks ``/openapi.json``
against this table.
"""

from __future__ import annotations

import enum
import re


class Guard(enum.Enum):
    PUBLIC = "public"
    API = "api key"
    ADMIN = "admin"


ROUTE_GUARDS: dict[str, Guard] = {
    # Probes and scrapers.
    "/health": Guard.PUBLIC,
    "/ready": Guard.PUBLIC,
    "/metrics": Guard.PUBLIC,
    # What the SGLang Model Gateway asks of a worker (read-only).
    "/server_info": Guard.PUBLIC,
    "/get_server_info": Guard.PUBLIC,
    "/model_info": Guard.PUBLIC,
    "/get_model_info": Guard.PUBLIC,
    "/get_load": Guard.PUBLIC,
    # FastAPI's own pages: the schema of the routes, nothing served through them.
    "/openapi.json": Guard.PUBLIC,
    "/docs": Guard.PUBLIC,
    "/docs/oauth2-redirect": Guard.PUBLIC,
    "/redoc": Guard.PUBLIC,
    # Generation and the model's questions.
    "/v1/chat/completions": Guard.API,
    "/v1/completions": Guard.API,
    "/v1/embeddings": Guard.API,
    "/v1/rerank": Guard.API,
    "/v2/rerank": Guard.API,
    "/rerank": Guard.API,
    "/v1/score": Guard.API,
    "/score": Guard.API,
    "/v1/responses": Guard.API,
    "/v1/responses/{response_id}": Guard.API,
    "/v1/messages": Guard.API,
    "/v1/messages/count_tokens": Guard.API,
    "/tokenize": Guard.API,
    "/detokenize": Guard.API,
    "/v1/models": Guard.API,
    "/v1/models/{model_id}": Guard.API,
    "/models": Guard.API,
    "/v1/slots": Guard.API,
    "/v1/prefix_cache_stats": Guard.API,
    # What changes the server's state.
    "/admin/reload": Guard.ADMIN,
    "/models/load": Guard.ADMIN,
    "/models/unload": Guard.ADMIN,
    "/flush_cache": Guard.ADMIN,
    "/v1/load_lora_adapter": Guard.ADMIN,
    "/v1/unload_lora_adapter": Guard.ADMIN,
}

# A templated row's parameter matches the rest of the path (``/v1/models/{model_id}`` serves
# ids with slashes, ``org/model``).
_TEMPLATED = [
    (re.compile("^" + re.sub(r"\\\{\w+\\\}", ".+", re.escape(path)) + "$"), guard)
    for path, guard in ROUTE_GUARDS.items()
    if "{" in path
]


def guard_of(path: str) -> Guard:
    """The guard of the route ``path`` reaches (``API`` for a path no row names)."""
    guard = ROUTE_GUARDS.get(path)
    if guard is not None:
        return guard
    if path.startswith("/admin/"):
        return Guard.ADMIN
    for pattern, templated in _TEMPLATED:
        if pattern.match(path):
            return templated
    return Guard.API


def admin_paths() -> list[str]:
    """The admin routes, for the start-up log and the docs."""
    return [path for path, guard in ROUTE_GUARDS.items() if guard is Guard.ADMIN]
