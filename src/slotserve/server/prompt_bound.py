"""Refuses a prompt that cannot fit the context from its length in characters, before it is
tokenized: tokenizing megabytes takes seconds, and such a prompt is refused anyway.

The bound must never refuse a prompt that would fit. A token stands for at most ``L`` bytes of
text, ``L`` being the vocabulary's longest token (its bytes, or its markup for a control token
such as ``<|im_start|>``), and a character is at least one byte, so a prompt of ``c``
characters is at least ``c / L`` tokens. ``SLACK`` more covers normalizers that merge
characters (NFKC compatibility forms, composed accents) before the vocabulary sees them.
"""

from __future__ import annotations

from slotserve.engine.core.limits import CONTEXT_LENGTH_EXCEEDED
from slotserve.engine.errors import InvalidRequestError
from slotserve.engine.runner_interface import Tokenizer
from slotserve.hosting.served import LoadedModel

SLACK = 4


# id(tokenizer) → (the tokenizer, kept so that its id is not reused; its longest token)
_LONGEST: dict[int, tuple[Tokenizer, int]] = {}
_LONGEST_KEPT = 16


def longest_token_bytes(tokenizer: Tokenizer, vocab_size: int) -> int:
    """The longest token of the vocabulary in bytes, text or markup (read once per
    tokenizer, from any thread: two threads may both read it, to the same result)."""
    known = _LONGEST.get(id(tokenizer))
    if known is not None:
        return known[1]
    longest = _read_longest(tokenizer, vocab_size)
    while len(_LONGEST) >= _LONGEST_KEPT:
        _LONGEST.pop(next(iter(_LONGEST)), None)
    _LONGEST[id(tokenizer)] = (tokenizer, longest)
    return longest


def _read_longest(tokenizer: Tokenizer, vocab_size: int) -> int:
    longest = 1
    for token_id in range(vocab_size):
        try:
            size = max(
                len(tokenizer.token_bytes(token_id)),
                len(tokenizer.token_text(token_id).encode()),
            )
        except Exception:  # an id the tokenizer does not know (padding rows of the embedding)
            continue
        longest = max(longest, size)
    return longest


def min_tokens(model: LoadedModel, text: str) -> int:
    """A lower bound on the tokens ``text`` becomes."""
    per_token = longest_token_bytes(model.tokenizer, model.info.vocab_size) * SLACK
    return len(text) // per_token


def check_prompt_chars(model: LoadedModel, text: str, param: str) -> None:
    """``InvalidRequestError`` (context_length_exceeded) when ``text`` cannot fit the context
    whatever its tokens; cheap for a prompt short enough to need no look (the usual case)."""
    limit = model.info.max_seq_len
    if len(text) <= limit:  # fewer characters than positions: always fits
        return
    at_least = min_tokens(model, text)
    if at_least > limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"resulted in {at_least} tokens or more ({len(text)} characters). Please reduce "
            "the length of the prompt.",
            param=param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
