"""Pure conversions between the OpenAI models and the engine's types (no Ray, no I/O).

- request fields and their output budget -> SamplingParams,
- a stream of RequestOutputs -> chat/completion chunks, or one full response,
- usage from the final RequestOutput.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deployments.http.errors import APIError
from deployments.http.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)
from engine.interfaces.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core.llm_engine import RequestOutput

GREEDY_BELOW_TEMPERATURE = 1e-5


def to_sampling_params(request: SamplingFields, max_tokens: int) -> SamplingParams:
    """Build the engine's SamplingParams; raises InvalidRequestError (HTTP 400) on values it
    cannot serve.

    max_tokens: the request's output budget (engine.interfaces.sampling_params.output_budget).
    A temperature below GREEDY_BELOW_TEMPERATURE is greedy (as in vLLM): dividing the logits
    by it would overflow them to infinities.
    """
    temperature = request.temperature if request.temperature >= GREEDY_BELOW_TEMPERATURE else 0.0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=request.stop_strings(),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
    )


def raise_if_failed(out: RequestOutput) -> None:
    """An engine-side failure ("error") or a server-side abort ends the request with an error."""
    if out.finish_reason == "error":
        # out.error is the engine's words; the client learns nothing of the server's internals
        raise APIError(500, f"The server failed while generating this request (id "
                            f"{out.request_id}); it may succeed if retried.", "server_error")
    if out.finish_reason == "abort":
        raise APIError(503, "The server aborted the request.", "server_error")


def usage_of(final: RequestOutput) -> Usage:
    """Usage from the last output of a request (the engine's counts are cumulative)."""
    return Usage(
        prompt_tokens=final.num_prompt_tokens,
        completion_tokens=final.num_output_tokens,
        total_tokens=final.num_prompt_tokens + final.num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=final.num_cached_tokens),
    )


@dataclass(frozen=True)
class ResponseMeta:
    """Fields every chunk and response of one request repeats; render_s: the seconds its prompt
    took to render (deployments/frontend.py; sent as the Server-Timing header, not in bodies)."""

    id: str
    created: int
    model: str
    render_s: float | None = None


@dataclass
class Collected:
    text: str
    finish_reason: str | None
    usage: Usage


async def collect(outputs: AsyncGenerator[RequestOutput, None]) -> Collected:
    """Drain (and close) a request's outputs into its full text, finish reason and usage."""
    parts: list[str] = []
    final: RequestOutput | None = None
    async with aclosing(outputs):
        async for out in outputs:
            parts.append(out.new_text)
            final = out
    if final is None or not final.finished:
        raise APIError(500, "the engine ended the request without a final output", "server_error")
    return Collected("".join(parts), final.finish_reason, usage_of(final))


def chat_response(meta: ResponseMeta, result: Collected) -> ChatCompletionResponse:
    return ChatCompletionResponse(
        id=meta.id, created=meta.created, model=meta.model, usage=result.usage,
        choices=[ChatChoice(message=AssistantMessage(content=result.text),
                            finish_reason=result.finish_reason)],
    )


def completion_response(meta: ResponseMeta, result: Collected) -> CompletionResponse:
    return CompletionResponse(
        id=meta.id, created=meta.created, model=meta.model, usage=result.usage,
        choices=[CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
    )


async def chat_chunks(
    meta: ResponseMeta, outputs: AsyncGenerator[RequestOutput, None], include_usage: bool
) -> AsyncIterator[ChatCompletionChunk]:
    """One chunk per engine output that carries text or the finish reason; closes `outputs`.

    The first chunk is sent with the first generated token and carries role="assistant"
    (its content may be "" when that token ends inside a UTF-8 sequence). With include_usage,
    a final chunk with empty choices carries the usage.
    """
    first = True
    async with aclosing(outputs):
        async for out in outputs:
            if not (first or out.new_text or out.finished):
                continue
            delta = DeltaMessage(role="assistant" if first else None, content=out.new_text)
            first = False
            yield ChatCompletionChunk(
                id=meta.id, created=meta.created, model=meta.model,
                choices=[ChatChunkChoice(delta=delta, finish_reason=_finish(out))],
            )
            if out.finished and include_usage:
                yield ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                                          choices=[], usage=usage_of(out))


async def completion_chunks(
    meta: ResponseMeta, outputs: AsyncGenerator[RequestOutput, None], include_usage: bool
) -> AsyncIterator[CompletionChunk]:
    """Like chat_chunks, for /v1/completions (text deltas, no role)."""
    first = True
    async with aclosing(outputs):
        async for out in outputs:
            if not (first or out.new_text or out.finished):
                continue
            first = False
            yield CompletionChunk(
                id=meta.id, created=meta.created, model=meta.model,
                choices=[CompletionChoice(text=out.new_text, finish_reason=_finish(out))],
            )
            if out.finished and include_usage:
                yield CompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                                      choices=[], usage=usage_of(out))


def _finish(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None
