"""The one request the serving side hands the engine: :class:`EngineCoreRequest`.

It holds everything a request brings (the prompt, its sampling, priority, LoRA adapter and
images, when it arrived), is built once where an API call is mapped to it, and travels whole:
through the engine client, across the process boundary (it is also the wire form: a msgspec
struct, one MessagePack frame, ``client/wire.py``) and into the core, which builds its own
mutable state from it (``request.Request``). A new per-request field is a field here, filled
by the API mapping that knows it and read by the code that uses it; nothing between names it.
"""

from __future__ import annotations

import time

import msgspec

from slotserve.engine.images import ImageInput
from slotserve.engine.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """One prompt to run as the API side validated it; never changed once built.

    The engine ends the request ``--request-timeout`` after ``arrival_time``. An API call with
    several prompts is several of these, one id each.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # schedule policy priority: lower runs first (vLLM's meaning)
    adapter: int = 0  # the LoRA adapter's id (``engine/adapters.py``); 0: the base model
    images: tuple[ImageInput, ...] = ()  # the prompt's images, in order (``engine/images.py``)
    # time.monotonic(): one clock for every process on the machine.
    arrival_time: float = msgspec.field(default_factory=time.monotonic)
