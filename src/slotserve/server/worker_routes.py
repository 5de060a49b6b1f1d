"""What the SGLang Model Gateway (``sglang-router``) asks of a worker, in SGLang's own shapes,
so that ``slotserve serve`` can stand behind it (docs/scaling.md).

The gateway (0.3.2) registers a worker with ``GET /health`` (any 2xx), then ``GET
/server_info`` and ``GET /model_info`` (falling back to the ``/get_`` names on a 404 only):
``served_model_name`` becomes the worker's model id, and ``model_path``, ``tp_size``,
``dp_size``, ``model_type`` and ``architectures`` its labels. ``POST /flush_cache`` on the
gateway is sent to every worker (any 2xx counts), and its load monitor reads ``GET /get_load``:
a list with one entry per data-parallel rank, of which it sums ``num_tokens``. The
``cache_aware`` policy itself needs nothing from the worker: it keeps its own approximate tree
of the request texts it sent where. It forwards requests re-serialised with SGLang's own fields
at their defaults, which ``openai/protocol.py`` accepts at those values.

Several models in one server: the info routes describe the default model (the first start-up
model: the one a request without ``model`` gets) unless ``?model=`` names another;
``/get_load`` sums every loaded model (this server is one rank: ``dp_size`` 1) and
``/flush_cache`` flushes every ready model, unless ``?model=`` names one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from slotserve import __version__
from slotserve.engine.core.stats import EngineStats
from slotserve.hosting.host import ModelHost
from slotserve.hosting.served import ModelState
from slotserve.server.errors import ErrorResponse
from slotserve.server.serving import ServingContext

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "No such model (or no default model)"},
    503: {"model": ErrorResponse, "description": "The named model is not ready"},
}


def _model_path(host: ModelHost) -> str:
    path = host.launch.model_path
    return str(path) if path is not None else host.name


def server_info(ctx: ServingContext, host: ModelHost) -> dict[str, Any]:
    """SGLang's ``/server_info``: its server arguments (the names SGLang uses) and scheduler
    figures, for ``host``; figures the model gives are None until it is loaded."""
    config = host.launch.config
    info = host.model.info if host.model is not None else None
    context = info.max_seq_len if info is not None else None
    path = _model_path(host)
    return {
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": host.name,
        "tp_size": info.tensor_parallel_size if info is not None else None,
        "dp_size": 1,  # the gateway's --dp-aware would split a worker by this
        "context_length": context,
        "max_model_len": context,  # vLLM's name for it
        "max_total_num_tokens": info.kv_capacity if info is not None else None,
        "max_running_requests": config.num_slots,
        "max_queued_requests": config.max_queue,
        "chunked_prefill_size": config.prefill_chunk,
        "max_prefill_tokens": config.max_batch_tokens,
        "disable_radix_cache": not config.prefix_cache,
        "speculative_algorithm": "NGRAM" if config.speculative is not None else None,
        "version": __version__,
        # slotserve's own
        "server": "slotserve",
        "runner": info.runner if info is not None else None,
        "state": host.state.value,
        "models": list(ctx.models.hosts),
    }


def model_info(host: ModelHost) -> dict[str, Any]:
    """SGLang's ``/model_info`` for ``host``."""
    info = host.model.info if host.model is not None else None
    path = _model_path(host)
    return {
        "model_path": path,
        "tokenizer_path": path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": info.accepts_images if info is not None else False,
        "has_audio_understanding": False,
        # The gateway reads these into its model card; not known here (the runner does not
        # report the architecture), so left out of its labels.
        "model_type": None,
        "architectures": None,
        # slotserve's own
        "served_model_name": host.name,
        "runner": info.runner if info is not None else None,
        "max_model_len": info.max_seq_len if info is not None else None,
    }


def load(stats: list[EngineStats]) -> list[dict[str, int]]:
    """SGLang's ``/get_load``: one entry per data-parallel rank. This server is one rank, its
    load the sum over its models: requests running or waiting, those waiting, and the KV
    tokens running requests hold (SGLang also counts the prompts of waiting requests)."""
    running = sum(s.num_running for s in stats)
    waiting = sum(s.num_waiting for s in stats)
    return [
        {
            "dp_rank": 0,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": sum(s.kv_used_tokens for s in stats),
        }
    ]


def worker_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter(tags=["SGLang Model Gateway worker"])
    models = ctx.models

    @router.get("/server_info", responses=_ERRORS)
    @router.get("/get_server_info", responses=_ERRORS)  # SGLang's older name
    async def get_server_info(model: str | None = None) -> dict[str, Any]:
        return server_info(ctx, models.host(model))

    @router.get("/model_info", responses=_ERRORS)
    @router.get("/get_model_info", responses=_ERRORS)  # the gateway proxies this name
    async def get_model_info(model: str | None = None) -> dict[str, Any]:
        return model_info(models.host(model))

    @router.get("/get_load", responses=_ERRORS)
    async def get_load(model: str | None = None) -> list[dict[str, int]]:
        hosts = [models.host(model)] if model is not None else list(models.hosts.values())
        return load([h.model.stats for h in hosts if h.model is not None])

    @router.post("/flush_cache", responses=_ERRORS)
    async def flush_cache(model: str | None = None) -> dict[str, Any]:
        """Drops every cached prefix no running request uses (SGLang refuses while requests
        run; here their prefixes stay cached and the rest goes, so it always succeeds)."""
        if model is not None:
            hosts = [models.host(model)]
        else:
            hosts = [h for h in models.hosts.values() if h.state is ModelState.READY]
        flushed: dict[str, dict[str, Any]] = {}
        for host in hosts:
            loaded = host.require_ready()  # 503 for a named model that is not ready
            freed = await loaded.engine.flush_prefix_cache()
            cache = loaded.stats.prefix_cache
            flushed[host.name] = {
                "prefix_cache": cache.enabled,
                "freed_tokens": freed,
                "cached_tokens": cache.cached_tokens,  # what running requests still use
            }
        return {"success": True, "message": "Cache flushed.", "models": flushed}

    return router
