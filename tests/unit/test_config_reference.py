"""docs/configuration.md is what deployments/config_reference.py renders from the models, and
it names every key with its default, so the reference cannot drift from the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from deployments.config import AppConfig
from deployments.config_reference import render
from engine.engine_config import EngineConfig

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_reference_is_the_rendered_one():
    assert REFERENCE.read_text() == render(), (
        "docs/configuration.md is stale: python -m deployments.config_reference > docs/configuration.md")


def test_every_key_is_documented_with_its_default():
    rows = {line.split("|")[1].strip(" `"): line.split("|")[3].strip()
            for line in REFERENCE.read_text().splitlines() if line.startswith("| `")}
    for name, info in AppConfig.model_fields.items():
        assert name in rows and info.description, name
    assert rows["stream_interval"] == str(AppConfig.model_fields["stream_interval"].default)
    for field in dataclasses.fields(EngineConfig):
        assert field.name in rows and field.metadata.get("help"), field.name
    assert rows["block_size"] == str(EngineConfig().block_size)
    assert rows["max_model_len"] == "unset"
