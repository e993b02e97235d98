"""The engine on one CUDA device takes the instruction checkpoint inside the prefill chunk's
forward pass (no cut at the boundary), and serves exactly what the split path serves: the same
tokens, the same cached_tokens, and a restore that equals computing from scratch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from tests.engine.reuse_cases import instruction_reuse, multi_turn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = EngineConfig(device="cuda", max_model_len=512, max_num_batched_tokens=512,
                      kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20)


@pytest.fixture(scope="module")
def engines():
    return LLMEngine(CONFIG), LLMEngine(replace(CONFIG, in_pass_capture=False))


def test_in_pass_engine_serves_what_the_split_engine_serves(engines):
    check_in_pass_engine_serves_what_the_split_engine_serves(*engines)


def check_in_pass_engine_serves_what_the_split_engine_serves(in_pass: LLMEngine, split: LLMEngine) -> None:
    """Two engines of one model, in-pass capture on and off: instruction reuse and multi-turn
    give the same tokens and cached_tokens, the restored instruction checkpoint the
    from-scratch tokens; the in-pass engine does not cut the first prompt at the boundary."""
    assert in_pass.scheduler.checkpoints.in_pass_capture and not split.scheduler.checkpoints.in_pass_capture
    for case in (instruction_reuse, multi_turn):
        got, expected = case(in_pass, "gpu"), case(split, "gpu")
        for a, b in zip(got, expected):
            assert a.tokens == b.tokens
            assert a.cached == b.cached
        first, second, scratch = got
        assert second.cached >= first.boundary > 0
        assert second.tokens == scratch.tokens
    first_in_pass, first_split = instruction_reuse(in_pass, "cuts")[0], instruction_reuse(split, "cuts")[0]
    assert first_split.chunk_sizes[0] == first_split.boundary  # the split path cuts there
    assert first_in_pass.chunk_sizes[0] > first_in_pass.boundary  # the in-pass path does not
    assert in_pass.stats().checkpoints["instruction"].captured >= 3
