"""Speculative decoding on Falcon-H1 on one CUDA device (issue 25): every layer runs attention
and Mamba2 side by side on one normed input (HYBRID), so a verification chunk takes both CUDA
routes in the same layer: the Mamba2 half mix_verification_gpu (engine/layers/verification.py),
leaving each position's state in a scratch slot, the attention half writing the K/V of every
position. The model is test_speculation_families' Falcon-H1 (test_falcon_h1's one Mamba group
normed after the gate, so the gated norm folds at one row) at head_dim 32, since the CUDA
attention kernels need a power of two (engine/execution/loader.py check_cuda_shapes). With 3 n-gram draft
tokens, greedy outputs equal speculation off's over tests/gpu/test_speculative_gpu.py's chat
rounds with span-repeating prompts added, drafts are accepted and the steps of verification
chunks alone replay verify_graphs.py's CUDA graphs, in fp32 and in bf16 (near-ties by dtype).

Here rather than in tests/gpu/ because it builds its model with this directory's family helpers.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import FalconH1Config, FalconH1ForCausalLM

from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from hf_reference_checks import save_engine_model
from test_falcon_h1 import CASES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Falcon-H1's CUDA verification route needs a CUDA device"),
]

K = 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_falcon_h1_drafts_on_cuda_as_speculation_off(tmp_path, dtype):
    from tests.gpu.test_speculative_gpu import compare_with_repeating_prompts_on_cuda

    model_dir = save_engine_model(FalconH1Config, FalconH1ForCausalLM,
                                  dict(CASES["norm_after_gate"], head_dim=32), tmp_path / "falcon_h1")
    config = EngineConfig(model_dir=str(model_dir), device="cuda", dtype=dtype, max_num_batched_tokens=128,
                          max_num_seqs=8, max_model_len=512, kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20)
    off = LLMEngine(config)
    on = LLMEngine(replace(config, num_speculative_tokens=K))
    compare_with_repeating_prompts_on_cuda(off, on, 5, dtype, f"falcon_h1 {dtype}")
    replays = on.executor.verify_graphs.replays
    print(f"verification graph replays: {replays}")
    assert replays > 0, "no step of verification chunks alone went through the verification graphs"
    off.shutdown()
    on.shutdown()
