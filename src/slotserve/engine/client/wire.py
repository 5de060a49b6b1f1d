"""Messages between the API process (``mp_client.py``) and the engine-core process
(``core_proc.py``).

Each message is a tagged ``msgspec`` struct, sent as one MessagePack frame over a ZMQ PUSH/PULL
pair; a request is the engine's own :class:`EngineCoreRequest`, sent whole. The engine's plain
dataclasses (``SamplingParams``, ``RequestOutput``, ``EngineStats``, ``ModelInfo``) ride inside
them as they are: msgspec encodes dataclasses, enums, tuples and frozensets natively and
rebuilds them typed on decode, so nothing is pickled on the hot path and no mirror types have
to be kept in step with the engine's.
"""

from __future__ import annotations

import msgspec

from slotserve.engine.core.stats import EngineStats
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.outputs import RequestOutput
from slotserve.engine.runner_interface import AdapterInfo, ModelInfo

# ---- API process → engine process ---------------------------------------------------------


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Stop(msgspec.Struct, tag=True, array_like=True):
    """End every request with an error saying ``reason``, close the runner, say
    :class:`Stopped`, exit."""

    reason: str


class FlushPrefixCache(msgspec.Struct, tag=True, array_like=True):
    """Evict every cached prefix no running sequence uses; answered by
    :class:`PrefixCacheFlushed` after the :class:`StepOutputs` that shows it."""

    flush_id: int


class AdapterCall(msgspec.Struct, tag=True, array_like=True):
    """Load the LoRA adapter at ``path`` as ``name`` (``path`` None: unload ``name``);
    answered by :class:`AdapterAnswer`."""

    call_id: int
    name: str
    path: str | None


ToEngine = EngineCoreRequest | Abort | Stop | FlushPrefixCache | AdapterCall

# ---- engine process → API process ---------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The runner is loaded and the core built: what the API side needs to serve."""

    model_info: ModelInfo
    stats: EngineStats


class LoadFailed(msgspec.Struct, tag=True, array_like=True):
    error: str  # "ExceptionType: message", raised again on the API side


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """One step's outputs and the state the core published after it.

    ``received`` counts the requests (:class:`EngineCoreRequest`) the core had taken when
    ``stats`` was built: requests sent but not yet received are still queued for the 429
    decision.
    """

    outputs: list[RequestOutput]
    stats: EngineStats
    received: int
    forward_seconds: float


class PrefixCacheFlushed(msgspec.Struct, tag=True, array_like=True):
    flush_ids: list[int]
    freed_tokens: int


class AdapterAnswer(msgspec.Struct, tag=True, array_like=True):
    """The adapter loaded or unloaded, or why not (``not_found``: no adapter had the name)."""

    call_id: int
    info: AdapterInfo | None
    error: str | None = None
    not_found: bool = False
    param: str | None = None  # the request field at fault


class Stopped(msgspec.Struct, tag=True, array_like=True):
    pass


class Crashed(msgspec.Struct, tag=True, array_like=True):
    """The engine loop itself broke (outside the runner call); the process exits."""

    error: str


FromEngine = (
    Ready | LoadFailed | StepOutputs | PrefixCacheFlushed | AdapterAnswer | Stopped | Crashed
)

_encoder = msgspec.msgpack.Encoder()
_to_engine: msgspec.msgpack.Decoder[ToEngine] = msgspec.msgpack.Decoder(ToEngine)
_from_engine: msgspec.msgpack.Decoder[FromEngine] = msgspec.msgpack.Decoder(FromEngine)


def encode(message: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(message)


def decode_to_engine(frame: bytes) -> ToEngine:
    return _to_engine.decode(frame)


def decode_from_engine(frame: bytes) -> FromEngine:
    return _from_engine.decode(frame)
