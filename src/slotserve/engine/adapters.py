"""LoRA adapters as the engine sees them: what a runner reports of one (:class:`AdapterInfo`),
what a runner that serves them does (:class:`AdapterRunner`) and the names and limit it keeps
(:class:`HeldAdapters`), and how the prefix cache keeps one adapter's KV apart from another's
(:func:`cache_keys`).

A request runs with at most one adapter, named by its id; the runner applies each row's
adapter within the one batched forward, so requests with different adapters (or none) share
every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar, runtime_checkable

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.runner_interface import AdapterInfo, ModelInfo, Runner

# A cache key is a token id with the adapter's id above these bits: vocabularies stay far
# below 2**32 tokens, so two adapters' keys (and the base model's, the token ids themselves)
# never meet.
_TOKEN_BITS = 32


class AdapterNotFoundError(LookupError):
    """No adapter has the name (HTTP 404)."""


Held = TypeVar("Held")


class HeldAdapters(Generic[Held]):
    """The adapters a runner holds: by name (several names may load the same files, one id)
    and, by id, what the runner keeps of each (its weights, a llama.cpp handle), at most
    ``max_loras`` ids at once. Refusals are ``ValueError``s naming the limit."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.by_id: dict[int, Held] = {}
        self._by_name: dict[str, AdapterInfo] = {}

    @property
    def infos(self) -> list[AdapterInfo]:
        return list(self._by_name.values())

    def check_name(self, name: str) -> None:
        if name in self._by_name:
            raise ValueError(f"an adapter named {name} is loaded already; unload it first")

    def add(self, info: AdapterInfo, make: Callable[[], Held]) -> None:
        """Holds ``info`` under its name; ``make`` builds what the runner keeps of a new id,
        once there is room (never for files another name holds already)."""
        if info.adapter_id not in self.by_id:
            if len(self.by_id) >= self.max_loras:
                raise ValueError(
                    f"{len(self.by_id)} adapters are loaded, the --max-loras limit: unload one "
                    f"before loading {info.name}"
                )
            self.by_id[info.adapter_id] = make()
        self._by_name[info.name] = info

    def remove(self, name: str) -> tuple[AdapterInfo, Held | None]:
        """Drops the name (``KeyError`` when none has it); what the runner kept of its id,
        when no other name holds it, to be freed."""
        info = self._by_name.pop(name)
        if any(other.adapter_id == info.adapter_id for other in self._by_name.values()):
            return info, None
        return info, self.by_id.pop(info.adapter_id)


@runtime_checkable
class AdapterRunner(Protocol):
    """A runner that serves LoRA adapters (``ModelInfo.lora_unsupported`` is None)."""

    def load_adapter(self, name: str, path: Path) -> AdapterInfo:
        """Reads and checks the adapter at ``path`` and holds it under ``name``; raises
        ``ValueError`` (the caller's fault: a bad folder, another base model, a rank or
        count over the limits) and leaves the runner as it was."""
        ...

    def unload_adapter(self, name: str) -> AdapterInfo:
        """Drops the adapter (``KeyError`` when none has the name); the engine has ended the
        requests that used it."""
        ...

    @property
    def adapters(self) -> Sequence[AdapterInfo]: ...


def adapter_ids(runner: object) -> set[int]:
    """The ids of the adapters ``runner`` holds."""
    if not isinstance(runner, AdapterRunner):
        return set()
    return {adapter.adapter_id for adapter in runner.adapters}


def _serving(runner: object, model: ModelInfo) -> AdapterRunner:
    if model.lora_unsupported is not None or not isinstance(runner, AdapterRunner):
        raise InvalidRequestError(model.lora_unsupported or "this runner serves no LoRA adapters")
    return runner


def load_adapter(runner: Runner, name: str, path: str) -> AdapterInfo:
    """``runner.load_adapter``, its refusals as ``InvalidRequestError``."""
    try:
        return _serving(runner, runner.model_info).load_adapter(name, Path(path))
    except (ValueError, OSError) as exc:  # OSError: a path the system refuses to read
        raise InvalidRequestError(str(exc), param="lora_path") from None


def unload_adapter(runner: Runner, name: str) -> AdapterInfo:
    """``runner.unload_adapter``; ``AdapterNotFoundError`` when no adapter has the name."""
    served = _serving(runner, runner.model_info)
    if all(adapter.name != name for adapter in served.adapters):
        raise AdapterNotFoundError(f"no LoRA adapter named {name} is loaded")
    return served.unload_adapter(name)


def cache_keys(tokens: Sequence[int], adapter_id: int) -> Sequence[int]:
    """What the prefix cache stores ``tokens`` under for a request with ``adapter_id``: the
    tokens themselves for the base model, else keys no other adapter shares (KV computed
    with one adapter is never another's)."""
    if not adapter_id:
        return tokens
    high = adapter_id << _TOKEN_BITS
    return [high | token for token in tokens]
