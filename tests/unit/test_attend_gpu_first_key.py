"""PagedAttention.attend_gpu refuses a plan whose first_key it cannot serve: a chunk that starts
its sequence goes to SDPA over the chunk's own K/V, which reads every key from position 0, so a
first_key above 0 there is a ValueError before any kernel runs (CPU only; the kernels' own
first_key is tested against the PyTorch reference in tests/gpu/test_kernels.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.interfaces.forward_batch import build_forward_batch
from engine.kernels.gpu.batch_plan import build_gpu_batch_plan
from engine.layers.attention import PagedAttention
from engine.models.registry import load_model_config
from engine.interfaces.sampling_params import SamplingParams
from engine.parallel.shard_layout import rank_shard_layout
from engine.interfaces.step_io import ScheduledChunk
from engine.parallel.tensor_parallel import TensorParallel


def test_a_fresh_chunk_with_first_key_is_refused():
    config = load_model_config(DEFAULT_MODEL_DIR)
    layer = PagedAttention(config, rank_shard_layout(config, TensorParallel.single()), TensorParallel.single(),
                           torch.float32)
    chunk = ScheduledChunk(request_id="r", token_ids=(1, 2, 3, 4), start_position=0, block_table=(0,),
                           state_slot=0, reset_state=True, sample=True, sampling=SamplingParams())
    plan = build_gpu_batch_plan(build_forward_batch([chunk], 16, torch.device("cpu")), 16, torch.device("cpu"))
    assert len(plan.fresh_chunks) == 1
    query = torch.zeros(4, layer.num_heads, layer.head_dim)
    key = value = torch.zeros(4, layer.num_kv_heads, layer.head_dim)
    cache = torch.zeros(1, 16, layer.num_kv_heads, layer.head_dim)
    with pytest.raises(ValueError, match="first_key 1"):
        layer.attend_gpu(query, key, value, cache, cache, replace(plan, first_key=1))
