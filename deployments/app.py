"""Application builder: `import_path: deployments.app:build_app` in serve_config.yaml.

    OpenAIIngress (HTTP + handle API)
      -> Renderer   (chat template, tokenizer)
      -> LLMServer  (the engine's step loop; the model itself with one rank, one worker actor
                     per rank with tensor_parallel_size > 1)

`build_app(args)` validates the args (unknown keys rejected, see deployments.config) and
returns the bound Application; `serve.run(build_app({...}))` runs it from Python.
"""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppConfig, parse_app_config
from deployments.ingress import OpenAIIngress
from deployments.llm_server import LLMServer
from deployments.renderer import Renderer
from engine.model_config import load_model_config
from engine.shard_layout import rank_shard_layout
from engine.tensor_parallel import TensorParallel


def check_model_splits(config: AppConfig) -> None:
    """Raise ValueError if the model's head counts cannot be split (or replicated)
    tensor_parallel_size ways, naming the count."""
    world_size = config.engine.tensor_parallel_size
    model_config = load_model_config(config.engine.model_dir)
    for rank in range(world_size):
        rank_shard_layout(model_config, TensorParallel(rank, world_size))


def llm_server_resources(config: AppConfig) -> dict:
    """The LLM server replica's Ray resources. With one rank the replica runs the model, so it
    also asks for the rank's worker_num_cpus and, on CUDA, its GPU; with more ranks each rank
    actor asks for its own (deployments.worker_group)."""
    engine = config.engine
    if engine.tensor_parallel_size > 1:
        return {"num_cpus": config.llm_server_num_cpus}
    return {"num_cpus": config.llm_server_num_cpus + config.worker_num_cpus,
            "num_gpus": 1 if engine.device.startswith("cuda") else 0}


def build_app(args: dict) -> Application:
    """Build the application from serve_config.yaml `args` (a dict) or an AppConfig.

    Raises ValueError naming every unknown or invalid key.
    """
    config: AppConfig = parse_app_config(args)
    check_model_splits(config)  # fail at build time, not when the replica starts
    serve_options = {"max_ongoing_requests": config.max_ongoing_requests}
    renderer = Renderer.options(
        ray_actor_options={"num_cpus": config.renderer_num_cpus}, **serve_options
    ).bind(config.engine.model_dir)
    llm_server = LLMServer.options(
        ray_actor_options=llm_server_resources(config),
        health_check_period_s=config.health_check_period_s, **serve_options
    ).bind(config)
    return OpenAIIngress.options(
        ray_actor_options={"num_cpus": config.ingress_num_cpus}, **serve_options
    ).bind(renderer, llm_server, config.served_model_name)
