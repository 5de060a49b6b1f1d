"""Routes about the served models: the model list, loading and unloading
at run time (llama-server's router-mode endpoints), reload, and each model's slots and prefix
cache."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from slotserve.engine.prefix_cache.stats import PrefixCacheStats
from slotserve.hosting.config import load_request_model
from slotserve.hosting.host import ModelHost
from slotserve.hosting.served import ModelState
from slotserve.server.errors import ErrorResponse, error_response
from slotserve.server.lora_routes import adapter_card, adapter_cards
from slotserve.server.serving import ServingContext

# llama-server's router reports loaded / loading / unloaded.
_ROUTER_STATUS = {ModelState.LOADING: "loading", ModelState.UNLOADING: "unloading"}


class LoadModelBody(BaseModel):
    """``POST /models/load``: a name from ``--models-dir``, or a name and a path, with any of
    ``slotserve serve``'s per-model options, named without dashes (``ctx_size`` for
    ``--ctx-size``); unset ones are the server's own."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    path: str | None = None


# The per-model options' fields are generated from their declarations (hosting/config.py).
if TYPE_CHECKING:
    LoadModelRequest = LoadModelBody
else:
    LoadModelRequest = load_request_model(LoadModelBody, "LoadModelRequest")


class UnloadModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    force: bool = False  # cancel requests in flight at once (they end with an error)
    timeout: float | None = Field(default=None, ge=0)  # seconds to wait (default: the server's)


def _card(ctx: ServingContext, name: str, state: str, router_status: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "slotserve",
        "root": name,
        "parent": None,
        "state": state,
        "status": {"value": router_status},
    }


def model_card(ctx: ServingContext, host: ModelHost) -> dict[str, Any]:
    """A model as vLLM describes it, with our state, runner, context and slots."""
    state = host.state
    entry = _card(ctx, host.name, state.value, _ROUTER_STATUS.get(state, "loaded"))
    if host.reason:
        entry["reason"] = host.reason
    model = host.model
    if model is not None:
        entry |= {
            "max_model_len": model.info.max_seq_len,
            "runner": model.info.runner,
            "slots": model.info.num_slots,
            # What the model serves: text generation, /v1/embeddings, or (a cross-encoder)
            # /v1/rerank and /v1/score.
            "capabilities": [
                kind
                for kind, served in (
                    ("generation", model.info.can_generate),
                    ("embeddings", model.info.can_embed and not model.info.cross_encoder),
                    ("rerank", model.info.cross_encoder),
                    ("score", model.info.cross_encoder),
                )
                if served
            ],
            # What a request gets for the sampling fields it leaves out.
            "sampling_defaults": model.sampling_defaults.as_dict(),
            # Which kernels serve it, with which CPU features, and whether it is batch-invariant.
            "compute": asdict(model.info.compute),
        }
    if host.keep_alive_s is not None:
        entry["keep_alive"] = host.keep_alive_s
    return entry


def unloaded_card(ctx: ServingContext, name: str) -> dict[str, Any]:
    """A model of ``--models-dir`` that is not loaded."""
    return _card(ctx, name, "unloaded", "unloaded")


def model_list(ctx: ServingContext) -> dict[str, Any]:
    """Every model served, then those of ``--models-dir`` not loaded (state "unloaded")."""
    data = [model_card(ctx, host) for host in ctx.models.hosts.values()]
    data += adapter_cards(ctx)
    data += [
        unloaded_card(ctx, name) for name in ctx.models.available() if name not in ctx.models.hosts
    ]
    return {"object": "list", "data": data}


def prefix_stats(host: ModelHost) -> PrefixCacheStats:
    """The current engine's cache, its counters summed since the model was first loaded (a
    reload must not make a Prometheus counter go back)."""
    current = (
        host.model.stats.prefix_cache
        if host.model is not None
        else PrefixCacheStats(False, "the model is not loaded")
    )
    return host.retired.with_prefix_counters(current)


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse} for status in statuses}


def model_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    models = ctx.models

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return model_list(ctx)

    @router.get("/models")  # llama-server's router lists its models here
    async def list_models_router() -> dict[str, Any]:
        return model_list(ctx)

    # ``:path``: model ids hold "/" (an HF repo id such as "org/name").
    @router.get("/v1/models/{model_id:path}", responses=_errors(404))
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id not in models.hosts and model_id in models.available():
            return unloaded_card(ctx, model_id)
        base = ctx.adapter_base(model_id)
        if base is not None and (model := models.host(base).model) is not None:
            return adapter_card(ctx, base, model.adapters[model_id])
        return model_card(ctx, models.host(model_id))

    @router.post("/models/load", responses=_errors(400, 401, 404, 409, 500))
    async def load(body: LoadModelRequest) -> JSONResponse:
        """Loads a model and answers once it is ready (400 bad options or too big for the
        memory left, 404 not in the models dir, 409 name taken, 500 the load failed)."""
        options = body.model_dump(exclude_unset=True, exclude={"model", "path"})
        host = await models.load(body.model, Path(body.path) if body.path else None, options)
        return JSONResponse({"success": True, "model": model_card(ctx, host)})

    @router.post("/models/unload", responses=_errors(401, 404))
    async def unload(body: UnloadModelRequest) -> JSONResponse:
        """Refuses new requests for the model at once, lets those in flight finish (up to
        ``timeout``; ``force``: none), then frees its memory."""
        cut_off = await models.unload(body.model, body.force, body.timeout)
        return JSONResponse({"success": True, "model": body.model, "requests_cut_off": cut_off})

    @router.post("/admin/reload", responses=_errors(404, 409, 500))
    async def reload(model: str | None = None) -> JSONResponse:
        """Builds a new runner and engine for a model: recovers an unhealthy one.
        Requests still in the old engine end with an error first."""
        host = models.host(model)
        await host.load()
        if host.state is not ModelState.READY:
            ctx.count_error(500, "internal_server_error", host.name)  # counted like every error
            return error_response(
                500, f"Reloading the model failed: {host.load_error}.", "internal_server_error"
            )
        return JSONResponse({"status": "ready", "model": host.name, "loads": host.loads})

    @router.get("/v1/slots", responses=_errors(404))
    async def slots(model: str | None = None) -> dict[str, Any]:
        host = models.host(model)
        loaded = host.model
        if loaded is None:
            return {"model": host.name, "state": host.state.value, "slots": []}
        stats = loaded.stats
        return {
            "model": host.name,
            "state": host.state.value,
            "slots": [asdict(s) for s in stats.slots],
            "num_waiting": stats.num_waiting,
            "num_running": stats.num_running,
            "kv_used_tokens": stats.kv_used_tokens,
            "kv_capacity_tokens": stats.kv_capacity_tokens,
            "steps": stats.steps,
            "step_seconds": stats.step_seconds,
            "execute_seconds": stats.execute_seconds,
            "forward_seconds": loaded.engine.forward_seconds,
            # The engine-core process (None: an engine thread of the server's process).
            "engine_pid": getattr(loaded.engine.client, "pid", None),
            "generated_tokens": stats.generated_tokens,
            "requests_submitted": stats.requests_submitted,
            "requests_finished": stats.requests_finished,
            "requests_aborted": stats.requests_aborted,
            "requests_failed": stats.requests_failed,
            "requests_timed_out": stats.requests_timed_out,
            "preemptions": stats.preemptions,
            "spec_decode": asdict(stats.spec_decode) if stats.spec_decode else None,
        }

    @router.get("/v1/prefix_cache_stats", responses=_errors(404))
    async def prefix_cache_stats(model: str | None = None) -> dict[str, Any]:
        # Reads the snapshot the engine published after its last step: never blocks it.
        host = models.host(model)
        stats = host.model.stats if host.model is not None else None
        return {
            "model": host.name,
            **prefix_stats(host).as_dict(),
            "integrity_checks": stats.integrity_checks if stats else 0,
            "integrity_failures": stats.integrity_failures if stats else 0,
            "last_integrity_error": stats.last_integrity_error if stats else None,
        }

    return router
