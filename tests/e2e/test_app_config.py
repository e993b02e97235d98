"""build_app validates serve_config args before anything starts (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.app import build_app
from deployments.config import AppConfig, parse_app_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_unknown_key_is_rejected_by_name():
    with pytest.raises(ValueError, match="unknown config key 'max_num_seq'"):
        build_app({"max_num_seq": 8})


def test_invalid_value_is_rejected_by_name():
    with pytest.raises(ValueError, match="block_size"):
        build_app({"block_size": 0})


def test_serve_config_yaml_args_are_valid():
    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    parsed = parse_app_config(app["args"])
    assert isinstance(parsed, AppConfig)
    parsed.engine_config()
