"""Where ``slotserve chat`` gets its replies: one protocol, two implementations.

:class:`EngineBackend` runs the engine in this process (no HTTP, no engine process: one user,
one conversation); :class:`RemoteBackend` talks to any OpenAI-compatible server with the
``openai`` client. Both stream the reply as text pieces and end with a :class:`Usage`, and
both give up a request when the iteration is left early (a cancelled task closes the engine
stream, which aborts the request, or closes the HTTP response, which the server sees as a
disconnect).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict

from slotserve.engine.config import EngineConfig
from slotserve.engine.core_request import EngineCoreRequest
from slotserve.engine.errors import EngineError
from slotserve.engine.runner_interface import RunnerSpec
from slotserve.engine.sampling_defaults import SamplingDefaults
from slotserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import openai
    from openai.types.chat import ChatCompletionMessageParam

    from slotserve.hosting.host import ModelHost


class Message(TypedDict):
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class GenerationOptions:
    """None leaves the choice to the model's defaults (the server's, or in-process the
    model's own)."""

    temperature: float | None = None
    max_tokens: int | None = None


class ChatBackendError(Exception):
    """No reply could be had; ``str(error)`` says why in one line, fit to show the user."""


class ChatBackend(Protocol):
    @property
    def model_name(self) -> str: ...

    def stream(
        self, messages: list[Message], options: GenerationOptions
    ) -> AsyncIterator[str | Usage]:
        """The reply's text as it comes, then its usage (absent if the server sends none).
        Raises :class:`ChatBackendError`."""
        ...

    async def close(self) -> None: ...


class EngineBackend:
    """The engine on a thread of this process, behind the same ``ModelHost`` ``serve`` uses
    (it resolves the chat template and turns a load failure into words)."""

    def __init__(self, host: ModelHost) -> None:
        self._host = host
        self._ids = itertools.count(1)

    @classmethod
    async def start(
        cls,
        name: str,
        spec: RunnerSpec,
        config: EngineConfig,
        chat_template_file: Path | None,
    ) -> EngineBackend:
        from slotserve.hosting.host import ModelHost
        from slotserve.hosting.served import ModelLaunch

        host = ModelHost(ModelLaunch(name, spec, config, chat_template_file))
        await host.load()
        if host.model is None:
            raise ChatBackendError(f"the model failed to load ({host.load_error})")
        if host.model.chat_template is None:
            await host.stop()
            raise ChatBackendError(
                "the model has no chat template; give one with --chat-template FILE"
            )
        return cls(host)

    @property
    def model_name(self) -> str:
        return self._host.name

    async def stream(
        self, messages: list[Message], options: GenerationOptions
    ) -> AsyncIterator[str | Usage]:
        from slotserve.hosting.served import ModelUnavailableError

        try:
            model = self._host.require_ready()
            template = model.chat_template
            assert template is not None  # checked at start
            text = template.render([dict(m) for m in messages])
            # A template that writes the BOS token itself must not get a second one.
            add_bos = not (template.bos_token and text.startswith(template.bos_token))
            prompt = model.tokenizer.encode(text, add_special_tokens=add_bos)
            # The model's defaults, as the server gives them, under --temperature.
            given = SamplingDefaults(temperature=options.temperature)
            params = SamplingParams(
                max_tokens=options.max_tokens, **given.params(model.sampling_defaults)
            )
            stream = model.engine.submit(
                EngineCoreRequest(f"chat-{next(self._ids)}", prompt, params)
            )
        except (EngineError, ModelUnavailableError) as exc:
            raise ChatBackendError(str(exc)) from exc
        with stream:  # leaving early (cancelled) aborts the request
            async for output in stream:
                for delta in output.deltas:
                    if delta.text:
                        yield delta.text
                if output.finished:
                    if output.failure is not None:
                        raise ChatBackendError(output.error or "the request timed out")
                    yield Usage(
                        output.num_prompt_tokens,
                        output.num_output_tokens,
                        output.num_cached_tokens,
                    )

    async def close(self) -> None:
        await self._host.stop()


def api_base(url: str) -> str:
    """The OpenAI base URL of a server given as ``http://host:port`` or ``.../v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


class RemoteBackend:
    def __init__(self, client: openai.AsyncOpenAI, url: str, model_name: str) -> None:
        self._client = client
        self._url = url
        self._model_name = model_name

    @classmethod
    async def connect(cls, url: str, api_key: str | None, model_name: str | None) -> RemoteBackend:
        """Asks the server for its models first, so that an unreachable server or a wrong key
        shows at start-up, not at the first message."""
        import openai

        client = openai.AsyncOpenAI(
            base_url=api_base(url),
            api_key=api_key or "none",  # the client insists on one; a keyless server ignores it
            # A chat shows the failure at once: the user decides whether to try again.
            max_retries=0,
            timeout=openai.Timeout(600.0, connect=10.0),
        )
        try:
            models = [model.id async for model in client.models.list()]
        except openai.APIError as exc:
            await client.close()
            raise ChatBackendError(describe_api_error(exc, url)) from exc
        if model_name is None:
            if not models:
                await client.close()
                raise ChatBackendError(f"{url} serves no model (GET /v1/models is empty)")
            model_name = models[0]
        return cls(client, url, model_name)

    @property
    def model_name(self) -> str:
        return self._model_name

    async def stream(
        self, messages: list[Message], options: GenerationOptions
    ) -> AsyncIterator[str | Usage]:
        import openai

        try:
            response = await self._client.chat.completions.create(
                model=self._model_name,
                messages=[_openai_message(m) for m in messages],
                stream=True,
                stream_options={"include_usage": True},
                temperature=openai.omit if options.temperature is None else options.temperature,
                max_tokens=openai.omit if options.max_tokens is None else options.max_tokens,
            )
            async with response:  # closing the response tells the server to abort
                async for chunk in response:
                    for choice in chunk.choices:
                        if choice.delta.content:
                            yield choice.delta.content
                    if chunk.usage is not None:
                        details = chunk.usage.prompt_tokens_details
                        yield Usage(
                            chunk.usage.prompt_tokens,
                            chunk.usage.completion_tokens,
                            (details.cached_tokens or 0) if details is not None else 0,
                        )
        except openai.APIError as exc:
            raise ChatBackendError(describe_api_error(exc, self._url)) from exc
        except Exception as exc:
            # The HTTP library's own errors (a connection dropped mid-stream) come through
            # unwrapped, and their classes depend on the openai release: a chat says what
            # happened and goes on.
            raise ChatBackendError(f"{self._url}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self._client.close()


def _openai_message(message: Message) -> ChatCompletionMessageParam:
    role, content = message["role"], message["content"]
    if role == "system":
        return {"role": "system", "content": content}
    if role == "user":
        return {"role": "user", "content": content}
    return {"role": "assistant", "content": content}


def describe_api_error(exc: openai.APIError, url: str) -> str:
    """One line: what the server said (its ``error.message``), or why it could not be asked."""
    import openai

    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        why = f": {cause}" if cause is not None and str(cause) else ""
        if isinstance(exc, openai.APITimeoutError):
            return f"{url} did not answer in time{why}"
        return f"cannot reach {url}{why}"
    body = exc.body
    message = body.get("message") if isinstance(body, dict) else None
    text = str(message) if message else exc.message
    if isinstance(exc, openai.APIStatusError):
        return f"{url}: HTTP {exc.status_code}: {text}"
    return f"{url}: {text}"
