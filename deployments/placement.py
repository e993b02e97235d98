"""Whether an application's Ray resources can be placed at all, checked when it is built.

Serve waits for ever for a replica whose resources no node can give ("has 1 replicas that have
taken more than 30s to initialize"): `tensor_parallel_size: 2` with `worker_num_cpus: 1.0` asks
2.3 CPUs of a 2-core machine. build_app and check_config refuse such a config instead, naming
the key and the numbers.

    app_demand(config, replicas, actor_options) -> Demand     pure: what the app asks
    placement_problem(demand, capacity) -> str | None         pure: why it cannot be placed
    check_placement(config, ...)                              the build's check (may wait)

What the app asks (deployments/app.py, deployments/worker_group.py): every deployment's starting
replicas (1 each from build_app; check_config reads num_replicas, or autoscaling_config
initial_replicas / min_replicas, and ray_actor_options from the file) x its num_cpus; the LLM
server replica with one rank asks llm_server_num_cpus + worker_num_cpus and, on CUDA, one GPU;
with more ranks it asks llm_server_num_cpus and its rank actors tensor_parallel_size x
(worker_num_cpus, one GPU on CUDA), packed on one node (STRICT_PACK); the checkpoint index actor
INDEX_NUM_CPUS with checkpoint_routing or checkpoint_transfer. Serve's controller and proxies
ask no CPUs.

Against what (Capacity): with Ray initialised, the alive nodes' total resources (not the free
ones: a redeploy of a running app would count its own replicas against it); without Ray, this
machine's CPUs and GPUs, which `serve run` / `serve.run` give the Ray it starts; with
RAY_ADDRESS set and Ray not initialised, nothing is checked here (the cluster is elsewhere: the
build in its Serve controller checks). The totals and the largest node are necessary
conditions, exact on one node; several nodes may still fail to pack, which Serve then reports.

Where an autoscaler can add nodes (allow_autoscaling_wait_s; by default on a KubeRay cluster,
detected by the KUBERAY_GEN_RAY_START_CMD variable KubeRay sets in its Ray containers), an app
that does not fit yet asks the autoscaler for its bundles (ray.autoscaler.sdk.request_resources),
logs one line, and waits that long for the nodes before it is refused.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from deployments.cluster.index import INDEX_NUM_CPUS
from deployments.config import AppConfig

logger = logging.getLogger("ray.serve")

KUBERAY_ENV = "KUBERAY_GEN_RAY_START_CMD"  # set by KubeRay in every Ray container
KUBERAY_AUTOSCALING_WAIT_S = 600.0  # allow_autoscaling_wait_s unset, on KubeRay
POLL_S = 5.0
SLACK = 1e-4  # Ray counts resources in units of 1/10000


class PlacementError(ValueError):
    """The application asks more than the cluster (or this machine) has. `key` is the config key
    to change; the message names it and the numbers."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Term:
    """One line of the demand: `text` says it ("1 x tensor_parallel_size 2 x worker_num_cpus
    1.0"), `amount` is its total, `key` the config key that sets it."""

    key: str
    text: str
    amount: float


@dataclass(frozen=True)
class Unit:
    """Resources that must come from one node: one actor, or a STRICT_PACK placement group."""

    key: str
    text: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class Demand:
    cpus: tuple[Term, ...]
    gpus: tuple[Term, ...]
    units: tuple[Unit, ...]
    bundles: tuple[dict, ...] = field(default=())  # for the autoscaler, one per actor/rank

    @property
    def total_cpus(self) -> float:
        return sum(t.amount for t in self.cpus)

    @property
    def total_gpus(self) -> float:
        return sum(t.amount for t in self.gpus)


@dataclass(frozen=True)
class Capacity:
    """Total CPUs and GPUs, each node's (cpus, gpus), and what they are ("the Ray cluster")."""

    cpus: float
    gpus: float
    nodes: tuple[tuple[float, float], ...]
    source: str


def num(value: float) -> str:
    """A config value as the user wrote it: 1.0, 0.1, 2.3 (never 2.3000000000000003)."""
    text = f"{value:.4f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _has(value: float) -> str:
    return f"{value:g}"


def llm_server_resources(config: AppConfig) -> dict:
    """The LLM server replica's Ray resources. With one rank the replica runs the model, so it
    also asks for the rank's worker_num_cpus and, on CUDA, its GPU; with more ranks each rank
    actor asks for its own (deployments.worker_group)."""
    engine = config.engine
    if engine.tensor_parallel_size > 1:
        return {"num_cpus": config.llm_server_num_cpus}
    return {"num_cpus": config.llm_server_num_cpus + config.worker_num_cpus,
            "num_gpus": 1 if engine.device.startswith("cuda") else 0}


def deployment_names(config: AppConfig, lean: bool) -> tuple[str, ...]:
    """The deployments of the graph build_app binds for `config` (deployments/app.py), the
    ingress first. Lean (deployments/serving_path.py): the LLM server is the ingress; with
    checkpoint_routing, the CheckpointIngressRouter in front of it; the Renderer only with
    render_in_replica false (the replica renders otherwise). Classic: OpenAIIngress, Renderer,
    LLM server. Pure."""
    if not lean:
        return ("OpenAIIngress", "Renderer", "LLMServer")
    return (("CheckpointIngressRouter",) * config.checkpoint_routing + ("LLMServer",)
            + ("Renderer",) * (not config.render_in_replica))


def app_demand(config: AppConfig, replicas: Mapping[str, int] | None = None,
               actor_options: Mapping[str, Mapping] | None = None, lean: bool = False) -> Demand:
    """What `config` asks when it starts: replicas (deployment class name -> starting replicas,
    1 when absent), actor_options (name -> the serve config file's ray_actor_options, which
    override build_app's); lean: the lean path's graph (deployment_names),
    deployments/serving_path.py. Pure."""
    replicas, actor_options = replicas or {}, actor_options or {}
    engine = config.engine
    tp, on_gpu = engine.tensor_parallel_size, engine.device.startswith("cuda")
    cpus: list[Term] = []
    gpus: list[Term] = []
    units: list[Unit] = []
    bundles: list[dict] = []

    def deployment(name: str, key: str, num_cpus: float, num_gpus: float, what: str) -> None:
        n = replicas.get(name, 1)
        options = actor_options.get(name) or {}
        if "num_cpus" in options:
            num_cpus = float(options["num_cpus"])
            key = f"deployments {name} ray_actor_options.num_cpus"
            what = f"ray_actor_options.num_cpus {num(num_cpus)}"
        gpu_key, gpu_what = "engine.device", f"(engine.device {engine.device})"
        if "num_gpus" in options:
            num_gpus = float(options["num_gpus"])
            gpu_key, gpu_what = f"deployments {name} ray_actor_options.num_gpus", "(ray_actor_options)"
        cpus.append(Term(key, f"{name} {n} x {what}", n * num_cpus))
        if num_gpus:
            gpus.append(Term(gpu_key, f"{name} {n} x {num_gpus:g} GPU {gpu_what}", n * num_gpus))
        units.append(Unit(key, f"one {name} replica ({what})", num_cpus, num_gpus))
        bundles.extend({"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})} for _ in range(n))

    names = deployment_names(config, lean)
    for ingress in ("CheckpointIngressRouter", "OpenAIIngress"):
        if ingress in names:
            deployment(ingress, "ingress_num_cpus", config.ingress_num_cpus, 0,
                       f"ingress_num_cpus {num(config.ingress_num_cpus)}")
    if "Renderer" in names:
        deployment("Renderer", "renderer_num_cpus", config.renderer_num_cpus, 0,
                   f"renderer_num_cpus {num(config.renderer_num_cpus)}")
    llm = llm_server_resources(config)  # what build_app gives the LLM server replica
    if tp == 1:
        deployment("LLMServer", "worker_num_cpus", llm["num_cpus"], llm["num_gpus"],
                   f"(llm_server_num_cpus {num(config.llm_server_num_cpus)} + worker_num_cpus "
                   f"{num(config.worker_num_cpus)})")
    else:
        deployment("LLMServer", "llm_server_num_cpus", llm["num_cpus"], 0,
                   f"llm_server_num_cpus {num(config.llm_server_num_cpus)}")
        n = replicas.get("LLMServer", 1)
        cpus.append(Term("worker_num_cpus", f"rank actors {n} x tensor_parallel_size {tp} x "
                         f"worker_num_cpus {num(config.worker_num_cpus)}", n * tp * config.worker_num_cpus))
        if on_gpu:
            gpus.append(Term("engine.tensor_parallel_size",
                             f"rank actors {n} x tensor_parallel_size {tp} x 1 GPU", n * tp))
        units.append(Unit("worker_num_cpus", f"the rank actors of one replica, packed on one node "
                          f"(tensor_parallel_size {tp} x worker_num_cpus {num(config.worker_num_cpus)}"
                          f"{' and 1 GPU' if on_gpu else ''})", tp * config.worker_num_cpus,
                          tp if on_gpu else 0))
        bundles.extend({"CPU": config.worker_num_cpus, **({"GPU": 1} if on_gpu else {})}
                       for _ in range(n * tp))
    if config.checkpoint_routing or config.checkpoint_transfer:
        cpus.append(Term("checkpoint_routing", f"checkpoint index actor {num(INDEX_NUM_CPUS)}",
                         INDEX_NUM_CPUS))
    return Demand(tuple(cpus), tuple(gpus), tuple(units), tuple(bundles))


def placement_problem(demand: Demand, capacity: Capacity) -> PlacementError | None:
    """Why `demand` can never be placed on `capacity` (the first reason), or None. Pure."""
    for kind, terms, total, have in (("CPUs", demand.cpus, demand.total_cpus, capacity.cpus),
                                     ("GPUs", demand.gpus, demand.total_gpus, capacity.gpus)):
        if total > have + SLACK:
            key = max(terms, key=lambda t: t.amount).key
            asked = f"{num(total)} CPUs" if kind == "CPUs" else f"{_has(total)} GPU{'s' * (total != 1)}"
            return PlacementError(key, (
                f"{key}: the application cannot be placed: {' + '.join(t.text for t in terms)} = "
                f"{asked}, {capacity.source} has {_has(have)}; "
                + ("set engine.device cpu or give Ray GPUs" if key == "engine.device"
                   else f"lower {key} or give Ray more {kind}")))
    for u in demand.units:
        if not any(u.cpus <= cpus + SLACK and u.gpus <= gpus + SLACK for cpus, gpus in capacity.nodes):
            largest = max(capacity.nodes, default=(0.0, 0.0))
            return PlacementError(u.key, (
                f"{u.key}: the application cannot be placed: {u.text} = {num(u.cpus)} CPUs"
                f"{f' and {_has(u.gpus)} GPUs' if u.gpus else ''} on one node, the largest node "
                f"of {capacity.source} has {_has(largest[0])} CPUs"
                f"{f' and {_has(largest[1])} GPUs' if u.gpus else ''}; lower {u.key} or give Ray "
                "a larger node"))
    return None


def current_capacity() -> Capacity | None:
    """The alive Ray nodes' totals with Ray initialised; else this machine's CPUs and GPUs (what
    the Ray that serve run starts gets); None with RAY_ADDRESS set (a cluster elsewhere)."""
    import ray

    if ray.is_initialized():
        nodes = tuple((float(n["Resources"].get("CPU", 0)), float(n["Resources"].get("GPU", 0)))
                      for n in ray.nodes() if n.get("Alive"))
        return Capacity(sum(c for c, _ in nodes), sum(g for _, g in nodes), nodes, "the Ray cluster")
    if os.environ.get("RAY_ADDRESS"):
        return None
    try:
        from ray._private.utils import get_num_cpus  # Ray's own count (cgroup limits included)

        cpus = float(get_num_cpus())
    except Exception:  # a private API: fall back to the OS's count
        cpus = float(os.cpu_count() or 1)
    import torch

    gpus = float(torch.cuda.device_count())
    return Capacity(cpus, gpus, ((cpus, gpus),), "this machine")


def autoscaling_wait_s(config: AppConfig, environ: Mapping[str, str] = os.environ) -> float:
    """allow_autoscaling_wait_s, or when unset KUBERAY_AUTOSCALING_WAIT_S on KubeRay, else 0."""
    if config.allow_autoscaling_wait_s is not None:
        return config.allow_autoscaling_wait_s
    return KUBERAY_AUTOSCALING_WAIT_S if KUBERAY_ENV in environ else 0.0


def check_placement(config: AppConfig, replicas: Mapping[str, int] | None = None,
                    actor_options: Mapping[str, Mapping] | None = None, lean: bool = False,
                    capacity: Callable[[], Capacity | None] | None = None,
                    wait_s: float | None = None, sleep: Callable[[float], None] = time.sleep,
                    request_resources: Callable[[list[dict]], None] | None = None) -> None:
    """Raise PlacementError when the app cannot be placed. With wait_s > 0 (default
    autoscaling_wait_s(config)) and Ray initialised, first ask the autoscaler for the bundles
    and wait up to wait_s for capacity, logging one line when the wait starts. lean: as
    app_demand's. capacity:
    default current_capacity; request_resources: default the autoscaler SDK's."""
    demand = app_demand(config, replicas, actor_options, lean)
    capacity = capacity or current_capacity
    have = capacity()
    problem = placement_problem(demand, have) if have is not None else None
    if problem is None:
        return
    wait_s = autoscaling_wait_s(config) if wait_s is None else wait_s
    if wait_s <= 0 or have.source != "the Ray cluster":
        raise problem
    if request_resources is None:
        from ray.autoscaler.sdk import request_resources as sdk_request

        def request_resources(bundles: list[dict]) -> None:
            sdk_request(bundles=bundles)
    logger.warning("hybrid-serve: %s; waiting up to %.0f s for the autoscaler to add nodes "
                   "(allow_autoscaling_wait_s)", problem, wait_s)
    request_resources(list(demand.bundles))
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
            have = capacity()
            problem = placement_problem(demand, have) if have is not None else None
            if problem is None:
                logger.info("hybrid-serve: the cluster now has room for the application")
                return
    finally:
        request_resources([])  # no standing request: the replicas hold what they need
    raise PlacementError(problem.key, f"{problem} (after waiting {wait_s:.0f} s for the autoscaler)")
