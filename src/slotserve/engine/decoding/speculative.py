"""Speculative decoding: draft tokens proposed per sequence, verified by the runner
inside the step's one batched forward.

A generating sequence's decode chunk becomes ``[last token, d1 .. dk]``. The runner computes
logits at all ``k + 1`` positions and samples them **in order with the sequence's own
sampler**, stopping at the first sample that differs from the next draft; it returns the
accepted drafts and that one more token. For a greedy sequence that is the usual greedy
acceptance plus the correction token. For a sampled one it is the standard rule for a
one-hot draft: the draft is accepted with probability p(draft), and a rejection leaves a
sample of p conditioned on "not the draft". Because each produced token costs the sampler
exactly one draw, as without speculation, and both runners compute a token the same way
whatever else runs in the step, a request's tokens, logprobs and seeded samples are the
same with and without speculation.

What this module owns: the configuration (vLLM's ``--speculative-config`` keys), the
:class:`Proposer` interface with the n-gram prompt-lookup proposer, the per-step and
per-sequence switches that turn drafting off where it does not pay, and the counters.

How many drafts pay depends on the runner and on the sequence. The runner states what a
verification costs (``ModelInfo.verify_cost``, measured per runner: small on the PyTorch
runner, whose step reads the weights once whatever the tokens; large on llama.cpp, whose CPU
kernels scale with the tokens).
Each sequence keeps an estimate of the chance that its next draft is accepted (a moving
average over its verified drafts and, while it is not drafting, over the proposals it would
have made, checked against the token it then produced); each step it drafts the length with
the most expected tokens per unit of cost, or nothing when no length beats a plain step. A draft
model or MTP heads plug in as another :class:`Proposer`; the verification path needs nothing
else from them (the seed's MTP heads need checkpoints that ship them; none of the offline
models does).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Protocol

from slotserve.engine.config import SpeculativeConfig
from slotserve.engine.request import Sequence
from slotserve.engine.runner_interface import ModelInfo
from slotserve.engine.verify_cost import VerifyCost

logger = logging.getLogger(__name__)


class Proposer(Protocol):
    """Drafts for one sequence: up to ``limit`` tokens likely to follow ``token_ids``."""

    def propose(self, token_ids: TokenIds[int], limit: int) -> list[int]: ...


@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: the longest suffix of ``token_ids`` (``max_n`` down to ``min_n`` tokens)
    that occurred earlier; the tokens that followed its latest earlier occurrence."""

    min_n: int
    max_n: int

    def propose(self, token_ids: TokenIds[int], limit: int) -> list[int]:
        total = len(token_ids)
        if limit <= 0:
            return []
        tokens = list(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n :]
            # Latest occurrence first: recent text predicts best (and copying loops resolve).
            for start in range(total - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + limit]
                    if follow:
                        return follow
        return []


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters: drafts (verification chunks), drafted and accepted tokens,
    and accepted tokens by draft position (position 0 = the first draft token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def plus(self, other: SpecCounters | None) -> SpecCounters:
        """The sum, as a new object (``plus(None)``: a copy)."""
        other = other or SpecCounters()
        per_position = zip_longest(
            self.accepted_per_position, other.accepted_per_position, fillvalue=0
        )
        return SpecCounters(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            [a + b for a, b in per_position],
        )

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        missing = drafted - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position.extend([0] * missing)
        for position in range(accepted):
            self.accepted_per_position[position] += 1


# The acceptance estimate: where a sequence starts (a little better than a coin: prompt lookup
# proposes only what the context repeats), and the weight of each new observation (on
# llama.cpp, where a draft costs half a step, one miss ends a copy run's drafting and two or
# three right proposals start it again; benchmarks/RESULTS.md compares weights).
PRIOR_ACCEPTANCE = 0.6
ACCEPTANCE_WEIGHT = 0.25


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a step yields with ``drafts`` drafts, each accepted (after the one before it)
    with probability ``acceptance``: the correction token plus the accepted run."""
    return sum(acceptance**depth for depth in range(drafts + 1))


def best_draft_length(
    acceptance: float, cost: VerifyCost, limit: int, context: int = 0, alone: bool = False
) -> int:
    """The number of drafts (0..limit) with the most expected tokens per unit of step cost;
    0 when none beats a plain step. ``context``: the sequence's computed tokens; ``alone``:
    the step's only generating sequence (``VerifyCost.of``)."""
    best, best_rate = 0, 1.0
    for drafts in range(1, limit + 1):
        rate = expected_tokens(acceptance, drafts) / cost.of(drafts, context, alone)
        if rate > best_rate:
            best, best_rate = drafts, rate
    return best


class Speculator:
    """Decides, per step and sequence, how many drafts to verify, and keeps the counts. A
    sequence's own record (``Sequence.num_drafted_tokens``, ``num_accepted_tokens`` and
    ``draft_acceptance``) drives its switch-off."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_seq_len: int,
        equal_drafts: bool = False,
        proposer: Proposer | None = None,
        verify_cost: VerifyCost | None = None,
    ) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.verify_cost = verify_cost or VerifyCost()
        self.equal_drafts = equal_drafts  # the runner's chunk policy asks for equal chunks
        self.proposer = proposer or NgramProposer(
            config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.counters = SpecCounters()

    def plan(self, generating: list[Sequence], budget: int, in_flight: int) -> dict[int, list[int]]:
        """Drafts by slot for this step's generating sequences, ``budget`` tokens at most in
        all. None while more than ``disable_by_batch_size`` sequences are in flight
        (``in_flight``: generating, prefilling or waiting; vLLM's reading): drafts pay at small
        batches only (a batched decode step already uses the weights it reads many times
        over), and a step that also prefills has no spare compute to verify with (see
        benchmarks/RESULTS.md)."""
        if not generating or in_flight > self.config.disable_by_batch_size:
            return {}
        planned: dict[int, list[int]] = {}
        for seq in generating:
            assert seq.slot is not None
            # Room for the drafts and the token after them: the length limit and the context.
            limit = min(
                budget,
                seq.max_tokens - seq.num_output_tokens - 1,
                self.max_seq_len - seq.num_computed_tokens - 1,
            )
            drafts = self.drafts(seq, limit, alone=len(generating) == 1)
            if drafts:
                planned[seq.slot] = drafts
                budget -= len(drafts)
        return equalize_drafts(planned) if self.equal_drafts else planned

    def drafts(self, seq: Sequence, limit: int, alone: bool) -> list[int]:
        """Up to ``limit`` (and the configured count of) drafts for ``seq``: as many of the
        proposer's as pay for their verification (module docstring)."""
        config = self.config
        if seq.grammar is not None:
            return []  # a draft may break the grammar; the mask covers one position a step
        floor = config.min_acceptance_rate
        if (
            floor is not None
            and seq.num_drafted_tokens >= config.probe_tokens
            and seq.num_accepted_tokens < floor * seq.num_drafted_tokens
        ):
            return []
        _check_shadow(seq)
        proposal = self.proposer.propose(seq.token_ids, min(limit, config.num_speculative_tokens))
        if not proposal:
            return []
        length = best_draft_length(
            _acceptance(seq), self.verify_cost, len(proposal), seq.num_computed_tokens, alone
        )
        if length == 0:
            # Not worth verifying now; whether it would have been right still teaches.
            seq.shadow_draft = (len(seq.token_ids), proposal[0])
        return proposal[:length]

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.counters.record(drafted, accepted)
        seq.num_drafted_tokens += drafted
        seq.num_accepted_tokens += accepted
        for depth in range(min(accepted + 1, drafted)):  # drafts past a rejection say nothing
            _observe(seq, depth < accepted)


def _acceptance(seq: Sequence) -> float:
    return PRIOR_ACCEPTANCE if seq.draft_acceptance is None else seq.draft_acceptance


def _observe(seq: Sequence, accepted: bool) -> None:
    estimate = _acceptance(seq)
    seq.draft_acceptance = estimate + ACCEPTANCE_WEIGHT * (float(accepted) - estimate)


def _check_shadow(seq: Sequence) -> None:
    """Scores the proposal held back last step against the token the sequence produced."""
    if seq.shadow_draft is None:
        return
    position, token = seq.shadow_draft
    if position < len(seq.token_ids):
        _observe(seq, seq.token_ids[position] == token)
        seq.shadow_draft = None


def build_speculator(config: SpeculativeConfig | None, info: ModelInfo) -> Speculator | None:
    if config is None:
        return None
    if info.speculative_unsupported is not None:
        logger.warning("speculative decoding disabled: %s", info.speculative_unsupported)
        return None
    return Speculator(
        config,
        info.max_seq_len,
        info.chunk_policy.equal_chunks,
        verify_cost=info.verify_cost,
    )


def equalize_drafts(drafts: dict[int, list[int]]) -> dict[int, list[int]]:
    """All drafting sequences of a step cut to the shortest draft (runners that run one
    forward call per chunk length, llama.cpp's, then verify them in one call)."""
    lengths = [len(d) for d in drafts.values() if d]
    if not lengths:
        return drafts
    shortest = min(lengths)
    return {key: d[:shortest] for key, d in drafts.items()}
