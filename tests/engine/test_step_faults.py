"""A step the executor fails (LLMEngine.step, Scheduler.requeue_failed): the request that fails
alone ends with an error, every other request is recomputed and ends exactly as it would have
without the fault, and nothing is left held.

The faults are injected by wrapping the in-process Worker: a collect that raises after the step
ran (an error on the way back), and a submit that raises for any step holding a given request
(a request that breaks every step it is in).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import FAILED_REQUEST_MESSAGE, LLMEngine
from engine.interfaces.sampling_params import SamplingParams
from engine.core.scheduler import MAX_FAILED_STEPS
from engine.interfaces.step_io import RunnerOutput, SchedulerOutput
from engine.execution.worker import Worker

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


class FaultyWorker:
    """The in-process worker with injected faults: every collect whose number is in
    `fail_collects` raises after the step ran; every submit of a step that `poisoned(step)`
    says yes to raises before it runs."""

    def __init__(self, config: EngineConfig, fail_collects=(), poisoned=lambda step: False) -> None:
        self.worker = Worker(config)
        self.fail_collects, self.poisoned = set(fail_collects), poisoned
        self.collects = self.failures = 0

    def cache_capacity(self):
        return self.worker.cache_capacity()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        if self.poisoned(scheduler_output):
            self.failures += 1
            raise RuntimeError("injected: this step cannot run")
        self.worker.submit(scheduler_output)

    def collect(self) -> RunnerOutput:
        self.collects += 1
        output = self.worker.collect()
        if self.collects in self.fail_collects:
            self.failures += 1
            raise RuntimeError("injected: lost on the way back")
        return output

    def shutdown(self) -> None:
        pass


def holds(request_id: str):
    return lambda step: any(chunk.request_id == request_id for chunk in step.chunks)


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (count,), generator=generator).tolist()
    return [torch.randint(5, vocab, (n,), generator=generator).tolist() for n in lengths]


def run(engine: LLMEngine, requests: dict[str, list[int]], sampling=lambda request_id: GREEDY) -> dict[str, tuple]:
    """Add every request, step to the end: id -> (token ids, finish reason, error)."""
    for request_id, prompt in requests.items():
        engine.add_request(GenerationRequest(request_id, prompt, sampling(request_id)))
    tokens = {rid: [] for rid in requests}
    ends = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.error)
    return {rid: (tokens[rid], *ends[rid]) for rid in requests}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def config(request) -> EngineConfig:
    return EngineConfig(max_num_seqs=4, async_scheduling=request.param)


@pytest.fixture(scope="module")
def requests(config) -> dict[str, list[int]]:
    vocab = LLMEngine(config).vocab_size
    return {f"r{i}": prompt for i, prompt in enumerate(prompts(6, vocab, seed=9))}


@pytest.fixture(scope="module")
def expected(config, requests):
    return run(LLMEngine(config), requests)


def test_a_transient_failure_loses_no_request(config, requests, expected):
    """Collects 3 and 9 fail (prefill and decode steps of several requests): every request
    is recomputed and ends as on a healthy engine."""
    executor = FaultyWorker(config, fail_collects=(3, 9))
    engine = LLMEngine(config, executor=executor)
    assert run(engine, requests) == expected
    assert executor.failures == 2 and engine.stats().scheduler.failed_steps == 2
    assert engine.stats().scheduler.requests_failed == 0
    assert engine.pool_usage().idle


def test_seeded_sampling_draws_the_same_tokens_after_a_recovery(config, requests):
    """A failed step drew tokens that were thrown away; the recomputed requests draw again and
    must get what a healthy engine draws (the sampler's draw depends on seed and index)."""
    seeded = lambda request_id: SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True,
                                               seed=int(request_id[1:]) + 100)
    expected = run(LLMEngine(config), requests, seeded)
    engine = LLMEngine(config, executor=FaultyWorker(config, fail_collects=(4, 8)))
    assert run(engine, requests, seeded) == expected
    assert engine.stats().scheduler.failed_steps == 2


def test_the_request_that_breaks_its_steps_fails_alone(config, requests, expected):
    poison = prompts(1, LLMEngine(config).vocab_size, seed=3)[0]
    executor = FaultyWorker(config, poisoned=holds("poison"))
    engine = LLMEngine(config, executor=executor)
    results = run(engine, {**requests, "poison": poison})
    assert results.pop("poison") == ([], "error", FAILED_REQUEST_MESSAGE)
    assert results == expected  # every other request as if the poison had never come
    assert engine.stats().scheduler.requests_failed == 1
    assert engine.pool_usage().idle


def test_a_fault_that_needs_company_ends_after_max_failed_steps(config, requests, expected):
    """A request whose steps fail only when it shares them never fails alone, and neither do
    the requests that share them: recovery cannot tell them apart. After MAX_FAILED_STEPS
    failed steps they are failed (the recovery ends); every other request is untouched."""
    company = FaultyWorker(config, poisoned=lambda step: holds("needy")(step)
                           and len({c.request_id for c in step.chunks}) > 1)
    engine = LLMEngine(config, executor=company)
    needy = prompts(1, engine.vocab_size, seed=4)[0]
    results = run(engine, {**requests, "needy": needy})
    assert results.pop("needy")[1:] == ("error", FAILED_REQUEST_MESSAGE)
    failed = {rid for rid, result in results.items() if result[1] == "error"}
    assert len(failed) < len(results)
    assert {rid: r for rid, r in results.items() if rid not in failed} == {
        rid: r for rid, r in expected.items() if rid not in failed}
    assert company.failures == MAX_FAILED_STEPS and engine.pool_usage().idle


def test_recovery_keeps_checkpoint_reuse_exact():
    """The checkpoint exactness workload (instruction reuse, multi-turn, repeats, each request
    checked against its from-scratch twin) with every 40th collect failing: the same outcomes
    as without faults, and no checkpoint captured in a failed step is ever restored. (Spaced so
    that no request is in MAX_FAILED_STEPS of them: those would be failed.)"""
    from tests.engine.exactness import Tally, run_workload, tight_config

    outcomes = {}
    for fail_every in (0, 40):
        config = dataclasses.replace(tight_config(), async_scheduling=True)
        faults = range(7, 100_000, fail_every) if fail_every else ()
        executor = FaultyWorker(config, fail_collects=faults)
        engine = LLMEngine(config, executor=executor)
        outcomes[fail_every] = run_workload(engine, seed=5, num_requests=16, tally=Tally())
        assert engine.stats().scheduler.requests_failed == 0
        assert engine.pool_usage().num_requests == 0
    assert executor.failures >= 2
    assert {k: v.token_ids for k, v in outcomes[40].items()} == {
        k: v.token_ids for k, v in outcomes[0].items()}
