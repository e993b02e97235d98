"""Health: an LLM server replica reports unhealthy once one of its rank actors is dead.

Exercised with the replica's own probe (llm_server.replica_health) on a private worker group
and an engine in this process, so the session's application keeps running.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from deployments.llm_server import replica_health
from deployments.worker_group import RayWorkerExecutor, WorkerGroup
from engine.core.async_engine import AsyncLLMEngine
from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine


@pytest.mark.parametrize("world_size, killed_rank", [(1, 0), (2, 1)])
def test_replica_health_fails_when_a_rank_dies(ray_session, http, world_size, killed_rank):
    health = http.get("/health")  # the session's app, for contrast: healthy, decoding eagerly
    assert health.status_code == 200 and health.json() == {"status": "ok", "warming_up": False}
    config = EngineConfig(max_model_len=256, max_num_seqs=2, kv_cache_bytes=8 * 1024 * 1024,
                          state_cache_bytes=8 * 1024 * 1024, tensor_parallel_size=world_size)
    group = asyncio.run(WorkerGroup.start(config, num_cpus_per_rank=0.2))
    executor = RayWorkerExecutor(group.ranks)
    engine = AsyncLLMEngine(LLMEngine(config, executor=executor))
    try:
        asyncio.run(asyncio.wait_for(replica_health(engine, executor), 60))
        ray.kill(group.ranks[killed_rank])
        _wait_until_dead(group.ranks[killed_rank])
        with pytest.raises(ray.exceptions.RayActorError):
            asyncio.run(asyncio.wait_for(replica_health(engine, executor), 60))
    finally:
        engine.shutdown()
        group.shutdown()


def _wait_until_dead(actor, timeout_s: float = 60.0) -> None:
    """ray.kill only asks for the kill: until it lands, the actor still answers (a health
    check in that window passes, as a CI run on a loaded 2-core machine showed). Ping it
    until the call fails."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the killed actor still answered after {timeout_s} s")
