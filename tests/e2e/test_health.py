"""Health: the scheduler actor reports unhealthy once its worker actor is dead.

Exercised on a second, private pair of actors so the session's application keeps running.
"""

from __future__ import annotations

import pytest
import ray

from deployments.llm_server import SchedulerActor
from engine.config import EngineConfig
from engine.worker import Worker


def test_scheduler_health_fails_when_worker_dies(ray_session, http):
    assert http.get("/health").status_code == 200  # the session's app, for contrast
    config = EngineConfig(max_model_len=256, max_num_seqs=2, kv_cache_bytes=8 * 1024 * 1024,
                          state_cache_bytes=8 * 1024 * 1024)
    worker = ray.remote(Worker).options(num_cpus=0.5).remote(config)
    scheduler = SchedulerActor.options(num_cpus=0.1).remote(config, worker)
    try:
        ray.get(scheduler.check_health.remote(), timeout=60)
        ray.kill(worker)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(scheduler.check_health.remote(), timeout=60)
    finally:
        ray.kill(scheduler)
        ray.kill(worker)
