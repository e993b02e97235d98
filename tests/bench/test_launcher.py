"""hybrid_serve_bench.launcher against a stand-in server: a plain HTTP server (written below)
answering /health and /v1/models, which starts a child process. The launcher must find the
server's processes, stop all of them on SIGINT, fall back to SIGKILL for those that ignore it,
find a child that left the session (setsid) by its marker, refuse a port already in use,
report a server that exits before answering, and wait past a /health that says it is still
warming up. No Ray, no vLLM."""

from __future__ import annotations

import os
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from hybrid_serve_bench.launcher import LaunchedServer, ServerCommand, ServerFailed, _stat

STAND_IN = textwrap.dedent('''
    import json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "exit":
        print("giving up before listening", flush=True)
        sys.exit(3)
    if mode == "stubborn":  # ignores SIGINT and SIGTERM, and so does its child
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child_code = (
        "import os, signal, sys, time\\n"
        "if sys.argv[1] == 'stubborn': signal.signal(signal.SIGINT, signal.SIG_IGN)\\n"
        "if sys.argv[1] == 'escape': os.setsid()\\n"
        "while True: time.sleep(0.1)\\n")
    child = subprocess.Popen([sys.executable, "-c", child_code, mode, __file__])  # its path: the test's
    if mode == "escape":  # the child leaves the session; this server then exits on SIGINT alone
        time.sleep(0.5)

    health_answers = 0

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            global health_answers
            body = json.dumps({"object": "list", "data": [{"id": "stand-in", "child": child.pid}]}).encode()
            if self.path == "/health":
                health_answers += 1
                # "warming": says it is warming up in its first three answers
                warming = mode == "warming" and health_answers <= 3
                body = json.dumps({"status": "ok", "warming_up": warming, "answers": health_answers}).encode()
            self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = HTTPServer(("127.0.0.1", port), Handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        if mode == "normal":
            child.terminate()
            child.wait()
''')


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launched(tmp_path: Path, mode: str, port: int | None = None, **kwargs) -> LaunchedServer:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    port = port or free_port()
    command = ServerCommand("stand-in", (sys.executable, str(script), str(port), mode),
                            f"http://127.0.0.1:{port}", cwd=tmp_path)
    return LaunchedServer(command, tmp_path / "server.log", ready_timeout_s=60, **kwargs)


def child_pid(server: LaunchedServer) -> int:
    import httpx

    return httpx.get(f"{server.command.base_url}/v1/models", timeout=5).json()["data"][0]["child"]


@pytest.fixture(params=["sigint default", "sigint ignored here"])
def launcher_sigint(request):
    """The launcher's own SIGINT disposition: as in a terminal, or ignored, as in a background
    job of a non-interactive shell (the server must still stop on SIGINT); restored after."""
    previous = signal.getsignal(signal.SIGINT)
    if request.param == "sigint ignored here":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield request.param
    signal.signal(signal.SIGINT, previous)


def test_stop_ends_the_server_and_its_child_on_sigint(tmp_path, launcher_sigint):
    server = launched(tmp_path, "normal", grace_s=20)
    with server:
        child = child_pid(server)
        assert set(server.processes()) == {server.pid, child}
    report = server.stop_report
    assert report.signal == "SIGINT" and not report.forced and report.left == ()
    assert report.gone_s is not None and report.exited_s is not None
    assert _stat(server.pid) is None and _stat(child) is None
    assert server.stop() is report  # a second stop changes nothing


def test_processes_that_ignore_sigint_are_killed_after_the_grace(tmp_path):
    server = launched(tmp_path, "stubborn", grace_s=1.0, kill_wait_s=5.0)
    with server:
        child = child_pid(server)
    report = server.stop_report
    assert report.forced and report.left == () and report.gone_s is not None
    assert report.gone_s >= 1.0  # SIGINT first, SIGKILL only after the grace
    assert _stat(server.pid) is None and _stat(child) is None


def test_a_child_that_left_the_session_is_found_by_its_marker(tmp_path):
    server = launched(tmp_path, "escape", grace_s=1.0)
    with server:
        child = child_pid(server)
        session = _stat(child)[1]
        assert session != server.pid  # it did leave the server's session
        assert child in server.processes()
    report = server.stop_report
    assert report.left == () and report.forced  # it never saw the SIGINT to the group
    assert _stat(child) is None


def test_a_port_in_use_is_refused_before_starting(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = launched(tmp_path, "normal", port=taken.getsockname()[1])
        with pytest.raises(ServerFailed, match="is in use"):
            server.start()
    assert server.pid is None


def test_a_server_that_exits_before_answering_fails_with_its_log(tmp_path):
    server = launched(tmp_path, "exit")
    with pytest.raises(ServerFailed, match=r"exited \(3\)[\s\S]*giving up before listening"):
        with server:
            pass
    assert server.stop_report is not None and server.stop_report.left == ()


def test_stop_before_start_is_an_error(tmp_path):
    server = launched(tmp_path, "normal")
    with pytest.raises(RuntimeError, match="before start"):
        server.stop()


@pytest.fixture(autouse=True)
def _no_strays(tmp_path):
    """Whatever a failing test leaves behind is killed (only processes started from tmp_path)."""
    yield
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if str(tmp_path).encode() in cmd:
                try:
                    os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass


def test_wait_ready_waits_until_health_no_longer_says_warming_up(tmp_path):
    """ready_s is when both paths first answered 200; warm_s when /health stopped saying
    "warming_up": true (its fourth answer here), and wait_ready returns only then."""
    import httpx

    with launched(tmp_path, "warming") as server:
        answers = httpx.get(f"{server.command.base_url}/health", timeout=5).json()["answers"]
        assert answers == 5  # three warming answers, the fourth not, then this one
        assert server.warm_s > server.ready_s > 0


def test_a_server_that_never_warms_up_is_ready_at_its_first_answer(tmp_path):
    import httpx

    with launched(tmp_path, "normal") as server:
        assert httpx.get(f"{server.command.base_url}/health", timeout=5).json()["answers"] == 2
        assert server.warm_s == server.ready_s
