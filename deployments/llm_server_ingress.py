"""The lean path's LLM server: the model replica is the application's HTTP ingress.

    client -> HAProxy (Ray Serve's HAProxy ingress) -> LLMServerIngress replica: uvicorn, the
              OpenAI routes, rendering and the engine's step loop in one process

With RAY_SERVE_ENABLE_HA_PROXY=1 (deployments/serving_path.py) Serve starts an HTTP server in
each replica of an application's ingress deployment (direct ingress) and an HAProxy in front
of them on the HTTP port. This deployment is that ingress: LLMServerReplica (the engine, the
model with one rank, `generate` and the operators' methods) plus the OpenAI API of
deployments/frontend.py over its own engine, so a streamed token crosses one process boundary
(replica -> HAProxy) before the client. Prompts are rendered in the replica (a PromptRenderer
of its own) or, with render_in_replica false, by the Renderer deployment through its handle.
With checkpoint_routing, HAProxy asks the CheckpointIngressRouter deployment
(deployments/cluster/ingress_router.py) which replica takes each request; without it HAProxy
balances by its least connections.

Handle calls (`serve.get_app_handle(name)`) reach the same typed methods as on the classic path
(OpenAIHandleAPI), through the gRPC data plane with RAY_SERVE_THROUGHPUT_OPTIMIZED=1.
"""

from __future__ import annotations

import asyncio

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import AppConfig
from deployments.frontend import (
    LocalPrompts,
    OpenAIFrontend,
    OpenAIHandleAPI,
    PromptSource,
    RendererPrompts,
    openai_app,
)
from deployments.http.api_keys import ApiKeys
from deployments.http.limits import RequestLimits
from deployments.llm_server import LLMServerReplica
from deployments.prompts.rendering import PromptRenderer


@serve.ingress()
class LLMServerIngress(OpenAIHandleAPI, LLMServerReplica):
    """An LLM server replica that serves the OpenAI API itself (see the module docstring)."""

    async def __init__(self, config: AppConfig, renderer: DeploymentHandle | None,
                       limits: RequestLimits) -> None:
        """renderer: the Renderer deployment's handle, bound only with render_in_replica
        false (deployments/placement.py deployment_names)."""
        await LLMServerReplica.__init__(self, config)
        self._api_keys = ApiKeys.load(config.api_keys_file)
        self._limits = limits
        if config.render_in_replica:
            # a tokenizer of its own: the engine's detokenizes on the step thread
            renderer_here = await asyncio.to_thread(PromptRenderer.from_pretrained,
                                                    config.engine.model_dir)
            prompts: PromptSource = LocalPrompts(renderer_here)
        else:
            prompts = RendererPrompts(renderer)
        self._api = OpenAIFrontend(prompts, self.generate, self._info, config.served_model_name,
                                   limits)

    def __serve_build_asgi_app__(self):
        return openai_app(self._api, self.check_health, self.warming_up, self._api_keys, self._limits)


# The lean path's deployment, under the classic LLMServer's name: serve_config.yaml's
# `deployments: - name: LLMServer` options apply on either path.
LLMServerIngressDeployment = serve.deployment(name="LLMServer")(LLMServerIngress)
