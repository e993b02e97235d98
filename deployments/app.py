"""Application builder: `import_path: deployments.app:build_app` in serve_config.yaml.

Two graphs, the same API (deployments/serving_path.py chooses, docs/design.md section 6):

    lean     LLMServer (LLMServerIngress: the OpenAI routes, rendering, the engine's step loop;
               HAProxy forwards HTTP to its replicas)
               + with render_in_replica false, Renderer (the replica renders through it)
               + with checkpoint_routing, CheckpointIngressRouter (HAProxy asks it which replica)
    classic  OpenAIIngress (HTTP + handle API)
               -> Renderer   (chat template, tokenizer)
               -> LLMServer  (the engine's step loop)

On both, the LLM server runs the model itself with one rank and one worker actor per rank with
tensor_parallel_size > 1; with checkpoint_routing its handle calls are routed by
CheckpointAwareRouter, and its replicas report their checkpoints to the application's
CheckpointIndex actor (deployments/cluster/index.py).

`build_app(args)` validates the args (unknown keys rejected, see deployments.config) and
returns the bound Application; `serve.run(build_app({...}))` runs it from Python.
"""

from __future__ import annotations

import logging

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.http.api_keys import ApiKeys
from deployments.cluster.ingress_router import CheckpointIngressRouter
from deployments.cluster.router import CheckpointAwareRouter
from deployments.config import AppConfig, parse_app_config
from deployments.http.limits import RequestLimits
from deployments.ingress import OpenAIIngress
from deployments.llm_server import LLMServer
from deployments.llm_server_ingress import LLMServerIngressDeployment
from deployments.placement import PlacementError, check_placement, deployment_names, llm_server_resources
from deployments.renderer import Renderer
from deployments.serving_path import serving_path
from engine.parallel.cache_capacity import check_cache_budgets
from engine.execution.loader import check_cuda_shapes
from engine.models.registry import load_model_config
from engine.speculative.checks import check_speculation
from engine.speculative.policy import resolve_speculation


logger = logging.getLogger("ray.serve")

# Requests an ingress replica takes beyond max_requests_in_flight: /health, /metrics, /v1/models
# and the generation requests the middleware answers with 429.
INGRESS_HEADROOM = 64
# The classic ingress's replicas (serve_config.yaml's `deployments:` may override them).
INGRESS_SCALING = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                          "target_ongoing_requests": 128},
                   "graceful_shutdown_timeout_s": 300}
# The Renderer's replicas, where the graph has one (serve_config.yaml's `deployments:` may
# override them there; naming it where the graph has none is refused, check_config).
RENDERER_SCALING = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                           "target_ongoing_requests": 32}}


def check_engine_config(config: AppConfig) -> None:
    """Raise ValueError, naming the key, for an engine configuration the workers would refuse
    when they start: a model_dir without config.json, a model family this engine does not
    run (engine/models/registry.py), a config key it refuses, head counts that cannot be split (or
    replicated) tensor_parallel_size ways, max_model_len beyond the model's context, cache
    budgets that cannot hold one request (engine/parallel/cache_capacity.py), speculative decoding
    the model cannot run (engine/speculative/checks.py), or on CUDA shapes its kernels cannot
    serve (engine/execution/loader.py check_cuda_shapes). Without this check Serve
    would restart the failing replica again and again and the deploy would never finish."""
    try:
        model_config = load_model_config(config.engine.model_dir)
        engine, _ = resolve_speculation(config.engine, model_config)  # as the engine will
        check_cache_budgets(engine, model_config)
        check_speculation(engine, model_config)
        if config.engine.device.startswith("cuda"):
            check_cuda_shapes(model_config)
    except FileNotFoundError as exc:
        raise ValueError(f"invalid hybrid-serve app args: engine.model_dir: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"invalid hybrid-serve app args: engine: {exc}") from None


def llm_server_routing(config: AppConfig) -> dict:
    """The LLM server's Serve options for checkpoint-aware routing (none when it is off):
    the router and its kwargs (deployments/cluster/router.py)."""
    if not config.checkpoint_routing:
        return {}
    threshold = config.routing_queue_threshold or config.engine.max_num_seqs
    return {"request_router_config": RequestRouterConfig(
        request_router_class=CheckpointAwareRouter,
        request_router_kwargs={"model_dir": config.engine.model_dir,
                               "queue_threshold": threshold})}


def in_ray_worker() -> bool:
    """Whether this process is a Ray worker (an actor or task, e.g. Serve's build task)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def build_app(args: dict) -> Application:
    """Build the application from serve_config.yaml `args` (a dict) or an AppConfig: the lean
    graph where HAProxy runs (deployments/serving_path.py), else the classic one; logs one
    line saying which and why.

    Raises ValueError naming every unknown or invalid key, and PlacementError (a ValueError)
    naming the key and the numbers when the cluster, or this machine without Ray, cannot hold
    what the app asks (deployments/placement.py; it may first wait for an autoscaler).
    """
    config: AppConfig = parse_app_config(args)
    check_engine_config(config)  # fail at build time, not when the replica starts
    path = serving_path(config)
    try:
        # a config no node can hold fails here instead of waiting for ever
        check_placement(config, lean=path.lean)
    except PlacementError as exc:
        raise PlacementError(exc.key, f"invalid hybrid-serve app args: {exc}") from None
    if config.api_keys_file is not None:
        try:
            ApiKeys.load(config.api_keys_file, environ={})
        except ValueError as exc:
            raise ValueError(f"invalid hybrid-serve app args: {exc}") from None
    # one line where the user reads: the driver's stderr (serve_main's check of the file, a
    # serve.run caller); inside Ray (Serve's build task) the controller's log file only, since
    # `serve run` would forward a copy to the same console
    logger.info(path.log_line(), extra={"log_to_stderr": not in_ray_worker()})
    serve_options = {"max_ongoing_requests": config.max_ongoing_requests,
                     "max_queued_requests": config.max_queued_requests}
    renderer = None
    if "Renderer" in deployment_names(config, path.lean):
        renderer = Renderer.options(
            ray_actor_options={"num_cpus": config.renderer_num_cpus}, **RENDERER_SCALING, **serve_options
        ).bind(config.engine.model_dir)
    limits = request_limits(config)
    llm_options = {"ray_actor_options": llm_server_resources(config),
                   "health_check_period_s": config.health_check_period_s,
                   **serve_options, **llm_server_routing(config)}
    if path.lean:
        return lean_app(config, renderer, limits, llm_options)
    llm_server = LLMServer.options(**llm_options).bind(config)
    return OpenAIIngress.options(
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        # above the middleware's own limit, so a request beyond it gets a 429, not a queue
        max_ongoing_requests=config.max_requests_in_flight + INGRESS_HEADROOM,
        **INGRESS_SCALING,
    ).bind(renderer, llm_server, config.served_model_name, limits, config.api_keys_file)


def request_limits(config: AppConfig) -> RequestLimits:
    """The edge's limits (deployments/http/limits.py) the app's config sets."""
    return RequestLimits(
        max_body_bytes=config.max_body_bytes, max_requests_in_flight=config.max_requests_in_flight,
        retry_after_s=config.retry_after_s, max_stop_strings=config.max_stop_strings,
        max_stop_string_chars=config.max_stop_string_chars,
        max_prompt_tokens=config.max_prompt_tokens, max_output_tokens=config.max_output_tokens,
        max_cache_breakpoints=config.max_cache_breakpoints)


def lean_app(config: AppConfig, renderer: Application | None, limits: RequestLimits,
             llm_options: dict) -> Application:
    """The lean graph: the LLM server deployment is the ingress; with checkpoint_routing, the
    CheckpointIngressRouter is attached as its ingress request router (Ray 2.60's hook)."""
    # HTTP requests wait in Serve's queue beyond max_ongoing_requests: keep it above the
    # middleware's max_requests_in_flight, so a request beyond that gets a 429, not a queue
    ongoing = max(config.max_ongoing_requests, config.max_requests_in_flight + INGRESS_HEADROOM)
    server = LLMServerIngressDeployment.options(
        **{**llm_options, "max_ongoing_requests": ongoing}).bind(config, renderer, limits)
    if not config.checkpoint_routing:
        return server
    router = CheckpointIngressRouter.options(
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        max_ongoing_requests=config.max_requests_in_flight + INGRESS_HEADROOM,
    ).bind(server, config.engine.model_dir)
    return server._with_ingress_request_router(router)
