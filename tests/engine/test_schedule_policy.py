"""Which waiting request takes a free slot (scheduler invariant 4): arrival order, or SGLang's
longest prefix match with a bound on how often a request is overtaken."""

from __future__ import annotations

import pytest

from slotserve.engine.config import EngineConfig
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.request import Request
from tests.engine.helpers import make_core, run_to_completion, submit, text_of
from tests.fake_runner import FakeRunner

SYSTEM = "You are a coding agent; read files before you edit them. " * 4


def _warm_core(policy: str, slots: int) -> EngineCore:
    """A core whose prefix cache holds SYSTEM in a paged pool (kept while every slot is busy,
    as the PyTorch runner keeps it)."""
    runner = FakeRunner(num_slots=slots, max_seq_len=512, kv_pool_blocks=1024)
    core, _ = make_core(runner, schedule_policy=policy)
    submit(core, "warm", SYSTEM + "first turn", max_tokens=2)
    run_to_completion(core)
    return core


def _admission_order(core: EngineCore, requests: list[Request]) -> list[str]:
    """Steps until every request has a slot; returns their ids in the order they got one."""
    order: list[str] = []
    while len(order) < len(requests):
        core.step()
        order += [r.request_id for r in requests if r.admitted_time and r.request_id not in order]
    return order


@pytest.mark.parametrize(
    ("policy", "expected"), [("fcfs", ["cold", "agent"]), ("lpm", ["agent", "cold"])]
)
def test_lpm_gives_a_free_slot_to_the_longest_cached_prefix(
    policy: str, expected: list[str]
) -> None:
    core = _warm_core(policy, slots=2)
    submit(core, "short", "busy a while", max_tokens=3)
    submit(core, "long", "busy much longer", max_tokens=40)
    core.step()  # both slots taken
    waiting = [
        submit(core, "cold", "an unrelated prompt", max_tokens=3),
        submit(core, "agent", SYSTEM + "next turn", max_tokens=3),
    ]
    assert _admission_order(core, waiting)[:1] == expected[:1]
    run_to_completion(core)
    assert waiting[1].sequences[0].num_cached_tokens >= len(SYSTEM.encode())
    core.check_integrity()


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", ["cold", "agent-1", "agent-2"]), ("lpm", ["agent-1", "cold", "agent-2"])],
)
def test_lpm_lets_a_request_be_overtaken_at_most_slots_times(
    policy: str, expected: list[str]
) -> None:
    """One slot: the cold request waits for one cached one, then goes before the next."""
    core = _warm_core(policy, slots=1)
    submit(core, "busy", "busy", max_tokens=4)
    core.step()
    waiting = [
        submit(core, "cold", "an unrelated prompt", max_tokens=2),
        submit(core, "agent-1", SYSTEM + "turn one", max_tokens=2),
        submit(core, "agent-2", SYSTEM + "turn two", max_tokens=2),
    ]
    assert _admission_order(core, waiting) == expected


def test_lpm_never_changes_what_a_request_generates() -> None:
    """The same requests under both policies, through two slots: the same text each."""
    texts: dict[str, dict[str, str]] = {}
    for policy in ("fcfs", "lpm"):
        core = _warm_core(policy, slots=2)
        for i in range(8):
            prompt = (SYSTEM if i % 2 else "cold prompt ") + f"question {i}"
            submit(core, f"r{i}", prompt, max_tokens=6)
        outputs = run_to_completion(core)
        texts[policy] = {rid: text_of(out) for rid, out in outputs.items()}
        core.check_integrity()
    assert texts["fcfs"] == texts["lpm"]


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(schedule_policy="random")
