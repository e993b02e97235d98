"""Request-boundary checkpoints in the in-process engine: what is captured, what a new request
restores, and that the worker's tensors follow the scheduler's ledger."""

from __future__ import annotations

import pytest

from deployments.prompts.instruction_boundary import BoundaryRejection, find_instruction_boundary
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from engine.core.scheduler import MAX_FAILED_STEPS
from engine.interfaces.step_io import RunnerOutput
from tests.engine.conversations import render
from tests.engine.reuse_cases import GREEDY, SYSTEM, chat, instruction_reuse, multi_turn, run


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(max_num_batched_tokens=40, max_num_seqs=8))


def test_a_new_user_message_restores_the_shared_instructions(engine):
    first, second, scratch = instruction_reuse(engine, "instruction-reuse")
    assert second.boundary is not None and second.boundary % 16 != 0
    assert first.cached == 0
    assert second.cached == second.boundary
    # only the rest of the prompt was computed
    assert sum(second.chunk_sizes) == len(second.prompt) - second.boundary + GREEDY.max_tokens - 1
    assert scratch.cached == 0 and scratch.tokens == second.tokens


def test_instruction_reuse_needs_the_instruction_slot():
    engine = LLMEngine(EngineConfig(checkpoint_slots=("prompt", "response")))
    run(engine, "a", chat(SYSTEM, "Tell me about the river."))
    assert run(engine, "b", chat(SYSTEM, "And the mountain, briefly please?")).cached == 0


def test_repeating_a_request_runs_no_prefill(engine):
    conversation = chat(SYSTEM, "Repeat after me: seven rivers.")
    first = run(engine, "r1", conversation, "repeat")
    second = run(engine, "r2", conversation, "repeat")
    assert second.cached == len(second.prompt)
    assert second.chunk_sizes[0] == 0  # the first step computed nothing: it sampled from the saved row
    assert second.tokens == first.tokens and second.text == first.text


def test_a_continued_conversation_restores_at_least_the_previous_prompt(engine):
    first, second, scratch = multi_turn(engine, "multi-turn")
    assert second.cached >= len(first.prompt)
    assert scratch.tokens == second.tokens


def test_checkpoints_of_one_salt_never_serve_another(engine):
    conversation = chat(SYSTEM, "Isolated?")
    run(engine, "n1", conversation, "tenant-a")
    assert run(engine, "n2", conversation, "tenant-b").cached == 0
    assert run(engine, "n3", conversation, "tenant-a").cached > 0


def test_no_instructions_means_no_boundary_and_no_instruction_checkpoint(engine):
    conversation = chat(None, "Just a user message.")
    prompt = render(engine.tokenizer, conversation)
    result = find_instruction_boundary(engine.tokenizer, conversation, prompt)
    assert result.position is None and result.rejection is BoundaryRejection.NO_LEADING_INSTRUCTIONS
    only_system = [{"role": "system", "content": "x"}]
    rejected = find_instruction_boundary(engine.tokenizer, only_system, render(engine.tokenizer, only_system))
    assert rejected.rejection is BoundaryRejection.ALL_INSTRUCTIONS


def test_worker_tensors_follow_the_ledger_through_eviction():
    probe = LLMEngine(EngineConfig())
    per_bundle = probe.executor.model.state_bytes_per_slot() + 16 * 1024
    engine = LLMEngine(EngineConfig(checkpoint_cache_bytes=3 * per_bundle))
    for i in range(6):
        run(engine, f"e{i}", chat(SYSTEM + str(i), f"question {i}"), "evict")
    stats = engine.stats()
    assert sum(c.evicted for c in stats.checkpoints.values()) > 0
    assert len(engine.executor.checkpoints) == stats.num_checkpoints <= 3
    assert engine.pool_usage().idle


class DroppingConfirmations:
    """An executor whose rank never confirms a capture (a failed copy): nothing may publish."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def cache_capacity(self):
        return self.worker.cache_capacity()

    def submit(self, scheduler_output) -> None:
        self.worker.submit(scheduler_output)

    def collect(self) -> RunnerOutput:
        output = self.worker.collect()
        output.confirmed_captures.clear()
        return output


def test_unconfirmed_captures_are_never_published(engine):
    failing = LLMEngine(EngineConfig(), executor=DroppingConfirmations(engine.executor.__class__(EngineConfig())))
    conversation = chat(SYSTEM, "Will this be cached?")
    run(failing, "u1", conversation)
    second = run(failing, "u2", conversation)
    stats = failing.stats()
    assert second.cached == 0
    assert sum(c.captured for c in stats.checkpoints.values()) == 0
    assert sum(c.dropped for c in stats.checkpoints.values()) >= 2
    assert stats.num_checkpoints == 0 and failing.pool_usage().idle


class FailingCaptureSteps:
    """An executor whose steps fail whenever they carry a capture or a restore (a worker error
    mid-step): the engine must not leak the step's checkpoint bookkeeping."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.failing = True

    def cache_capacity(self):
        return self.worker.cache_capacity()

    def submit(self, scheduler_output) -> None:
        if self.failing and (scheduler_output.captures or scheduler_output.restores):
            raise RuntimeError("injected worker failure")
        self.worker.submit(scheduler_output)

    def collect(self) -> RunnerOutput:
        return self.worker.collect()

    def shutdown(self) -> None:
        pass


def test_a_failed_step_drops_its_captures_and_releases_its_restores(engine):
    """Every step with a capture fails: the engine retries the request (each retry reserves and
    drops the capture again) until it has been in MAX_FAILED_STEPS failed steps, then fails it;
    nothing stays held."""
    executor = FailingCaptureSteps(engine.executor.__class__(EngineConfig()))
    flaky = LLMEngine(EngineConfig(), executor=executor)
    prompt = list(range(5, 60))
    flaky.add_request(GenerationRequest("f1", prompt, GREEDY, instruction_boundary=20))
    reasons = [out.finish_reason for out in drain(flaky) if out.finished]
    assert reasons == ["error"]
    usage = flaky.pool_usage()
    assert usage.idle and usage.num_checkpoints == 0
    assert flaky.stats().checkpoints["instruction"].dropped == MAX_FAILED_STEPS
    # The same endpoint can be captured again once the worker works.
    executor.failing = False
    first = run(flaky, "f2", chat(SYSTEM, "Tell me about the river."))
    second = run(flaky, "f3", chat(SYSTEM, "And the mountain, briefly please?"))
    assert second.cached == first.boundary > 0
    # A restore whose step fails leaves the bundle unpinned, so eviction can still take it.
    executor.failing = True
    flaky.add_request(GenerationRequest("f4", render(flaky.tokenizer, chat(SYSTEM, "Once more?")),
                                        GREEDY, instruction_boundary=first.boundary))
    assert [out.finish_reason for out in drain(flaky) if out.finished] == ["error"]
    ledger = flaky.scheduler.cache.ledger
    while len(ledger):  # every bundle, the restored one included, can be evicted: none pinned
        assert ledger.evict_one() is not None


def drain(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs