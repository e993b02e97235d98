"""`compare-servers --launch`: start each server (peer_servers.py) in turn, run the peer suite
(peer_suite.py) against it, stop it fully (launcher.py), then the next; one table and one JSON.

Writes, under --out-dir (default benchmarks/results/bench/compare-servers/):
  peers.json  PEER_RESULT_FIELDS: the command, the machine, each server (its command line,
              readiness and stop times, /v1/models), the settings, the table, the summary rows
              of every pass (stats.py) and every request's record (client.py);
  peers.md    the table, the notes and the per-pass rows.
The servers' logs go to --log-dir (default: a new temporary folder), never to the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

import httpx
from tqdm import tqdm

from hybrid_serve_bench.launcher import LaunchedServer
from hybrid_serve_bench.peer_servers import (HYBRID_SERVES, VLLM, VLLM_PREFIX_CACHING, PeerOptions,
                                             missing_vllm, prefix_reuse, server_command, vllm_version)
from hybrid_serve_bench.peer_suite import SuiteSizes, build_suite, peer_row, peer_table, run_suite, warm_up
from hybrid_serve_bench.report import summary_table
from hybrid_serve_bench.runner import Target, salted, server_identity
from hybrid_serve_bench.stats import summarize
from hybrid_serve_bench.tokens import TokenCounter
from hybrid_serve_bench.workloads import Sizes

DEFAULT_OUT = Path("benchmarks/results/bench/compare-servers")
PEER_RESULT_FIELDS = ("benchmark", "mode", "command", "machine", "servers", "settings", "token_counter",
                      "passes", "table", "notes", "summary", "records")
PREFIX_CACHING_NOTE = (
    f"`{VLLM}` runs with vLLM's prefix caching off: on CPU its Mamba prefix caching ('align' mode) "
    "crashes without benchmarks/peers/patch_vllm.py, so throughput is compared without it. "
    f"`{VLLM_PREFIX_CACHING}` runs it on, with that patch (applied by install_vllm_cpu.sh).")


def peer_options(args: argparse.Namespace) -> PeerOptions:
    from engine.engine_config import DEFAULT_MODEL_DIR

    return PeerOptions(model_dir=Path(args.model_dir or DEFAULT_MODEL_DIR).resolve(),
                       max_model_len=args.max_model_len, hybrid_port=args.hybrid_port,
                       vllm_port=args.vllm_port, serve_config=Path(args.serve_config).resolve(),
                       vllm_venv=Path(args.vllm_venv).resolve(), vllm_dtype=args.vllm_dtype,
                       vllm_kv_cache_gib=args.vllm_kv_cache_gib, vllm_args=tuple(args.vllm_arg or ()),
                       python=sys.executable)


def suite_sizes(args: argparse.Namespace, sizes: Sizes) -> SuiteSizes:
    return SuiteSizes(sizes=sizes, concurrency=args.concurrency, max_tokens=args.max_tokens,
                      decode_concurrency=tuple(args.decode_concurrency), decode_tokens=args.decode_tokens,
                      cold_requests=args.cold_requests)


def notes(launched: list[str], extra: list[str]) -> list[str]:
    said = list(extra)
    if VLLM in launched or VLLM_PREFIX_CACHING in launched:
        said.append(PREFIX_CACHING_NOTE)
    return said


async def _identity(base_url: str) -> dict:
    async with httpx.AsyncClient(timeout=30) as client:
        return await server_identity(client, base_url)


def measure_server(name: str, options: PeerOptions, suite: SuiteSizes, passes, counter: TokenCounter,
                   args: argparse.Namespace, log_dir: Path) -> tuple[dict, list[dict], list]:
    """Start `name`, warm it up, run every pass, stop it. Returns (its server dict, records,
    passes). The server is stopped whatever happens; a failed warm-up request ends the run
    (SystemExit with the server's answer) rather than fill a table with errors."""
    command = server_command(name, options, log_dir)
    server = LaunchedServer(command, log_dir / f"{name}.log", ready_timeout_s=args.ready_timeout_s)
    print(f"{name}: starting ({shlex.join(command.argv)}); log {server.log_path}", flush=True)
    with server:
        print(f"{name}: ready after {server.ready_s:.1f} s, at full speed after {server.warm_s:.1f} s", flush=True)
        identity = asyncio.run(_identity(command.base_url))
        try:
            model = identity["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise SystemExit(f"{name}: GET /v1/models gave no model id ({identity})") from None
        target = Target(name, command.base_url, model)
        salt = None if args.no_cache_salt else salted(args.cache_salt, name)
        warm_errors = asyncio.run(warm_up(target, suite, counter, salt, args.timeout_s))
        if warm_errors:
            raise SystemExit(f"{name}: warm-up requests failed ({len(warm_errors)}), e.g. {warm_errors[0]}")
        total = sum(p.workload.num_requests for p in passes)
        with tqdm(total=total, unit="req", desc=name) as bar:
            records, done = asyncio.run(run_suite(target, passes, counter, seed=args.seed,
                                                  timeout_s=args.timeout_s, salt=salt,
                                                  on_request=lambda: bar.update(1)))
    stop = server.stop_report
    print(f"{name}: stopped, every process gone after {stop.gone_s} s"
          + (" (SIGKILL needed)" if stop.forced else ""), flush=True)
    info = {"label": name, "argv": list(command.argv), "base_url": command.base_url, "model": model,
            "prefix_reuse": prefix_reuse(name, options), "ready_s": server.ready_s,
            "warm_s": server.warm_s,
            "stop": stop.as_dict(), "warm_up_errors": warm_errors, "server_models": identity,
            "log": str(server.log_path)}
    return info, records, done


def compare_launched(args: argparse.Namespace, argv: list[str], counter: TokenCounter,
                     sizes: Sizes) -> dict[str, Path]:
    """The whole run (module doc); returns the written paths."""
    options = peer_options(args)
    for name in args.launch:
        if name not in HYBRID_SERVES and (reason := missing_vllm(options)):
            raise SystemExit(f"cannot launch {name}: {reason}")
    suite = suite_sizes(args, sizes)
    passes = build_suite(suite, counter)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="compare-servers-"))
    servers, records, summaries = [], [], []
    for name in args.launch:
        info, got, done = measure_server(name, options, suite, passes, counter, args, log_dir)
        servers.append(info)
        records += got
        summaries += done
    rows = summarize(records, summaries, args.target_ttft_ms)
    table = [peer_row(s["label"], s["prefix_reuse"], rows, records, suite) for s in servers]
    result = {
        "benchmark": "hybrid-serve-bench", "mode": "compare-servers --launch",
        "command": shlex.join(["hybrid-serve-bench", *argv]),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version()},
        "servers": servers,
        "settings": {"model_dir": str(options.model_dir), "max_model_len": options.max_model_len,
                     "vllm": vllm_version(options), "vllm_dtype": options.vllm_dtype, "vllm_kv_cache_gib": options.vllm_kv_cache_gib,
                     "concurrency": suite.concurrency, "max_tokens": suite.max_tokens,
                     "decode_concurrency": list(suite.decode_concurrency),
                     "decode_tokens": suite.decode_tokens, "decode_prompt_tokens": suite.decode_prompt_tokens,
                     "cold_requests": suite.cold_requests, "seed": args.seed,
                     "cache_salt": None if args.no_cache_salt else args.cache_salt,
                     "target_ttft_ms": args.target_ttft_ms},
        "token_counter": counter.name,
        "passes": [{"name": p.name, "kind": p.workload.kind, "requests": p.workload.num_requests,
                    "concurrency": p.concurrency, "max_tokens": p.max_tokens, "params": p.workload.params}
                   for p in passes],
        "table": table, "notes": notes(args.launch, args.note or []), "summary": rows, "records": records,
    }
    paths = write_peer_result(result, suite, args.out_dir or DEFAULT_OUT)
    print(peer_table(table, suite))
    for line in result["notes"]:
        print(f"- {line}")
    return paths


def peer_markdown(result: dict, suite: SuiteSizes) -> str:
    servers = "\n".join(f"- **{s['label']}** ({s['prefix_reuse']}): `{shlex.join(s['argv'])}`; ready after "
                        f"{s['ready_s']:.1f} s (at full speed after {s['warm_s']:.1f} s), every process gone "
                        f"{s['stop']['gone_s']} s after SIGINT"
                        for s in result["servers"])
    return "\n".join([
        "# hybrid-serve-bench: compare-servers --launch", "", "```", result["command"], "```", "",
        f"Machine: {result['machine']}", "", "Servers, one at a time:", servers, "",
        peer_table(result["table"], suite), "", *[f"- {n}" for n in result["notes"]], "",
        "## Every pass", "", summary_table(result["summary"]), "",
        "Definitions: hybrid_serve_bench/peer_suite.py (the passes and the table) and "
        "hybrid_serve_bench/stats.py (the per-pass rows). The table above times the first token "
        "at the stream's first chunk; these rows time it at the first non-empty text, which a "
        "random-weight model's output can delay (vLLM withholds text ending inside a UTF-8 "
        "sequence).", ""])


def write_peer_result(result: dict, suite: SuiteSizes, out_dir: Path) -> dict[str, Path]:
    """peers.json and peers.md under out_dir (created). `result` has exactly PEER_RESULT_FIELDS."""
    if tuple(result) != PEER_RESULT_FIELDS:
        raise ValueError(f"result keys {list(result)} are not {list(PEER_RESULT_FIELDS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "peers.json", out_dir / "peers.md"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    md_path.write_text(peer_markdown(result, suite))
    return {"json": json_path, "markdown": md_path}
