"""The Ray executor under async scheduling: steps submitted to rank 0 before the ones before are
collected run one at a time, in the order submitted, on every rank, each reading its pending
tokens from what the step before sampled.

Exercised on a private worker group so the session's application keeps running.
"""

from __future__ import annotations

import asyncio

import pytest

from deployments.worker_group import RayWorkerExecutor, WorkerGroup
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.request import PENDING_TOKEN
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk, SchedulerOutput

BLOCKS = 4
PROMPT = (5, 17, 29, 41, 53, 65, 77)
STEPS = 6


def _step(slot: int, tokens, start: int, bulky: bool = False) -> SchedulerOutput:
    """bulky: the step's message is large enough (a block table padded with 60,000 unused
    entries) that Ray passes it through the object store, so it reaches rank 0 later than a
    small step sent after it."""
    blocks = tuple(range(slot * BLOCKS, (slot + 1) * BLOCKS)) + (0,) * (60_000 if bulky else 0)
    chunk = ScheduledChunk(
        request_id=f"r{slot}", token_ids=tuple(tokens), start_position=start, block_table=blocks,
        state_slot=slot, reset_state=start == 0, sample=True, sampling=SamplingParams(temperature=0),
    )
    return SchedulerOutput((chunk,))


@pytest.mark.parametrize("world_size", [1, 2])
def test_queued_steps_run_in_order_and_read_their_pending_tokens(ray_session, world_size):
    config = EngineConfig(max_model_len=64, max_num_seqs=2, kv_cache_bytes=8 * 1024 * 1024,
                          state_cache_bytes=8 * 1024 * 1024, tensor_parallel_size=world_size)
    group = asyncio.run(WorkerGroup.start(config, num_cpus_per_rank=0.2))
    executor = RayWorkerExecutor(group.ranks)
    try:
        # request 0, one step at a time, every token known
        expected, tokens = [], list(PROMPT)
        for _ in range(STEPS + 1):
            start = len(tokens) - (1 if expected else len(PROMPT))
            executor.submit(_step(0, tokens[start:], start))
            expected.append(executor.collect().sampled_token_ids["r0"])
            tokens.append(expected[-1])
        # request 1, the same prompt: every step queued before any is collected
        executor.submit(_step(1, PROMPT, 0))
        for i in range(STEPS):
            executor.submit(_step(1, (PENDING_TOKEN,), len(PROMPT) + i, bulky=i % 2 == 0))
        got = [executor.collect().sampled_token_ids["r1"] for _ in range(STEPS + 1)]
        assert got == expected
    finally:
        group.shutdown()


def test_after_a_failed_step_later_steps_run(ray_session):
    """Rank 0 fails one step while the next is already submitted. The engine abandons both and
    recomputes their requests; the steps after them run in order (the step index moves past a
    failure) and every request finishes normally."""
    import ray

    from deployments.worker_group import STEP_GROUP, STEP_THREADS, StepsInOrder
    from engine.core.llm_engine import LLMEngine
    from engine.execution.worker import Worker

    config = EngineConfig(max_num_seqs=4, kv_cache_bytes=8 * 1024 * 1024, state_cache_bytes=8 * 1024 * 1024)

    class FailsOnce(StepsInOrder):
        def __init__(self) -> None:
            super().__init__()
            self.worker, self.calls = Worker(config), 0

        def cache_capacity(self):
            return self.worker.cache_capacity()

        def execute(self, scheduler_output):
            self.calls += 1
            if self.calls == 4:
                raise RuntimeError("injected step failure")
            return self.worker.execute(scheduler_output)

    rank = ray.remote(concurrency_groups={STEP_GROUP: STEP_THREADS})(FailsOnce).options(
        max_concurrency=2, num_cpus=0.2).remote()
    engine = LLMEngine(config, executor=RayWorkerExecutor([rank]))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        reasons = []
        for i in range(12):
            engine.add_request(GenerationRequest(f"r{i}", [5 + i, 9, 11, 13, 17], params))
            reasons += [out.finish_reason for out in engine.step() if out.finished]
        while engine.has_unfinished_requests():
            reasons += [out.finish_reason for out in engine.step() if out.finished]
        # the requests of the two abandoned steps were recomputed: every request finished
        assert engine.stats().scheduler.failed_steps == 1
        assert sorted(reasons) == ["length"] * 12
    finally:
        ray.kill(rank)
