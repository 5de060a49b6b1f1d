"""What a chat generation produced, as typed events: the one vocabulary between the pipeline
that runs a request through the engine (``pipeline.py``) and the renderers that write it in
an API's wire format (chat completions JSON and SSE, the Responses API's JSON and events).

Every event but :class:`Usage` names its ``choice`` (OpenAI's ``n``). A tool call is a
:class:`ToolCallStart`, its :class:`ToolCallArguments` fragments, then a :class:`ToolCallEnd`
before anything else of that choice; a choice ends with :class:`ChoiceFinished`, and a run
that went to the end ends with :class:`Usage`. :class:`Reply` folds one choice's events into
what a JSON answer shows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from slotserve.engine.outputs import SampledToken
from slotserve.protocol.tool_parsers import ToolCall


@dataclass(frozen=True, slots=True)
class _Text:
    choice: int
    text: str


@dataclass(frozen=True, slots=True)
class TextDelta(_Text):
    """Answer text (what OpenAI calls content)."""


@dataclass(frozen=True, slots=True)
class ReasoningDelta(_Text):
    """Thinking text split off the answer (``--reasoning-parser``)."""


@dataclass(frozen=True, slots=True)
class _Call:
    choice: int
    index: int  # the call's position among the choice's calls


@dataclass(frozen=True, slots=True)
class ToolCallStart(_Call):
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments(_Call):
    """A piece of a call's arguments: the pieces concatenate to the arguments' JSON text."""

    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd(_Call):
    """The call is whole: nothing more of it follows."""


@dataclass(frozen=True, slots=True)
class _Scores:
    choice: int
    tokens: list[SampledToken]


@dataclass(frozen=True, slots=True)
class TokenLogprobs(_Scores):
    """The sampled tokens' log-probabilities, before the text they decode to (which a parser
    may still hold back)."""


@dataclass(frozen=True, slots=True)
class PromptLogprobs(_Scores):
    """vLLM's ``prompt_logprobs``: one score per prompt token after the first."""


@dataclass(frozen=True, slots=True)
class ChoiceFinished:
    choice: int
    # OpenAI's finish_reason: "stop", "length", "abort", or "tool_calls" when the model ended
    # on calls it chose to make (a forced named function keeps "stop").
    reason: str | None
    # The stop string or stop token id that ended the choice, when one did.
    stop: str | int | None = None
    tool_calls: bool = False  # the choice made tool calls (forced or chosen)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token totals of every choice; the last event of a run that went to the end."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


Event = (
    TextDelta
    | ReasoningDelta
    | ToolCallStart
    | ToolCallArguments
    | ToolCallEnd
    | TokenLogprobs
    | PromptLogprobs
    | ChoiceFinished
    | Usage
)


@dataclass(frozen=True)
class Reply:
    """Everything one choice produced, folded: the text pieces joined, the calls whole."""

    reasoning: str | None = None  # None: no thinking text
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[SampledToken] | None = None
    finish: ChoiceFinished | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.finish.reason if self.finish is not None else None


@dataclass
class _Folding:
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: dict[int, tuple[str, str, list[str]]] = field(default_factory=dict)
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[SampledToken] | None = None
    finish: ChoiceFinished | None = None

    def reply(self) -> Reply:
        return Reply(
            reasoning="".join(self.reasoning) or None,
            content="".join(self.content),
            tool_calls=[
                ToolCall(call_id, name, "".join(pieces))
                for call_id, name, pieces in self.calls.values()
            ],
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            finish=self.finish,
        )


def fold(events: Iterable[Event], choices: int) -> tuple[list[Reply], Usage | None]:
    """The replies of ``choices`` choices, and the usage (None: the run did not finish)."""
    folding = [_Folding() for _ in range(choices)]
    usage = None
    for event in events:
        if isinstance(event, Usage):
            usage = event
            continue
        into = folding[event.choice]
        match event:
            case TextDelta():
                into.content.append(event.text)
            case ReasoningDelta():
                into.reasoning.append(event.text)
            case ToolCallStart():
                into.calls[event.index] = (event.call_id, event.name, [])
            case ToolCallArguments():
                into.calls[event.index][2].append(event.arguments)
            case TokenLogprobs():
                into.logprobs.extend(event.tokens)
            case PromptLogprobs():
                into.prompt_logprobs = event.tokens
            case ChoiceFinished():
                into.finish = event
    return [f.reply() for f in folding], usage
