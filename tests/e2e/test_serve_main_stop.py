"""`make serve` stops within 5 s of Ctrl-C or SIGTERM, with nothing left behind (issue 43,
point 6): `python -m deployments.serve_main` on the embedded model, once answering
/v1/models, gets one signal; the process must exit, and every process it started (Serve's
controller, proxy and replicas, Ray's raylet, GCS, agents and workers) must be gone, within
STOP_WITHIN_S.

SIGINT goes to the server's process group, as Ctrl-C in a terminal sends it; SIGTERM to a server
started the way a script starts a background job, with SIGINT ignored (tests/e2e/test_serve_main.py
sends SIGINT to one). Each server runs in a session of its own (start_new_session), so its
processes are those of that session; Ray's stay in it (its workers make process groups of their
own, not sessions). A process outside that session whose environment carries the server's
marker variable (every process Ray starts inherits the driver's environment) counts too: it
escaped the session. A Ray of another test or user on the machine carries no marker, so it
never counts. Whatever is still alive at the end is killed, so a failing run leaves nothing
behind either. The stop times are printed (`pytest -s`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tests.ray_env import SERVE_ON_TWO_CORES_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240
STOP_WITHIN_S = 5.0
MARKER = "HYBRID_SERVE_STOP_TEST"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, session id) of a live process; None if it is gone or a zombie (a zombie has
    exited; only its exit status waits for its parent)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # state ppid pgrp session ...
    if fields[0] in ("Z", "X"):
        return None
    return fields[0], int(fields[3])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def _has_marker(pid: int, token: bytes) -> bool:
    try:
        return token in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _started_by(server_sid: int, token: bytes, before: set[int]) -> dict[int, str]:
    """The live processes of the server's session, and the new ones elsewhere that carry its
    marker: pid -> command line."""
    found = {}
    for pid in _pids():
        stat = _stat(pid)
        if stat is not None and (stat[1] == server_sid
                                 or (pid not in before and _has_marker(pid, token))):
            found[pid] = _cmdline(pid)
    return found


def _config(tmp_path: Path, port: int) -> Path:
    """serve_config.yaml on a free port with a smaller engine, as tests/e2e/test_serve_main.py."""
    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["engine"].update(max_model_len=256, max_num_seqs=2, kv_cache_bytes=8 << 20,
                          state_cache_bytes=8 << 20, checkpoint_cache_bytes=8 << 20)
    args["worker_num_cpus"] = 0.5
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.timeout(START_TIMEOUT_S + 120)
@pytest.mark.parametrize("signum, background", [
    (signal.SIGINT, False),  # Ctrl-C: the terminal signals the foreground process group
    (signal.SIGTERM, True),  # `make serve &` in a script (SIGINT ignored), then `kill`
], ids=["SIGINT-foreground-group", "SIGTERM-background"])
def test_serve_main_stops_within_5s_leaving_nothing(tmp_path, signum, background):
    port = free_port()
    path = _config(tmp_path, port)
    # Its own Ray, never the suite's (RAY_ADDRESS and the like removed), sized for 2 cores.
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env.update(SERVE_ON_TWO_CORES_ENV)
    env[MARKER] = uuid.uuid4().hex
    token = f"{MARKER}={env[MARKER]}".encode()
    log_path = tmp_path / "serve.log"
    before = _pids()
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "deployments.serve_main", str(path)], cwd=REPO_ROOT, env=env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if background else None,
        )
    left: dict[int, str] = {}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"the server exited ({server.returncode}) before answering: "
                            f"{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no answer on /v1/models within {START_TIMEOUT_S}s: "
                            f"{log_path.read_text()[-3000:]}")
            time.sleep(1)

        started = _started_by(server.pid, token, before)
        assert any("raylet" in cmdline for cmdline in started.values()), started
        signalled = time.monotonic()
        if background:
            server.send_signal(signum)
        else:
            os.killpg(server.pid, signum)  # its Ray children are in its group; they block SIGINT
        exited_after = gone_after = None
        while True:
            now = time.monotonic() - signalled
            if exited_after is None and server.poll() is not None:
                exited_after = now
            # Everything seen so far, and whatever the session started meanwhile.
            started.update(_started_by(server.pid, token, before))
            left = {pid: cmdline for pid, cmdline in started.items() if _stat(pid) is not None}
            if exited_after is not None and not left:
                gone_after = now
                break
            if now > STOP_WITHIN_S + 15:
                break
            time.sleep(0.05)
        print(f"{signal.Signals(signum).name}: server exited after {exited_after} s "
              f"(status {server.returncode}), every process gone after {gone_after} s")
        log_tail = log_path.read_text()[-3000:]
        assert exited_after is not None and exited_after <= STOP_WITHIN_S, (
            f"the server had not exited {STOP_WITHIN_S}s after {signal.Signals(signum).name} "
            f"(exited after {exited_after} s); log: {log_tail}")
        assert gone_after is not None and gone_after <= STOP_WITHIN_S, (
            f"{signal.Signals(signum).name}: processes left after {STOP_WITHIN_S}s "
            f"(all gone after {gone_after} s): "
            f"{sorted(cmdline[:80] for cmdline in left.values())}; log: {log_tail}")
        assert server.returncode == 0, f"exit status {server.returncode}; log: {log_tail}"
        assert "Segmentation fault" not in log_path.read_text(), log_tail  # faulthandler's words
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        for pid in {**left, **_started_by(server.pid, token, before)}:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
