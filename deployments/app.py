"""Application builder: `import_path: deployments.app:build_app` in serve_config.yaml.

    OpenAIIngress (HTTP + handle API)
      -> Renderer   (chat template, tokenizer)
      -> LLMServer  (the engine's step loop; the model itself with one rank, one worker actor
                     per rank with tensor_parallel_size > 1); with checkpoint_routing, routed
                     by CheckpointAwareRouter, and its replicas report their checkpoints to
                     the application's CheckpointIndex actor (deployments/cluster/index.py)

`build_app(args)` validates the args (unknown keys rejected, see deployments.config) and
returns the bound Application; `serve.run(build_app({...}))` runs it from Python.
"""

from __future__ import annotations

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.http.api_keys import ApiKeys
from deployments.cluster.router import CheckpointAwareRouter
from deployments.config import AppConfig, parse_app_config
from deployments.http.limits import RequestLimits
from deployments.ingress import OpenAIIngress
from deployments.llm_server import LLMServer
from deployments.placement import PlacementError, check_placement, llm_server_resources
from deployments.renderer import Renderer
from engine.parallel.cache_capacity import check_cache_budgets
from engine.execution.loader import check_cuda_shapes
from engine.models.registry import load_model_config
from engine.speculative.checks import check_speculation


# Requests an ingress replica takes beyond max_requests_in_flight: /health, /metrics, /v1/models
# and the generation requests the middleware answers with 429.
INGRESS_HEADROOM = 64


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
        check_cache_budgets(config.engine, model_config)
        check_speculation(config.engine, model_config)
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


def build_app(args: dict) -> Application:
    """Build the application from serve_config.yaml `args` (a dict) or an AppConfig.

    Raises ValueError naming every unknown or invalid key, and PlacementError (a ValueError)
    naming the key and the numbers when the cluster, or this machine without Ray, cannot hold
    what the app asks (deployments/placement.py; it may first wait for an autoscaler).
    """
    config: AppConfig = parse_app_config(args)
    check_engine_config(config)  # fail at build time, not when the replica starts
    try:
        check_placement(config)  # a config no node can hold fails here instead of waiting for ever
    except PlacementError as exc:
        raise PlacementError(exc.key, f"invalid hybrid-serve app args: {exc}") from None
    if config.api_keys_file is not None:
        try:
            ApiKeys.load(config.api_keys_file, environ={})
        except ValueError as exc:
            raise ValueError(f"invalid hybrid-serve app args: {exc}") from None
    serve_options = {"max_ongoing_requests": config.max_ongoing_requests,
                     "max_queued_requests": config.max_queued_requests}
    renderer = Renderer.options(
        ray_actor_options={"num_cpus": config.renderer_num_cpus}, **serve_options
    ).bind(config.engine.model_dir)
    llm_server = LLMServer.options(
        ray_actor_options=llm_server_resources(config),
        health_check_period_s=config.health_check_period_s, **serve_options,
        **llm_server_routing(config)
    ).bind(config)
    limits = RequestLimits(
        max_body_bytes=config.max_body_bytes, max_requests_in_flight=config.max_requests_in_flight,
        retry_after_s=config.retry_after_s, max_stop_strings=config.max_stop_strings,
        max_stop_string_chars=config.max_stop_string_chars,
        max_prompt_tokens=config.max_prompt_tokens, max_output_tokens=config.max_output_tokens,
        max_cache_breakpoints=config.max_cache_breakpoints)
    return OpenAIIngress.options(
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        # above the middleware's own limit, so a request beyond it gets a 429, not a queue
        max_ongoing_requests=config.max_requests_in_flight + INGRESS_HEADROOM,
    ).bind(renderer, llm_server, config.served_model_name, limits, config.api_keys_file)
