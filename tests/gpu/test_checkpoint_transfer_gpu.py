"""A checkpoint moved between two engines on one CUDA device (the instruction checkpoint taken
inside the prefill pass, the KV gathered from and scattered into device caches that CUDA
graphs read) serves exactly what the importing engine computes from scratch; one captured by
the CPU path is refused."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoints.import_checks import ImportRejection
from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from tests.engine.exactness import Outcome, Tally, check_near_ties, compare
from tests.engine.reuse_cases import SYSTEM, chat, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = EngineConfig(device="cuda", max_model_len=512, max_num_batched_tokens=512,
                      kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20)
FIRST = chat(SYSTEM, "Tell me about the river.")
SECOND = chat(SYSTEM, "And the mountain, briefly please?")


def test_a_checkpoint_moves_between_cuda_engines():
    source, target = LLMEngine(CONFIG), LLMEngine(CONFIG)
    assert source.scheduler.checkpoints.in_pass_capture
    first = run(source, "first", FIRST, "gpu-moved")
    exported = source.export_checkpoint((CONFIG.model_dir, "gpu-moved"), first.prompt[: first.boundary])
    assert exported is not None and all(t.device.type == "cpu" for t in exported.shards[0].tensors().values())
    assert target.import_checkpoint(exported).accepted
    served = run(target, "served", SECOND, "gpu-moved")
    scratch = run(target, "scratch", SECOND, "gpu-scratch")
    assert served.cached == first.boundary and scratch.cached == 0
    tally = Tally()
    compare(Outcome(served.tokens, served.logits, served.text, served.cached),
            Outcome(scratch.tokens, scratch.logits, scratch.text, scratch.cached), tally, "cuda import")
    check_near_ties(tally, "cuda import")
    assert run(source, "on-source", SECOND, "gpu-moved").tokens == served.tokens
    assert target.pool_usage().idle

    cpu = LLMEngine(EngineConfig(max_num_batched_tokens=40))
    cpu_first = run(cpu, "cpu-first", FIRST, "from-cpu")
    from_cpu = cpu.export_checkpoint((CONFIG.model_dir, "from-cpu"), cpu_first.prompt[: cpu_first.boundary])
    assert target.import_checkpoint(from_cpu).rejection is ImportRejection.MODEL
