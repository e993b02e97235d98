"""Start one server process, wait until it answers, stop it and everything it started.

A LaunchedServer runs its command in a session of its own (start_new_session: the session id
and the process group id are the command's pid), with a marker variable in its environment
that every process it starts inherits. Its processes are those of that session, plus any
process elsewhere that carries the marker (one that left the session with setsid): only
processes this launcher started, never another server or Ray on the machine.

Stopping (stop()): SIGINT to the process group, as Ctrl-C in a terminal sends it (both
`python -m deployments.serve_main` and `vllm serve` stop their children on it); after
`grace_s`, SIGKILL to every process of the server still alive, and to any that appears
meanwhile, until none is left or `kill_wait_s` passes. StopReport says how long each part took,
whether SIGKILL was needed and what was left. The command starts with SIGINT's default action
even where the launcher ignores SIGINT (a background job of a non-interactive shell, nohup):
a server would otherwise inherit the ignoring and only ever stop by SIGKILL. Linux only (/proc).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

MARKER = "HYBRID_SERVE_BENCH_SERVER"
READY_PATHS = ("/health", "/v1/models")


class ServerFailed(RuntimeError):
    """The server could not be started: its port was taken, it exited, or it did not answer
    in time. The message ends with the tail of its log."""


@dataclass(frozen=True)
class ServerCommand:
    """What to run: argv in cwd with env (the whole environment), answering at base_url (an
    http://host:port root) once every path of ready_paths answers 200, and at full speed once
    none of those answers is a JSON object with "warming_up": true (hybrid-serve's /health
    while its compiled CPU decode step still compiles; a server that never says so is at full
    speed when it answers)."""

    label: str
    argv: tuple[str, ...]
    base_url: str
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    cwd: Path = Path(".")
    ready_paths: tuple[str, ...] = READY_PATHS


@dataclass(frozen=True)
class StopReport:
    """exited_s: seconds from the first signal until the command's own process exited;
    gone_s: until every process of the server was gone (None: some were left); forced:
    SIGKILL was sent; left: command lines still alive at the end (empty on success)."""

    signal: str
    exited_s: float | None
    gone_s: float | None
    forced: bool
    left: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"signal": self.signal, "exited_s": self.exited_s, "gone_s": self.gone_s,
                "forced": self.forced, "left": list(self.left)}


def _warming_up(answer: httpx.Response) -> bool:
    """The answer is a JSON object with "warming_up": true."""
    try:
        body = answer.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("warming_up") is True


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) == 0


def _default_sigint() -> None:
    """Run in the command's process between fork and exec: SIGINT back to its default action
    (an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, session id) of a live process; None when it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # state ppid pgrp session ...
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[3]))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _has_marker(pid: int, token: bytes) -> bool:
    try:
        return token in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


class LaunchedServer:
    """One server: start(), wait_ready(), stop(); or `with LaunchedServer(...) as server:`,
    which starts it, waits for it and always stops it."""

    def __init__(self, command: ServerCommand, log_path: Path, *, ready_timeout_s: float = 900.0,
                 grace_s: float = 15.0, kill_wait_s: float = 5.0) -> None:
        self.command = command
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.kill_wait_s = kill_wait_s
        self._token = f"{MARKER}={uuid.uuid4().hex}".encode()
        self._process: subprocess.Popen | None = None
        self._before: set[int] = set()
        self.ready_s: float | None = None  # seconds from start() until it answered
        self.warm_s: float | None = None  # ... until it no longer said it was warming up
        self.stop_report: StopReport | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the command. Raises ServerFailed when something already answers on its port
        (the benchmark would measure that server instead)."""
        url = urlsplit(self.command.base_url)
        if port_in_use(url.hostname or "127.0.0.1", url.port or 80):
            raise ServerFailed(f"{self.command.label}: port {url.port} is in use; stop what runs "
                               "there or choose another port")
        env = {**self.command.env, MARKER: self._token.decode().split("=", 1)[1]}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._before = {int(n) for n in os.listdir("/proc") if n.isdigit()}
        with self.log_path.open("w") as log:
            self._process = subprocess.Popen(list(self.command.argv), cwd=self.command.cwd, env=env,
                                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True, preexec_fn=_default_sigint)
        self._started = time.monotonic()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self) -> float:
        """Wait until every ready path answered 200 (ready_s) and none says the server is
        still warming up (warm_s; ServerCommand); returns ready_s. Raises ServerFailed when the
        process exits first or ready_timeout_s passes."""
        assert self._process is not None, "start() first"
        deadline = self._started + self.ready_timeout_s
        base = self.command.base_url.rstrip("/")
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self._process.poll() is not None:
                    raise ServerFailed(f"{self.command.label} exited ({self._process.returncode}) "
                                       f"before answering; log {self.log_path}:\n{self.log_tail()}")
                try:
                    answers = [client.get(base + path) for path in self.command.ready_paths]
                    if all(a.status_code == 200 for a in answers):
                        now = time.monotonic() - self._started
                        self.ready_s = now if self.ready_s is None else self.ready_s
                        if not any(_warming_up(a) for a in answers):
                            self.warm_s = now
                            return self.ready_s
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerFailed(f"{self.command.label} did not answer {list(self.command.ready_paths)} "
                                       f"within {self.ready_timeout_s:.0f} s; log {self.log_path}:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.5)

    def processes(self) -> dict[int, str]:
        """The live processes of the server (module doc): pid -> command line."""
        if self._process is None:
            return {}
        found = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            stat = _stat(pid)
            if stat is not None and (stat[1] == self._process.pid
                                     or (pid not in self._before and _has_marker(pid, self._token))):
                found[pid] = _cmdline(pid)
        return found

    def stop(self) -> StopReport:
        """SIGINT to the group, then SIGKILL to whatever is left after grace_s (module doc).
        Safe to call twice: the second call returns the first report."""
        if self.stop_report is not None:
            return self.stop_report
        if self._process is None:
            raise RuntimeError("stop() before start()")
        seen = self.processes()
        signalled = time.monotonic()
        try:
            os.killpg(self._process.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        exited_s = gone_s = None
        forced = False
        left: dict[int, str] = {}
        while True:
            now = time.monotonic() - signalled
            if exited_s is None and self._process.poll() is not None:
                exited_s = now
            seen.update(self.processes())
            left = {pid: cmd for pid, cmd in seen.items() if _stat(pid) is not None}
            if exited_s is not None and not left:
                gone_s = now
                break
            if now > self.grace_s + (self.kill_wait_s if forced else 0.0):
                if forced:
                    break
                forced = True
                for pid in [self._process.pid, *left]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            elif forced:
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.05)
        self.stop_report = StopReport("SIGINT", exited_s, gone_s, forced, tuple(sorted(left.values())))
        return self.stop_report

    def __enter__(self) -> LaunchedServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
