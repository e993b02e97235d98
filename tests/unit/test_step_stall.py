"""A step that runs longer than STEP_STALL_S makes the replica unhealthy (a hang no collective
timeout catches), before any rank is even pinged."""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments import worker_group
from deployments.worker_group import RayWorkerExecutor


def test_a_stalled_step_fails_the_health_check(monkeypatch):
    monkeypatch.setattr(worker_group, "STEP_STALL_S", 5.0)
    executor = RayWorkerExecutor(ranks=[])
    asyncio.run(executor.check_health(timeout_s=1.0))  # no step in flight, no ranks: healthy
    executor._in_flight.append((None, time.monotonic() - 1.0))  # a step in flight for 1 s: still fine
    asyncio.run(executor.check_health(timeout_s=1.0))
    executor._in_flight.appendleft((None, time.monotonic() - 6.0))  # the oldest: 6 s
    with pytest.raises(TimeoutError, match="a step has run for over 5 s"):
        asyncio.run(executor.check_health(timeout_s=1.0))
