"""The classic path's ingress deployment: the OpenAI HTTP routes and the Python handle API in a
replica of their own, in front of the Renderer and LLMServer deployments.

    HTTP proxy (Serve) -> OpenAIIngress -> Renderer, then LLMServer (a stream of RequestOutputs)

build_app uses it where the lean path cannot run (deployments/serving_path.py); the API itself
is deployments/frontend.py, which the lean path's LLMServerIngress serves too. Handle:
`serve.get_app_handle(name)` returns a handle to this deployment; call the typed methods

    response = await handle.chat.remote(ChatCompletionRequest(messages=[...], max_tokens=16))
    async for chunk in handle.options(stream=True).chat_stream.remote(request):
        ...                                   # ChatCompletionChunk objects
    (likewise completions / completions_stream, models, pool_usage, engine_stats)

Streams are cancelled when the consumer goes away, which aborts the request in the engine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.frontend import ModelInfo, OpenAIFrontend, OpenAIHandleAPI, RendererPrompts, openai_app
from deployments.http.api_keys import ApiKeys
from deployments.http.limits import RequestLimits
from engine.core.llm_engine import EngineStats, PoolUsage, RequestOutput
from engine.interfaces.generation_request import GenerationRequest


def handle_stream(llm_server: DeploymentHandle):
    """The classic path's GenerateFn: LLMServer.generate through a streaming handle call,
    cancelled (the request aborted) when closed before its last output."""

    async def generate(request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        stream = llm_server.options(stream=True).generate.remote(request)
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                yield out
        finally:
            if not finished:
                stream.cancel()

    return generate


@serve.deployment
@serve.ingress()
class OpenAIIngress(OpenAIHandleAPI):
    """Routes and handle methods (OpenAIHandleAPI). Holds no model state: only handles and the
    model's name and limits."""

    async def __init__(
        self, renderer: DeploymentHandle, llm_server: DeploymentHandle, served_model_name: str,
        limits: RequestLimits, api_keys_file: str | None = None,
    ) -> None:
        self._api_keys = ApiKeys.load(api_keys_file)
        self._limits = limits
        self._llm = llm_server
        info: ModelInfo = await llm_server.model_info.remote()
        self._api = OpenAIFrontend(RendererPrompts(renderer), handle_stream(llm_server), info,
                                   served_model_name, limits)

    def __serve_build_asgi_app__(self):
        return openai_app(self._api, self._llm.check_health.remote, self._llm.warming_up.remote,
                          self._api_keys, self._limits)

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
