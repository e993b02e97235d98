"""OpenAI-compatible request, response and error models: the typed edge of the API.

Requests validate shape and ranges here (pydantic); the FastAPI ingress turns every validation
error into an OpenAI error body with HTTP 400. The same objects are the Python handle API:
`await handle.chat.remote(ChatCompletionRequest(...))` returns a ChatCompletionResponse.

Supported beyond OpenAI (as in vLLM): top_k, stop_token_ids, ignore_eos, min_tokens, cache_salt;
and, as in Anthropic's Messages API, `cache_control: {"type": "ephemeral"}` on a chat message or
a text content part: a checkpoint at the end of it (deployments/prompts/cache_breakpoints.py),
at most max_cache_breakpoints a request (deployments/http/limits.py).
Every value must have its JSON type, with no coercion (true is not 1, "3" is not 3, 2.0 is not
2). Numbers must be finite (no NaN or infinities), temperature at most 2 (as in OpenAI), every
string valid Unicode (no lone surrogates: the tokenizer and the JSON answers cannot carry them),
a seed a 64-bit integer, stop token ids non-negative (the engine checks them against the
vocabulary), and a cache_salt at most MAX_CACHE_SALT_CHARS characters. Unknown fields are
ignored; known OpenAI features this server does not implement
(n > 1, logprobs, top_logprobs, logit_bias, penalties, tools, functions, tool calls in
messages, non-text response formats, echo, suffix, best_of > 1) are rejected with 400 naming
the field rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    field_validator,
    model_serializer,
)

# ----- requests


def _unicode_text(value: str) -> str:
    """JSON can carry lone surrogates (an escaped "\\ud800"); they are not text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid Unicode text (a lone surrogate at {exc.start})") from None
    return value


Text = Annotated[str, AfterValidator(_unicode_text)]
# Numbers and booleans as JSON types, without coercion between them (as OpenAI's API takes
# them): true is not 1, "3" is not 3, 2.0 is not 2, "yes" is not true; an integer is a number.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]


def _unsupported(feature: str) -> AfterValidator:
    """The field of an OpenAI feature this server does not implement: accepted at its neutral
    value (absent, null, false, 0, "", empty), else a 400 naming the field, never ignored."""

    def refuse_when_set(value: Any) -> Any:
        if value:
            raise ValueError(f"{feature} not supported")
        return value

    return AfterValidator(refuse_when_set)


# Request models validate again when given an instance (revalidate_instances): the handle API
# validates what a caller built with model_construct, or changed after construction.
REQUEST_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False, revalidate_instances="always")


class CacheControl(BaseModel):
    """A cache breakpoint marker: what precedes it, up to the end of the message or content part
    that carries it, is shared by later requests, and a checkpoint is kept there when the
    renderer can verify its position (docs/design.md section 3). Only "ephemeral" exists;
    eviction decides how long a checkpoint lives, so no ttl is accepted."""

    model_config = ConfigDict(extra="forbid", revalidate_instances="always")

    type: Literal["ephemeral"]


class TextContentPart(BaseModel):
    """One part of a list-valued message content; only text parts are supported."""

    model_config = ConfigDict(extra="forbid", revalidate_instances="always")

    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


class ChatMessage(BaseModel):
    """A conversation message. Roles are the ones the chat template knows."""

    model_config = REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextContentPart]
    name: Text | None = None
    cache_control: CacheControl | None = None
    tool_calls: Annotated[list[Any] | None, _unsupported("tool calls are")] = None

    def num_cache_markers(self) -> int:
        """cache_control markers on this message and its content parts."""
        parts = self.content if isinstance(self.content, list) else []
        return (self.cache_control is not None) + sum(p.cache_control is not None for p in parts)


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    include_usage: Bool = False


# A cache_salt names a namespace of checkpoints and lives as long as they do (every
# checkpoint's key holds it), outside the checkpoint memory budgets: a salt needs few characters.
MAX_CACHE_SALT_CHARS = 1024


class SamplingFields(BaseModel):
    """Sampling fields shared by chat and completions (ranges checked here, before the engine)."""

    model_config = REQUEST_CONFIG

    model: Text | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0, le=2)  # OpenAI's range; far above, logits / t is nan
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=0)
    seed: Int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None
    ignore_eos: Bool = False
    min_tokens: Int = Field(0, ge=0)
    n: Int = Field(1, ge=1)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    presence_penalty: Annotated[Float, _unsupported("presence penalties are")] = 0.0
    frequency_penalty: Annotated[Float, _unsupported("frequency penalties are")] = 0.0
    logprobs: Annotated[Bool | Int | None, _unsupported("logprobs are")] = None
    top_logprobs: Annotated[Int | None, _unsupported("top_logprobs are")] = None
    logit_bias: Annotated[dict[str, Float] | None, _unsupported("logit_bias is")] = None
    cache_salt: Text | None = Field(
        None, min_length=1, max_length=MAX_CACHE_SALT_CHARS,
        description="Checkpoints are reused only between requests with the same salt (as in vLLM).",
    )

    @field_validator(
        "temperature", "top_p", "top_k", "min_tokens", "n", "presence_penalty", "frequency_penalty",
        mode="before",
    )
    @classmethod
    def _null_means_default(cls, value: Any, info) -> Any:
        """OpenAI clients send explicit nulls for unset fields; treat them as the default."""
        if value is None:
            return cls.model_fields[info.field_name].default
        return value

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. `max_completion_tokens` wins over the legacy `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    tools: Annotated[list[Any] | None, _unsupported("tools are")] = None
    functions: Annotated[list[Any] | None, _unsupported("functions are")] = None
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("type", "text") != "text":
            raise ValueError("only the text response_format is supported")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_cache_markers(self) -> int:
        """cache_control markers on the messages and their content parts."""
        return sum(message.num_cache_markers() for message in self.messages)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt` is one string or one list of token ids (no batches)."""

    prompt: Text | list[Int]
    echo: Annotated[Bool, _unsupported("echo is")] = False
    suffix: Annotated[Text | None, _unsupported("suffix is")] = None
    best_of: Int | None = Field(None, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, value: str | list[int]) -> str | list[int]:
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(t < 0 for t in value):
            raise ValueError("token ids must be non-negative")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


# ----- responses


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChoiceBase(BaseModel):
    """The fields every choice has (subclasses add its content and finish_reason); logprobs
    are not supported and always null."""

    index: int = 0
    logprobs: None = None


class ChatChoice(ChoiceBase):
    message: AssistantMessage
    finish_reason: FinishReason | None


class ResponseEnvelope(BaseModel):
    """The fields every completion response and chunk starts with (subclasses add `object`,
    `choices` and `usage`)."""

    id: str
    created: int
    model: str


class ChatCompletionResponse(ResponseEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """A streamed message delta; unset fields are left out of the JSON (as OpenAI does)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(ChoiceBase):
    delta: DeltaMessage
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(ResponseEnvelope):
    """One SSE event. The usage-only final chunk has no choices."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(ChoiceBase):
    text: str
    finish_reason: FinishReason | None = None


class CompletionResponse(ResponseEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(CompletionResponse):
    """One SSE event of a streamed completion: a CompletionResponse (same object name) whose
    usage comes only in the final chunk."""

    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hybrid-serve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ----- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo
