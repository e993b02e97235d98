"""Ingress deployment: the OpenAI HTTP routes and the Python handle API, over one code path.

HTTP:   POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
        GET /metrics (no samples: metrics are exported through Ray, see deployments.metrics).
Handle: `serve.get_app_handle(name)` returns a handle to this deployment; call the typed methods

    handle = serve.get_app_handle("hybrid-serve")
    response = await handle.chat.remote(ChatCompletionRequest(messages=[...], max_tokens=16))
    async for chunk in handle.options(stream=True).chat_stream.remote(request):
        ...                                   # ChatCompletionChunk objects
    (likewise completions / completions_stream, models, pool_usage, engine_stats)

Each request: check the model name -> render (renderer deployment) -> one GenerationRequest
(engine/interfaces/generation_request.py) -> stream RequestOutputs from the LLM server -> OpenAI objects. Streams are cancelled when the
consumer goes away, which aborts the request in the engine.
"""

import time
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
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
from deployments.http.streaming import first_output_ready, json_response, sse_response
from deployments.llm_server import ModelInfo
from deployments.metrics import METRICS_CONTENT_TYPE, METRICS_ELSEWHERE, RequestMetrics
from deployments.prompts.rendering import RenderedPrompt
from engine.core.llm_engine import EngineStats, PoolUsage, RequestOutput
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.sampling_params import output_budget

_Started = tuple[ResponseMeta, AsyncGenerator[RequestOutput, None]]

app = FastAPI(title="hybrid-serve", summary="OpenAI-compatible API for hybrid Mamba2+attention LLMs")
install_error_handlers(app)
app.add_middleware(RequestLimitsMiddleware)
app.add_middleware(ApiKeyMiddleware)  # added last, runs first: no limit is spent on a refused key


def refused(exc: BaseException, arrival_time: float, metrics: RequestMetrics) -> APIError:
    """`exc` as the APIError of a request refused before it reached the engine (a bad model
    name, a limit, the renderer, sampling against the context), its record logged and
    counted in `metrics`: _generate records only the requests that reach the engine.
    (Defined above the class: @serve.ingress freezes the routes, with the module globals
    they see, when the class is decorated.)"""
    error = as_api_error(exc)
    record = RequestRecord(None, "error", error.status_code, duration_s=time.time() - arrival_time)
    log_request(record)
    metrics.record_request(record)
    return error


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    """Routes and handle methods. Holds no model state: only handles and the model's name/limits."""

    async def __init__(
        self, renderer: DeploymentHandle, llm_server: DeploymentHandle, served_model_name: str,
        limits: RequestLimits, api_keys_file: str | None = None,
    ) -> None:
        app.state.api_keys = ApiKeys.load(api_keys_file)  # read by ApiKeyMiddleware
        app.state.request_limits = limits  # read by RequestLimitsMiddleware
        self._limits = limits
        self._renderer = renderer
        self._llm = llm_server
        self._model_name = served_model_name
        self._info: ModelInfo = await llm_server.model_info.remote()
        self._created = now()
        self._metrics = RequestMetrics()

    # ----- Python handle API (typed request in, typed response or chunks out)

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        """Full chat completion. Raises APIError (status_code 400/404/500) on failure."""
        request = self._validated(ChatCompletionRequest, request)
        meta, outputs = await self._start_chat(request)
        return chat_response(meta, await collect(outputs))

    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Streamed chat completion (call with handle.options(stream=True))."""
        request = self._validated(ChatCompletionRequest, request)
        meta, outputs = await self._start_chat(request)
        async for chunk in chat_chunks(meta, outputs, request.include_usage):
            yield chunk

    async def completions(self, request: CompletionRequest) -> CompletionResponse:
        """Full text completion. Raises APIError on failure."""
        request = self._validated(CompletionRequest, request)
        meta, outputs = await self._start_completion(request)
        return completion_response(meta, await collect(outputs))

    async def completions_stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        """Streamed text completion (call with handle.options(stream=True))."""
        request = self._validated(CompletionRequest, request)
        meta, outputs = await self._start_completion(request)
        async for chunk in completion_chunks(meta, outputs, request.include_usage):
            yield chunk

    def _validated(self, model, request):
        """A handle caller's request validated as `model` (the HTTP routes get theirs validated
        by FastAPI): objects built with model_construct, or changed after construction, and
        dicts get the same 400 an HTTP body would (refused and logged)."""
        try:
            return validated(model, request)
        except APIError as exc:
            raise refused(exc, time.time(), self._metrics) from None

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self._model_name, created=self._created,
                                         root=self._info.model_dir,
                                         max_model_len=self._info.max_model_len)])

    async def pool_usage(self) -> PoolUsage:
        """Block/state pool occupancy of the LLM server replica the call is routed to (with one
        replica, the engine's); for debugging and tests."""
        return await self._llm.pool_usage.remote()

    async def engine_stats(self) -> EngineStats:
        """The engine's checkpoint and prefill counters (the LLM server replica routed to)."""
        return await self._llm.engine_stats.remote()

    async def num_aborted_requests(self) -> int:
        """Requests whose stream ended before their final output (e.g. client disconnects)."""
        return await self._llm.num_aborted_requests.remote()

    # ----- HTTP routes

    @app.post("/v1/chat/completions")
    async def http_chat(self, body: ChatCompletionRequest, request: Request):
        return await self._respond(body, request.scope.get(TENANT_SCOPE, ""), self._start_chat,
                                   chat_response, chat_chunks)

    @app.post("/v1/completions")
    async def http_completions(self, body: CompletionRequest, request: Request):
        return await self._respond(body, request.scope.get(TENANT_SCOPE, ""), self._start_completion,
                                   completion_response, completion_chunks)

    @app.get("/v1/models")
    def http_models(self):
        return json_response(self.models())

    @app.get("/health")
    async def http_health(self):
        """200 when the LLM server replica is healthy (its step loop runs, no step has stalled,
        its rank actors answer); 503 otherwise."""
        try:
            await self._llm.check_health.remote()
        except Exception as exc:
            return error_json(APIError(503, f"unhealthy: {type(exc).__name__}", "server_error"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def http_metrics(self):
        """A Prometheus exposition without samples that says where the metrics are: Ray
        exports them from every replica (deployments.metrics)."""
        return Response(content=METRICS_ELSEWHERE, media_type=METRICS_CONTENT_TYPE)

    # ----- one code path for both APIs

    async def _respond(self, body, tenant: str, start, full_response, chunks):
        """The HTTP answer to `body` from `tenant` (deployments/http/api_keys.py; "" without keys):
        started with `start`, then one JSON body built by `full_response`, or server-sent
        events from `chunks`; errors before the first output as an OpenAI error body with its
        status."""
        try:
            meta, outputs = await start(body, tenant)
            if not body.stream:
                return json_response(full_response(meta, await collect(outputs)))
            outputs = await first_output_ready(outputs)
        except Exception as exc:
            return error_json(as_api_error(exc))
        return sse_response(chunks(meta, outputs, body.include_usage))

    async def _start_chat(self, request: ChatCompletionRequest, tenant: str = "") -> _Started:
        arrival_time = time.time()
        try:
            self._check_request(request)
            check_cache_markers(request, self._limits)
            prompt: RenderedPrompt = await self._renderer.render_chat.remote(request.messages)
            self._metrics.count_boundary_rejection(prompt.boundary_rejection)
            self._metrics.count_breakpoint_rejections(prompt.breakpoint_rejections)
            return self._start(new_request_id("chatcmpl"), prompt, request,
                               request.requested_max_tokens(), arrival_time, tenant)
        except Exception as exc:
            raise refused(exc, arrival_time, self._metrics) from None

    async def _start_completion(self, request: CompletionRequest, tenant: str = "") -> _Started:
        arrival_time = time.time()
        try:
            self._check_request(request)
            prompt: RenderedPrompt = await self._renderer.tokenize_prompt.remote(request.prompt)
            return self._start(new_request_id("cmpl"), prompt, request,
                               request.requested_max_tokens(), arrival_time, tenant)
        except Exception as exc:
            raise refused(exc, arrival_time, self._metrics) from None

    def _start(
        self, request_id: str, prompt: RenderedPrompt, fields: SamplingFields,
        max_tokens: int | None, arrival_time: float, tenant: str,
    ) -> _Started:
        """Validate the prompt and sampling against the limits and the context, build the
        engine's GenerationRequest (its cache salt scoped to the tenant) and open (lazily) the
        LLM server stream."""
        max_tokens = output_budget(
            len(prompt.token_ids), max_tokens, self._info.max_model_len,
            max_prompt_tokens=self._limits.max_prompt_tokens,
            max_output_tokens=self._limits.max_output_tokens,
            prompt_param="messages" if isinstance(fields, ChatCompletionRequest) else "prompt")
        sampling = to_sampling_params(fields, max_tokens)
        request = GenerationRequest(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling=sampling,
            instruction_boundary=prompt.instruction_boundary,
            cache_breakpoints=prompt.cache_breakpoints,
            cache_salt=scoped_cache_salt(tenant, fields.cache_salt),
            tenant=tenant,
            arrival_time=arrival_time,
        )
        meta = ResponseMeta(id=request_id, created=now(), model=self._model_name)
        return meta, self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        """The LLM server's stream; cancelled (request aborted) if not drained to the end.
        Measures the time to first token from request.arrival_time; when the request ends,
        logs its RequestRecord and records it as metrics (deployments/http/request_log.py,
        deployments/metrics.py)."""
        stream = self._llm.options(stream=True).generate.remote(request)
        record = RequestRecord(request.request_id)
        finished = False
        try:
            async for out in stream:
                if record.ttft_s is None:
                    record.ttft_s = time.time() - request.arrival_time
                finished = out.finished
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
            if not finished:
                stream.cancel()
            record.duration_s = time.time() - request.arrival_time
            log_request(record)
            self._metrics.record_request(record)

    def _check_request(self, request: SamplingFields) -> None:
        """The checks that need neither the renderer nor the engine: the model name and the
        stop-condition limits. Raises APIError."""
        if request.model is not None and request.model != self._model_name:
            raise APIError.model_not_found(request.model)
        check_stop_limits(request, self._limits)

