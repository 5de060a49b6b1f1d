"""The model registry's rules with the fake runner (the real models are served in
tests/server/test_multi_model.py): how ``--models-dir`` names models, the memory pre-flight,
which model ``--models-max`` unloads, and requests during a load."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.memory_need import MemoryNeed
from slotserve.engine.sampling_params import SamplingParams
from slotserve.hosting.catalog import scan_models_dir
from slotserve.hosting.registry import (
    MemoryReading,
    ModelLoadError,
    ModelNotFoundError,
    ModelRegistry,
)
from slotserve.hosting.served import ModelLaunch, ModelUnavailableError
from tests.fake_runner import FakeRunner

GIB = 2**30


def test_models_dir_names_models_as_llama_servers_router_does(tmp_path: Path) -> None:
    for name in ("a.gguf", "big-00001-of-00002.gguf", "big-00002-of-00002.gguf", "mmproj-a.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    (tmp_path / ".hidden.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "hf-model").mkdir()
    (tmp_path / "hf-model" / "config.json").write_text("{}")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "weights-q4.gguf").write_bytes(b"GGUF")
    (tmp_path / "empty").mkdir()
    found = scan_models_dir(tmp_path)
    assert found == {
        "a": tmp_path / "a.gguf",
        "big": tmp_path / "big-00001-of-00002.gguf",
        "folder": tmp_path / "folder" / "weights-q4.gguf",
        "hf-model": tmp_path / "hf-model",
    }
    assert scan_models_dir(tmp_path / "missing") == {}


def fake_launch(name: str, gib: float = 1.0, device_share: float = 0.0) -> ModelLaunch:
    need = MemoryNeed(int(gib * GIB), 0, 0, 0, device_share)
    return ModelLaunch(
        name, lambda: FakeRunner(num_slots=1), EngineConfig(num_slots=1), memory=need
    )


def registry(tmp_path: Path, **options: Any) -> ModelRegistry:
    """Every file in ``tmp_path`` is a model of the dir; ``options`` set the registry's own."""
    sizes: dict[str, float] = options.pop("sizes", {})
    shares: dict[str, float] = options.pop("device_shares", {})

    def make(name: str, path: Path, load_options: Mapping[str, Any]) -> ModelLaunch:
        return fake_launch(name, sizes.get(name, 1.0), shares.get(name, 0.0))

    memory = options.pop("memory", MemoryReading(64 * GIB, 64 * GIB))
    return ModelRegistry(make, models_dir=tmp_path, read_memory=lambda: memory, **options)


def models_dir(tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
    return tmp_path


def test_the_preflight_refuses_what_does_not_fit_before_loading(tmp_path: Path) -> None:
    async def main() -> None:
        models = registry(
            models_dir(tmp_path, "small", "huge"),
            sizes={"small": 2.0, "huge": 7.9},
            memory=MemoryReading(available_bytes=12 * GIB, total_bytes=10 * GIB),
        )
        await models.load("small")
        with pytest.raises(ModelLoadError) as refused:
            # Free: min(12 available, 10 total - 2 held by "small") = 8 GiB, minus headroom.
            await models.load("huge", options={})
        assert refused.value.status == 400 and "7.90 GiB" in str(refused.value)
        assert "huge" not in models.hosts
        await models.stop()

    asyncio.run(main())


def test_offloaded_layers_count_against_the_gpu_not_the_ram(tmp_path: Path) -> None:
    """llama.cpp's --n-gpu-layers: the offloaded share of a model is not RAM's to hold (this
    machine has no GPU, so only the RAM side is checked)."""
    need = MemoryNeed(8 * GIB, 0, 0, 0, device_share=0.75)
    assert (need.device_bytes, need.host_bytes) == (6 * GIB, 2 * GIB)
    assert "6.00 GiB of it on the GPU" in need.describe()

    async def main() -> None:
        models = registry(
            models_dir(tmp_path, "offloaded", "on-cpu"),
            sizes={"offloaded": 7.9, "on-cpu": 7.9},
            device_shares={"offloaded": 0.75},
            memory=MemoryReading(available_bytes=6 * GIB, total_bytes=6 * GIB),
        )
        await models.load("offloaded")
        with pytest.raises(ModelLoadError):
            await models.load("on-cpu", options={})
        await models.stop()

    asyncio.run(main())


def test_models_max_unloads_the_least_recently_used_idle_model(tmp_path: Path) -> None:
    async def main() -> None:
        models = registry(models_dir(tmp_path, "a", "b", "c", "d"), models_max=2)
        await models.acquire("a")
        await models.acquire("b")
        await models.acquire("a")  # b is now the least recently used
        await models.acquire("c")
        assert list(models.hosts) == ["a", "c"]
        # A model with a request in flight is never the one unloaded.
        # (An unread stream keeps its request in flight.)
        stream = (
            models.hosts["a"]
            .require_ready()
            .engine.submit(EngineCoreRequest("busy", [1, 2, 3], SamplingParams(max_tokens=4)))
        )
        await models.acquire("c")
        await models.acquire("d")  # a is older but busy: c goes
        assert sorted(models.hosts) == ["a", "d"]
        # Both busy: a request for a third model is told to retry (503), not refused.
        other = (
            models.hosts["d"]
            .require_ready()
            .engine.submit(EngineCoreRequest("busy-too", [1, 2, 3], SamplingParams(max_tokens=4)))
        )
        with pytest.raises(ModelUnavailableError, match="every one is serving"):
            await models.acquire("b")
        other.close()
        stream.close()
        await models.stop()

    asyncio.run(main())


def test_requests_during_an_explicit_load_wait_or_get_a_503(tmp_path: Path) -> None:
    async def main() -> None:
        models = registry(models_dir(tmp_path, "a"))
        loading = asyncio.ensure_future(models.load("a"))
        await asyncio.sleep(0)  # the load has claimed the name
        with pytest.raises(ModelUnavailableError):
            await models.acquire("a")
        with pytest.raises(ModelLoadError) as taken:
            await models.load("a")
        assert taken.value.status == 409
        await loading
        assert (await models.acquire("a")).name == "a"
        with pytest.raises(ModelNotFoundError, match="loaded models: 'a'"):
            await models.acquire("nope")
        await models.stop()

    asyncio.run(main())


def test_the_restart_backoff_grows_only_with_deaths_soon_after_a_start() -> None:
    """An engine killed after serving a while restarts after the first delay again, however
    many deaths the window holds; deaths in a row, each soon after the engine's start (or
    before it became ready), double it up to the cap."""
    from slotserve.hosting.served import RESTART_STABLE_S, RestartPolicy

    policy = RestartPolicy()
    quick = policy.quick_deaths_after(0, 3600.0)
    assert (quick, policy.backoff_s(quick)) == (1, 0.25)
    quick = policy.quick_deaths_after(quick, RESTART_STABLE_S + 1)  # served a while again
    assert (quick, policy.backoff_s(quick)) == (1, 0.25)
    for expected in (0.5, 1.0, 2.0):
        quick = policy.quick_deaths_after(quick, 2.0)
        assert policy.backoff_s(quick) == expected
    assert policy.backoff_s(policy.quick_deaths_after(quick, 0.0)) == 4.0  # a failed rebuild
    assert policy.backoff_s(20) == 30.0


def test_a_small_request_is_prepared_while_large_ones_hold_their_threads(
    tmp_path: Path,
) -> None:
    """Rendering and tokenizing run off the event loop; large requests have threads of their
    own, so a small one is prepared at once however many large ones are under way."""

    async def main() -> None:
        models = registry(models_dir(tmp_path, "a"))
        host = await models.acquire("a")
        model = host.require_ready()
        release = threading.Event()
        large = [asyncio.create_task(host.off_loop(model, True, release.wait)) for _ in range(4)]
        try:
            small = host.off_loop(model, False, lambda: "prepared")
            assert await asyncio.wait_for(small, timeout=30) == "prepared"
            assert not any(task.done() for task in large)
        finally:
            release.set()
        assert await asyncio.gather(*large) == [True] * 4
        await models.stop()

    asyncio.run(main())
