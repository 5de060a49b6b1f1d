"""What verifying speculative drafts costs a runner, in plain decode steps
(``engine/decoding/speculative.py`` weighs drafts against it; ``ModelInfo.verify_cost``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyCost:
    """A one-sequence step that verifies ``d >= 1`` drafts costs ``1 + first + per_draft * d``
    plain decode steps (``first``: whatever switches on with a multi-token chunk). Measured per
    runner with ``benchmarks/verify_cost.py``; the defaults are the PyTorch runner's (its
    one-sequence step reads the weights once whatever the tokens).

    ``lone_step_pays_a_draft_from``: from this many tokens of context, a sequence decoding
    alone makes the runner compute one token more anyway (llama.cpp's ballast, which keeps its
    attention batch-invariant), so the plain step costs what a one-draft verification does and
    the first draft takes that token's place."""

    first: float = 0.0
    per_draft: float = 0.025
    lone_step_pays_a_draft_from: int | None = None

    def of(self, drafts: int, context: int = 0, alone: bool = False) -> float:
        """The step's cost with ``drafts`` drafts, in plain steps of this sequence."""
        if drafts == 0:
            return 1.0
        verify = 1.0 + self.first + self.per_draft * drafts
        start = self.lone_step_pays_a_draft_from
        if alone and start is not None and context >= start:
            return verify / (1.0 + self.first + self.per_draft)
        return verify
