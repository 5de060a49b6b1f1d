"""LoRA adapters at run time, with vLLM's routes and bodies: ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter`` (admin routes: ``access.py`` decides who may call
them), and each adapter's card in ``/v1/models``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.runner_interface import AdapterInfo
from slotserve.hosting.host import ModelHost
from slotserve.server.errors import ErrorResponse
from slotserve.server.serving import ServingContext


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)  # what requests name as their model
    lora_path: str = Field(min_length=1)  # a PEFT folder on the server's machine
    # The base model (default: the server's default model); vLLM serves one.
    model: str | None = None


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name alone picks the adapter here


def adapter_card(ctx: ServingContext, base: str, adapter: AdapterInfo) -> dict[str, Any]:
    """An adapter as vLLM lists it: its own id, its folder as ``root``, its base as
    ``parent``."""
    return {
        "id": adapter.name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "slotserve",
        "root": adapter.path,
        "parent": base,
        "state": "ready",
        "status": {"value": "loaded"},
        "lora_rank": adapter.rank,
    }


def adapter_cards(ctx: ServingContext) -> list[dict[str, Any]]:
    return [
        adapter_card(ctx, host.name, adapter)
        for host in list(ctx.models.hosts.values())
        if host.model is not None
        for adapter in host.model.adapters.values()
    ]


def lora_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    errors: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 503)
    }

    @router.post("/v1/load_lora_adapter", responses=errors)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> JSONResponse:
        """Loads a PEFT LoRA adapter onto a served model; requests then name it as their
        model (400: a bad folder, another base model's shapes, a rank or count over the
        limits, a runner that serves none; the server keeps serving)."""
        name = body.lora_name
        if name in ctx.models.hosts or ctx.adapter_base(name) is not None:
            raise InvalidRequestError(f"the name {name} is taken already", param="lora_name")
        host = ctx.models.host(body.model)
        model = host.require_ready()
        path = _folder(body.lora_path)
        with host.refusing_a_dead_engine():
            info = await model.engine.call_adapter(name, path)
        model.adapters[name] = info
        return JSONResponse({"success": True, "model": adapter_card(ctx, host.name, info)})

    @router.post("/v1/unload_lora_adapter", responses=errors)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> JSONResponse:
        """Unloads an adapter; its requests still in flight end with an error."""
        host = _host_of(ctx, body.lora_name)
        model = host.require_ready()
        with host.refusing_a_dead_engine():
            await model.engine.call_adapter(body.lora_name, None)
        model.adapters.pop(body.lora_name, None)
        return JSONResponse({"success": True, "model": body.lora_name})

    return router


def _folder(text: str) -> str:
    """The adapter folder a request names, as an absolute path; a 400 for what is no path (a
    NUL byte, an unknown ~user, a name the system refuses)."""
    try:
        return str(Path(text).expanduser().resolve())
    except (ValueError, RuntimeError, OSError) as exc:
        raise InvalidRequestError(
            f"lora_path is not a usable path: {exc}", param="lora_path"
        ) from None


def _host_of(ctx: ServingContext, name: str) -> ModelHost:
    base = ctx.adapter_base(name)
    if base is None:
        raise ctx.models.not_found(name)
    return ctx.models.host(base)
