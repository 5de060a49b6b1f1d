"""The step loop: finishing rules, stop strings, UTF-8, queueing, cancellation, failures."""

from __future__ import annotations

import pytest

from slotserve.engine.client.inproc_client import InprocClient
from slotserve.engine.core.engine_core import EngineCore
from slotserve.engine.core.slots import SlotState
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RunnerFailure,
)
from slotserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run_to_completion, submit, text_of
from tests.fake_runner import EOS, FakeRunner


def test_reply_ends_at_eos_and_counts_it() -> None:
    core, _ = make_core(FakeRunner(replies={"Q": b"Hello"}))
    submit(core, "r", "Q", temperature=0)
    outputs = run_to_completion(core)["r"]
    assert text_of(outputs) == "Hello"
    final = outputs[-1]
    assert final.finished and final.deltas[-1].finish_reason == "stop"
    assert final.num_output_tokens == 6  # five bytes and EOS


def test_ignore_eos_runs_to_max_tokens() -> None:
    core, _ = make_core(FakeRunner(replies={"Q": b"Hi"}))
    submit(core, "r", "Q", temperature=0, ignore_eos=True, max_tokens=5)
    outputs = run_to_completion(core)["r"]
    assert outputs[-1].num_output_tokens == 5
    assert outputs[-1].deltas[-1].finish_reason == "length"


def test_a_request_without_max_tokens_stops_at_the_servers_default() -> None:
    # Within the context: a prompt of 1 token leaves 255 of the fake model's 256 positions.
    for cap, given, expected in ((5, None, 5), (5, 20, 20), (1000, None, 255), (0, None, 255)):
        core, _ = make_core(FakeRunner(max_seq_len=256), max_tokens_default=cap)
        submit(core, "r", "Q", temperature=0, ignore_eos=True, max_tokens=given)
        final = run_to_completion(core)["r"][-1]
        assert final.num_output_tokens == expected, (cap, given)
        assert final.deltas[-1].finish_reason == "length"


def test_stop_token_id_ends_the_sequence_without_text() -> None:
    core, _ = make_core(FakeRunner(replies={"Q": b"abc;def"}))
    submit(core, "r", "Q", temperature=0, stop_token_ids=(ord(";"),))
    outputs = run_to_completion(core)["r"]
    assert text_of(outputs) == "abc"
    assert outputs[-1].deltas[-1].stop_reason == ord(";")


def test_stop_string_split_across_tokens_is_cut_and_never_streamed() -> None:
    core, _ = make_core(FakeRunner(replies={"Q": b"Hello STOP world"}))
    submit(core, "r", "Q", temperature=0, stop=("STOP",))
    outputs = run_to_completion(core)["r"]
    deltas = [d.text for o in outputs for d in o.deltas]
    assert "".join(deltas) == "Hello "
    assert not any("S" in d for d in deltas), f"part of the stop string leaked: {deltas}"
    assert outputs[-1].deltas[-1].finish_reason == "stop"
    assert outputs[-1].deltas[-1].stop_reason == "STOP"


def test_text_held_back_for_a_stop_string_is_released_when_it_does_not_match() -> None:
    core, _ = make_core(FakeRunner(replies={"Q": b"Hello STUFF"}))
    submit(core, "r", "Q", temperature=0, stop=("STOP",))
    assert text_of(run_to_completion(core)["r"]) == "Hello STUFF"


def test_multibyte_utf8_split_across_tokens_is_never_broken() -> None:
    reply = "héllo → 😀 done"
    core, _ = make_core(FakeRunner(replies={"Q": reply.encode("utf-8")}))
    submit(core, "r", "Q", temperature=0)
    outputs = run_to_completion(core)["r"]
    deltas = [d.text for o in outputs for d in o.deltas]
    assert "".join(deltas) == reply
    assert all("\ufffd" not in d for d in deltas)
    # The 4-byte emoji arrives as four tokens; three steps emit nothing.
    assert deltas.count("") >= 3


def test_full_queue_rejects_at_once() -> None:
    # The 429 decision is the hand-off's: it counts its inbox against what the core published.
    core, _ = make_core(FakeRunner(num_slots=1), max_queue=2)
    client = InprocClient(core, deliver=lambda outputs: None)  # no thread: driven by hand

    def send(request_id: str) -> None:
        client.add_request(EngineCoreRequest(request_id, [1], SamplingParams(max_tokens=3)))

    for request_id in ("a", "b", "c"):  # "a" will take the free slot
        send(request_id)
    with pytest.raises(QueueFullError):
        send("d")
    assert client.take_inbox()
    outputs = run_to_completion(core)
    assert set(outputs) == {"a", "b", "c"}


def _slot_states(core: EngineCore) -> list[SlotState]:
    return [s.state for s in core.scheduler.slots.slots]


def test_abort_mid_prefill_frees_the_slot_within_one_step() -> None:
    core, runner = make_core(max_batch_tokens=9, prefill_chunk=8)
    submit(core, "long", "p" * 64, max_tokens=4)
    core.step()
    assert _slot_states(core)[0] is SlotState.PREFILLING
    batches_before = len(runner.batches)
    core.abort("long")
    outputs = core.step()
    assert _slot_states(core)[0] is SlotState.FREE
    assert runner.removed == [0] and runner.active == set()
    assert runner.kv[0] == list(b"p" * 8), "the computed chunk stays cached"
    core.check_integrity()
    assert len(runner.batches) == batches_before, "no forward work after the abort"
    assert outputs[0].finished
    assert [d.finish_reason for d in outputs[0].deltas] == ["abort"]


def test_abort_mid_decode_frees_the_slot_within_one_step() -> None:
    core, runner = make_core()
    submit(core, "a", "x", max_tokens=100)
    submit(core, "b", "y", max_tokens=10)
    for _ in range(3):
        core.step()
    core.abort("a")
    core.step()
    assert _slot_states(core)[0] is SlotState.FREE
    assert 0 in runner.removed
    assert [c.slot for c in runner.batches[-1]] == [1], "no forward work for the aborted slot"
    assert core.snapshot().requests_aborted == 1


def test_abort_of_a_waiting_request_removes_it_from_the_queue() -> None:
    core, runner = make_core(FakeRunner(num_slots=1))
    submit(core, "a", "x", max_tokens=10)
    submit(core, "b", "y", max_tokens=10)
    core.step()
    core.abort("b")
    core.step()
    assert list(core.scheduler.waiting) == []
    assert runner.added == [0]


def test_runner_failure_poisons_the_engine_until_a_new_one_is_built() -> None:
    runner = FakeRunner(num_slots=1)
    core, _ = make_core(runner)
    submit(core, "running", "x", max_tokens=10)
    submit(core, "queued", "y", max_tokens=10)  # waits for the only slot
    runner.fail_on_execute = True
    outputs = {o.request_id: o for o in core.step()}
    for request_id in ("running", "queued"):
        out = outputs[request_id]
        assert out.finished and "simulated device failure" in (out.error or "")
        assert [d.finish_reason for d in out.deltas] == ["error"]
    assert _slot_states(core) == [SlotState.FREE]
    assert core.unhealthy is not None and "simulated device failure" in core.unhealthy
    with pytest.raises(EngineDeadError):
        submit(core, "late", "z", max_tokens=2)
    assert core.step() == [] and len(runner.batches) == 1, "no work after the failure"
    # Recovery: a new engine over a working runner (the server's reload builds both anew).
    runner.fail_on_execute = False
    fresh, _ = make_core(runner)
    submit(fresh, "next", "y", max_tokens=2)
    assert run_to_completion(fresh)["next"][-1].num_output_tokens == 2


def test_non_finite_logits_poison_the_engine() -> None:
    runner = FakeRunner()
    core, _ = make_core(runner)
    submit(core, "r", "x", max_tokens=10)
    runner.fail_with = RunnerFailure("non-finite logits for sequence 0")
    (out,) = core.step()
    assert out.error is not None and "non-finite logits" in out.error
    assert core.unhealthy is not None and "RunnerFailure" in core.unhealthy


def test_prompt_longer_than_the_context_is_refused() -> None:
    core, _ = make_core(FakeRunner(max_seq_len=32))
    with pytest.raises(InvalidRequestError) as err:
        core.validate(EngineCoreRequest("r", [1] * 32, SamplingParams()))
    assert "32" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        core.validate(EngineCoreRequest("r", [1] * 10, SamplingParams(max_tokens=30)))
    assert err.value.param == "max_tokens"


def test_max_tokens_defaults_to_the_room_left_in_the_context() -> None:
    core, _ = make_core(FakeRunner(max_seq_len=40))
    submit(core, "r", "x" * 30)
    final = run_to_completion(core)["r"][-1]
    assert final.num_output_tokens == 10
    assert final.deltas[-1].finish_reason == "length"


def test_n_sequences_are_independent_choices() -> None:
    core, runner = make_core()
    submit(core, "r", "Q", n=3, max_tokens=4, temperature=0)
    outputs = run_to_completion(core)["r"]
    assert {d.index for o in outputs for d in o.deltas} == {0, 1, 2}
    assert outputs[-1].num_output_tokens == 12
    assert sorted(runner.removed) == [0, 1, 2]


def test_eos_is_reported_by_the_model_info_not_hard_coded() -> None:
    core, _ = make_core(FakeRunner(replies={"Q": b"ab"}))
    submit(core, "r", "Q", temperature=0, max_tokens=10)
    outputs = run_to_completion(core)["r"]
    assert outputs[-1].deltas[-1].token_ids[-1] == EOS


def test_slow_queue_waits_and_slow_steps_are_logged_with_the_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner = FakeRunner(num_slots=1, forward_seconds_per_step=0.002)
    core, _ = make_core(runner, slow_step_warn_s=0.001, slow_queue_warn_s=0.001)
    submit(core, "first", "x", max_tokens=3)
    submit(core, "second", "y", max_tokens=1)  # waits for the only slot
    with caplog.at_level("WARNING"):
        run_to_completion(core)
    queued = [r for r in caplog.records if "queued" in r.getMessage()]
    assert any(getattr(r, "request_id", None) == "second" for r in queued)
    slow = [r for r in caplog.records if "slow step" in r.getMessage()]
    assert slow and getattr(slow[0], "request_id", None) == "first"


def test_a_request_past_its_deadline_is_ended_and_frees_its_slot() -> None:
    runner = FakeRunner(num_slots=1, forward_seconds_per_step=0.01)
    core, _ = make_core(runner, request_timeout_s=0.05)
    submit(core, "slow", "x", max_tokens=200, ignore_eos=True)
    outputs = run_to_completion(core)["slow"]
    final = outputs[-1]
    assert final.finished and final.timed_out and final.error is None
    assert final.deltas[-1].finish_reason == "abort"
    assert 0 < final.num_output_tokens < 200
    assert _slot_states(core) == [SlotState.FREE] and core.snapshot().requests_timed_out == 1
