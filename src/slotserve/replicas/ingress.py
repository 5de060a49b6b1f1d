"""The deployment's one OpenAI URL: a FastAPI ingress that forwards every request to an engine
replica (picked by the handle's router, ``routing.py``) and streams its response back with an
``x-replica-id`` header; ``/metrics``, ``/health`` and ``/v1/replicas`` answer for the whole
deployment.

Failures: a request whose replica dies before the first byte of its response went out is sent
again (Ray's router already retries one that a dead replica never accepted); one whose
response had started ends there, a stream with an OpenAI error event.
"""

# No postponed annotations (``from __future__``): Serve rebuilds the route methods for
# FastAPI, which must see their parameters' types as objects.
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import RayActorError

from slotserve.replicas.replica import ForwardedRequest, ReplicaInfo, ResponseHead
from slotserve.server.access import is_loopback

logger = logging.getLogger(__name__)

ATTEMPTS = 3  # replicas tried for a request whose response has not started
BROADCAST_TIMEOUT_S = 10.0
app = FastAPI(title="slotserve (Ray Serve replicas)")


async def _body(chunks: Any, streaming: bool) -> AsyncIterator[bytes]:
    """The replica's body; a client that goes away cancels the replica's generator, which
    closes its connection to the server: the request's slot is freed there."""
    finished = False
    try:
        async for chunk in chunks:
            yield chunk
        finished = True
    except RayActorError as exc:
        finished = True
        logger.warning("replica died during a response: %s", exc)
        if streaming:
            error = {
                "message": "the engine replica serving this request died; retry it",
                "type": "server_error",
                "param": None,
                "code": "replica_failed",
            }
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
    finally:
        if not finished:
            chunks.cancel()


def caller_headers(request: Request) -> list[tuple[str, str]]:
    """The request's headers for a replica, which sees the ingress as a loopback peer: a caller
    from elsewhere is named in ``X-Forwarded-For``, so the replica's admin rule (callers on
    this machine only, without a key) refuses it as it refuses any proxied caller."""
    headers = list(request.headers.items())
    client = request.client.host if request.client is not None else "unknown"
    if not is_loopback(client):
        headers.append(("x-forwarded-for", client))
    return headers


def prompt_text(body: bytes) -> str:
    """The text a request's prompt starts with, for prefix routing: a chat's message contents
    in order, a completion's prompt, a response's input; "" when there is none."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(payload, dict):
        return ""
    parts: list[str] = []
    for message in payload.get("messages") or []:
        if isinstance(message, dict):
            parts.extend(_texts(message.get("content")))
    parts.extend(_texts(payload.get("prompt")))
    parts.extend(_texts(payload.get("input")))
    return "".join(parts)


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        texts = []
        for item in value:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, dict) and isinstance(item.get("text"), str):
                texts.append(item["text"])
        return texts
    return []


def merge_metrics(answers: list[tuple[str, str]]) -> bytes:
    """One exposition of several replicas' metrics: each family once, every sample with a
    ``replica`` label."""
    families: dict[str, Metric] = {}
    for replica_id, text in sorted(answers):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            for sample in family.samples:
                merged.samples.append(
                    sample._replace(labels={**sample.labels, "replica": replica_id})
                )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _error(status: int, message: str) -> JSONResponse:
    error = {"message": message, "type": "server_error", "param": None, "code": None}
    return JSONResponse({"error": error}, status_code=status)


# Last: serve.ingress copies the class when it is decorated, with the module names it sees then.
@serve.ingress(app)
class Ingress:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stream = engine.options(stream=True)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Every live replica's metrics, each sample labelled with its ``replica``."""
        answers = await self._broadcast("metrics")
        return Response(merge_metrics(answers), media_type="text/plain; version=0.0.4")

    @app.get("/v1/replicas")
    async def replicas(self) -> JSONResponse:
        infos: list[ReplicaInfo] = await self._broadcast("info")
        rows = sorted((vars(info) for info in infos), key=lambda row: row["rank"])
        return JSONResponse({"object": "list", "data": rows})

    @app.get("/health")
    async def health(self) -> JSONResponse:
        infos = await self._broadcast("info")
        status = 200 if infos else 503
        return JSONResponse(
            {"status": "ok" if infos else "no replica", "replicas": len(infos)}, status
        )

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        forwarded = ForwardedRequest(
            request.method,
            "/" + path,
            request.url.query,
            caller_headers(request),
            body,
            prompt_text(body) if request.method == "POST" else "",
        )
        for attempt in range(1, ATTEMPTS + 1):
            # The prefix router reads the first positional argument's prompt; a request
            # without text goes as a keyword argument and is routed by load.
            if forwarded.prompt:
                chunks = self.stream.forward.remote(forwarded)
            else:
                chunks = self.stream.forward.remote(request=forwarded)
            try:
                head: ResponseHead = await chunks.__anext__()
            except RayActorError as exc:
                logger.warning("replica died before answering (attempt %d): %s", attempt, exc)
                continue
            headers = dict(head.headers) | {"x-replica-id": head.replica_id}
            streaming = headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(
                _body(chunks, streaming), status_code=head.status, headers=headers
            )
        return _error(503, "no engine replica could take the request; retry later")

    async def _broadcast(self, method: str) -> list[Any]:
        results = await self.engine.broadcast(method).results_async(
            timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True
        )
        return [r for r in results if not isinstance(r, BaseException)]
