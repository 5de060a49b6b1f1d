"""A BERT cross-encoder's head (``BertForSequenceClassification`` with one label): a query and a
document in one prompt, scored by the pooler (dense + tanh on [CLS]) and the classifier, then
the activation sentence-transformers' ``CrossEncoder.predict`` applies by default.

The engine carries token ids only, so the runner finds the pair's second segment itself: HF's
pair template is ``[CLS] query [SEP] document [SEP]``, with token type 0 up to and including
the first [SEP] and 1 after it. A query holds no [SEP] of its own (the route tokenizes text,
where "[SEP]" would only come from the user's markup), so the first one is the boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from slotserve.runners.pytorch.families.base import is_sequence_classifier

# sentence-transformers stores a non-default activation as a dotted torch path in
# ``config.json`` (``sentence_transformers.activation_fn``); these two are the ones it writes
# for one-label models.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
    "torch.nn.Sigmoid": torch.sigmoid,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.Identity": lambda x: x,
}


def score_activation(
    raw: Mapping[str, Any], name: str
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The activation of a sequence classifier's logit (BERT's here, a decoder's in
    ``score_head.py``); None for a folder that is not one. Raises for a classifier served
    nowhere here (several labels)."""
    if not is_sequence_classifier(raw):
        return None
    labels = int(raw.get("num_labels", len(raw.get("id2label") or {}) or 2))
    if labels != 1:
        raise ValueError(
            f"{name}: a cross-encoder with {labels} labels is not served (one label only: "
            "its logit is the relevance score)"
        )
    path = (raw.get("sentence_transformers") or {}).get("activation_fn")
    if path is None:
        return torch.sigmoid  # CrossEncoder's default for one label
    if path not in _ACTIVATIONS:
        raise ValueError(f"{name}: the cross-encoder activation {path!r} is not supported")
    return _ACTIVATIONS[path]


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
