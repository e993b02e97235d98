"""The OpenAI API over one prompt source and one generation stream: the Python handle methods
and the HTTP app, the same code on both serving paths (docs/design.md section 6).

    classic  OpenAIIngress (deployments/ingress.py): renders through the Renderer deployment,
             streams from an LLMServer replica through a DeploymentHandle.
    lean     LLMServerIngress (deployments/llm_server_ingress.py): the LLM server replica is the
             ingress; it renders in process and streams from its own engine.

OpenAIFrontend holds what a request needs (model name, limits, the model's context) and turns a
typed request into one GenerationRequest (engine/interfaces/generation_request.py), then the
engine's RequestOutputs into OpenAI objects. `openai_app(frontend, ...)` builds the FastAPI app
of one replica over it: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health, GET /metrics (no samples: Ray exports them, deployments/metrics.py). Both paths
serve their app through `serve.ingress()` with `__serve_build_asgi_app__`, one app per replica.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray.serve.handle import DeploymentHandle

from deployments.http.api_keys import TENANT_SCOPE, ApiKeyMiddleware, ApiKeys, scoped_cache_salt
from deployments.http.errors import APIError, as_api_error, error_json, install_error_handlers, validated
from deployments.http.limits import RequestLimits, RequestLimitsMiddleware, check_cache_markers, check_stop_limits
from deployments.http.openai_format import (
    ResponseMeta,
    chat_chunks,
    chat_response,
    collect,
    completion_chunks,
    completion_response,
    raise_if_failed,
    to_sampling_params,
)
from deployments.http.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    new_request_id,
    now,
)
from deployments.http.request_log import RequestRecord, log_request
from deployments.http.streaming import first_output_ready, json_response, server_timing, sse_response
from deployments.metrics import METRICS_CONTENT_TYPE, METRICS_ELSEWHERE, RequestMetrics
from deployments.prompts.rendering import PromptRenderer, RenderedPrompt
from engine.core.llm_engine import RequestOutput
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.sampling_params import output_budget

Started = tuple[ResponseMeta, AsyncGenerator[RequestOutput, None]]
# A request's outputs; closing the generator before its last output aborts the request.
GenerateFn = Callable[[GenerationRequest], AsyncGenerator[RequestOutput, None]]


@dataclass(frozen=True)
class ModelInfo:
    """What the API layer needs to know about the loaded model."""

    max_model_len: int
    model_dir: str


class PromptSource(Protocol):
    """Renders API input into the engine's token ids (deployments/prompts/rendering.py);
    raises InvalidRequestError (HTTP 400) where the renderer refuses."""

    async def render_chat(self, messages: list[ChatMessage]) -> RenderedPrompt: ...

    async def tokenize_prompt(self, prompt: str | list[int]) -> RenderedPrompt: ...


class LocalPrompts:
    """A PromptSource in this process: the replica's own PromptRenderer. A chat's templates
    render on the event loop (PromptRenderer.prepare_chat: a fraction of a millisecond even at
    8,000 instruction tokens); its tokenization (finish_chat) runs inline when at most
    INLINE_CHARS characters are left to tokenize (the usual case once the instructions are
    remembered: a thread's hop would cost more), else on one of the `threads` render threads of
    its own, so that milliseconds of tokenizing do not hold up the loop's streams. Tokenizing
    through transformers releases the GIL while the Rust tokenizer encodes (its encode_batch;
    benchmarks/render_time.py checks it), so the render threads tokenize beside the loop and
    the step thread. Completion prompts likewise,
    by their length."""

    INLINE_CHARS = 4096  # at most this many characters to tokenize: inline
    RENDER_THREADS = 2

    def __init__(self, renderer: PromptRenderer, threads: int = RENDER_THREADS) -> None:
        self._renderer = renderer
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hybrid-serve-render")

    async def render_chat(self, messages: list[ChatMessage]) -> RenderedPrompt:
        draft = self._renderer.prepare_chat([m.model_dump(exclude_none=True) for m in messages])
        if draft.pending_chars <= self.INLINE_CHARS:
            return self._renderer.finish_chat(draft)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._renderer.finish_chat, draft)

    async def tokenize_prompt(self, prompt: str | list[int]) -> RenderedPrompt:
        if not isinstance(prompt, str) or len(prompt) <= self.INLINE_CHARS:
            return self._renderer.tokenize_prompt(prompt)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._renderer.tokenize_prompt, prompt)


class RendererPrompts:
    """The PromptSource of the classic path: the Renderer deployment, through its handle."""

    def __init__(self, renderer: DeploymentHandle) -> None:
        self._renderer = renderer

    async def render_chat(self, messages: list[ChatMessage]) -> RenderedPrompt:
        return await self._renderer.render_chat.remote(messages)

    async def tokenize_prompt(self, prompt: str | list[int]) -> RenderedPrompt:
        return await self._renderer.tokenize_prompt.remote(prompt)


def refused(exc: BaseException, arrival_time: float, metrics: RequestMetrics) -> APIError:
    """`exc` as the APIError of a request refused before it reached the engine (a bad model
    name, a limit, the renderer, sampling against the context), its record logged and counted
    in `metrics`: `_generate` records only the requests that reach the engine."""
    error = as_api_error(exc)
    record = RequestRecord(None, "error", error.status_code, duration_s=time.time() - arrival_time)
    log_request(record)
    metrics.record_request(record)
    return error


class OpenAIFrontend:
    """The API's one code path. Create inside a Serve replica (its metrics carry Serve's tags).

    prompts: where prompts are rendered. generate: opens a request's output stream.
    Handle methods raise APIError (status_code 400/404/500/503) on failure; the HTTP routes
    answer the same errors as OpenAI error bodies.
    """

    def __init__(self, prompts: PromptSource, generate: GenerateFn, info: ModelInfo,
                 served_model_name: str, limits: RequestLimits) -> None:
        self._prompts = prompts
        self._generate_fn = generate
        self.info = info
        self._model_name = served_model_name
        self._limits = limits
        self._created = now()
        self._metrics = RequestMetrics()

    # ----- the Python handle API (typed request in, typed response or chunks out)

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        request = self._validated(ChatCompletionRequest, request)
        meta, outputs = await self.start_chat(request)
        return chat_response(meta, await collect(outputs))

    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        request = self._validated(ChatCompletionRequest, request)
        meta, outputs = await self.start_chat(request)
        async for chunk in chat_chunks(meta, outputs, request.include_usage):
            yield chunk

    async def completions(self, request: CompletionRequest) -> CompletionResponse:
        request = self._validated(CompletionRequest, request)
        meta, outputs = await self.start_completion(request)
        return completion_response(meta, await collect(outputs))

    async def completions_stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        request = self._validated(CompletionRequest, request)
        meta, outputs = await self.start_completion(request)
        async for chunk in completion_chunks(meta, outputs, request.include_usage):
            yield chunk

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self._model_name, created=self._created,
                                         root=self.info.model_dir,
                                         max_model_len=self.info.max_model_len)])

    # ----- HTTP

    async def respond_chat(self, body: ChatCompletionRequest, tenant: str):
        return await self._respond(body, tenant, self.start_chat, chat_response, chat_chunks)

    async def respond_completion(self, body: CompletionRequest, tenant: str):
        return await self._respond(body, tenant, self.start_completion, completion_response,
                                   completion_chunks)

    async def _respond(self, body, tenant: str, start, full_response, chunks):
        """The HTTP answer to `body` from `tenant` (deployments/http/api_keys.py; "" without
        keys): started with `start`, then one JSON body built by `full_response`, or
        server-sent events from `chunks`; errors before the first output as an OpenAI error
        body with its status."""
        try:
            meta, outputs = await start(body, tenant)
            headers = server_timing(meta.render_s)
            if not body.stream:
                return json_response(full_response(meta, await collect(outputs)), headers)
            outputs = await first_output_ready(outputs)
        except Exception as exc:
            return error_json(as_api_error(exc))
        return sse_response(chunks(meta, outputs, body.include_usage), headers)

    # ----- one request

    async def start_chat(self, request: ChatCompletionRequest, tenant: str = "") -> Started:
        arrival_time = time.time()
        try:
            self._check_request(request)
            check_cache_markers(request, self._limits)
            rendering = time.perf_counter()
            prompt = await self._prompts.render_chat(request.messages)
            render_s = time.perf_counter() - rendering
            self._record_render_later("chat", render_s, prompt)
            return self._start(new_request_id("chatcmpl"), prompt, request,
                               request.requested_max_tokens(), arrival_time, tenant, render_s)
        except Exception as exc:
            raise refused(exc, arrival_time, self._metrics) from None

    async def start_completion(self, request: CompletionRequest, tenant: str = "") -> Started:
        arrival_time = time.time()
        try:
            self._check_request(request)
            rendering = time.perf_counter()
            prompt = await self._prompts.tokenize_prompt(request.prompt)
            render_s = time.perf_counter() - rendering
            self._record_render_later("completion", render_s, prompt)
            return self._start(new_request_id("cmpl"), prompt, request,
                               request.requested_max_tokens(), arrival_time, tenant, render_s)
        except Exception as exc:
            raise refused(exc, arrival_time, self._metrics) from None

    def _record_render_later(self, route: str, render_s: float, prompt: RenderedPrompt) -> None:
        """Record the rendering (RequestMetrics.record_render) on a later turn of the event loop:
        a Ray metric costs a fraction of a millisecond, which the request would otherwise pay
        before its engine submission; by then the engine is computing its prefill."""
        asyncio.get_running_loop().call_soon(self._metrics.record_render, route, render_s, prompt)

    def _start(self, request_id: str, prompt: RenderedPrompt, fields: SamplingFields,
               max_tokens: int | None, arrival_time: float, tenant: str, render_s: float) -> Started:
        """Validate the prompt and sampling against the limits and the context, build the
        engine's GenerationRequest (its cache salt scoped to the tenant) and open (lazily) its
        output stream; render_s (the prompt's rendering) goes into its meta and log record."""
        max_tokens = output_budget(
            len(prompt.token_ids), max_tokens, self.info.max_model_len,
            max_prompt_tokens=self._limits.max_prompt_tokens,
            max_output_tokens=self._limits.max_output_tokens,
            prompt_param="messages" if isinstance(fields, ChatCompletionRequest) else "prompt")
        request = GenerationRequest(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling=to_sampling_params(fields, max_tokens),
            instruction_boundary=prompt.instruction_boundary,
            cache_breakpoints=prompt.cache_breakpoints,
            cache_salt=scoped_cache_salt(tenant, fields.cache_salt),
            tenant=tenant,
            arrival_time=arrival_time,
        )
        meta = ResponseMeta(id=request_id, created=now(), model=self._model_name, render_s=render_s)
        return meta, self._generate(request, render_s)

    async def _generate(self, request: GenerationRequest,
                        render_s: float | None = None) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs; closed before the last one, the stream is closed too, which
        aborts the request. Measures the time to first token from request.arrival_time; when
        the request ends, logs its RequestRecord (with render_s) and records it as metrics
        (deployments/http/request_log.py, deployments/metrics.py)."""
        record = RequestRecord(request.request_id, render_s=render_s)
        try:
            async with aclosing(self._generate_fn(request)) as outputs:
                async for out in outputs:
                    if record.ttft_s is None:
                        record.ttft_s = time.time() - request.arrival_time
                    record.finish_reason = out.finish_reason
                    record.prompt_tokens, record.cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
                    record.output_tokens = out.num_output_tokens
                    raise_if_failed(out)
                    yield out
            record.status = "ok"
        except Exception as exc:
            error = as_api_error(exc)
            record.status, record.http_status = "error", error.status_code
            raise error from None
        finally:
            record.duration_s = time.time() - request.arrival_time
            log_request(record)
            self._metrics.record_request(record)

    def _check_request(self, request: SamplingFields) -> None:
        """The checks that need neither the renderer nor the engine: the model name and the
        stop-condition limits. Raises APIError."""
        if request.model is not None and request.model != self._model_name:
            raise APIError.model_not_found(request.model)
        check_stop_limits(request, self._limits)

    def _validated(self, model, request):
        """A handle caller's request validated as `model` (the HTTP routes get theirs validated
        by FastAPI): objects built with model_construct, or changed after construction, and
        dicts get the same 400 an HTTP body would (refused and logged)."""
        try:
            return validated(model, request)
        except APIError as exc:
            raise refused(exc, time.time(), self._metrics) from None


class OpenAIHandleAPI:
    """The typed handle methods of an ingress deployment (`serve.get_app_handle(name)`), over
    its `_api` (an OpenAIFrontend): the same on both paths.

        response = await handle.chat.remote(ChatCompletionRequest(messages=[...], max_tokens=16))
        async for chunk in handle.options(stream=True).chat_stream.remote(request):
            ...                                   # ChatCompletionChunk objects
    """

    _api: OpenAIFrontend

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        """Full chat completion. Raises APIError (status_code 400/404/500/503) on failure."""
        return await self._api.chat(request)

    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Streamed chat completion (call with handle.options(stream=True))."""
        async for chunk in self._api.chat_stream(request):
            yield chunk

    async def completions(self, request: CompletionRequest) -> CompletionResponse:
        """Full text completion. Raises APIError on failure."""
        return await self._api.completions(request)

    async def completions_stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        """Streamed text completion (call with handle.options(stream=True))."""
        async for chunk in self._api.completions_stream(request):
            yield chunk

    def models(self) -> ModelList:
        return self._api.models()


def openai_app(frontend: OpenAIFrontend, check_health: Callable[[], Awaitable[None]],
               warming_up: Callable[[], Awaitable[bool]], api_keys: ApiKeys,
               limits: RequestLimits) -> FastAPI:
    """One replica's FastAPI app over `frontend`. check_health raises when the model replica is
    unhealthy (GET /health then answers 503); warming_up says whether its start work still runs
    beside serving (LLMEngine.warming_up; GET /health says so). The middlewares read their
    settings from the app's state: API keys (401 before the body is read) and the edge's limits
    (413, 429)."""
    app = FastAPI(title="hybrid-serve",
                  summary="OpenAI-compatible API for hybrid Mamba2+attention LLMs")
    install_error_handlers(app)
    app.add_middleware(RequestLimitsMiddleware)
    app.add_middleware(ApiKeyMiddleware)  # added last, runs first: no limit is spent on a refused key
    app.state.api_keys = api_keys
    app.state.request_limits = limits

    @app.post("/v1/chat/completions")
    async def http_chat(body: ChatCompletionRequest, request: Request):
        return await frontend.respond_chat(body, request.scope.get(TENANT_SCOPE, ""))

    @app.post("/v1/completions")
    async def http_completions(body: CompletionRequest, request: Request):
        return await frontend.respond_completion(body, request.scope.get(TENANT_SCOPE, ""))

    # the routes that do no I/O are coroutines: a plain def would run in Starlette's thread
    # pool, a thread hop per request (half of a GET /v1/models on the 2-core VM)
    @app.get("/v1/models")
    async def http_models():
        return json_response(frontend.models())

    @app.get("/health")
    async def http_health():
        """200 when the LLM server replica is healthy (its step loop runs, no step has stalled,
        its rank actors answer), with "warming_up": true while it serves before its start work
        has ended (the compiled CPU decode step still compiling: decode steps run eagerly,
        slower); 503 otherwise."""
        try:
            await check_health()
            warming = await warming_up()
        except Exception as exc:
            return error_json(APIError(503, f"unhealthy: {type(exc).__name__}", "server_error"))
        return JSONResponse({"status": "ok", "warming_up": bool(warming)})

    @app.get("/metrics")
    async def http_metrics():
        """A Prometheus exposition without samples that says where the metrics are: Ray
        exports them from every replica (deployments.metrics)."""
        return Response(content=METRICS_ELSEWHERE, media_type=METRICS_CONTENT_TYPE)

    return app
