"""Which chat templates carry a cross-encoder's (query, document) pair: one that passes any
role through (ChatML) or names both roles (a Qwen3-Reranker score template, vLLM's form) does;
one that renders only the roles it knows (Qwen3's own) does not, and the pair then takes the
tokenizer's pair template."""

from __future__ import annotations

from slotserve.protocol.chat_template import ChatTemplate
from slotserve.protocol.score_pairs import carries_pair_roles, pair_messages
from tests.prompts import QWEN3_RERANKER

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
KNOWN_ROLES_ONLY = (
    "{% for message in messages %}{% if message.role in ('system', 'user', 'assistant') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
)
RAISES_ON_OTHER_ROLES = (
    "{% for message in messages %}{% if message.role not in ('user', 'assistant') %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{{ message.content }}{% endfor %}"
)


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, "", "<|im_end|>")


def test_templates_that_carry_both_texts_are_used() -> None:
    assert carries_pair_roles(template(CHATML))
    reranker = template(QWEN3_RERANKER)
    assert carries_pair_roles(reranker)
    text = reranker.render(pair_messages("what is a cat", "a small mammal"), False)
    assert "<Query>: what is a cat\n<Document>: a small mammal<|im_end|>" in text


def test_templates_that_drop_or_refuse_the_roles_are_not() -> None:
    assert not carries_pair_roles(None)
    assert not carries_pair_roles(template(KNOWN_ROLES_ONLY))
    assert not carries_pair_roles(template(RAISES_ON_OTHER_ROLES))
