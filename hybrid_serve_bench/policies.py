"""hybrid-serve in this process, one Serve app per checkpoint_slots setting, for compare-policies.

`serve_policies` starts Ray (ray.init in this process) and one Serve instance, deploys
deployments.app.build_app once per setting, each as its own app under its own route prefix
(/slots-none, /slots-prompt, ...: separate LLM server replicas, so separate caches), yields one
runner.Target per setting (labelled by its slots, e.g. "[prompt, response]"), and shuts Serve
and Ray down when the block ends. Needs the project's own packages (deployments, engine), so it
runs from a checkout or an install of hybrid-serve; the client side needs neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from hybrid_serve_bench.runner import Target

POLICIES: tuple[tuple[str, ...], ...] = ((), ("prompt",), ("prompt", "response"),
                                         ("prompt", "response", "instruction"),
                                         ("prompt", "response", "instruction", "breakpoint"))


def policy_label(slots: tuple[str, ...]) -> str:
    return "[" + ", ".join(slots) + "]"


def parse_policy(text: str) -> tuple[str, ...]:
    """"none" or "" -> (); "prompt,response" -> ("prompt", "response")."""
    return tuple(s.strip() for s in text.split(",") if s.strip() and s.strip() != "none")


def engine_config(model_dir: str | None, max_model_len: int, slots: tuple[str, ...]):
    """The engine settings of every policy app: the defaults, with max_model_len (the embedded
    tiny model's context is 4,096 tokens) and the policy's checkpoint_slots."""
    from engine.engine_config import EngineConfig

    config = EngineConfig(max_model_len=max_model_len, checkpoint_slots=slots)
    return dataclasses.replace(config, model_dir=model_dir) if model_dir else config


@contextlib.contextmanager
def serve_policies(policies: list[tuple[str, ...]], *, model_dir: str | None, max_model_len: int,
                   port: int, served_model_name: str = "hybrid-serve-tiny",
                   ray_cpus: int = 8) -> Iterator[tuple[list[Target], list[dict]]]:
    """Yield (targets, configs): one Target and one AppConfig dump per policy, in order."""
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.config import AppConfig

    ray.init(num_cpus=ray_cpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 1024 * 1024)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        targets, configs = [], []
        for slots in policies:
            name = "-".join(slots) or "none"
            config = AppConfig(served_model_name=served_model_name,
                               engine=engine_config(model_dir, max_model_len, slots))
            serve.run(build_app(config.model_dump()), name=f"bench-slots-{name}",
                      route_prefix=f"/slots-{name}")
            targets.append(Target(policy_label(slots), f"http://127.0.0.1:{port}/slots-{name}",
                                  served_model_name))
            configs.append(config.model_dump(mode="json"))
        yield targets, configs
    finally:
        serve.shutdown()
        ray.shutdown()
