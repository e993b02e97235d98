"""Cluster routing: the shared-instructions workload on 3 LLM server replicas with Serve's
default router, with Ray Serve LLM's text-matching PrefixCacheAffinityRouter, with
checkpoint-aware routing, and with routing plus checkpoint transfer.

    .venv/bin/python benchmarks/cluster_routing.py                # the documented run
    .venv/bin/python benchmarks/cluster_routing.py --routing-queue-threshold 1 \
        --out benchmarks/results/cluster_routing_threshold1.json  # holders overflow
    .venv/bin/python benchmarks/cluster_routing.py --requests 12 --rounds 1 --out /tmp/cr.json

Starts Ray (256 MiB object store) with the lean path's environment (benchmarks/lean_cluster.py;
--no-lean: without it, and without the ingress_routing mode), so that one Serve instance (HTTP
on --port, behind HAProxy) runs every mode, then for each
round and each mode, in an order rotated every round (so a slow drift of the shared machine
hits every mode alike), one after the other:
  1. deploys deployments.app:build_app on the embedded tiny model with --replicas LLM server
     replicas (small fractional CPUs, one torch thread each) and the mode's keys:
       default           checkpoint_routing false (Serve's power-of-two router)
       prefix_affinity   checkpoint_routing false, and the LLM server routed by Ray Serve
                         LLM's PrefixCacheAffinityRouter, given the text of the prompt's token
                         ids (benchmarks/prefix_affinity_router.py: what it takes, and why)
       routing           checkpoint_routing true
       routing+transfer  checkpoint_routing true, checkpoint_transfer true
       ingress_routing   the lean path (deployments/serving_path.py): checkpoint_routing
                         true, direct_ingress true: HAProxy asks the CheckpointIngressRouter,
                         which renders the body, where each request goes
     (a mode whose AppConfig key does not exist in this checkout, or prefix_affinity when
     the router does not import, is skipped, with the reason printed and written to the JSON);
     the other modes set direct_ingress false: the classic graph, whose ingress routes each
     generation through its LLMServer handle;
  2. warms every replica up (short requests under a salt of their own, until each replica's
     engine has computed a prompt) and, with routing, the router: one warm-up prompt again
     and again until the router has sent it to its holder (its mirror of the index is
     current), so no pass measures the mirror's first connection;
  3. reads every replica's counters and the router's, drives the shared-instructions workload of
     hybrid_serve_bench (S system prompts of L tokens, one distinct user message a request,
     a closed loop of --concurrency clients, streamed over HTTP) under a cache_salt of its own
     (fresh per mode and round: no pass restores another's checkpoints), reads the counters
     again;
  4. deletes the app (its checkpoint index actor ends with it).

Per-replica counters: Serve cannot pin a call to a replica, so `LLMServer.replica_stats()`
(its replica id, EngineStats and, with transfer, the tier's counters) is asked through a
handle until every replica has answered (as tests/cluster_checkpoints does). A checkout whose
LLMServer lacks replica_stats falls back to calling `engine_stats` on each replica actor
(`SERVE_REPLICA::<app>#LLMServer#<id>`) through Serve's internal `handle_request` entry
point. Bytes moved between replicas = the sum over replicas of
`EngineStats.transfers.imported_bytes` (checkpoint shards published on a replica from a copy
another replica exported) between the two reads; exported bytes (put into the object store)
are recorded beside it. Both are 0 without transfer.

Router decisions: the ingress's router counts requests sent to a holder and fallbacks by
reason (hybrid_serve_routed_to_checkpoint_holder, hybrid_serve_routing_fallbacks); the script
reads them from Ray's metrics agent (--metrics-port; Ray reports every second here) before and
after each pass. They include no warm-up request, and can lag a pass by a report. Ray's
PrefixCacheAffinityRouter counts nothing of the kind: its row shows a dash, as the default's.

Token hit rate = cached tokens (usage.prompt_tokens_details.cached_tokens) / shareable tokens
(hybrid_serve_bench/accounting.py: on this workload the system prompt, and the few template
tokens that open the user message, of every request but the first of its system prompt in the
pass), summed over a mode's rounds. TTFT percentiles are
nearest-rank over every successful request of the mode.

Writes --out (default results/cluster_routing.json: the command, each mode's app config, the
summary rows, per-round rows, per-replica counters and every request's record) and prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import pickle
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from harness import add_out_argument, markdown_table, write_result

BENCHMARK = "cluster_routing"
MODEL_NAME = "hybrid-serve-tiny"
ROUTE_PREFIX = "/cluster-routing"
LLM_SERVER = "LLMServer"
# each replica: 0.05 + 0.25 Ray CPUs and one torch thread (as tests/cluster_checkpoints)
SMALL_CPUS = dict(worker_num_cpus=0.25, llm_server_num_cpus=0.05, ingress_num_cpus=0.05,
                  renderer_num_cpus=0.05)
WARM_UP_ROUNDS = 5


@dataclass(frozen=True)
class Mode:
    """A router setting: its name (the table's row), the AppConfig keys it sets, and whether
    the LLM server gets Ray Serve LLM's PrefixCacheAffinityRouter (prefix_affinity_router)."""

    name: str
    keys: dict
    affinity_router: bool = False


MODES = (
    Mode("default", {"checkpoint_routing": False, "direct_ingress": False}),
    Mode("prefix_affinity", {"checkpoint_routing": False, "direct_ingress": False},
         affinity_router=True),
    Mode("routing", {"checkpoint_routing": True, "direct_ingress": False}),
    Mode("routing+transfer", {"checkpoint_routing": True, "checkpoint_transfer": True,
                              "direct_ingress": False}),
    Mode("ingress_routing", {"checkpoint_routing": True, "direct_ingress": True}),
)
MODE_NAMES = tuple(m.name for m in MODES)

ROW_FIELDS = ("mode", "rounds", "requests", "errors", "cached_tokens", "shareable_tokens",
              "token_hit_rate", "hit_rate_by_round", "ttft_p50_ms", "ttft_p95_ms",
              "prompt_tokens", "prompt_tokens_computed", "routed_to_holder", "routing_fallbacks",
              "imports", "imported_bytes", "exports", "exported_bytes", "import_rejections",
              "fetches", "fetch_import_s", "wall_s")
ROUTED = "ray_hybrid_serve_routed_to_checkpoint_holder_total"
FALLBACKS = "ray_hybrid_serve_routing_fallbacks_total"


# ----- pure parts (tests/bench/test_cluster_routing.py)

def select_modes(names: Sequence[str], app_fields: Sequence[str],
                 affinity_error: str | None = None) -> tuple[list[Mode], dict[str, str]]:
    """The modes named (in MODES order) whose keys AppConfig has (`app_fields`) and, for a mode
    with the affinity router, that it imports (`affinity_error`: why not; None: it does), and
    for each named mode left out the reason."""
    unknown = sorted(set(names) - set(MODE_NAMES))
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(MODE_NAMES)}")
    chosen, skipped = [], {}
    for mode in MODES:
        if mode.name not in names:
            continue
        missing = sorted(set(mode.keys) - set(app_fields))
        if missing:
            skipped[mode.name] = (f"AppConfig has no {', '.join(missing)} key in this checkout "
                                  f"(deployments/config.py)")
        elif mode.affinity_router and affinity_error is not None:
            skipped[mode.name] = affinity_error
        else:
            chosen.append(mode)
    return chosen, skipped


def schedule(modes: Sequence[Mode], rounds: int) -> list[tuple[int, Mode]]:
    """(round, mode) passes: every mode once a round, the order rotated by one each round."""
    passes = []
    for r in range(rounds):
        k = r % len(modes) if modes else 0
        passes += [(r, mode) for mode in [*modes[k:], *modes[:k]]]
    return passes


def counters_delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per replica, after - before of its numeric counters (nested dicts subtracted key by
    key; a key or replica missing from `before` counts from 0)."""

    def sub(a, b):
        if isinstance(a, dict):
            return {k: sub(v, (b or {}).get(k)) for k, v in a.items()}
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return a - (b or 0)
        return a

    return {replica: sub(counters, before.get(replica, {})) for replica, counters in after.items()}


def transfer_totals(deltas: Sequence[dict[str, dict]]) -> dict[str, int] | None:
    """Exports, imports, their bytes and rejected imports (the engines' counters), and the
    tier's fetches and their seconds (getting the objects plus importing; 0 without the
    tier), summed over replicas and passes (counters_delta results); None when any pass has
    no counters."""
    if not deltas or any(not d for d in deltas):
        return None
    totals = {"imports": 0, "imported_bytes": 0, "exports": 0, "exported_bytes": 0,
              "import_rejections": 0, "fetches": 0, "fetch_import_s": 0.0}
    for delta in deltas:
        for counters in delta.values():
            t = counters.get("transfers") or {}
            totals["imports"] += t.get("imported", 0)
            totals["imported_bytes"] += t.get("imported_bytes", 0)
            totals["exports"] += t.get("exported", 0)
            totals["exported_bytes"] += t.get("exported_bytes", 0)
            totals["import_rejections"] += sum((t.get("rejected") or {}).values())
            tier = counters.get("tier") or {}
            totals["fetches"] += tier.get("fetched", 0)
            totals["fetch_import_s"] += tier.get("fetch_seconds", 0.0) + tier.get("import_seconds", 0.0)
    return totals


def routing_counts(metrics_text: str, app_name: str) -> dict:
    """The router's decisions for `app_name` in a Prometheus text page of Ray's metrics agent:
    {"holder": n, "fallbacks": {reason: n}}, summed over ingress replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {"holder": 0, "fallbacks": {}}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.labels.get("application") != app_name:
                continue
            if sample.name == ROUTED:
                counts["holder"] += int(sample.value)
            elif sample.name == FALLBACKS:
                reason = sample.labels.get("reason", "?")
                counts["fallbacks"][reason] = counts["fallbacks"].get(reason, 0) + int(sample.value)
    return counts


def routing_delta(before: dict, after: dict) -> dict:
    """after - before of two routing_counts."""
    reasons = sorted(set(before["fallbacks"]) | set(after["fallbacks"]))
    fallbacks = {r: after["fallbacks"].get(r, 0) - before["fallbacks"].get(r, 0) for r in reasons}
    return {"holder": after["holder"] - before["holder"],
            "fallbacks": {r: n for r, n in fallbacks.items() if n}}


def sum_routing(passes: Sequence[dict | None]) -> tuple[int | None, dict | None]:
    """(routed to holder, fallbacks by reason) summed over passes' routing deltas; (None, None)
    when a pass has none (no router: Serve's default)."""
    if not passes or any(p is None for p in passes):
        return None, None
    fallbacks: dict[str, int] = {}
    for p in passes:
        for reason, n in p["fallbacks"].items():
            fallbacks[reason] = fallbacks.get(reason, 0) + n
    return sum(p["holder"] for p in passes), dict(sorted(fallbacks.items()))


def summarize_mode(mode: str, records: Sequence[dict], walls: Sequence[float],
                   deltas: Sequence[dict[str, dict]],
                   routing: Sequence[dict | None] | None = None) -> dict:
    """One row (ROW_FIELDS) from a mode's request records over all its rounds (each with a
    "round" key), the passes' wall times, per-replica counter deltas and router decisions
    (routing_delta per pass; None for a pass without the router)."""
    from hybrid_serve_bench.stats import percentile

    ok = [r for r in records if r["error"] is None]
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    reported = any(r["cached_tokens"] is not None for r in ok)
    shareable = sum(r["shareable_tokens"] or 0 for r in ok)
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    by_round = {}
    for r in ok:
        tally = by_round.setdefault(r["round"], [0, 0])
        tally[0] += r["cached_tokens"] or 0
        tally[1] += r["shareable_tokens"] or 0
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    p50, p95 = percentile(ttfts, 50), percentile(ttfts, 95)
    holder, fallbacks = sum_routing(routing or [None])
    transfers = transfer_totals(deltas) or dict.fromkeys(
        ("imports", "imported_bytes", "exports", "exported_bytes", "import_rejections",
         "fetches", "fetch_import_s"))
    row = {
        "mode": mode, "rounds": len(walls), "requests": len(records),
        "errors": len(records) - len(ok),
        "cached_tokens": cached if reported else None, "shareable_tokens": shareable,
        "token_hit_rate": cached / shareable if reported and shareable else None,
        "hit_rate_by_round": [c / s if s else None for _, (c, s) in sorted(by_round.items())],
        "ttft_p50_ms": None if p50 is None else 1000 * p50,
        "ttft_p95_ms": None if p95 is None else 1000 * p95,
        "prompt_tokens": prompt, "prompt_tokens_computed": prompt - cached if reported else None,
        "routed_to_holder": holder, "routing_fallbacks": fallbacks, **transfers, "wall_s": sum(walls),
    }
    assert tuple(row) == ROW_FIELDS
    return row


def _num(value, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**20:,.1f} MiB" if value >= 2**20 else f"{value:,} B"


def _routing_cell(row: dict) -> str:
    if row["routed_to_holder"] is None:
        return "-"
    fallbacks = row["routing_fallbacks"] or {}
    detail = ", ".join(f"{reason} {n}" for reason, n in fallbacks.items())
    return f"{row['routed_to_holder']} / {sum(fallbacks.values())}" + (f" ({detail})" if detail else "")


def format_table(rows: Sequence[dict]) -> str:
    """The Markdown table: one line per mode."""
    header = ["mode", "requests (errors)", "token hit rate", "by round", "cached / shareable tokens",
              "TTFT p50 ms", "TTFT p95 ms", "prompt tokens computed",
              "routed to holder / fallbacks", "imports (rejected)", "bytes moved between replicas",
              "exported to object store"]
    lines = []
    for r in rows:
        lines.append([
            r["mode"], f"{r['requests']} ({r['errors']})",
            _num(r["token_hit_rate"], "{:.3f}"),
            " / ".join(_num(h, "{:.3f}") for h in r["hit_rate_by_round"]) or "-",
            f"{_num(r['cached_tokens'], '{:,}')} / {r['shareable_tokens']:,}",
            _num(r["ttft_p50_ms"]), _num(r["ttft_p95_ms"]),
            _num(r["prompt_tokens_computed"], "{:,}"),
            _routing_cell(r),
            "-" if r["imports"] is None else f"{r['imports']} ({r['import_rejections']})",
            _bytes(r["imported_bytes"]), _bytes(r["exported_bytes"])])
    return markdown_table(header, lines)


# ----- the deployment

def replica_counters(stats) -> dict:
    """A ReplicaStats (or an EngineStats) as plain data: the engine's counters, and the
    tier's under "tier" (None without transfer)."""
    if hasattr(stats, "engine"):
        tier = stats.tier
        return {**dataclasses.asdict(stats.engine),
                "tier": None if tier is None else dataclasses.asdict(tier)}
    return {**dataclasses.asdict(stats), "tier": None}


def replica_stats(app_name: str, replicas: int, timeout_s: float = 60.0) -> dict[str, dict]:
    """Every LLM server replica's counters (replica_counters), by replica id: replica_stats
    asked through a handle until `replicas` replicas answered, or, where LLMServer has no
    replica_stats, engine_stats on each replica actor (module doc)."""
    from ray import serve

    handle = serve.get_deployment_handle(LLM_SERVER, app_name)
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(seen) < replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(seen)} of {replicas} replicas answered")
            responses = [handle.replica_stats.remote() for _ in range(2 * replicas)]
            for response in responses:
                stats = response.result(timeout_s=timeout_s)
                seen[stats.replica_id] = replica_counters(stats)
    except AttributeError:  # an LLMServer without replica_stats
        return replica_engine_stats(app_name)
    return seen


def replica_actors(app_name: str) -> dict[str, object]:
    """The app's LLM server replica actors by replica id (their Serve actor names)."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    prefix = f"SERVE_REPLICA::{app_name}#{LLM_SERVER}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(prefix)]
    return {name.removeprefix(prefix): ray.get_actor(name, namespace=SERVE_NAMESPACE)
            for name in sorted(names)}


def replica_engine_stats(app_name: str) -> dict[str, dict]:
    """Every LLM server replica's engine_stats() of the app, by replica id, called on each
    replica actor through Serve's internal handle_request entry point (the fallback)."""
    import ray
    from ray.serve._private.common import RequestMetadata

    refs = {}
    for replica, actor in replica_actors(app_name).items():
        metadata = RequestMetadata(request_id=f"cluster-routing-stats-{uuid.uuid4().hex[:8]}",
                                   internal_request_id=uuid.uuid4().hex,
                                   call_method="engine_stats", app_name=app_name)
        refs[replica] = actor.handle_request.remote(pickle.dumps(metadata))
    return {replica: replica_counters(ray.get(ref, timeout=60)) for replica, ref in refs.items()}


def read_routing(metrics_port: int, app_name: str) -> dict:
    """routing_counts from the metrics agent of this node."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
        return routing_counts(page.read().decode(), app_name)


def app_config(mode: Mode, args: argparse.Namespace):
    from deployments.config import AppConfig
    from engine.engine_config import EngineConfig

    mib = 1024 * 1024
    engine = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=16,
                          max_num_batched_tokens=512, kv_cache_bytes=32 * mib,
                          state_cache_bytes=32 * mib, checkpoint_cache_bytes=32 * mib,
                          checkpoint_slots=("prompt", "response", "instruction"))
    keys = dict(mode.keys)
    if mode.keys.get("checkpoint_routing"):
        keys["routing_queue_threshold"] = args.routing_queue_threshold
    if mode.keys.get("checkpoint_transfer"):  # within the 256 MiB object store
        keys["checkpoint_store_bytes"] = args.store_mib * mib
    return AppConfig(served_model_name=MODEL_NAME, engine=engine, **SMALL_CPUS, **keys)


def affinity_router_config(config):
    """The LLM server's request_router_config for the prefix_affinity mode."""
    import prefix_affinity_router

    return prefix_affinity_router.router_config(config.engine.model_dir)


def deploy(mode: Mode, config, app_name: str, replicas: int) -> None:
    """serve.run the app with `replicas` LLM server replicas (build_app keeps num_replicas of
    the LLMServer deployment it binds, as tests/cluster_checkpoints does, and with the affinity
    router its request_router_config: build_app sets one only with checkpoint_routing)."""
    from ray import serve

    import deployments.app

    original = deployments.app.LLMServer, deployments.app.LLMServerIngressDeployment
    router = {"request_router_config": affinity_router_config(config)} if mode.affinity_router else {}
    deployments.app.LLMServer = original[0].options(num_replicas=replicas, **router)
    deployments.app.LLMServerIngressDeployment = original[1].options(num_replicas=replicas, **router)
    try:
        serve.run(deployments.app.build_app(config.model_dump()), name=app_name,
                  route_prefix=ROUTE_PREFIX)
    finally:
        deployments.app.LLMServer, deployments.app.LLMServerIngressDeployment = original


async def _warm_request(client, url: str, salt: str, n: int | str) -> None:
    from hybrid_serve_bench.client import ChatRequest, stream_chat

    system = f"Warm-up {n}: " + "answer briefly and politely, in one sentence. " * 12
    request = ChatRequest(MODEL_NAME, [{"role": "system", "content": system},
                                       {"role": "user", "content": f"hello {uuid.uuid4().hex}"}],
                          2, extra_body={"cache_salt": salt, "ignore_eos": True})
    result = await stream_chat(client, url, request)
    if result.error:
        raise RuntimeError(f"warm-up request failed: {result.error}")


def warm_up(base_url: str, app_name: str, replicas: int, routing: bool,
            metrics_port: int) -> dict:
    """Short concurrent requests, in bursts, until every replica's engine computed a prompt
    (the first request of a process pays torch's lazy start); with routing, then one prompt
    again and again until the router sent it to its holder. Returns what it took."""
    import httpx

    url = f"{base_url}/v1/chat/completions"
    salt = f"warm-up-{uuid.uuid4().hex[:8]}"

    async def burst(start: int, size: int, same: bool = False) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(_warm_request(client, url, salt, "router" if same else start + i)
                                   for i in range(size)))

    computed: dict[str, int] = {}
    for b in range(WARM_UP_ROUNDS):
        asyncio.run(burst(b * 2 * replicas, 2 * replicas))
        computed = {r: c["scheduler"]["prompt_tokens_computed"]
                    for r, c in replica_stats(app_name, replicas).items()}
        if all(computed.values()):
            break
    tries = 0
    if routing:
        deadline = time.monotonic() + 60
        while read_routing(metrics_port, app_name)["holder"] == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the router never sent a warm-up request to its holder")
            asyncio.run(burst(0, 1, same=True))
            tries += 1
            time.sleep(1.0)
    return {"prompt_tokens_computed": computed, "router_warm_up_requests": tries}


def run_pass(mode: Mode, round_index: int, workload, counter, args, base_url: str, salt: str):
    """The workload once against the deployed app: (records with "round", wall seconds)."""
    from hybrid_serve_bench.runner import RunSettings, Target, run_workloads

    settings = RunSettings(concurrency=args.concurrency, max_tokens=args.max_tokens, rounds=1,
                           timeout_s=args.timeout_s, seed=args.seed, ignore_eos=True,
                           cache_salt=salt)
    records, passes = asyncio.run(run_workloads(
        [Target(mode.name, base_url, MODEL_NAME)], [workload], [None], settings, counter))
    return [{"round": round_index, **r} for r in records], passes[0].wall_s


def measure(modes: list[Mode], args: argparse.Namespace, workload, counter) -> dict:
    import ray
    from ray import serve

    base_url = f"http://127.0.0.1:{args.port}{ROUTE_PREFIX}"
    run_id = uuid.uuid4().hex[:8]
    results = {m.name: {"records": [], "walls": [], "deltas": [], "routing": [], "passes": []}
               for m in modes}
    configs = {m.name: app_config(m, args).model_dump(mode="json") for m in modes}
    ray.init(address="local", num_cpus=args.ray_cpus, object_store_memory=256 * 1024 * 1024,
             include_dashboard=False, log_to_driver=False,
             _metrics_export_port=args.metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for round_index, mode in schedule(modes, args.rounds):
            app_name = f"cluster-routing-{mode.name.replace('+', '-')}-r{round_index}"
            routing = bool(mode.keys.get("checkpoint_routing"))
            started = time.monotonic()
            deploy(mode, app_config(mode, args), app_name, args.replicas)
            deployed_s = time.monotonic() - started
            warm = warm_up(base_url, app_name, args.replicas, routing, args.metrics_port)
            time.sleep(args.settle_s)  # the warm-up's reports and metrics
            before = replica_stats(app_name, args.replicas)
            routing_before = read_routing(args.metrics_port, app_name) if routing else None
            salt = f"cluster-routing-{run_id}-{mode.name}-r{round_index}"
            records, wall_s = run_pass(mode, round_index, workload, counter, args, base_url, salt)
            time.sleep(args.settle_s)  # transfers, reports and metrics after the last answer
            after = replica_stats(app_name, args.replicas)
            delta = counters_delta(before, after)
            decisions = (routing_delta(routing_before, read_routing(args.metrics_port, app_name))
                         if routing else None)
            serve.delete(app_name)
            state = results[mode.name]
            state["records"] += records
            state["walls"].append(wall_s)
            state["deltas"].append(delta)
            state["routing"].append(decisions)
            state["passes"].append({"round": round_index, "app": app_name, "cache_salt": salt,
                                    "deploy_s": deployed_s, "wall_s": wall_s, "warm_up": warm,
                                    "routing": decisions, "replica_counters_delta": delta,
                                    "replica_counters_after": after})
            ok = [r for r in records if r["error"] is None]
            cached = sum(r["cached_tokens"] or 0 for r in ok)
            shareable = sum(r["shareable_tokens"] or 0 for r in ok)
            print(f"round {round_index} {mode.name}: {len(records)} requests "
                  f"({len(records) - len(ok)} errors) in {wall_s:.1f} s, hit rate "
                  f"{cached / shareable if shareable else float('nan'):.3f}, router {decisions}; "
                  f"deploy {deployed_s:.1f} s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"configs": configs, "results": results}


def git_state() -> dict:
    """The commit measured and the paths that differed from it (others' work in progress;
    this run's own result files among them)."""
    import subprocess

    def git(*command: str) -> str:
        try:
            return subprocess.run(["git", *command], capture_output=True, text=True, timeout=30,
                                  check=True).stdout.rstrip()  # not strip: " M path" keeps its status column
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "changed_paths": [line[3:] for line in git("status", "--porcelain").splitlines()]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=list(MODE_NAMES), choices=MODE_NAMES)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="passes per mode, order rotated")
    p.add_argument("--systems", type=int, default=4, help="S: shared system prompts")
    p.add_argument("--instruction-tokens", type=int, default=500, help="L: tokens of each")
    p.add_argument("--requests", type=int, default=48, help="requests per pass")
    p.add_argument("--user-tokens", type=int, nargs=2, default=(50, 200), metavar=("MIN", "MAX"))
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--routing-queue-threshold", type=int, default=None,
                   help="the routing modes' routing_queue_threshold (default: the app's, "
                        "engine.max_num_seqs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--settle-s", type=float, default=2.5,
                   help="wait after a pass before reading the replicas' counters")
    p.add_argument("--ray-cpus", type=int, default=4)
    p.add_argument("--store-mib", type=int, default=128,
                   help="routing+transfer's checkpoint_store_bytes, in MiB (object store: 256)")
    p.add_argument("--port", type=int, default=8251)
    p.add_argument("--no-lean", dest="lean", action="store_false",
                   help="start Ray without the lean path's environment (classic modes only)")
    p.add_argument("--metrics-port", type=int, default=8261,
                   help="Ray's metrics agent (the router's decisions are read there)")
    add_out_argument(p, BENCHMARK)
    return p.parse_args(argv)


def affinity_import_error() -> str | None:
    """Why the prefix_affinity mode cannot run here (its router does not import); None: it can."""
    try:
        import prefix_affinity_router  # noqa: F401  (benchmarks/, on sys.path as the script's folder)
    except ImportError as exc:
        return f"Ray Serve LLM's PrefixCacheAffinityRouter does not import: {exc}"
    return None


def affinity_router_source() -> str:
    import prefix_affinity_router

    return (f"prefix_affinity_router.RenderedPromptAffinityRouter over "
            f"{prefix_affinity_router.ROUTER_SOURCE}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.lean:
        # before anything imports Ray Serve's modules, which read these once
        import os

        from lean_cluster import lean_env

        os.environ.update(lean_env())
        # an app deleted between passes drains its ingress for this long (Serve's floor: 30 s)
        os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "1"
    elif "ingress_routing" in args.modes:
        args.modes = [m for m in args.modes if m != "ingress_routing"]
    from deployments.config import AppConfig
    from engine.engine_config import DEFAULT_MODEL_DIR
    from hybrid_serve_bench.tokens import TokenizerCounter
    from hybrid_serve_bench.workloads import Sizes, shared_instructions

    affinity_error = affinity_import_error() if "prefix_affinity" in args.modes else None
    modes, skipped = select_modes(args.modes, list(AppConfig.model_fields), affinity_error)
    for name, reason in skipped.items():
        print(f"skipping mode {name}: {reason}")
    if not modes:
        raise SystemExit("no mode to run")
    started = time.monotonic()
    git = git_state()  # replicas import the tree as it is when each app deploys
    counter = TokenizerCounter(str(DEFAULT_MODEL_DIR))
    workload = shared_instructions(Sizes(seed=args.seed, systems=args.systems,
                                         instruction_tokens=args.instruction_tokens,
                                         requests=args.requests,
                                         user_tokens=tuple(args.user_tokens)), counter)
    measured = measure(modes, args, workload, counter)
    rows = [summarize_mode(m.name, measured["results"][m.name]["records"],
                           measured["results"][m.name]["walls"],
                           measured["results"][m.name]["deltas"],
                           measured["results"][m.name]["routing"]) for m in modes]
    wall_s = time.monotonic() - started
    table = format_table(rows)
    git_at_end = git_state()
    if git_at_end["commit"] != git["commit"]:
        git["at_end"] = git_at_end
        print(f"warning: the tree changed during the run (commit {git['commit']} at the start, "
              f"{git_at_end['commit']} at the end): later passes ran other code")
    print(f"\n{args.replicas} replicas, {args.systems} instructions x {args.requests} requests a "
          f"pass ({args.instruction_tokens} instruction tokens, user {args.user_tokens[0]}-"
          f"{args.user_tokens[1]}), concurrency {args.concurrency}, {args.rounds} rounds; "
          f"{wall_s:.0f} s in all\n")
    print(table)
    out = write_result(args.out, BENCHMARK, {
        "args": vars(args),
        "git": git,
        "modes": {m.name: m.keys for m in modes},
        "affinity_router": affinity_router_source() if any(m.affinity_router for m in modes) else None,
        "skipped_modes": skipped,
        "app_configs": measured["configs"],
        "workload": {"name": workload.name, "kind": workload.kind, "params": workload.params,
                     "token_counter": counter.name},
        "wall_s": wall_s,
        "rows": rows,
        "table": table,
        "passes": {name: r["passes"] for name, r in measured["results"].items()},
        "records": [r for m in modes for r in measured["results"][m.name]["records"]],
    })
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
