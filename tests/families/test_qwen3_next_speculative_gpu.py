"""Speculative decoding on Qwen3-Next on one CUDA device (issue 25): test_qwen3_next_speculative's
model (the tiny random Qwen3-Next whose LM head favours four tokens, so its outputs repeat and
drafts are accepted), with test_qwen3_next_mtp's random mtp.* tensors, at head_dim 32 (the CUDA
attention kernels need a power of two; BASE's 24 is refused there, engine/execution/loader.py
check_cuda_shapes), in fp32: speculation off against the n-gram drafter and against the
checkpoint's own MTP head. Verification goes through the gated delta-net's CUDA route
(engine/layers/verification.py mix_delta_rule_verification_gpu), the head's passes through
their batch plans. Greedy outputs equal over tests/gpu/test_speculative_gpu.py's chat rounds
with repeating prompts added, and drafts are accepted.

Here rather than in tests/gpu/ because it builds its model with this directory's family helpers.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.core.llm_engine import LLMEngine
from test_qwen3_next_mtp import add_random_mtp_tensors
from test_qwen3_next_speculative import K, save_speculating_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's kernels need a CUDA device"),
]


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_qwen3_next_drafts_on_cuda_as_speculation_off(tmp_path, drafter):
    from tests.gpu.test_speculative_gpu import compare_with_repeating_prompts_on_cuda

    config = save_speculating_model(tmp_path / "qwen3_next", head_dim=32)
    add_random_mtp_tensors(Path(config.model_dir), seed=7)
    # a budget of 128 (test_qwen3_next_speculative's 40 cuts the prompts into three times as many
    # steps; at 40 neither drafter's run finished in 260 s on a fresh H100)
    config = replace(config, device="cuda", dtype="float32", speculative_drafter=drafter, max_num_batched_tokens=128)
    off = LLMEngine(config)
    on = LLMEngine(replace(config, num_speculative_tokens=K))
    compare_with_repeating_prompts_on_cuda(off, on, 5, "float32", f"qwen3_next {drafter}")
    off.shutdown()
    on.shutdown()
