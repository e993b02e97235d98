"""`make serve`: check a Serve config file, then run Ray's `serve run` on it; on SIGINT or SIGTERM
stop Serve, Ray and every process they started within a few seconds, whether started in the
foreground or the background.

    python -m deployments.serve_main serve_config.yaml [serve run options]

The lean serving path (deployments/serving_path.py) needs Ray Serve's switches in the
environment before Ray starts: unless the file's hybrid-serve applications all set
`direct_ingress: false`, or RAY_SERVE_ENABLE_HA_PROXY is already in the environment (then it is
left as given), this sets them, with HAProxy's files in a directory of this run (removed at
exit) and its stats, its metrics and the Serve proxy it falls back to on free ports, where
HAProxy can run; where it cannot (no binary, not Linux) it sets none and build_app logs the
reason with the classic path it builds.
Joining a running cluster (`--address`, RAY_ADDRESS), the cluster's environment decides.

The file is checked by `python -m deployments.check_config` (exit status 2 and the refused
key), because `serve run` on a config file blocks even when the application fails to build.
The check runs in a process of its own while `serve run` starts a local Ray (or joins the one
`--address` / RAY_ADDRESS names): each takes seconds (on 2 cores, about 4.5 s each; the
first chat answered about 1.5 s sooner than with the check first). `serve run` deploys the
file only once the check passed; a refused file stops what Ray started and exits with the
check's status.

Stopping. Left to itself, `serve run` stopped slowly and not cleanly (measured on 2 cores, on
the embedded model, idle):
- SIGINT: `serve run` answers KeyboardInterrupt with `serve.shutdown()`, which waits for the
  controller to stop each replica (about 2 s a deployment wave; up to its 30 s timeout, more
  with requests in flight, LLMServer's graceful_shutdown_timeout_s being 300 s); then the
  interpreter's exit runs `ray.shutdown()`, which stops Ray's processes one after the other,
  each given up to a second after SIGTERM: 11 s in all.
- SIGTERM: `ray.init` replaces the driver's SIGTERM handler with its own `sys.exit(15)`, so
  Serve was never shut down: the driver ran `ray.shutdown()` at exit under running replicas
  and died of SIGABRT (a segmentation fault in other runs) after 3 s.
- A shell starts a background command with SIGINT ignored, and Python leaves an ignored SIGINT
  ignored, so `serve run &` in a script did not stop on SIGINT at all.
With HAProxy on, the same held, and more: Serve's HAProxy manager actor starts `haproxy` as a
child, and each reload starts another that lingers up to its hard-stop-after (120 s).
So this launcher takes both signals itself, again right after `ray.init` (it wraps `ray.init`
for `serve run`), and makes itself a child subreaper, so that every process Ray starts below it
(a worker whose raylet exits first included) stays its descendant. On the first signal:
SIGTERM to the raylet, which stops its workers, agents and object store (0.1-0.5 s), then
SIGKILL to every descendant left (GCS, dashboard, log monitor, autoscaler monitor, HAProxy),
and exit
status 0, without Ray's atexit `ray.shutdown()`: 0.2-1.8 s in all. Serve's graceful shutdown
is skipped, since the whole cluster goes with it: requests in flight are cut. When `serve run`
joined another cluster (`--address`), none of its processes runs below this one: Serve is shut
down there, as `serve run` does. A second signal kills every descendant at once and exits with
128 + the signal's number. A SIGTERM while `ray.init` runs meets Ray's own handler: exit status
15, and the processes started so far go the same way.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import yaml

from deployments.check_config import IMPORT_PATH
from deployments.serving_path import UNAVAILABLE_ENV, haproxy_problem, lean_environment

RAYLET_GRACE_S = 2.0  # after SIGTERM to the raylet, before SIGKILL to everything
KILL_WAIT_S = 1.0  # after SIGKILL, for the kernel to take them
REMOTE_SERVE_SHUTDOWN_TIMEOUT_S = 30.0  # Serve's own client timeout, on a cluster we joined
PR_SET_CHILD_SUBREAPER = 36

_stopping = False
_state_dirs: list[str] = []  # HAProxy's files of this run, removed at exit


def _say(text: str) -> None:
    """One line on stderr, safe inside a signal handler (no buffered stream's lock)."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


def _become_subreaper() -> None:
    """Linux: orphans below this process are re-parented to it instead of to init, so that
    `_descendants` still finds a worker whose raylet exited. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _descendants() -> dict[int, str]:
    """Every live process below this one (from /proc; zombies left out): pid -> its name."""
    children: dict[int, list[tuple[int, str]]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        close = stat.rindex(b")")
        fields = stat[close + 2:].split()  # state ppid ...
        if fields[0] not in (b"Z", b"X"):
            comm = stat[stat.index(b"(") + 1:close].decode(errors="replace")
            children.setdefault(int(fields[1]), []).append((int(name), comm))
    found: dict[int, str] = {}
    stack = [os.getpid()]
    while stack:
        for child, comm in children.get(stack.pop(), ()):
            if child not in found:
                found[child] = comm
                stack.append(child)
    return found


def _reap() -> None:
    """Collect the exit status of any child that has exited (a subreaper inherits zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _signal_all(pids, signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def _wait_until_gone(pids, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap()
        if not set(pids) & set(_descendants()):
            return
        time.sleep(0.05)


def _kill_descendants(timeout_s: float) -> None:
    """SIGKILL to every descendant, and to any that appears meanwhile, until none is left or
    timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        _reap()
        left = _descendants()
        if not left or time.monotonic() >= deadline:
            return
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.05)


def _stop_descendants() -> None:
    """The raylet first, with SIGTERM: it stops its workers and agents and its object store
    (about 0.5 s on 2 cores). Then SIGKILL to everything left: the GCS (which takes more than
    2 s over SIGTERM), the dashboard, the log monitor and the autoscaler's monitor (which,
    SIGTERMed, has its traceback printed here as "The autoscaler failed"), and any worker."""
    raylets = [pid for pid, comm in _descendants().items() if comm == "raylet"]
    _signal_all(raylets, signal.SIGTERM)
    _wait_until_gone(raylets, RAYLET_GRACE_S)
    _kill_descendants(KILL_WAIT_S)


def _owns_ray() -> bool:
    """Whether `serve run` started Ray here (ray.init without an address) rather than joined a
    cluster: then Ray's processes are this process's descendants."""
    worker = sys.modules.get("ray._private.worker")
    node = getattr(worker, "_global_node", None) if worker else None
    return bool(node is not None and getattr(node, "all_processes", None))


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")  # no import in a signal handler: the import lock may be held
    return bool(ray is not None and ray.is_initialized())


def _shut_serve_down_on_the_cluster() -> None:
    """`serve run`'s own answer to Ctrl-C, for a cluster we only joined: it outlives us."""
    serve = sys.modules.get("ray.serve")
    if serve is not None and _ray_initialized():
        thread = threading.Thread(target=serve.shutdown, daemon=True)
        thread.start()
        thread.join(REMOTE_SERVE_SHUTDOWN_TIMEOUT_S)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _wants_lean_path(config_path: str) -> bool:
    """Whether any hybrid-serve application of the file keeps direct_ingress on (the default);
    a file that cannot be read is left to check_config to refuse."""
    try:
        config = yaml.safe_load(Path(config_path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    return any((app.get("args") or {}).get("direct_ingress", True)
               for app in config.get("applications") or [] if app.get("import_path") == IMPORT_PATH)


def set_lean_environment(config_path: str, argv: list[str],
                         environ: dict[str, str] | os._Environ = os.environ) -> None:
    """Put the lean path's switches in `environ` before Ray starts, where it applies (see the
    module docstring); where HAProxy cannot run, its reason instead (UNAVAILABLE_ENV), which
    build_app's log line gives."""
    if "RAY_SERVE_ENABLE_HA_PROXY" in environ:
        return  # the caller chose
    if any(arg == "--address" or arg.startswith("--address=") or arg == "-a" for arg in argv) \
            or environ.get("RAY_ADDRESS"):
        return  # a cluster elsewhere: its environment decides
    if not _wants_lean_path(config_path):
        return
    problem = haproxy_problem(environ)
    if problem is not None:
        environ[UNAVAILABLE_ENV] = f"HAProxy cannot run here: {problem}"
        return
    state_dir = tempfile.mkdtemp(prefix="hs-hap-")  # short: unix socket paths go below it
    _state_dirs.append(state_dir)
    environ.update(lean_environment(Path(state_dir), *(_free_port() for _ in range(4))))


def _remove_state_dirs() -> None:
    for path in _state_dirs:
        shutil.rmtree(path, ignore_errors=True)


def _exit(status: int) -> None:
    """Exit now: Ray's atexit `ray.shutdown()` would take seconds for what is already gone."""
    _remove_state_dirs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream in use by the interrupted code
            pass
    os._exit(status)


def _on_signal(signum: int, frame) -> None:
    global _stopping
    name = signal.Signals(signum).name
    if _stopping:
        _say(f"Got {name} again: killing every process at once.")
        _kill_descendants(KILL_WAIT_S)
        _exit(128 + signum)
    _stopping = True
    if _owns_ray() or not _ray_initialized():
        _say(f"Got {name}: stopping Serve, Ray and their processes (a second signal kills them).")
    else:
        _say(f"Got {name}: shutting Serve down on the cluster (a second signal stops at once).")
        _shut_serve_down_on_the_cluster()
    _stop_descendants()
    _exit(0)


def _take_signals() -> None:
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def _start_check(config_path: str) -> subprocess.Popen:
    """`python -m deployments.check_config config_path` in a process of its own, in this
    environment (the lean switches included), its output on this one's."""
    return subprocess.Popen([sys.executable, "-m", "deployments.check_config", config_path],
                            stdin=subprocess.DEVNULL, start_new_session=True)  # Ctrl-C: stopped by us


def _wrap_ray_init(check: subprocess.Popen) -> None:
    """Around `serve run`'s `ray.init`: take SIGINT and SIGTERM back after it (it sets its own
    SIGTERM handler, `sys.exit(15)`), then wait for the config check, which ran while Ray
    started; a refused file stops what Ray started and exits with the check's status, before
    anything is deployed."""
    import ray

    init = ray.init

    def init_then_take_signals(*args, **kwargs):
        try:
            return init(*args, **kwargs)
        finally:
            if threading.current_thread() is threading.main_thread():
                _take_signals()
                status = check.wait()
                if status != 0:
                    _stop_descendants()
                    _exit(status)

    ray.init = init_then_take_signals


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m deployments.serve_main SERVE_CONFIG.yaml [serve run options]",
              file=sys.stderr)
        return 2
    set_lean_environment(argv[0], argv[1:])
    _become_subreaper()
    _take_signals()
    check = _start_check(argv[0])  # beside Ray's start: both take seconds
    _wrap_ray_init(check)
    from ray.serve.scripts import cli

    try:
        cli.main(args=["run", *argv], prog_name="serve")  # exits: click's standalone mode
    except SystemExit as exit_:
        code = exit_.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:  # noqa: BLE001 - reported, then the processes go as on a signal
        traceback.print_exc()
        status = 1
    # `serve run` ended by itself (a bad option, an error it reported): what it started goes
    # too. A refused file is what it reports first, as when the check ends before Ray's start.
    check_status = check.wait()
    _stop_descendants()
    _exit(check_status or status)
    return status  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
