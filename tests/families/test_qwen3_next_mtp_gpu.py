"""Qwen3-Next's own MTP head drafting on one CUDA device (issue 25): test_qwen3_next_mtp's model
(the tiny random Qwen3-Next whose LM head favours four tokens, with random mtp.* tensors) in
fp32 on CUDA, speculation off against the mtp drafter: the head's passes through their batch
plans, verification through the gated delta-net's CUDA route (engine/speculative/verify_gpu.py
mix_delta_rule_verification_gpu). Greedy outputs equal over tests/gpu/test_speculative_gpu.py's
chat rounds with repeating prompts added, and drafts are accepted.

Here rather than in tests/gpu/ because it builds its model with this directory's family helpers
(test_qwen3_next_speculative, test_qwen3_next_mtp).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.llm_engine import LLMEngine
from test_qwen3_next_mtp import add_random_mtp_tensors
from test_qwen3_next_speculative import K, save_speculating_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's kernels need a CUDA device"),
]


def test_qwen3_next_mtp_head_drafts_on_cuda_as_speculation_off(tmp_path):
    from tests.gpu.test_speculative_gpu import compare_with_repeating_prompts_on_cuda

    config = save_speculating_model(tmp_path / "qwen3_next_mtp")
    add_random_mtp_tensors(Path(config.model_dir), seed=7)
    config = replace(config, device="cuda", dtype="float32", speculative_drafter="mtp")
    off = LLMEngine(config)
    on = LLMEngine(replace(config, num_speculative_tokens=K))
    compare_with_repeating_prompts_on_cuda(off, on, 5, "float32", "qwen3_next mtp")
    off.shutdown()
    on.shutdown()
