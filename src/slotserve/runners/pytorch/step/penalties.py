"""Repetition, presence and frequency penalties, as OpenAI and vLLM define them: the
repetition penalty divides the positive logits of tokens in the prompt or generated and
multiplies the negative ones; presence and frequency subtract from generated tokens' logits.

A sequence keeps the distinct token ids each penalty touches (:class:`TokenIds`), so a step
gathers and scatters those logits alone instead of passing over the whole vocabulary once per
penalty and row; a logit no penalty touches keeps its bits, and one it touches gets the same
arithmetic as over the whole row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slotserve.engine.sampling_params import SamplingParams


@dataclass
class TokenIds:
    """Distinct token ids in the order first met (``ids``, a device tensor to index with) and,
    where they are counted (presence and frequency), how many times each was met (``counts``,
    float32, aligned with ``ids``; None for the repetition penalty, which only asks whether)."""

    positions: dict[int, int]  # token id → its place in ids
    ids: torch.Tensor
    counts: torch.Tensor | None

    @classmethod
    def of(cls, tokens: Sequence[int], device: torch.device, counted: bool = False) -> TokenIds:
        times = Counter(tokens)
        positions = {token: at for at, token in enumerate(times)}
        counts = None
        if counted:
            counts = torch.tensor(list(times.values()), dtype=torch.float32, device=device)
        return cls(positions, torch.tensor(list(times), dtype=torch.int64, device=device), counts)

    def add(self, token: int) -> None:
        at = self.positions.get(token)
        if at is None:
            self.positions[token] = len(self.positions)
            device = self.ids.device
            new = torch.tensor([token], dtype=torch.int64, device=device)
            self.ids = torch.cat([self.ids, new])
            if self.counts is not None:
                one = torch.ones(1, dtype=torch.float32, device=device)
                self.counts = torch.cat([self.counts, one])
        elif self.counts is not None:
            self.counts[at] += 1.0


@dataclass
class Penalties:
    """One sequence's penalties and the tokens they apply to: ``seen`` (prompt and generated:
    the repetition penalty), ``generated`` (presence and frequency); None where off."""

    repetition: float
    presence: float
    frequency: float
    seen: TokenIds | None
    generated: TokenIds | None

    @classmethod
    def of(
        cls, params: SamplingParams, prompt_token_ids: Sequence[int], device: torch.device
    ) -> Penalties | None:
        if not params.has_penalties:
            return None
        repeating = params.repetition_penalty != 1.0
        counting = bool(params.presence_penalty or params.frequency_penalty)
        return cls(
            params.repetition_penalty,
            params.presence_penalty,
            params.frequency_penalty,
            TokenIds.of(prompt_token_ids, device) if repeating else None,
            TokenIds.of((), device, counted=True) if counting else None,
        )

    def add(self, token: int) -> None:
        """The sequence produced ``token``."""
        if self.seen is not None:
            self.seen.add(token)
        if self.generated is not None:
            self.generated.add(token)


def apply_penalties(adjusted: torch.Tensor, penalties: Sequence[Penalties | None]) -> None:
    """Row ``i`` of ``adjusted`` (float32 logits) takes ``penalties[i]``, in place: the
    repetition penalty first, then presence and frequency."""
    device = adjusted.device
    repeating: list[tuple[int, Penalties, TokenIds]] = []
    counting: list[tuple[int, Penalties, TokenIds]] = []
    for row, p in enumerate(penalties):
        if p is not None and p.seen is not None and p.seen.positions:
            repeating.append((row, p, p.seen))
        if p is not None and p.generated is not None and p.generated.positions:
            counting.append((row, p, p.generated))
    if repeating:
        rows, ids = _places(repeating)
        penalty = _spread([(p.repetition, seen) for _, p, seen in repeating], device)
        part = adjusted[rows, ids]
        adjusted[rows, ids] = torch.where(part > 0, part / penalty, part * penalty)
    if counting:
        rows, ids = _places(counting)
        counts = torch.cat([_counts(generated) for _, _, generated in counting])
        frequency = _spread([(p.frequency, generated) for _, p, generated in counting], device)
        presence = _spread([(p.presence, generated) for _, p, generated in counting], device)
        part = adjusted[rows, ids] - frequency * counts
        # Every generated token was met at least once: the dense form's presence · (count > 0)
        # is presence · 1, the same bits.
        adjusted[rows, ids] = part - presence


def _counts(tokens: TokenIds) -> torch.Tensor:
    assert tokens.counts is not None, "presence and frequency count their tokens"
    return tokens.counts


def _places(
    rows: Sequence[tuple[int, Penalties, TokenIds]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, token id) places of each row's tokens, flattened."""
    return (
        torch.cat([torch.full_like(tokens.ids, row) for row, _, tokens in rows]),
        torch.cat([tokens.ids for _, _, tokens in rows]),
    )


def _spread(values: Sequence[tuple[float, TokenIds]], device: torch.device) -> torch.Tensor:
    """Each row's value once per token of its set, flattened as :func:`_places` is."""
    return torch.cat(
        [torch.full((len(t.positions),), v, dtype=torch.float32, device=device) for v, t in values]
    )
