"""benchmarks/roofline/model.py sized_config: the budgets it sets give the worker exactly the
blocks and state slots the benchmark's chunks address (requests x blocks_per_seq blocks), with
and without the MTP drafter's extra KV layer (which makes every block larger: sized without it,
the MTP step-cost rows of spec_decode.py addressed blocks past the pool on the GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.parallel.cache_capacity import size_caches
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig
from engine.models.registry import load_model_config
from engine.parallel.tensor_parallel import TensorParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from roofline.model import sized_config  # noqa: E402


@pytest.mark.parametrize("drafter", [None, "ngram", "mtp"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sized_config_holds_the_blocks_the_chunks_address(drafter, dtype):
    speculation = {} if drafter is None else dict(
        num_speculative_tokens=4, speculative_drafter=drafter,
        random_mtp_head_seed=7 if drafter == "mtp" else None)
    config = EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), dtype=dtype, max_model_len=1024, **speculation)
    sized = sized_config(config, num_requests=16, blocks_per_seq=66)
    capacity = size_caches(sized, load_model_config(sized.model_dir), TensorParallel.single())
    assert capacity.num_blocks == 16 * 66
    assert capacity.num_state_slots == 16
