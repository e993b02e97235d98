"""A checkpoint moved between two engines whose tensor-parallel ranks are Ray actors
(RayWorkerExecutor.export_shards / import_shards, rank 0 gathering and scattering the shards):
the importing engine restores it and answers as from scratch.

Exercised on private worker groups, one at a time, so the session's application keeps running.
"""

from __future__ import annotations

import asyncio

import pytest

from deployments.worker_group import RayWorkerExecutor, WorkerGroup
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.reuse_cases import SYSTEM, chat, run

CONFIG = EngineConfig(max_num_batched_tokens=40, max_num_seqs=4, kv_cache_bytes=8 * 1024 * 1024,
                      state_cache_bytes=8 * 1024 * 1024, tensor_parallel_size=2)


def _engine_on_ray(group: WorkerGroup) -> LLMEngine:
    return LLMEngine(CONFIG, executor=RayWorkerExecutor(group.ranks))


@pytest.mark.timeout(600)
def test_a_checkpoint_moves_between_ray_worker_groups(ray_session):
    group = asyncio.run(WorkerGroup.start(CONFIG, num_cpus_per_rank=0.2))
    try:
        source = _engine_on_ray(group)
        first = run(source, "first", chat(SYSTEM, "Tell me about the river."), "ray-moved")
        exported = source.export_checkpoint((CONFIG.model_dir, "ray-moved"), first.prompt[: first.boundary])
    finally:
        group.shutdown()
    assert [shard.rank for shard in exported.shards] == [0, 1]

    group = asyncio.run(WorkerGroup.start(CONFIG, num_cpus_per_rank=0.2))
    try:
        target = _engine_on_ray(group)
        assert target.import_checkpoint(exported).accepted
        served = run(target, "served", chat(SYSTEM, "And the mountain, briefly please?"), "ray-moved")
        scratch = run(target, "scratch", chat(SYSTEM, "And the mountain, briefly please?"), "ray-scratch")
        assert served.cached == first.boundary and scratch.cached == 0
        assert served.tokens == scratch.tokens
        assert target.pool_usage().idle
    finally:
        group.shutdown()
