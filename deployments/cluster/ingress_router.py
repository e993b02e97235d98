"""Checkpoint-aware routing on the lean path: the ingress request router HAProxy asks where each
HTTP request goes.

    client -> HAProxy --POST /internal/route (the request's body)--> CheckpointIngressRouter
                      <-- {"host", "port", "replica_id"} --
           -> HAProxy -> that LLM server replica (deployments/llm_server_ingress.py)

On the lean path an HTTP request reaches an LLM server replica without a Serve handle, so the
CheckpointAwareRouter (deployments/cluster/router.py), which routes handle calls, would never
see it. Ray Serve 2.60 lets an application attach an "ingress request router" deployment
(`Application._with_ingress_request_router`, the hook Ray Serve LLM's direct streaming uses):
with it, HAProxy's Lua action posts each request's body (RAY_SERVE_INGRESS_REQUEST_ROUTER_
FORWARD_BODY=1) to a router replica's /internal/route and forwards the request to the replica
named in the answer. This deployment renders the body into the prompt's token ids with its own
PromptRenderer, exactly as the replica will (the same template, tokenizer and message fields),
and asks the LLM server deployment's request router, the CheckpointAwareRouter, to pick a
replica for that PromptKey (`DeploymentHandle.choose_replica`, without reserving a slot: the
request itself goes through HAProxy). So the choice is the classic path's, by token ids: the
replica holding the longest checkpoint of the prompt, below its queue threshold.

A body that cannot be read as a chat or completion request (malformed, truncated past HAProxy's
buffer, another route), or a prompt the template refuses, is routed without a key: Serve's
power-of-two choice; the replica then answers the request (with its 400, if any). HAProxy does
not forward the Authorization header to the router, so with API keys the router cannot scope
the namespace to the tenant: lookups miss and only the recent placements (per router, keyed by
instructions) keep a tenant's shared instructions on one replica.

The replica renders the prompt again: a short chat costs well under a millisecond, and so
does a prompt of 8,000 instruction tokens once its instructions are remembered (the renderer
then tokenizes only the rest: benchmarks/render_time.py), paid once more per routed request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.cluster.prompt_key import PromptKey
from deployments.http.errors import APIError, validated
from deployments.http.protocol import ChatCompletionRequest, CompletionRequest
from deployments.prompts.rendering import PromptRenderer

logger = logging.getLogger("ray.serve")

ROUTE_PATH = "/internal/route"  # the path HAProxy's Lua action posts to


def prompt_key(body: bytes, renderer: PromptRenderer) -> PromptKey | None:
    """The routing key of an OpenAI request body, rendered as the LLM server replica renders
    it (deployments/frontend.py): chat messages through the chat template, a completion
    prompt through the tokenizer. None for a body that is not a valid chat or completion
    request, or whose prompt the renderer refuses."""
    try:
        data: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        if "messages" in data:
            chat = validated(ChatCompletionRequest, data)
            rendered = renderer.render_chat([m.model_dump(exclude_none=True) for m in chat.messages])
            salt = chat.cache_salt
        elif "prompt" in data:
            completion = validated(CompletionRequest, data)
            rendered = renderer.tokenize_prompt(completion.prompt)
            salt = completion.cache_salt
        else:
            return None
    except (APIError, ValueError):  # invalid body, InvalidRequestError from the renderer
        return None
    return PromptKey(rendered.token_ids, salt, rendered.instruction_boundary)


def router_app(route: Callable[[bytes], Awaitable[JSONResponse]]) -> FastAPI:
    """The router replica's HTTP app: POST ROUTE_PATH (HAProxy's question), GET /health.
    (Module level: Serve pickles the deployment class by value, and a closure's annotations
    would then lose the names they refer to.)"""
    app = FastAPI()

    @app.post(ROUTE_PATH)
    async def route_request(request: Request):
        return await route(await request.body())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


@serve.deployment
@serve.ingress()
class CheckpointIngressRouter:
    """The ingress request router of the lean path with checkpoint_routing (see the module
    docstring). server: the LLM server deployment's handle; model_dir: its engine's."""

    async def __init__(self, server: DeploymentHandle, model_dir: str) -> None:
        self._server = server
        self._renderer = await asyncio.to_thread(PromptRenderer.from_pretrained, model_dir)
        self._warned_no_body = False

    def __serve_build_asgi_app__(self):
        return router_app(self.route)

    async def route(self, body: bytes) -> JSONResponse:
        """HAProxy's question: 200 {"host", "port", "replica_id"} names the replica; any other
        status makes HAProxy answer the client 503."""
        if not body and not self._warned_no_body:
            self._warned_no_body = True
            logger.warning("checkpoint-aware ingress routing: HAProxy sent no request body (set "
                           "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1 before Ray starts); "
                           "requests go by power-of-two choices")
        key = await asyncio.to_thread(prompt_key, body, self._renderer) if body else None
        try:
            async with self._server.choose_replica(*([key] if key else []), _reserve=False) as selection:
                replica = selection._replica
                endpoint = replica.backend_http_endpoint
                if endpoint is None:
                    raise RuntimeError(f"replica {selection.replica_id} has no HTTP endpoint")
                host, port = endpoint
                replica_id = replica.replica_id.to_full_id_str()
        except Exception as exc:  # no replica (yet): HAProxy answers 503
            logger.warning("checkpoint-aware ingress routing found no replica: %s", exc)
            return JSONResponse({"detail": str(exc)}, status_code=503)
        return JSONResponse({"host": host, "port": port, "replica_id": replica_id})
