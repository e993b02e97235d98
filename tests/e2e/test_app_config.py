"""build_app validates serve_config args before anything starts (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments import placement
from deployments.app import build_app
from deployments.config import AppConfig, parse_app_config

REPO_ROOT = Path(__file__).resolve().parents[2]
# A machine that holds what the tests below build, whatever this one has (tests/unit/test_placement.py
# tests the refusal of what a machine cannot hold).
LARGE_MACHINE = placement.Capacity(64, 8, ((64, 8),), "this machine")


def test_unknown_key_is_rejected_by_name():
    with pytest.raises(ValueError, match="unknown config key 'max_num_seq'"):
        build_app({"max_num_seq": 8})


def test_invalid_value_is_rejected_by_name():
    with pytest.raises(ValueError, match="block_size"):
        build_app({"engine": {"block_size": 0}})


def test_stream_interval_must_be_positive():
    assert parse_app_config({}).stream_interval >= 1
    assert parse_app_config({"stream_interval": 1}).stream_interval == 1
    with pytest.raises(ValueError, match="stream_interval"):
        build_app({"stream_interval": 0})


def test_unknown_engine_key_is_rejected_by_name():
    with pytest.raises(ValueError, match=r"unknown engine key\(s\) \['max_num_seq'\]"):
        build_app({"engine": {"max_num_seq": 8}})
    with pytest.raises(ValueError, match="unknown config key 'block_size'"):
        build_app({"block_size": 16})  # an engine key at the top level


def test_serve_config_yaml_args_are_valid():
    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    parsed = parse_app_config(app["args"])
    assert isinstance(parsed, AppConfig)
    assert parsed.engine.checkpoint_slots == tuple(app["args"]["engine"]["checkpoint_slots"])
    build_app(app["args"])  # and the workers would accept it


def test_checkpoint_slots_accept_any_subset_and_reject_unknown_names():
    def slots(value):
        return parse_app_config({"engine": {"checkpoint_slots": value}}).engine.checkpoint_slots

    assert parse_app_config({}).engine.checkpoint_slots == ("prompt", "response", "instruction", "breakpoint")
    assert slots([]) == ()
    assert slots(["response", "prompt", "response"]) == ("prompt", "response")
    assert slots(["breakpoint", "instruction"]) == ("instruction", "breakpoint")  # the fixed kinds first
    with pytest.raises(ValueError, match=r"checkpoint_slots may hold only .* got \['instructions'\]"):
        build_app({"engine": {"checkpoint_slots": ["prompt", "instructions"]}})
    with pytest.raises(ValueError, match="checkpoint_slots"):
        build_app({"engine": {"checkpoint_slots": "prompt"}})
    with pytest.raises(ValueError, match="checkpoint_cache_bytes"):
        build_app({"engine": {"checkpoint_cache_bytes": -1}})


def test_tensor_parallel_size_is_checked_against_the_model_at_build_time(monkeypatch):
    monkeypatch.setattr(placement, "current_capacity", lambda: LARGE_MACHINE)
    build_app({"engine": {"tensor_parallel_size": 4}})  # the tiny model splits 4 ways
    with pytest.raises(ValueError, match="does not divide by tensor_parallel_size=3"):
        build_app({"engine": {"tensor_parallel_size": 3}})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        build_app({"engine": {"tensor_parallel_size": 0}})
    with pytest.raises(ValueError, match="worker_num_cpus"):
        build_app({"worker_num_cpus": 0})


def test_values_the_workers_would_refuse_fail_the_build_naming_the_key():
    """Refused at build time, so `serve run` fails at once instead of Serve restarting a
    replica whose worker raises (the embedded model's context is 4,096 tokens)."""
    with pytest.raises(ValueError, match="max_model_len 8192 exceeds the model's max_position_embeddings 4096"):
        build_app({"engine": {"max_model_len": 8192}})
    with pytest.raises(ValueError, match="kv_cache_bytes=65536 holds .* fewer than max_model_len=4096"):
        build_app({"engine": {"kv_cache_bytes": 65536}})
    with pytest.raises(ValueError, match="state_cache_bytes=16 cannot hold one recurrent state slot"):
        build_app({"engine": {"state_cache_bytes": 16}})
    with pytest.raises(ValueError, match="engine.model_dir: .*config.json"):
        build_app({"engine": {"model_dir": "/nonexistent/model"}})
    build_app({"engine": {"max_model_len": 4096}})  # the model's own context fits the defaults


def test_check_config_exits_with_the_refusal_before_serve_run(tmp_path):
    """`make serve` runs deployments.check_config first, because `serve run` on a config file
    blocks even when build_app refuses the args."""
    import subprocess
    import sys

    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"]["engine"]["max_model_len"] = 8192
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))

    def check(path):
        return subprocess.run([sys.executable, "-m", "deployments.check_config", str(path)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)

    refused = check(bad)
    assert refused.returncode == 2
    assert "application 'hybrid-serve'" in refused.stderr and "max_model_len 8192" in refused.stderr
    accepted = check(REPO_ROOT / "serve_config.yaml")
    assert accepted.returncode == 0, accepted.stderr
    assert "hybrid-serve" in accepted.stdout



def test_speculation_the_model_cannot_run_fails_the_build_naming_the_key():
    """The mtp drafter on the embedded model (no mtp.* weights) is refused when the app is
    built, as the worker would refuse it when it starts (engine/speculative/checks.py); with a
    random head for benchmarks, or the n-gram drafter, the build goes through."""
    with pytest.raises(ValueError, match="speculative_drafter mtp: this model has no multi-token-prediction head"):
        build_app({"engine": {"num_speculative_tokens": 3, "speculative_drafter": "mtp"}})
    build_app({"engine": {"num_speculative_tokens": 3, "speculative_drafter": "mtp", "random_mtp_head_seed": 1}})
    build_app({"engine": {"num_speculative_tokens": 3, "speculative_drafter": "ngram"}})


def test_a_head_dim_the_cuda_kernels_cannot_serve_fails_a_cuda_build_naming_the_key(tmp_path, monkeypatch):
    """The paged attention kernels need a power-of-two head_dim (engine/execution/loader.py
    check_cuda_shapes): a CUDA deploy of a model with head_dim 24 is refused naming the key,
    before any replica starts; the same model deploys on the CPU, whose path has no such limit."""
    import json
    import shutil

    from engine.engine_config import DEFAULT_MODEL_DIR

    monkeypatch.setattr(placement, "current_capacity", lambda: LARGE_MACHINE)  # one with a GPU
    model_dir = tmp_path / "head_dim_24"
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "head_dim": 24}))
    with pytest.raises(ValueError, match="head_dim 24: the CUDA attention kernels need a power of two"):
        build_app({"engine": {"model_dir": str(model_dir), "device": "cuda"}})
    build_app({"engine": {"model_dir": str(model_dir)}})
    build_app({"engine": {"device": "cuda"}})  # the embedded model: a power of two
