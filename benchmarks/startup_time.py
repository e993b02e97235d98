"""How long `make serve` takes to serve: `python -m deployments.serve_main serve_config.yaml`
started, until it answers a chat completion, and until GET /health no longer says it is
warming up (the compiled CPU decode step compiled: full speed).

    .venv/bin/python benchmarks/startup_time.py                          # this tree, 3 starts
    .venv/bin/python benchmarks/startup_time.py --against /tmp/before    # and another checkout

Each start runs the tree's own serve_config.yaml on a free port, from the tree's directory (so
its own code serves), with inductor's cache on disk as earlier starts left it (a first start
ever compiles for longer); the trees take turns, one server at a time. Per start:

  first_chat_s  a chat completion of 2 tokens answered 200 (polled from the start, every
                0.2 s, each poll waiting up to 5 s);
  full_speed_s  then GET /health without "warming_up": true (a tree whose /health never says
                so is at full speed at its first chat).

Prints a table (medians and every start) and writes JSON (--out, default
benchmarks/results/startup_time.json). Absolute times on a shared machine are noise: compare
the trees within one run.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from harness import add_out_argument, markdown_table, write_result  # noqa: E402
from hybrid_serve_bench.launcher import LaunchedServer, ServerCommand  # noqa: E402

POLL_S = 0.2
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(tree: Path, log_dir: Path, label: str) -> ServerCommand:
    """serve_main on the tree's serve_config.yaml, its port replaced by a free one."""
    config = yaml.safe_load((tree / "serve_config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    path = log_dir / f"{label}-serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "PYTHONPATH"}
    return ServerCommand(label, (sys.executable, "-m", "deployments.serve_main", str(path)),
                         f"http://127.0.0.1:{port}", env=env, cwd=tree)


def one_start(tree: Path, label: str, log_dir: Path, timeout_s: float) -> dict:
    """Start the tree's server, time its first chat and its full speed, stop it."""
    command = server_command(tree, log_dir, label)
    server = LaunchedServer(command, log_dir / f"{label}.log", ready_timeout_s=timeout_s)
    server.start()
    started = time.monotonic()
    first_chat = full_speed = None
    try:
        with httpx.Client(base_url=command.base_url, timeout=5.0) as client:
            while time.monotonic() - started < timeout_s:
                try:
                    if first_chat is None:
                        models = client.get("/v1/models")
                        if models.status_code == 200:
                            model = models.json()["data"][0]["id"]
                            if client.post("/v1/chat/completions", json={**CHAT, "model": model}).status_code == 200:
                                first_chat = time.monotonic() - started
                    if first_chat is not None:
                        health = client.get("/health")
                        body = health.json() if health.status_code == 200 else {}
                        if health.status_code == 200 and body.get("warming_up") is not True:
                            full_speed = time.monotonic() - started
                            break
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    pass
                time.sleep(POLL_S)
    finally:
        stop = server.stop()
    if full_speed is None:
        raise SystemExit(f"{label}: not at full speed within {timeout_s:.0f} s; log {server.log_path}")
    return {"first_chat_s": round(first_chat, 2), "full_speed_s": round(full_speed, 2), "stopped_s": stop.gone_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, default=None, help="another checkout, started in turns with this one")
    parser.add_argument("--starts", type=int, default=3, help="starts of each tree")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/startup_time"))
    add_out_argument(parser, "startup_time")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    trees = {"this": ROOT, **({"against": args.against.resolve()} if args.against else {})}
    rows = []
    for index in range(args.starts):
        for label, tree in trees.items():
            row = {"tree": label, **one_start(tree, f"{label}-{index}", args.log_dir, args.timeout_s)}
            rows.append(row)
            print(f"{label} start {index}: first chat {row['first_chat_s']} s, full speed {row['full_speed_s']} s",
                  flush=True)
    summary = {label: {key: statistics.median(r[key] for r in rows if r["tree"] == label)
                       for key in ("first_chat_s", "full_speed_s")} for label in trees}
    print(markdown_table(["tree", "path", "first chat s (median)", "full speed s (median)", "every start"],
                         [[label, str(tree), f"{summary[label]['first_chat_s']:.1f}",
                           f"{summary[label]['full_speed_s']:.1f}",
                           ", ".join(f"{r['first_chat_s']:.1f}/{r['full_speed_s']:.1f}" for r in rows if r["tree"] == label)]
                          for label, tree in trees.items()]))
    path = write_result(args.out, "startup_time", {"trees": {k: str(v) for k, v in trees.items()},
                                                   "starts": args.starts, "rows": rows, "median": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
