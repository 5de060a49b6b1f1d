"""The PyTorch runner's batched sampler on CPU tensors: each stage batched over rows gives each
row what it would get alone, seeded rows draw their own streams, and the filters, biases,
penalties and log-probabilities do what the fields say."""

from __future__ import annotations

from typing import Any

import torch

from slotserve.engine.sampling_params import SamplingParams
from slotserve.runners.pytorch.step.penalties import Penalties, apply_penalties
from slotserve.runners.pytorch.step.sampler import (
    PREFIX_TOKENS,
    SequenceSampler,
    new_sequence_sampler,
    sample,
)

VOCAB = 64
CPU = torch.device("cpu")


def _sampler(seed: int | None = None, **fields: Any) -> SequenceSampler:
    prompt = fields.pop("prompt", ())
    return new_sequence_sampler(SamplingParams(max_tokens=8, **fields), list(prompt), seed, CPU)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_seeded_rows_draw_the_same_tokens_alone_and_beside_any_others() -> None:
    logits = _logits(5)
    fields: list[dict[str, Any]] = [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.1},
        {"temperature": 0.0},
    ]
    alone = []
    for row, f in enumerate(fields):
        s = _sampler(seed=100 + row, **f)
        alone.append([sample(logits[row : row + 1], [s])[0].token_id for _ in range(6)])
    batched = [_sampler(seed=100 + row, **f) for row, f in enumerate(fields)]
    others = [_sampler(temperature=1.0) for _ in range(3)]
    together = [[] for _ in fields]  # type: list[list[int]]
    for _ in range(6):
        rows = torch.cat([logits, _logits(3, seed=9)])
        for row, token in enumerate(sample(rows, [*batched, *others])[: len(fields)]):
            together[row].append(token.token_id)
    assert together == alone


def test_filters_keep_what_their_fields_say() -> None:
    logits = _logits(1)
    best = int(logits.argmax())
    for fields in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        s = _sampler(seed=1, temperature=1.0, **fields)
        assert {sample(logits, [s])[0].token_id for _ in range(20)} == {best}, fields
    top3 = set(logits[0].topk(3).indices.tolist())
    s = _sampler(seed=2, temperature=2.0, top_k=3)
    assert {sample(logits, [s])[0].token_id for _ in range(60)} <= top3
    # top_k off (0 or -1) beside another filter leaves that filter alone to decide.
    for off in (0, -1):
        s = _sampler(seed=3, temperature=2.0, top_k=off, top_p=0.95)
        assert len({sample(logits, [s])[0].token_id for _ in range(60)}) > 3, off


def test_bias_and_penalties_move_the_greedy_choice() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 1.0
    biased = _sampler(temperature=0.0, logit_bias=((3, 5.0),))
    assert sample(logits, [biased])[0].token_id == 3
    repeated = _sampler(prompt=(7,), temperature=0.0, repetition_penalty=2.0)
    logits[0, 9] = 0.8
    assert sample(logits, [repeated])[0].token_id == 9  # 7's 1.0 halved below 9's 0.8
    present = _sampler(temperature=0.0, presence_penalty=0.5)
    assert sample(logits, [present])[0].token_id == 7
    assert sample(logits, [present])[0].token_id == 9  # 7 was generated: 0.5 less


def test_logprobs_come_from_the_raw_logits_with_the_asked_alternatives() -> None:
    logits = _logits(3)
    samplers = [
        _sampler(temperature=0.0, logprobs=2),
        _sampler(temperature=0.0),
        _sampler(temperature=0.0, logprobs=0),
    ]
    tokens = sample(logits, samplers)
    expected = torch.log_softmax(logits, dim=-1)
    assert tokens[0].logprob == float(expected[0, tokens[0].token_id])
    assert [t for t, _ in tokens[0].top_logprobs] == expected[0].topk(2).indices.tolist()
    assert tokens[1].logprob is None and tokens[2].top_logprobs == ()


def _whole_sort_draw(logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor) -> int:
    """The filters over the whole vocabulary sorted at once: what a filtered draw means."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    keep = torch.arange(len(ordered)) < (params.top_k if params.top_k > 0 else len(ordered))
    keep &= ordered.cumsum(0) - ordered < params.top_p
    keep &= ordered >= params.min_p * ordered[0]
    keep[0] = True
    cdf = torch.where(keep, ordered, torch.zeros_like(ordered)).cumsum(0)
    return int(order[torch.searchsorted(cdf, uniform * cdf[-1:])])


def test_filtered_draws_over_a_large_vocabulary_are_those_of_a_whole_sort() -> None:
    # Past PREFIX_TOKENS: peaked rows are settled by their most likely tokens, flat ones
    # (top_p, min_p keeping thousands) sort the whole row; alone or batched alike.
    vocab = 4 * PREFIX_TOKENS
    generator = torch.Generator().manual_seed(5)
    peaked = torch.randn(4, vocab, generator=generator) * 4
    flat = torch.randn(4, vocab, generator=generator) * 0.1
    logits = torch.cat([peaked, flat])
    fields: list[dict[str, Any]] = [
        {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 1.2, "min_p": 0.01},
        {"temperature": 0.7, "top_k": 2000, "top_p": 0.99},
    ]
    rows = [(row, fields[row % len(fields)]) for row in range(len(logits))]
    expected = []
    for row, f in rows:
        uniform = torch.rand(1, generator=torch.Generator().manual_seed(row))
        expected.append(_whole_sort_draw(logits[row], SamplingParams(max_tokens=1, **f), uniform))
    samplers = [
        new_sequence_sampler(SamplingParams(max_tokens=1, **f), [], row, CPU) for row, f in rows
    ]
    assert [t.token_id for t in sample(logits, samplers)] == expected
    for row, f in rows:
        alone = new_sequence_sampler(SamplingParams(max_tokens=1, **f), [], row, CPU)
        assert sample(logits[row : row + 1], [alone])[0].token_id == expected[row]


def test_penalties_touch_only_their_tokens_with_the_whole_row_arithmetic() -> None:
    # The sparse update gives every logit the bits of the dense definition over the row.
    vocab, prompt = 4 * PREFIX_TOKENS, [5, 9, 9, 700, 4000]
    generated = [9, 12, 12, 12, 3000]
    params = SamplingParams(
        max_tokens=8, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.7
    )
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(11)) * 3
    penalties = Penalties.of(params, prompt, CPU)
    assert penalties is not None
    for token in generated:
        penalties.add(token)
    adjusted = logits.clone()
    apply_penalties(adjusted, [None, penalties])
    expected = logits[1].clone()
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[prompt + generated] = True
    penalty = torch.tensor(1.3)
    expected = torch.where(
        seen, torch.where(expected > 0, expected / penalty, expected * penalty), expected
    )
    counts = torch.bincount(torch.tensor(generated), minlength=vocab).float()
    expected = expected - torch.tensor(-0.7) * counts - torch.tensor(0.4) * (counts > 0).float()
    assert torch.equal(adjusted[0], logits[0]) and torch.equal(adjusted[1], expected)


def test_greedy_rows_take_torch_s_argmax_ties_and_nan_included() -> None:
    # The first of tied largest values, a NaN as the largest, rows of -inf: as torch.argmax.
    logits = torch.randn(8, 4096, generator=torch.Generator().manual_seed(3))
    logits[1, [10, 900, 4000]] = 50.0
    logits[2, [5, 77]] = float("nan")
    logits[3] = float("-inf")
    logits[4, 4095] = float("inf")
    logits[5, :] = 0.0
    logits[5, 7] = -0.0
    expected = logits.argmax(dim=-1).tolist()
    assert expected[1:4] == [10, 5, 0]
    greedy = [_sampler(temperature=0.0) for _ in range(8)]
    assert [t.token_id for t in sample(logits, greedy)] == expected
    # Beside a drawing row, the greedy ones still take the argmax.
    mixed = [*greedy[:7], _sampler(seed=1, temperature=1.0)]
    assert [t.token_id for t in sample(logits, mixed)][:7] == expected[:7]
