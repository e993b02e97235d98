"""Speculative decoding on the families whose speculation no other module checks (issue 25,
point 1): GraniteMoeHybrid with routed experts, dense Nemotron-H and Bamba. With 3 n-gram draft
tokens, test_speculative's exactness run (chat requests sharing system prompts, multi-turn
continuations, each also from scratch, and prompts that repeat a span) gives speculation off's
greedy outputs, with drafts accepted. The models are test_engine_tp2's engine models of each
family. (The embedded dense Granite: tests/engine/test_speculative.py; Qwen3-Next:
test_qwen3_next_speculative.py; Nemotron-H with MoE blocks: test_nemotron_h_moe.py; Falcon-H1's
hybrid layers are refused.)
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from test_engine_tp2 import ENGINE, FAMILIES
from tests.engine.test_speculative import (  # noqa: F401 (repeating_prompts: a fixture, built with engine_off)
    check_speculation_equals_off,
    repeating_prompts,
)


@pytest.fixture(scope="module", params=["granitemoehybrid", "nemotron_h", "bamba"])
def engine_off(request, tmp_path_factory) -> LLMEngine:
    """The family's engine with speculation off (test_speculative's repeating_prompts fixture
    continues spans with it)."""
    model_dir = FAMILIES[request.param](tmp_path_factory.mktemp(f"{request.param}_speculation"))
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **ENGINE))


def test_speculation_equals_off(engine_off, repeating_prompts):
    family = engine_off.executor.model.config.model_type
    check_speculation_equals_off(engine_off.config, 3, repeating_prompts, family)
