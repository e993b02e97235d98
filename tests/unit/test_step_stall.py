"""A step that runs longer than STEP_STALL_S makes the replica unhealthy (a hang no collective
timeout catches), whether the model runs in the replica or in rank actors: the engine's step
loop itself reports how long its current step has run."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from deployments import llm_server
from deployments.llm_server import replica_health
from engine.core.async_engine import AsyncLLMEngine
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from engine.interfaces.sampling_params import SamplingParams
from engine.execution.worker import Worker

CONFIG = EngineConfig(max_model_len=128, max_num_seqs=2, kv_cache_bytes=4 << 20,
                      state_cache_bytes=4 << 20, checkpoint_slots=())


class StallingWorker:
    """The in-process Worker, except that collect() waits until `release` is set."""

    def __init__(self) -> None:
        self.worker, self.release, self.collecting = Worker(CONFIG), threading.Event(), threading.Event()

    def cache_capacity(self):
        return self.worker.cache_capacity()

    def submit(self, scheduler_output) -> None:
        self.worker.submit(scheduler_output)

    def collect(self):
        self.collecting.set()
        self.release.wait()
        return self.worker.collect()

    def shutdown(self) -> None:
        pass


def test_a_stalled_step_fails_the_health_check(monkeypatch):
    monkeypatch.setattr(llm_server, "STEP_STALL_S", 0.5)
    executor = StallingWorker()
    engine = AsyncLLMEngine(LLMEngine(CONFIG, executor=executor))
    try:
        asyncio.run(replica_health(engine, None))  # idle: healthy
        assert engine.step_running_for() == 0.0

        async def generate():
            request = GenerationRequest("r", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
            return [out async for out in engine.generate(request)]

        runner = threading.Thread(target=lambda: asyncio.run(generate()), daemon=True)
        runner.start()
        assert executor.collecting.wait(30)  # the step loop is inside a step that does not end
        time.sleep(0.6)
        assert engine.step_running_for() > 0.5
        with pytest.raises(TimeoutError, match="a step has run for over"):
            asyncio.run(replica_health(engine, None))
        executor.release.set()  # the step ends: healthy again, and the request finishes
        runner.join(30)
        assert not runner.is_alive()
        # The request's last output can reach it while the loop still collects the step it
        # had in flight behind it (a step of well under a millisecond now): wait for idle.
        deadline = time.monotonic() + 10
        while engine.step_running_for() > 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.step_running_for() == 0.0
        asyncio.run(replica_health(engine, None))
    finally:
        executor.release.set()
        engine.shutdown()
