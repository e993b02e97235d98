"""`make serve`'s launcher (deployments/serve_main.py) stops on SIGINT even when started the way
a script starts a background job, with SIGINT ignored, which plain `serve run` does not.

It starts its own Ray cluster in a child process (RAY_* variables removed, so it cannot join
this session's), on a free port, with a small engine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240
STOP_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(START_TIMEOUT_S + STOP_TIMEOUT_S + 60)
def test_a_background_serve_stops_on_sigint(tmp_path):
    port = free_port()
    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["engine"].update(max_model_len=256, max_num_seqs=2, kv_cache_bytes=8 << 20,
                          state_cache_bytes=8 << 20, checkpoint_cache_bytes=8 << 20)
    args["worker_num_cpus"] = 0.5
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "deployments.serve_main", str(path)], cwd=REPO_ROOT, env=env,
        stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as `cmd &` in a script
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail(f"the server did not come up: {(tmp_path / 'serve.log').read_text()[-2000:]}")
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=STOP_TIMEOUT_S) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
