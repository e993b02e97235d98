"""A config whose Ray resources cannot be placed is refused when the app is built, naming the
key and the numbers, instead of Serve waiting for ever (deployments/placement.py). Pure: no Ray;
capacities are given, and the check_config test pins this machine to 2 CPUs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from deployments import check_config, placement
from deployments.config import AppConfig
from deployments.placement import (
    Capacity, PlacementError, app_demand, autoscaling_wait_s, check_placement, placement_problem)

REPO_ROOT = Path(__file__).resolve().parents[2]
TWO_CORES = Capacity(2, 0, ((2, 0),), "this machine")
TP2 = {"engine": {"tensor_parallel_size": 2}}


def _config(**args) -> AppConfig:
    return AppConfig.model_validate(args)


def test_tensor_parallel_2_with_one_cpu_a_rank_asks_2_3_of_2_cpus():
    problem = placement_problem(app_demand(_config(**TP2)), TWO_CORES)
    assert problem.key == "worker_num_cpus"
    assert str(problem) == (
        "worker_num_cpus: the application cannot be placed: OpenAIIngress 1 x ingress_num_cpus 0.1"
        " + Renderer 1 x renderer_num_cpus 0.1 + LLMServer 1 x llm_server_num_cpus 0.1 + rank actors"
        " 1 x tensor_parallel_size 2 x worker_num_cpus 1.0 = 2.3 CPUs, this machine has 2; lower"
        " worker_num_cpus or give Ray more CPUs")


def test_what_fits_is_not_refused():
    assert placement_problem(app_demand(_config()), TWO_CORES) is None  # 1.3 of 2: the default
    assert placement_problem(app_demand(_config(**TP2, worker_num_cpus=0.8)), TWO_CORES) is None
    assert placement_problem(app_demand(_config(**TP2, worker_num_cpus=0.9)), TWO_CORES) is not None


def test_one_rank_asks_the_llm_server_replica_for_the_model_and_its_gpu():
    demand = app_demand(_config(engine={"device": "cuda"}))
    assert demand.total_cpus == pytest.approx(1.3) and demand.total_gpus == 1
    problem = placement_problem(demand, TWO_CORES)
    assert problem.key == "engine.device"
    assert "LLMServer 1 x 1 GPU (engine.device cuda) = 1 GPU, this machine has 0; set engine.device" \
        " cpu or give Ray GPUs" in str(problem)
    assert placement_problem(demand, Capacity(2, 1, ((2, 1),), "this machine")) is None
    ranks = app_demand(_config(engine={"device": "cuda", "tensor_parallel_size": 2}, worker_num_cpus=0.5))
    problem = placement_problem(ranks, Capacity(8, 1, ((8, 1),), "the Ray cluster"))
    assert problem.key == "engine.tensor_parallel_size"
    assert "rank actors 1 x tensor_parallel_size 2 x 1 GPU = 2 GPUs, the Ray cluster has 1" in str(problem)


def test_the_ranks_of_a_replica_must_fit_one_node():
    """STRICT_PACK: 2.3 CPUs fit four 1-CPU nodes in total, but the two ranks need one node."""
    problem = placement_problem(app_demand(_config(**TP2)),
                                Capacity(4, 0, ((1, 0),) * 4, "the Ray cluster"))
    assert problem.key == "worker_num_cpus"
    assert str(problem) == (
        "worker_num_cpus: the application cannot be placed: the rank actors of one replica, packed"
        " on one node (tensor_parallel_size 2 x worker_num_cpus 1.0) = 2.0 CPUs on one node, the"
        " largest node of the Ray cluster has 1 CPUs; lower worker_num_cpus or give Ray a larger"
        " node")
    assert placement_problem(app_demand(_config(**TP2, worker_num_cpus=0.5)),
                             Capacity(4, 0, ((1, 0),) * 4, "the Ray cluster")) is None


def test_replicas_and_actor_options_of_the_serve_config_file_count():
    problem = placement_problem(app_demand(_config(), replicas={"LLMServer": 2}), TWO_CORES)
    assert "LLMServer 2 x (llm_server_num_cpus 0.1 + worker_num_cpus 1.0)" in str(problem)
    assert "= 2.4 CPUs" in str(problem)
    problem = placement_problem(app_demand(_config(), actor_options={"Renderer": {"num_cpus": 1}}),
                                TWO_CORES)
    assert "Renderer 1 x ray_actor_options.num_cpus 1.0" in str(problem) and "= 2.2 CPUs" in str(problem)
    assert check_config.starting_replicas([
        {"name": "LLMServer", "autoscaling_config": {"min_replicas": 2, "max_replicas": 4}},
        {"name": "Renderer", "num_replicas": 3, "ray_actor_options": {"num_cpus": 0.5}},
        {"name": "OpenAIIngress", "autoscaling_config": {"min_replicas": 0}},
    ]) == ({"LLMServer": 2, "Renderer": 3, "OpenAIIngress": 1}, {"Renderer": {"num_cpus": 0.5}})


def test_the_index_actor_counts_with_checkpoint_routing():
    plain, routed = app_demand(_config()), app_demand(_config(checkpoint_routing=True))
    assert routed.total_cpus - plain.total_cpus == pytest.approx(0.01)


def test_an_autoscaler_gets_a_bounded_wait_then_the_refusal(caplog):
    asked = []
    grown = Capacity(4, 0, ((2, 0), (2, 0)), "the Ray cluster")
    capacities = iter([Capacity(2, 0, ((2, 0),), "the Ray cluster")] * 3 + [grown])
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        check_placement(_config(**TP2, worker_num_cpus=1.0), capacity=lambda: next(capacities),
                        wait_s=60, sleep=lambda s: None, request_resources=asked.append)
    assert asked[0] == [{"CPU": 0.1}, {"CPU": 0.1}, {"CPU": 0.1}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert asked[-1] == []  # the request is withdrawn
    assert "waiting up to 60 s for the autoscaler to add nodes (allow_autoscaling_wait_s)" in caplog.text

    clock = iter(range(0, 1000, 10))
    never = Capacity(2, 0, ((2, 0),), "the Ray cluster")
    monotonic = placement.time.monotonic
    placement.time.monotonic = lambda: next(clock)
    try:
        with pytest.raises(PlacementError, match=r"= 2.3 CPUs, the Ray cluster has 2; .* \(after "
                                                 r"waiting 30 s for the autoscaler\)"):
            check_placement(_config(**TP2), capacity=lambda: never, wait_s=30,
                            sleep=lambda s: None, request_resources=asked.append)
    finally:
        placement.time.monotonic = monotonic
    assert asked[-1] == []


def test_no_wait_without_an_autoscaler_and_none_on_this_machine():
    with pytest.raises(PlacementError):  # wait_s set, but this machine grows no nodes
        check_placement(_config(**TP2), capacity=lambda: TWO_CORES, wait_s=60,
                        sleep=lambda s: pytest.fail("waited"), request_resources=lambda b: None)
    check_placement(_config(**TP2), capacity=lambda: None)  # RAY_ADDRESS: checked over there
    assert autoscaling_wait_s(_config(), environ={}) == 0
    assert autoscaling_wait_s(_config(), environ={placement.KUBERAY_ENV: "ray start"}) == 600
    assert autoscaling_wait_s(_config(allow_autoscaling_wait_s=5), environ={placement.KUBERAY_ENV: "x"}) == 5


def test_check_config_refuses_an_unplaceable_config_file_with_the_key(tmp_path, monkeypatch, capsys):
    """`make serve` runs check_config first: on a 2-core machine tensor_parallel_size 2 exits 2
    with the key and the numbers, before serve run could wait for ever."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(placement, "current_capacity", lambda: TWO_CORES)
    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"]["engine"]["tensor_parallel_size"] = 2
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(config))

    with pytest.raises(PlacementError, match=r"application 'hybrid-serve': invalid hybrid-serve app "
                                             r"args: worker_num_cpus: .* = 2\.3 CPUs, this machine has 2"):
        check_config.check_serve_config(path)
    assert check_config.main([str(path)]) == 2
    assert "worker_num_cpus: the application cannot be placed" in capsys.readouterr().err
    assert check_config.main([str(REPO_ROOT / "serve_config.yaml")]) == 0  # 1.2 of 2 CPUs

    config["applications"][0]["args"]["engine"]["tensor_parallel_size"] = 1  # the file's replicas
    config["applications"][0]["deployments"][0]["autoscaling_config"]["min_replicas"] = 2
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(PlacementError, match=r"LLMServer 2 x \(llm_server_num_cpus 0\.1 \+ "
                                             r"worker_num_cpus 1\.0\) = 2\.4 CPUs"):
        check_config.check_serve_config(path)


def test_check_config_refuses_a_deployment_the_graph_lacks_with_its_name(tmp_path, monkeypatch):
    """Serve refuses `deployments:` options for a deployment the application does not have, but
    only after the deploy started (and `serve run` keeps running): check_config refuses the
    file first. On the lean path the replica renders (render_in_replica's default), so naming
    a Renderer is refused; with render_in_replica false it is the graph's, and accepted."""
    import deployments.app as app_module
    import deployments.serving_path as serving_path_module
    from deployments.serving_path import ServingPath

    lean = lambda config: ServingPath(True, "chosen by the test")  # noqa: E731
    monkeypatch.setattr(app_module, "serving_path", lean)
    monkeypatch.setattr(serving_path_module, "serving_path", lean)
    monkeypatch.setattr(placement, "current_capacity", lambda: TWO_CORES)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    app["deployments"].append({"name": "Renderer", "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}})
    path = tmp_path / "renderer.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"deployments: 'Renderer' is not a deployment of this application "
                                         r"on the lean path \(it has LLMServer"):
        check_config.check_serve_config(path)
    app["args"]["render_in_replica"] = False
    path.write_text(yaml.safe_dump(config))
    assert check_config.check_serve_config(path) == ["hybrid-serve"]
