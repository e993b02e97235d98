"""The embedded model (models/tiny-granite-hybrid) end to end: LLMEngine's greedy tokens and
logits equal transformers' generate() on the same directory (fp32, CPU), with chunked prefill
and several requests in one batch (tests/engine/generate_reference.py). The family models get
the same check in tests/families/."""

from __future__ import annotations

import torch
from transformers import GraniteMoeHybridForCausalLM

from engine.core.llm_engine import LLMEngine
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig
from tests.engine.generate_reference import check_engine_matches_generate


def test_embedded_model_greedy_output_equals_generate():
    reference = GraniteMoeHybridForCausalLM.from_pretrained(
        DEFAULT_MODEL_DIR, torch_dtype=torch.float32, attn_implementation="eager").eval()
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=40, max_num_seqs=8))
    assert engine.config.dtype == "float32" and engine.config.device == "cpu"
    check_engine_matches_generate(engine, reference, "embedded model", num_new=32)
