"""Speculative decoding on the families whose speculation no other module checks (issue 25,
point 1): GraniteMoeHybrid with routed experts, dense Nemotron-H, Bamba and Falcon-H1 (whose
layers run attention and Mamba2 side by side on one input, each mixer verifying as it does
alone). With 3 n-gram draft tokens, test_speculative's exactness run (chat requests sharing
system prompts, multi-turn continuations, each also from scratch, and prompts that repeat a
span) gives speculation off's greedy outputs, with drafts accepted; and test_speculative's
worker-level rollback check holds: a rejected draft leaves the request's state slot as it was,
and the commit gives plain decoding's state and K/V. The models are test_engine_tp2's engine
models of each family. (The embedded dense Granite: tests/engine/test_speculative.py;
Qwen3-Next: test_qwen3_next_speculative.py; Nemotron-H with MoE blocks: test_nemotron_h_moe.py.)
"""

from __future__ import annotations

import pytest

from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from test_engine_tp2 import ENGINE, FAMILIES
from tests.engine.test_speculative import (  # noqa: F401 (repeating_prompts: a fixture, built with engine_off)
    check_rejected_draft_leaves_no_trace,
    check_speculation_equals_off,
    repeating_prompts,
)


@pytest.fixture(scope="module", params=["granitemoehybrid", "nemotron_h", "bamba", "falcon_h1"])
def engine_off(request, tmp_path_factory) -> LLMEngine:
    """The family's engine with speculation off (test_speculative's repeating_prompts fixture
    continues spans with it)."""
    model_dir = FAMILIES[request.param](tmp_path_factory.mktemp(f"{request.param}_speculation"))
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **ENGINE))


def test_speculation_equals_off(engine_off, repeating_prompts):
    family = engine_off.executor.model.config.model_type
    check_speculation_equals_off(engine_off.config, 3, repeating_prompts, family)


def test_a_rejected_draft_leaves_no_trace(engine_off):
    check_rejected_draft_leaves_no_trace(engine_off.config)
