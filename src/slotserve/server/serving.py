"""State shared by the routes: the models, the metrics, the API key."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.runner_interface import AdapterInfo
from slotserve.hosting.host import ModelHost
from slotserve.hosting.registry import ModelRegistry
from slotserve.hosting.served import LoadedModel
from slotserve.protocol.chat_template import ChatTemplate
from slotserve.server.access import LOCAL, AccessPolicy
from slotserve.server.metrics import ServerMetrics
from slotserve.server.tracing import RequestTracer

# Ordinary text takes 4 to 8 bytes a token as JSON; 32 leaves room for dense escapes (up to 12
# bytes a character) and for batches of prompts; the floor covers small contexts.
REQUEST_BYTES_PER_TOKEN = 32
MIN_REQUEST_BYTES = 8 * 2**20
LARGE_BODY_BYTES = 2**20  # past this, a request is prepared on the large requests' threads


@dataclass(frozen=True)
class CorsRules:
    """What CORS allows the pages of ``--allowed-origins`` (vLLM's flags); empty: all."""

    methods: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()
    credentials: bool = False


@dataclass
class ServingContext:
    models: ModelRegistry
    metrics: ServerMetrics
    access: AccessPolicy = LOCAL  # who may call what (keys, the admin rule, Host, Origin)
    cors: CorsRules | None = None  # None: no CORS headers (no --allowed-origins)
    tracer: RequestTracer | None = None  # --otlp-traces-endpoint
    max_request_bytes: int | None = None  # None: derived from the loaded models' contexts
    created: int = field(default_factory=lambda: int(time.time()))

    async def acquire(
        self, requested: str | None, raw: Request, keep_alive: float | str | None = None
    ) -> tuple[ModelHost, LoadedModel]:
        """The model a request names, ready (404 unknown, 503 not ready); its name labels the
        request's error metrics. A LoRA adapter's name gives its base model, the adapter
        noted for :func:`request_adapter`. Nothing awaits between this and the request's
        submission, so neither can be unloaded in between."""
        base = self.adapter_base(requested)
        host = await self.models.acquire(base or requested, parse_keep_alive(keep_alive))
        model = host.require_ready()
        raw.state.model_name = host.name
        raw.state.adapter = None
        if base is not None:
            raw.state.adapter = model.adapters.get(requested or "")
            if raw.state.adapter is None:  # unloaded while the base model loaded
                raise self.models.not_found(requested)
        return host, model

    def adapter_base(self, name: str | None) -> str | None:
        """The model whose LoRA adapter ``name`` is (None: no adapter has the name)."""
        for host in list(self.models.hosts.values()):
            if name and host.model is not None and name in host.model.adapters:
                return host.name
        return None

    def request_bytes_limit(self) -> int:
        """The largest request body accepted: ``--max-request-bytes``, else
        ``REQUEST_BYTES_PER_TOKEN`` bytes for every slot's context of the largest loaded model
        (room for a full context in JSON escapes and for batches of prompts), at least
        ``MIN_REQUEST_BYTES``."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        tokens = [
            model.info.max_seq_len * model.engine.config.num_slots
            for model in (host.model for host in list(self.models.hosts.values()))
            if model is not None
        ]
        return max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * max(tokens, default=0))

    def count_error(self, status: int, error_type: str, model_name: str | None = None) -> None:
        self.metrics.count_error(status, error_type, model_name or self.models.default_name or "")


def _named_adapter(raw: Request) -> AdapterInfo | None:
    """The LoRA adapter the request named as its model (``ServingContext.acquire`` notes it)."""
    adapter: AdapterInfo | None = getattr(raw.state, "adapter", None)
    return adapter


def served_name(host: ModelHost, raw: Request) -> str:
    """The model a response names: the LoRA adapter the request named, else the model."""
    adapter = _named_adapter(raw)
    return host.name if adapter is None else adapter.name


def request_adapter(raw: Request) -> int:
    """The id of the LoRA adapter the request named as its model (0: none)."""
    adapter = _named_adapter(raw)
    return 0 if adapter is None else adapter.adapter_id


_DURATION_PART = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def large_body(raw: Request) -> bool:
    """Whether ``raw`` is prepared (rendered, tokenized) as a large request
    (``ModelHost.off_loop``): a body over ``LARGE_BODY_BYTES``, or one of no stated length."""
    length = raw.headers.get("content-length", "")
    return not length.isdigit() or int(length) > LARGE_BODY_BYTES


def parse_keep_alive(value: float | str | None) -> float | None:
    """Ollama's ``keep_alive``: seconds, or a Go duration ("5m", "1h30m", "300ms"); negative
    keeps the model loaded; 0 unloads it once idle. None: the model's current setting."""
    if value is None or isinstance(value, int | float):
        return None if value is None else float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise InvalidRequestError(
            f"Invalid keep_alive {value!r}: a number of seconds or a duration such as '5m', "
            "'1h30m' or '-1' (keep loaded).",
            param="keep_alive",
        )
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)


def require_chat_template(model: LoadedModel) -> ChatTemplate:
    if not model.info.can_generate:
        raise InvalidRequestError(
            f"The model {model.info.name} is {model.info.routes_served}.",
            param="model",
        )
    if model.chat_template is None:
        raise InvalidRequestError(
            "This model has no chat template, so /v1/chat/completions cannot format "
            "messages. Start the server with --chat-template FILE, or use /v1/completions.",
            param="messages",
        )
    return model.chat_template


def engine_request_id(
    model: LoadedModel, prefix: str, http_request_id: str, num_prompts: int = 1
) -> str:
    """``chatcmpl-<x-request-id>``: the engine's id names the HTTP request in its log lines.
    Two clients may send the same ``x-request-id``; the second gets a suffix. A request with
    several prompts holds ``<id>-0``, ``<id>-1``, ... in the engine, so those are checked too."""
    request_id = f"{prefix}-{http_request_id}"
    held = [request_id] if num_prompts == 1 else [f"{request_id}-{k}" for k in range(num_prompts)]
    if any(model.engine.has_request(rid) for rid in held):
        request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
    return request_id
