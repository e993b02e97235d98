"""Reading Ray Serve's replica logs (logging_config encoding JSON): which replica served a
request, where each replica ran, and what a stopped replica's drain loop reported.

Serve writes one file per replica, logs/serve/replica_<app>_<deployment>_<replica id>.log,
with an access line per call ("CALL generate OK 812.3ms") whose request_id is the HTTP
request's x-request-id, and, while a stopped replica drains, its wait loop's lines.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def replica_logs(logs_dir: Path, app: str, deployment: str) -> dict[str, list[dict]]:
    """The Serve log records (JSON lines) of `deployment`'s replicas, by replica id."""
    logs: dict[str, list[dict]] = {}
    prefix = f"replica_{app}_{deployment}_"
    for path in sorted((logs_dir / "serve").glob(f"{prefix}*.log")):
        records = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        replica = path.stem.removeprefix(prefix)
        logs[replica] = records
    return logs


def served_by(logs: dict[str, list[dict]]) -> dict[str, str]:
    """request id -> replica id, from each replica's access log line of `generate`."""
    owner = {}
    for replica, records in logs.items():
        for record in records:
            message = record.get("message", "")
            if message.startswith("CALL generate ") and record.get("request_id"):
                owner[record["request_id"]] = replica
    return owner


def replica_nodes(logs: dict[str, list[dict]]) -> dict[str, list[str]]:
    """replica id -> the node ids its log records name (Ray's JSON log context)."""
    return {replica: sorted({r["node_id"] for r in records if r.get("node_id")})
            for replica, records in logs.items()}


def log_time(record: dict) -> float:
    """A JSON log record's wall-clock time (epoch seconds)."""
    if "timestamp_ns" in record:
        return int(record["timestamp_ns"]) / 1e9
    stamp, millis = record["asctime"].split(",")
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def drain_events(logs: dict[str, list[dict]], wait_loop_s: float) -> dict[str, dict]:
    """Per replica that was stopped, from Serve's drain loop: `started` (when its shutdown
    began: the loop's first line is one wait period, graceful_shutdown_wait_loop_s =
    `wait_loop_s`, late), `ongoing_while_draining` (the ongoing-request counts it logged:
    "Waiting for an additional ...s to shut down: N ongoing requests"), `shutdown_complete`
    (it logged that the graceful shutdown completed)."""
    events = {}
    for replica, records in logs.items():
        drain = [r for r in records if r.get("message", "").startswith(
            ("Waiting for an additional", "Drained ongoing requests"))]
        if not drain:
            continue
        waits = [int(r["message"].split(": ", 1)[1].split()[0]) for r in drain
                 if r["message"].startswith("Waiting")]
        events[replica] = {
            "started": log_time(drain[0]) - wait_loop_s,
            "ongoing_while_draining": waits,
            "shutdown_complete": any("Graceful shutdown complete" in r.get("message", "")
                                     for r in records)}
    return events
