"""A deterministic stand-in for a model runner, for engine-logic tests.

Tokens are bytes (ids 0-255) plus ``EOS`` (256). For a prompt whose text is a key of
``replies`` the fake "model" emits that reply's bytes one token per step, then EOS; for any
other prompt it emits the letters ``a..z`` cyclically forever. Every call is recorded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.outputs import SampledToken
from slotserve.engine.runner_interface import ModelInfo, ScheduledChunk
from slotserve.engine.sampling_params import SamplingParams, StructuredOutput

EOS = 256


class ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace") or "<eos>"


@dataclass
class FakeRunner:
    num_slots: int = 4
    max_seq_len: int = 256
    replies: dict[str, bytes] = field(default_factory=dict)
    fail_on_execute: bool = False
    equal_prefill_chunks: bool = False
    # Seconds one forward pass takes: a fake model as slow as a real one, for tests that race
    # the engine thread against the event loop.
    forward_seconds_per_step: float = 0.0
    batches: list[list[ScheduledChunk]] = field(default_factory=list)
    added: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    # slot -> tokens whose "KV" is held: checks the engine feeds contiguous positions.
    kv: dict[int, list[int]] = field(default_factory=dict)

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            name="fake",
            vocab_size=257,
            num_slots=self.num_slots,
            max_seq_len=self.max_seq_len,
            eog_token_ids=frozenset({EOS}),
            chat_template=None,
            bos_token="",
            eos_token="",
            runner="fake",
            equal_prefill_chunks=self.equal_prefill_chunks,
        )

    @property
    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    @property
    def forward_seconds(self) -> float:
        return 0.0

    def check_structured_output(self, spec: StructuredOutput) -> None:
        raise InvalidRequestError("no grammar support in the fake runner", "response_format")

    def add_sequence(
        self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None
    ) -> None:
        assert slot not in self.kv, f"slot {slot} reused before removal"
        self.added.append(slot)
        self.kv[slot] = []

    def execute(self, chunks: Sequence[ScheduledChunk]) -> dict[int, SampledToken]:
        self.batches.append(list(chunks))
        if self.forward_seconds_per_step:
            time.sleep(self.forward_seconds_per_step)
        if self.fail_on_execute:
            raise RuntimeError("simulated device failure")
        sampled = {}
        for chunk in chunks:
            held = self.kv[chunk.slot]
            assert chunk.start_pos == len(held), "positions must continue the slot's KV"
            held.extend(chunk.token_ids)
            if chunk.sample:
                sampled[chunk.slot] = SampledToken(self._next(held))
        return sampled

    def remove_sequence(self, slot: int) -> None:
        self.removed.append(slot)
        self.kv.pop(slot, None)

    def close(self) -> None:
        pass

    def _next(self, held: list[int]) -> int:
        for prompt, reply in self.replies.items():
            prompt_ids = list(prompt.encode("utf-8"))
            if held[: len(prompt_ids)] == prompt_ids:
                done = len(held) - len(prompt_ids)
                return reply[done] if done < len(reply) else EOS
        return ord("a") + len(held) % 26
