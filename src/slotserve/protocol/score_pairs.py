"""A (query, document) pair as one cross-encoder prompt.

A model whose chat template carries the ``query`` and ``document`` roles renders the pair as
those two messages, no generation prompt: sentence-transformers' ``CrossEncoder`` does so for
every model with a chat template, and vLLM's score templates (Qwen3-Reranker's instruction,
query and document) use the same roles. Whether a template carries them is decided by
rendering two probe pairs and seeing both texts move (a ChatML template passes any role
through; Qwen3's own drops roles it does not know, and renders a pair to nothing). Any other
model takes its tokenizer's pair template (BERT's ``[CLS] a [SEP] b [SEP]``; a decoder's two
texts one after the other).
"""

from __future__ import annotations

from typing import Any

from slotserve.engine.runner_interface import PairTokenizer
from slotserve.protocol.chat_template import ChatTemplate, ChatTemplateError

_PROBES = (("query one", "document one"), ("query two", "document one"), ("query one", "doc two"))


def pair_messages(first: str, second: str) -> list[dict[str, Any]]:
    return [{"role": "query", "content": first}, {"role": "document", "content": second}]


def carries_pair_roles(template: ChatTemplate | None) -> bool:
    if template is None:
        return False
    try:
        base, *varied = (
            template.render(pair_messages(q, d), add_generation_prompt=False) for q, d in _PROBES
        )
    except ChatTemplateError:  # a template that raises on unknown roles
        return False
    return all(render != base for render in varied)


def pair_prompt(
    tokenizer: PairTokenizer, template: ChatTemplate | None, first: str, second: str
) -> list[int]:
    """The pair's token ids; ``template``: the model's chat template when it carries the
    pair's roles (:func:`carries_pair_roles`), else None."""
    if template is None:
        return tokenizer.encode_pair(first, second)
    text = template.render(pair_messages(first, second), add_generation_prompt=False)
    return tokenizer.encode(text, add_special_tokens=False)
