"""The lean serving path for benchmarks (deployments/serving_path.py): its environment for a Ray
this process starts, or a whole server started as `make serve` starts it.

    lean_env()                        the variables to set before ray.init (free ports, and a
                                      directory of HAProxy's files, removed at exit)
    serve_main_server(config, ...)    `python -m deployments.serve_main` on a config dict in a
                                      child process of its own session; waits until every
                                      application answers /v1/models; SIGINT at the end

Both keep HAProxy's files and ports apart from any other server on the machine.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def lean_env() -> dict[str, str]:
    """LEAN_CLUSTER_ENV and one instance's HAProxy files and ports, for a Ray this process
    starts (set them in os.environ before ray.init and before Serve's modules are imported)."""
    from deployments.serving_path import lean_environment

    state_dir = tempfile.mkdtemp(prefix="hs-hap-")
    atexit.register(shutil.rmtree, state_dir, True)
    return lean_environment(Path(state_dir), *(free_port() for _ in range(4)))


@contextmanager
def serve_main_server(config: dict, log_path: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run deployments.serve_main on `config` (a Serve config file's dict) with this process's
    environment minus RAY_* (its own Ray, never this process's), plus `env`."""
    config_path = log_path.with_suffix(".yaml")
    config_path.write_text(yaml.safe_dump(config))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    child_env.update({"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "PYTHONPATH": str(REPO),
                      **(env or {})})
    with log_path.open("w") as log:
        server = subprocess.Popen([sys.executable, "-m", "deployments.serve_main", str(config_path)],
                                  cwd=REPO, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        _wait_ready(server, config, log_path)
        yield server
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def _wait_ready(server: subprocess.Popen, config: dict, log_path: Path) -> None:
    import httpx

    port = config["http_options"]["port"]
    prefixes = [app.get("route_prefix", "/").rstrip("/") for app in config["applications"]]
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = set(prefixes)
    while waiting:
        if server.poll() is not None:
            raise RuntimeError(f"serve_main exited ({server.returncode}): {log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready within {START_TIMEOUT_S} s: {log_path.read_text()[-3000:]}")
        for prefix in list(waiting):
            try:
                if httpx.get(f"http://127.0.0.1:{port}{prefix}/v1/models", timeout=2).status_code == 200:
                    waiting.discard(prefix)
            except httpx.HTTPError:
                pass
        time.sleep(1)
