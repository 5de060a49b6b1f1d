"""Request priority (``--schedule-policy priority``, vLLM's meaning: lower runs first): the
admission order of waiting requests, the victim when KV runs short and the resume order, and
a clear refusal of a priority under another policy."""

from __future__ import annotations

from typing import Any

import pytest

from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core.slots import SlotState
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.request import Request
from slotserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run_to_completion, text_of
from tests.engine.test_preemption import assert_kv_consistent, pooled, solo_text
from tests.engine.test_schedule_policy import _admission_order
from tests.fake_runner import FakeRunner


def submit(
    core: EngineCore, request_id: str, prompt: str, priority: int = 0, **params: Any
) -> Request:
    request = EngineCoreRequest(
        request_id, list(prompt.encode("utf-8")), SamplingParams(**params), priority
    )
    core.validate(request)
    return core.add_request(request)


def test_a_later_request_of_higher_priority_takes_the_next_free_slot() -> None:
    core, _ = make_core(FakeRunner(num_slots=1, max_seq_len=64), schedule_policy="priority")
    submit(core, "busy", "running", max_tokens=3)
    core.step()
    waiting: list[Request] = [
        submit(core, "low", "background job", priority=5, max_tokens=2),
        submit(core, "also-low", "another job", priority=5, max_tokens=2),
        submit(core, "urgent", "the user's turn", priority=-1, max_tokens=2),
        submit(core, "normal", "a request", max_tokens=2),
    ]
    assert _admission_order(core, waiting) == ["urgent", "normal", "low", "also-low"]
    core.check_integrity()


def test_kv_short_preempts_the_lowest_priority_first_and_resumes_the_highest_first() -> None:
    """Three sequences that cannot all keep their KV: the lowest priority gives it back, though
    it is not the youngest, and every output is what it would be alone."""
    runner = pooled(18, num_slots=3)
    core, _ = make_core(runner, prefix_cache=False, schedule_policy="priority")
    prompts = {"old-low": ("aaaaaaa1", 9), "mid": ("bbbbbbb2", 0), "young-high": ("ccccccc3", -2)}
    for request_id, (prompt, priority) in prompts.items():
        submit(core, request_id, prompt, priority=priority, max_tokens=24, ignore_eos=True)
    outputs: dict[str, list] = {}  # type: ignore[type-arg]
    preempted: set[str] = set()
    for _ in range(1000):
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
        assert_kv_consistent(core, runner)
        for slot in core.scheduler.slots.slots:
            if slot.state is SlotState.PREEMPTED and slot.sequence is not None:
                preempted.add(slot.sequence.request.request_id)
        if not core.scheduler.has_work:
            break
    assert preempted == {"old-low"}
    for request_id, (prompt, _) in prompts.items():
        assert text_of(outputs[request_id]) == solo_text(prompt, 24), request_id


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_priority_under_another_policy_is_refused_naming_the_flag(policy: str) -> None:
    core, _ = make_core(FakeRunner(num_slots=1, max_seq_len=64), schedule_policy=policy)
    with pytest.raises(InvalidRequestError, match="--schedule-policy priority") as refused:
        submit(core, "r", "hello", priority=1, max_tokens=2)
    assert refused.value.param == "priority"
    submit(core, "zero", "hello", priority=0, max_tokens=2)  # the default is always fine
    run_to_completion(core)
