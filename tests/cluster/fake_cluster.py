"""A fake autoscaling Ray cluster on this machine (Ray's fake_multinode node provider), kept
apart from any other Ray instance running here.

The Ray autoscaler runs on the head node with the `fake_multinode` provider: to "launch" a
worker node it starts a raylet process on this machine, to terminate one it kills those
processes. That is what ray.cluster_utils.AutoscalingCluster sets up, but in ray 2.60 that
class cannot be used here as is:

- its constructor reads autoscaler/_private/fake_multi_node/example.yaml, which the ray
  wheel does not ship (FileNotFoundError);
- start() and shutdown() run `ray stop --force`, which kills every Ray process of this user
  on the machine: other test sessions' clusters included;
- its head listens on the default GCS port 6379 and records itself in
  /tmp/ray/ray_current_cluster, so any later plain `ray.init()` here would join it.

FakeAutoscalingCluster builds the same autoscaling config (example.yaml's fields inline),
starts the head the same way (`ray start --head --autoscaling-config=...` with
RAY_FAKE_CLUSTER=1 and a 1 s autoscaler update interval) but on its own GCS port and temp
dir, in a session of its own; shutdown() ends exactly the processes of that session.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the scenario runs as a script
from tests.ray_env import SERVE_ON_TWO_CORES_ENV  # noqa: E402

HEAD_NODE_TYPE = "ray.head.default"
# For the cluster and for every process that connects to it: token authentication (Ray's
# default for a local cluster when ~/.ray/auth_token exists), set explicitly so the head and
# its clients cannot disagree. `ray start` with it refuses to run without a token, so start()
# has `ray get-auth-token --generate` create ~/.ray/auth_token first where none exists (on a
# fresh machine nothing else has made one before these tests).
CLIENT_ENV = {"RAY_AUTH_MODE": "token"}
MARKER_ENV = "HYBRID_SERVE_FAKE_CLUSTER"  # its value: the cluster's temp dir


def free_port(preferred: int) -> int:
    """`preferred` if nothing listens on it, else a port the OS picks."""
    for port in (preferred, 0):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError("no free port")


def autoscaling_config(head_resources: dict, worker_node_types: dict, gcs_address: str,
                       idle_timeout_minutes: float) -> dict:
    """The cluster config AutoscalingCluster generates (from fake_multi_node/example.yaml),
    with the provider pointed at our GCS address instead of port 6379."""
    node_types = dict(worker_node_types)
    node_types[HEAD_NODE_TYPE] = {"resources": head_resources, "node_config": {},
                                  "max_workers": 0}
    return {
        "cluster_name": "fake_multinode",
        "max_workers": sum(t.get("max_workers", 0) for t in worker_node_types.values()),
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": gcs_address},
        "available_node_types": node_types,
        "head_node_type": HEAD_NODE_TYPE,
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_minutes,
        "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
    }


def session_processes(sid: int, marker: str) -> list[int]:
    """Pids of the live processes in session `sid` (Ray's setpgrp keeps the session) whose
    environment has MARKER_ENV=marker (inherited from the head: a reused pid is not ours)."""
    pids = []
    tag = f"{MARKER_ENV}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != sid:
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if tag not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except (OSError, IndexError):  # gone meanwhile
            continue
        if state != "Z":  # a zombie is dead already, its parent only has to reap it
            pids.append(int(entry.name))
    return pids


class FakeAutoscalingCluster:
    """Head node with `head_cpus` CPUs, worker nodes of `worker_node_types` (autoscaler node
    types: resources, min_workers, max_workers), idle workers removed after
    `idle_timeout_minutes`. start() returns the GCS address to pass to ray.init()."""

    def __init__(self, head_cpus: int, worker_node_types: dict, *, idle_timeout_minutes: float,
                 object_store_bytes: int, gcs_port: int = 6390) -> None:
        self.head_cpus = head_cpus
        self.worker_node_types = worker_node_types
        self.idle_timeout_minutes = idle_timeout_minutes
        self.object_store_bytes = object_store_bytes
        self.gcs_port = free_port(gcs_port)
        self.address: str | None = None
        self.temp_dir: str | None = None
        self._sid: int | None = None

    def start(self) -> str:
        import ray._private.services

        ip = ray._private.services.get_node_ip_address()
        self.address = f"{ip}:{self.gcs_port}"
        # short: Ray's unix socket paths live under it
        self.temp_dir = tempfile.mkdtemp(prefix="hs-as-", dir="/tmp")
        config = autoscaling_config({"CPU": self.head_cpus}, self.worker_node_types,
                                    self.address, self.idle_timeout_minutes)
        config_path = os.path.join(self.temp_dir, "autoscaling.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        subprocess.run([ray_cli, "get-auth-token", "--generate"], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60)
        cmd = [ray_cli, "start", "--head", f"--port={self.gcs_port}",
               f"--autoscaling-config={config_path}", f"--temp-dir={self.temp_dir}",
               f"--num-cpus={self.head_cpus}", f"--object-store-memory={self.object_store_bytes}",
               "--include-dashboard=false", "--disable-usage-stats",
               f"--ray-client-server-port={free_port(9990)}",
               f"--dashboard-agent-listen-port={free_port(52390)}"]
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1",
               **CLIENT_ENV, **SERVE_ON_TWO_CORES_ENV, MARKER_ENV: self.temp_dir}
        env.pop("RAY_ADDRESS", None)
        # a session of its own: every process of this cluster (head, the worker nodes the
        # autoscaler starts, their workers) stays in it, so shutdown() can find them all
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self._sid = proc.pid
        output, _ = proc.communicate(timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start failed ({proc.returncode}):\n{output}")
        return self.address

    @property
    def identity(self) -> dict | None:
        """{"sid", "marker"} of this cluster's processes (None before start): with them
        end_session ends the cluster from another process, e.g. after this one was killed."""
        return None if self._sid is None else {"sid": self._sid, "marker": self.temp_dir}

    def shutdown(self, grace_s: float = 10.0) -> None:
        """End every process of this cluster (end_session), then remove the temp dir."""
        if self._sid is not None:
            end_session(self._sid, self.temp_dir, grace_s)
            self._sid = None
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def end_session(sid: int, marker: str, grace_s: float = 10.0) -> None:
    """SIGTERM each process of the cluster (session_processes), SIGKILL those left after
    `grace_s`. Touches no other process; a cluster already gone is a no-op."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in session_processes(sid, marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while session_processes(sid, marker) and time.monotonic() < deadline:
            time.sleep(0.2)
