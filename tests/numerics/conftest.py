"""Fixtures of the numerics tests: one reference case per tiny random config, plus the
embedded default model when it exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from numerics_support import TINY_CONFIGS, Case, build_random_case, load_case

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-granite-hybrid"
CASE_NAMES = [*TINY_CONFIGS, "embedded"]


@pytest.fixture(scope="session", params=CASE_NAMES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    if name == "embedded":
        if not (EMBEDDED_MODEL_DIR / "config.json").exists():
            reason = f"embedded model not found at {EMBEDDED_MODEL_DIR} (no config.json)"
            print(f"skipping: {reason}")
            pytest.skip(reason)
        return load_case(name, EMBEDDED_MODEL_DIR)
    return build_random_case(name, TINY_CONFIGS[name], tmp_path_factory.mktemp(name))
