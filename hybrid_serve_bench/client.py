"""One streaming chat request against an OpenAI-compatible server -> one RequestRecord.

The request asks for `stream: true` with `stream_options: {include_usage: true}` and parses the
server-sent events itself (httpx; no OpenAI SDK, so nothing between the bytes and the clock).
Times are seconds from just before the request is sent:
  first_chunk_s  the first event with a choice (often only the role, with empty content);
  ttft_s         the first event whose delta has non-empty content: time to first token;
  e2e_s          the end of the stream;
  itl_s          inter-token latency: (last content event - first content event) /
                 (completion tokens - 1); without a usage count, per content event instead.
render_s is the server's own time to render the prompt, from its Server-Timing header
(`render;dur=<ms>`, which hybrid-serve sends); None for a server that sends none. Token counts
come from the final usage event: prompt_tokens, completion_tokens and
usage.prompt_tokens_details.cached_tokens. A server that sends no usage, or usage without
prompt_tokens_details.cached_tokens, leaves them None (never 0: "not reported" is not "none
cached").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

# The result JSON's record keys; tests assert this exact set, so the schema does not drift.
# counted_prompt_tokens: the prompt's tokens as the bench's tokenizer renders it (runner.py),
# beside the server's prompt_tokens: they differ when the tokenizer is not the served model's.
RECORD_FIELDS = ("workload", "target", "conversation", "turn", "rate", "start_s", "first_chunk_s",
                 "ttft_s", "itl_s", "e2e_s", "render_s", "prompt_tokens", "counted_prompt_tokens", "completion_tokens",
                 "cached_tokens", "shareable_tokens", "finish_reason", "error")


@dataclass(frozen=True)
class ChatRequest:
    """What one request sends. extra_body: fields merged into the JSON body (cache_salt,
    ignore_eos, ...)."""

    model: str
    messages: list[dict]
    max_tokens: int
    temperature: float = 0.0
    extra_body: dict | None = None

    def body(self) -> dict:
        return {"model": self.model, "messages": self.messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "stream": True,
                "stream_options": {"include_usage": True}, **(self.extra_body or {})}


@dataclass(frozen=True)
class StreamResult:
    """What came back: timings (seconds from the send), usage counts (None: not reported), the
    reply text, and error (None when the request succeeded)."""

    first_chunk_s: float | None
    ttft_s: float | None
    itl_s: float | None
    e2e_s: float
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    finish_reason: str | None
    reply: str
    error: str | None
    render_s: float | None = None


def cached_tokens_of(usage: dict | None) -> int | None:
    """usage.prompt_tokens_details.cached_tokens, or None when the server did not report it."""
    details = (usage or {}).get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return int(cached) if isinstance(cached, int) else None


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line (None for other lines: comments, event names, blanks)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


async def stream_chat(client: httpx.AsyncClient, url: str, request: ChatRequest) -> StreamResult:
    """POST `request` to `url` (…/v1/chat/completions) and read the stream to its end. Never
    raises for server or transport errors: they come back as StreamResult.error."""
    start = time.perf_counter()
    first_chunk = first_content = last_content = None
    content_events = 0
    parts: list[str] = []
    usage: dict | None = None
    finish_reason = error = None
    try:
        async with client.stream("POST", url, json=request.body()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return _failed(start, f"HTTP {response.status_code}: {body[:300]}")
            render_s = server_render_s(response.headers.get("server-timing"))
            async for line in response.aiter_lines():
                data = sse_data(line)
                if data is None or data == "" or data == "[DONE]":
                    continue
                event = json.loads(data)
                now = time.perf_counter() - start
                if event.get("error"):
                    error = f"stream error: {json.dumps(event['error'])[:300]}"
                    continue
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    first_chunk = now if first_chunk is None else first_chunk
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        first_content = now if first_content is None else first_content
                        last_content = now
                        content_events += 1
                        parts.append(content)
                    finish_reason = choice.get("finish_reason") or finish_reason
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return _failed(start, f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - start
    completion_tokens = usage.get("completion_tokens") if usage else None
    return StreamResult(
        first_chunk_s=first_chunk, ttft_s=first_content,
        itl_s=_inter_token_latency(first_content, last_content, completion_tokens, content_events),
        e2e_s=e2e, prompt_tokens=usage.get("prompt_tokens") if usage else None,
        completion_tokens=completion_tokens, cached_tokens=cached_tokens_of(usage),
        finish_reason=finish_reason, reply="".join(parts),
        error=error if error else (None if first_content is not None else "no content in the stream"),
        render_s=render_s)


def server_render_s(header: str | None) -> float | None:
    """Seconds of the `render` metric of a Server-Timing header (`render;dur=1.234`, in ms);
    None when the header or the metric or its duration is absent or malformed."""
    for metric in (header or "").split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        if name != "render":
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "dur":
                try:
                    return float(value.strip().strip('"')) / 1000
                except ValueError:
                    return None
    return None


def _inter_token_latency(first: float | None, last: float | None, tokens: int | None,
                         content_events: int) -> float | None:
    if first is None or last is None:
        return None
    steps = (tokens - 1) if tokens else (content_events - 1)
    return (last - first) / steps if steps and steps > 0 else None


def _failed(start: float, error: str) -> StreamResult:
    return StreamResult(None, None, None, time.perf_counter() - start, None, None, None, None, "", error)
