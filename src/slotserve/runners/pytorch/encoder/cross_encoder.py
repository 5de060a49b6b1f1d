"""A BERT cross-encoder's head (``BertForSequenceClassification`` with one label): a query and a
document in one prompt, scored by the pooler (dense + tanh on [CLS]) and the classifier, then
the activation sentence-transformers' ``CrossEncoder.predict`` applies by default (as
``config.json`` names it: ``families/base.py``, ``score_activation``).

The engine carries token ids only, so the runner finds the pair's second segment itself: HF's
pair template is ``[CLS] query [SEP] document [SEP]``, with token type 0 up to and including
the first [SEP] and 1 after it. A query holds no [SEP] of its own (the route tokenizes text,
where "[SEP]" would only come from the user's markup), so the first one is the boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F


def token_types(token_ids: Sequence[int], sep_id: int, device: torch.device) -> torch.Tensor:
    """0 up to and including the first [SEP], 1 after it (all 0 when there is none)."""
    types = torch.zeros(len(token_ids), dtype=torch.int64, device=device)
    if sep_id in token_ids:
        types[list(token_ids).index(sep_id) + 1 :] = 1
    return types


def score(
    weights: Mapping[str, torch.Tensor],
    hidden: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> float:
    """The pair's relevance score from the last layer's hidden states (one row per token)."""
    pooled = torch.tanh(
        F.linear(hidden[0], weights["pooler.dense.weight"], weights["pooler.dense.bias"])
    )
    logit = F.linear(pooled, weights["classifier.weight"], weights["classifier.bias"])
    return float(activation(logit.float())[0])
