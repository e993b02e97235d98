"""Node autoscaling and drain, end to end on a fake autoscaling cluster (fake_cluster.py).

    python tests/cluster/autoscaling_scenario.py RESULT.json

The head node has room for one LLM server replica only (2 CPUs: ingress 0.1 + renderer 0.1 +
LLM server 1.1); a second needs a worker node (2 CPUs, at most one), which the Ray autoscaler
adds when Serve asks for the replica and removes once idle. The app is deployed the way
operators deploy it, `serve run` of serve_config.yaml, with a small engine and the LLM server
autoscaling 1..2 on few ongoing requests.

  load    LOAD_CLIENTS streaming chat requests at a time: Serve asks for a second replica,
          the autoscaler adds a worker node, the replica starts; load goes on until both
          replicas have served requests.
  drain   the load stops; DRAIN_CLIENTS long requests stay in flight (one ends, the next
          starts) until Serve has scaled down to one replica: the replica it stops drains the
          requests it holds. Then the worker node goes idle and is removed.

Every request must finish with all its max_tokens tokens (finish_reason "length") and
`data: [DONE]`. Which replica served a request comes from the LLM server replicas' Serve
logs (serve_logs.py): the request's x-request-id is Serve's request id there. The script
writes RESULT.json (see `main`) and always shuts Serve, Ray and the cluster down; the caller
asserts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_cluster import CLIENT_ENV, FakeAutoscalingCluster  # noqa: E402
from serve_logs import drain_events, replica_logs, replica_nodes, served_by  # noqa: E402

os.environ.update(CLIENT_ENV)  # before ray is imported: it reads the auth mode once
import ray  # noqa: E402
from ray import serve  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
APP_NAME = "hybrid-serve"
LLM_DEPLOYMENT = "LLMServer"
HTTP_PORT = int(os.environ.get("HYBRID_SERVE_CLUSTER_PORT", "8214"))
MB = 1024 * 1024

HEAD_CPUS = 2
WORKER_NODE_TYPES = {"ray.worker.llm": {
    "resources": {"CPU": 2, "object_store_memory": 200 * MB}, "node_config": {},
    "min_workers": 0, "max_workers": 1}}
IDLE_TIMEOUT_MINUTES = 0.1

# the small engine of tests/e2e/conftest.py E2E_CONFIG
ENGINE = {"max_model_len": 512, "block_size": 16, "max_num_batched_tokens": 256,
          "max_num_seqs": 16, "kv_cache_bytes": 32 * MB, "state_cache_bytes": 32 * MB,
          "checkpoint_cache_bytes": 32 * MB,
          "cpu_compile_decode": False}  # a compile would take a minute of each new replica's CPUs
# LOAD_CLIENTS requests need two replicas, DRAIN_CLIENTS only one (ongoing / target, rounded
# up); with DRAIN_CLIENTS above one, Serve's routing (to the replica with fewer ongoing
# requests) keeps at least one on each replica, so the replica it stops holds requests.
LLM_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4,
                   "upscale_delay_s": 2, "downscale_delay_s": 5, "look_back_period_s": 4,
                   # How often replicas and handles push their metrics (default 10 s; Serve
                   # marks the field deprecated, but in ray 2.60 nothing else sets the
                   # interval). Metrics that old make Serve scale down, then up again on the
                   # survivor's stale load-time numbers; fresh ones keep it at 1 -> 2 -> 1.
                   "metrics_interval_s": 1}
# Serve checks a stopping replica for ongoing requests every graceful_shutdown_wait_loop_s
# (default 2 s): often here, so its log shows what it held when the stop began.
LLM_DRAIN_OPTIONS = {"graceful_shutdown_wait_loop_s": 0.1}

LOAD_CLIENTS, LOAD_MAX_TOKENS = 8, 96
DRAIN_CLIENTS, DRAIN_MAX_TOKENS = 3, 400
MIN_REQUESTS_PER_REPLICA = 3
# per phase, and all phases together (after the cluster started)
DEPLOY_TIMEOUT_S, SCALE_UP_TIMEOUT_S, SCALE_DOWN_TIMEOUT_S = 180, 180, 120
NODE_REMOVAL_TIMEOUT_S, SCENARIO_TIMEOUT_S = 90, 360


def serve_config() -> dict:
    """serve_config.yaml with the small engine, the HTTP port, JSON logs, the LLM server
    autoscaling 1..2 and polling its drain often (its graceful_shutdown_timeout_s as in the
    file)."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": HTTP_PORT}
    app = config["applications"][0]
    app["args"]["engine"].update(ENGINE)
    app["logging_config"] = {"encoding": "JSON"}
    llm = next((d for d in app.get("deployments", []) if d["name"] == LLM_DEPLOYMENT), None)
    if llm is None:
        raise ValueError(f"serve_config.yaml has no deployments: entry for {LLM_DEPLOYMENT}")
    llm["autoscaling_config"].update(LLM_AUTOSCALING)
    llm.update(LLM_DRAIN_OPTIONS)
    return config


def deploy(address: str, config_path: Path) -> None:
    """`serve run --non-blocking` of the config: the operators' path, deployments: block
    included; returns once submitted."""
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    subprocess.run(
        [serve_cli, "run", str(config_path), "--non-blocking", f"--address={address}"],
        cwd=REPO, check=True, timeout=120, env={**os.environ, **CLIENT_ENV})


def sample() -> dict:
    """The LLM server's replica states and the ids of the alive nodes, now."""
    states: dict[str, int] = {}
    app_status = None
    app = serve.status().applications.get(APP_NAME)
    if app is not None:
        app_status = str(app.status.value)
        llm = app.deployments.get(LLM_DEPLOYMENT)
        if llm is not None:
            states = {str(k.value if hasattr(k, "value") else k): v
                      for k, v in llm.replica_states.items() if v}
    nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
    return {"t": time.time(), "app": app_status, "replicas": states, "nodes": nodes}


class Monitor:
    """Samples the cluster every `period_s` into `timeline` (a background thread)."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.timeline: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            try:
                self.timeline.append(sample())
            except Exception as exc:  # the controller busy or restarting: note it, go on
                self.timeline.append({"t": time.time(), "error": repr(exc)})
            self._stop.wait(period_s)

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def latest(self) -> dict:
        for entry in reversed(self.timeline):
            if "error" not in entry:
                return entry
        return {}

    async def wait_for(self, what: str, predicate, timeout_s: float, check=None) -> float:
        """Wait until predicate(latest sample) (and check(), if given); return when it held.
        TimeoutError names `what` and the last sample."""
        deadline = time.monotonic() + timeout_s
        while True:
            latest = self.latest()
            if latest and predicate(latest) and (check is None or check()):
                return time.time()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f}s; last sample {latest}")
            await asyncio.sleep(0.5)


def steady(entry: dict, replicas: int) -> bool:
    """Exactly `replicas` LLM server replicas, all RUNNING (none starting or stopping)."""
    return entry.get("replicas") == {"RUNNING": replicas}


async def chat(client: httpx.AsyncClient, phase: str, max_tokens: int) -> dict:
    """One streaming chat request; its outcome as a record (`ok`: every token, finish_reason
    "length", usage and [DONE])."""
    request_id = f"{phase}-{uuid.uuid4().hex[:12]}"
    body = {"model": "hybrid-serve-tiny", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Tell a long story ({request_id})."}]}
    record = {"id": request_id, "phase": phase, "max_tokens": max_tokens, "start": time.time(),
              "status": None, "finish_reason": None, "completion_tokens": None, "chars": 0,
              "done": False, "error": None}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"x-request-id": request_id}) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                record["error"] = (await response.aread()).decode(errors="replace")[:500]
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        record["done"] = True
                        break
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        record["error"] = chunk["error"]
                    for choice in chunk.get("choices", []):
                        record["chars"] += len(choice.get("delta", {}).get("content") or "")
                        if choice.get("finish_reason"):
                            record["finish_reason"] = choice["finish_reason"]
                    if chunk.get("usage"):
                        record["completion_tokens"] = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # connection cut, timeout: the request failed
        record["error"] = repr(exc)
    record["end"] = time.time()
    record["ok"] = (record["status"] == 200 and record["done"] and record["error"] is None
                    and record["finish_reason"] == "length"
                    and record["completion_tokens"] == max_tokens)
    return record


async def clients(client: httpx.AsyncClient, count: int, phase: str, max_tokens: int,
                  stop: asyncio.Event, records: list[dict]) -> None:
    """`count` clients, each sending one request after another until `stop` (the request in
    flight then still runs to its end)."""
    async def one_client() -> None:
        while not stop.is_set():
            records.append(await chat(client, phase, max_tokens))

    await asyncio.gather(*(one_client() for _ in range(count)))


async def scenario(monitor: Monitor, logs_dir: Path, result: dict) -> None:
    records: list[dict] = result["requests"]
    marks = result["marks"]
    await monitor.wait_for("app running with one LLM server replica",
                           lambda s: s["app"] == "RUNNING" and steady(s, 1), DEPLOY_TIMEOUT_S)
    marks["deployed"] = time.time()
    timeout = httpx.Timeout(300.0, connect=30.0)
    limits = httpx.Limits(max_connections=LOAD_CLIENTS + DRAIN_CLIENTS)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{HTTP_PORT}", timeout=timeout,
                                 limits=limits) as client:
        stop_load, stop_drain = asyncio.Event(), asyncio.Event()
        load = asyncio.create_task(
            clients(client, LOAD_CLIENTS, "load", LOAD_MAX_TOKENS, stop_load, records))

        def both_served() -> bool:
            counts = {}
            for replica in served_by(replica_logs(logs_dir, APP_NAME, LLM_DEPLOYMENT)).values():
                counts[replica] = counts.get(replica, 0) + 1
            return (len(counts) >= 2
                    and all(n >= MIN_REQUESTS_PER_REPLICA for n in counts.values()))

        try:
            marks["two_replicas"] = await monitor.wait_for(
                "second LLM server replica running on a new worker node",
                lambda s: steady(s, 2) and len(s["nodes"]) == 2, SCALE_UP_TIMEOUT_S)
            marks["both_served"] = await monitor.wait_for(
                "both replicas served requests", lambda s: steady(s, 2), SCALE_UP_TIMEOUT_S,
                check=both_served)
            drain = asyncio.create_task(
                clients(client, DRAIN_CLIENTS, "drain", DRAIN_MAX_TOKENS, stop_drain, records))
        finally:
            stop_load.set()
            await load
        marks["load_stopped"] = time.time()
        try:
            marks["one_replica"] = await monitor.wait_for(
                "scaled down to one LLM server replica", lambda s: steady(s, 1),
                SCALE_DOWN_TIMEOUT_S)
        finally:
            stop_drain.set()
            await drain
        marks["drain_stopped"] = time.time()
    marks["worker_node_removed"] = await monitor.wait_for(
        "idle worker node removed", lambda s: len(s["nodes"]) == 1 and steady(s, 1),
        NODE_REMOVAL_TIMEOUT_S)


def shutdown_serve(timeout_s: float = 30.0) -> None:
    """serve.shutdown(), bounded: the cluster is killed right after anyway."""
    thread = threading.Thread(target=serve.shutdown, daemon=True)
    thread.start()
    thread.join(timeout_s)


def raise_on_sigterm(signum, frame):
    """A caller that gives up sends SIGTERM: unwind, so the finally blocks end the cluster."""
    raise SystemExit(f"signal {signum}")


def main(result_path: str) -> None:
    """Write RESULT.json: `requests` (each request's outcome and the replica that served it),
    `timeline` (LLM server replica states and alive node ids, sampled twice a second),
    `marks` (wall-clock times of the phases), `drain` (per replica that shut down: ongoing
    requests it waited for), `replica_nodes` (the node of each replica), `served_by`,
    `settings` (the numbers the caller checks against), `error` (a traceback, or None).
    RESULT.json.cluster, written once the cluster runs, holds its FakeAutoscalingCluster
    identity: a caller that had to kill this process ends the cluster with it."""
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    started = time.time()
    result = {"requests": [], "timeline": [], "marks": {}, "drain": {}, "served_by": {},
              "replica_nodes": {},
              "settings": {"min_requests_per_replica": MIN_REQUESTS_PER_REPLICA,
                           "load_clients": LOAD_CLIENTS, "drain_clients": DRAIN_CLIENTS,
                           "llm_autoscaling": LLM_AUTOSCALING},
              "error": None, "config": None}
    cluster = FakeAutoscalingCluster(HEAD_CPUS, WORKER_NODE_TYPES,
                                     idle_timeout_minutes=IDLE_TIMEOUT_MINUTES,
                                     object_store_bytes=200 * MB)
    try:
        address = cluster.start()
        Path(result_path + ".cluster").write_text(json.dumps(cluster.identity))
        result["marks"]["cluster_started"] = time.time()
        ray.init(address=address, log_to_driver=False)
        signal.signal(signal.SIGTERM, raise_on_sigterm)  # ray.init set its own
        config = serve_config()
        result["config"] = config
        config_path = Path(cluster.temp_dir) / "serve_config.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        deploy(address, config_path)
        logs_dir = Path(cluster.temp_dir) / "session_latest" / "logs"
        with Monitor() as monitor:
            try:
                asyncio.run(asyncio.wait_for(scenario(monitor, logs_dir, result),
                                             SCENARIO_TIMEOUT_S))
            finally:
                result["timeline"] = monitor.timeline
        logs = replica_logs(logs_dir, APP_NAME, LLM_DEPLOYMENT)
        result["served_by"] = served_by(logs)
        result["drain"] = drain_events(logs, LLM_DRAIN_OPTIONS["graceful_shutdown_wait_loop_s"])
        result["replica_nodes"] = replica_nodes(logs)
    except BaseException:
        result["error"] = traceback.format_exc()
    finally:
        try:
            if ray.is_initialized():
                shutdown_serve()
                ray.shutdown()
        finally:
            cluster.shutdown()
            for record in result["requests"]:
                record["replica"] = result["served_by"].get(record["id"])
            result["elapsed_s"] = time.time() - started
            Path(result_path).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
    sys.exit(1 if json.loads(Path(sys.argv[1]).read_text())["error"] else 0)
