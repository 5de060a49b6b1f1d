"""A decoder served as a reranker: a (query, document) pair is one prompt, and its relevance
score is a linear head on the last token's final-norm state, through an activation.

Two forms of checkpoint serve so:

- a ``<Family>ForSequenceClassification`` folder with one label (Qwen3-Reranker converted to a
  classifier, as sentence-transformers' ``CrossEncoder`` loads it): the head is its
  ``score.weight``, the activation the one sentence-transformers names (sigmoid by default);
- a causal LM scored by its own next-token logits (Qwen3-Reranker as released: "yes" against
  "no"), named by ``--classifier-from-token`` (vLLM's ``classifier_from_token``). With two
  tokens (false, true) the score is ``sigmoid(logit[true] - logit[false])``, the softmax of the
  pair at the true token; with one, ``sigmoid(logit[token])``. The head is the LM head's rows,
  their difference for two tokens, so no vocabulary-wide logits are computed.

The head is applied in float64 to the pooled state (``runners/pooling.py``), a row at a time:
a score never depends on what ran beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slotserve.runners.pytorch.families.base import CLASSIFIER_WEIGHT, score_activation
from slotserve.runners.pytorch.load.checkpoint import Checkpoint
from slotserve.runners.pytorch.load.tokenizer import HfTokenizer


def sigmoid(logit: float) -> float:
    return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1 + math.exp(logit))


@dataclass(frozen=True)
class ScoreHead:
    weight: np.ndarray[Any, Any]  # float64, one value per hidden unit
    activation: Callable[[float], float]

    def __call__(self, state: np.ndarray[Any, Any]) -> list[float]:
        """The score of a pooled final-norm state (float, ``[hidden]``)."""
        return [self.activation(float(np.dot(state.astype(np.float64), self.weight)))]


def classifier_activation(checkpoint: Checkpoint) -> Callable[[float], float] | None:
    """A sequence classifier folder's activation on its one logit; None for any other
    checkpoint (a GGUF file, a causal LM)."""
    torch_activation = score_activation(checkpoint.raw_config, checkpoint.name)
    if torch_activation is None:
        return None
    if torch_activation is torch.sigmoid:
        return sigmoid
    return lambda logit: float(torch_activation(torch.tensor(logit)))


def token_ids(tokenizer: HfTokenizer, tokens: Sequence[str], checkpoint: Checkpoint) -> list[int]:
    """The vocabulary ids of ``--classifier-from-token``'s tokens, each one whole token (as
    vLLM reads them); none without the flag."""
    if not tokens:
        return []
    if classifier_activation(checkpoint) is not None:
        raise ValueError(
            f"{checkpoint.name} is a sequence classifier, scored by its own head: "
            "--classifier-from-token is for a causal LM"
        )
    if not 1 <= len(tokens) <= 2:
        raise ValueError("--classifier-from-token takes one token, or two: false then true")
    ids = []
    for token in tokens:
        token_id = tokenizer.vocabulary_id(token)
        if token_id is None:
            raise ValueError(
                f"{checkpoint.name}: {token!r} is not a token of the model's vocabulary"
            )
        ids.append(token_id)
    return ids


def choose(
    checkpoint: Checkpoint, classifier: torch.Tensor | None, lm_head_rows: torch.Tensor | None
) -> ScoreHead | None:
    """The model's score head, None for a generative model: a sequence classifier's (its
    weights set aside by the loader), or the LM head's rows of the classifier tokens."""
    activation = classifier_activation(checkpoint)
    if activation is not None:
        if classifier is None:
            raise ValueError(
                f"{checkpoint.name}: a sequence classifier without {CLASSIFIER_WEIGHT}"
            )
        return from_classifier(classifier, activation)
    return None if lm_head_rows is None else from_lm_head(lm_head_rows)


def from_lm_head(rows: torch.Tensor) -> ScoreHead:
    """The head over the LM head's rows of the classifier tokens (``[1 or 2, hidden]``)."""
    rows64 = rows.double().cpu().numpy()
    weight = rows64[1] - rows64[0] if len(rows64) == 2 else rows64[0]
    return ScoreHead(weight, sigmoid)


def from_classifier(weight: torch.Tensor, activation: Callable[[float], float]) -> ScoreHead:
    if weight.dim() != 2 or weight.shape[0] != 1:
        raise ValueError(f"{CLASSIFIER_WEIGHT} has shape {tuple(weight.shape)}: one label only")
    return ScoreHead(weight[0].double().cpu().numpy(), activation)
