"""Workloads for ``slotserve bench``: random lengths, shared system prompt, multi-turn chat,
a coding agent's conversations (a long shared system-and-tools prefix, a growing history),
ShareGPT files, and for speculative decoding an input-grounded one (copy or edit a given text
or code) and an open-ended one (nothing to copy).

Every workload is a list of :class:`Conversation`; a single request is a one-turn
conversation. Lengths are counted in words, which common BPE tokenizers map to about one token
each; the server's ``usage`` reports the exact token counts used in the results.

Synthetic prompts ask the model to repeat numbered random words: even a small chat model then
answers each prompt differently, so the isolation check (distinct prompts must not return
identical greedy text) does not trip over a model's stock reply to nonsense. Random prompts
start with their number, so they share no prefix a server's prompt cache could reuse.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from slotserve.bench.passages import edit_prompt

# Common English words: each is one token (with its leading space) in typical BPE vocabularies.
WORDS = (  # noqa: SIM905 -- one word list reads better as text than as 200 literals
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show "
    "every good me give our under name very through just form sentence great think say help "
    "low line differ turn cause much mean before move right boy old too same tell does set "
    "three want air well also play small end put home read hand port large spell add even "
    "land here must big high such follow act why ask men change went light kind off need "
    "house picture try us again animal point mother world near build self earth father head "
    "stand own page should country found answer school grow study still learn plant cover "
    "food sun four between state keep eye never"
).split()


@dataclass
class Conversation:
    """User turns sent in order; each reply is appended before the next turn (chat)."""

    conversation_id: str
    user_turns: list[str]
    max_tokens: int
    system: str | None = None
    replies: list[str] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(turn + 1):
            messages.append({"role": "user", "content": self.user_turns[i]})
            if i < turn:
                messages.append({"role": "assistant", "content": self.replies[i]})
        return messages

    def prompt(self, turn: int) -> str:
        """The conversation as plain text, for the completions endpoint."""
        parts = [self.system] if self.system else []
        for i in range(turn + 1):
            parts.append(self.user_turns[i])
            if i < turn:
                parts.append(self.replies[i])
        return "\n".join(parts)


ECHO = "Repeat these words exactly: "


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, count)))


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, round(mean * (1 - range_ratio)))
    high = max(low, round(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_dataset(
    num: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[Conversation]:
    """Independent prompts of random words; a unique numbered opening keeps them distinct."""
    rng = random.Random(seed)
    return [
        Conversation(
            f"random-{i}",
            [f"{i}. {ECHO}" + _words(rng, _length(rng, input_len, range_ratio))],
            _length(rng, output_len, range_ratio),
        )
        for i in range(num)
    ]


def shared_prefix_dataset(
    num: int, prefix_len: int, input_len: int, output_len: int, seed: int = 0
) -> list[Conversation]:
    """One long system prompt shared by every user, then a short question of each user's own."""
    rng = random.Random(seed)
    system = "You are a careful assistant. Reference notes: " + _words(rng, prefix_len)
    return [
        Conversation(
            f"user-{i}", [f"{i}. {ECHO}" + _words(rng, input_len)], output_len, system=system
        )
        for i in range(num)
    ]


def multi_turn_dataset(
    num: int, turns: int, input_len: int, output_len: int, seed: int = 0
) -> list[Conversation]:
    """Conversations of several turns; each turn resends the history with the replies."""
    rng = random.Random(seed)
    return [
        Conversation(
            f"chat-{i}",
            [f"{ECHO}{i}.{t}: " + _words(rng, input_len) for t in range(turns)],
            output_len,
        )
        for i in range(num)
    ]


AGENT_INTRO = (
    "You are a coding agent working inside a software repository. You read files, search the "
    "code, run commands and edit files with the tools below, one call at a time, and you keep "
    "your answers to the user short. Never guess a file's content: read it first."
)
# Tools every coding agent has; the rest of the schema list is generated from WORDS.
AGENT_TOOLS = ("read_file", "write_file", "apply_patch", "search_code", "list_dir", "run_command")


def _tool_schema(rng: random.Random, name: str) -> dict[str, object]:
    """One tool in the OpenAI function-calling layout, its descriptions random words."""
    names = [f"{rng.choice(WORDS)}_{rng.choice(WORDS)}" for _ in range(rng.randint(2, 4))]
    properties = {
        param: {
            "type": rng.choice(("string", "integer", "boolean")),
            "description": _words(rng, 12),
        }
        for param in names
    }
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": _words(rng, rng.randint(30, 60)),
            "parameters": {"type": "object", "properties": properties, "required": names[:1]},
        },
    }


def approx_tokens(text: str) -> int:
    """Words and runs of punctuation: JSON's quotes and braces are tokens of their own, which a
    plain word count misses by far."""
    return len(re.findall(r"[A-Za-z0-9]+|[^A-Za-z0-9\s]+", text))


def agent_prefix(prefix_len: int, seed: int = 0) -> str:
    """A coding agent's system prompt followed by its tool schemas (one JSON object a line),
    at least ``prefix_len`` tokens as :func:`approx_tokens` counts them; the same text for the
    same arguments."""
    rng = random.Random(seed)
    lines = [AGENT_INTRO, "", "# Tools", ""]
    length = approx_tokens("\n".join(lines))
    index = 0
    while length < prefix_len:
        name = (
            AGENT_TOOLS[index]
            if index < len(AGENT_TOOLS)
            else f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{index}"
        )
        line = json.dumps(_tool_schema(rng, name))
        lines.append(line)
        length += approx_tokens(line)
        index += 1
    return "\n".join(lines)


def agent_dataset(
    num: int, turns: int, prefix_len: int, input_len: int, output_len: int, seed: int = 0
) -> list[Conversation]:
    """Coding-agent conversations: each turn resends the shared system-and-tools prefix and the
    conversation's history. Each user turn opens with its conversation and turn, so only the
    prefix and a conversation's own history can come from a server's prompt cache."""
    system = agent_prefix(prefix_len, seed)
    # A stream of its own: the prefix's length must not change the user turns.
    rng = random.Random(seed + 1)
    return [
        Conversation(
            f"agent-{i}",
            [
                f"Conversation {i}, turn {t + 1}. {ECHO}" + _words(rng, input_len)
                for t in range(turns)
            ],
            output_len,
            system=system,
        )
        for i in range(num)
    ]


def background_dataset(
    num: int, input_len: int, output_len: int, seed: int = 0
) -> list[Conversation]:
    """Unrelated single prompts that keep a server's slots busy beside another workload."""
    return [
        replace(
            conv, conversation_id=f"background-{i}", user_turns=[f"Background {conv.user_turns[0]}"]
        )
        for i, conv in enumerate(random_dataset(num, input_len, output_len, seed=seed + 2))
    ]


OPEN_TOPICS = (
    "why the sky is blue",
    "how bread rises",
    "what a compiler does",
    "the life of a bee",
    "how tides work",
    "why we sleep",
    "how a bicycle stays up",
    "what causes rain",
    "how vaccines work",
    "the history of paper",
    "how magnets work",
    "why leaves change colour",
    "how a refrigerator cools",
    "what a black hole is",
    "how birds navigate",
    "how soap cleans",
)


def edit_dataset(num: int, output_len: int, seed: int = 0) -> list[Conversation]:
    """Input-grounded: copy or lightly edit a given text or piece of code (``passages.py``),
    so most of each answer is in its prompt. ``seed`` rotates which passage comes first."""
    return [Conversation(f"edit-{i}", [edit_prompt(i + seed)], output_len) for i in range(num)]


def open_dataset(num: int, output_len: int, seed: int = 0) -> list[Conversation]:
    """Open-ended explanations: nothing in the prompt to copy."""
    return [
        Conversation(
            f"open-{i}",
            [f"Explain {OPEN_TOPICS[(i + seed) % len(OPEN_TOPICS)]} in a few paragraphs."],
            output_len,
        )
        for i in range(num)
    ]


def sharegpt_dataset(path: Path, num: int, max_tokens: int, seed: int = 0) -> list[Conversation]:
    """First human turn of ShareGPT-format conversations; output capped at ``max_tokens``.

    Accepts ``[{"conversations": [{"from": "human", "value": ...}, ...]}, ...]`` (the format
    of ShareGPT_V3_unfiltered_cleaned_split.json).
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    prompts = []
    for entry in data:
        turns = entry.get("conversations", []) if isinstance(entry, dict) else []
        human = [t.get("value", "") for t in turns if t.get("from") in ("human", "user")]
        if human and human[0].strip():
            prompts.append(human[0])
    if not prompts:
        raise ValueError(f"{path}: no conversation with a human turn")
    random.Random(seed).shuffle(prompts)
    return [
        Conversation(f"sharegpt-{i}", [prompts[i % len(prompts)]], max_tokens) for i in range(num)
    ]
