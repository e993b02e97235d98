"""Requests that arrive together and share a prefix (engine/checkpoints/in_flight.py): the
first one admitted captures the shared instructions; the others, with capture_wait_s on, wait
off the queue for that capture instead of computing the prefix again, then restore it, with
exactly the output each computes from scratch. With capture_wait_s 0 they all compute it. A
wait ends early when its producer stops running (aborted), and the waiter recomputes."""

from __future__ import annotations

from cache.cache_manager import BundleSizing, CacheManager
from cache.checkpoint_keys import Namespace
from deployments.prompts.instruction_boundary import find_instruction_boundary
from engine.checkpoints.in_flight import InFlightCaptures
from engine.checkpoints.policy import CheckpointPolicy
from engine.core.llm_engine import LLMEngine
from engine.core.scheduler import Scheduler
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.request import Request, RequestStatus
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import RunnerOutput
from cache.checkpoint_keys import CheckpointKind
from tests.engine.conversations import render
from tests.engine.reuse_cases import GREEDY, SYSTEM, chat, run
from tests.engine.test_checkpoint_sources import drain

# async scheduling on, as on cuda: a capture is published a step after the step that takes it
CONFIG = dict(max_num_batched_tokens=40, max_num_seqs=8, async_scheduling=True)
QUESTIONS = ("Tell me about the river.", "And the mountain, briefly please?",
             "Why seven?", "Which river is longest?")


def submit_together(engine: LLMEngine, salt: str) -> tuple[dict[str, list[int]], dict[str, int], int]:
    """The four questions under one system prompt, added before any step; returns each
    request's tokens and cached tokens, and the instruction boundary."""
    boundary = None
    for index, question in enumerate(QUESTIONS):
        conversation = chat(SYSTEM, question)
        prompt = render(engine.tokenizer, conversation)
        boundary = find_instruction_boundary(engine.tokenizer, conversation, prompt).position
        engine.add_request(GenerationRequest(f"{salt}{index}", prompt, GREEDY, cache_salt=salt,
                                             instruction_boundary=boundary))
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    drain(engine, outputs, cached)
    return outputs, cached, boundary


def test_requests_arriving_together_wait_for_the_first_ones_instruction_capture():
    engine = LLMEngine(EngineConfig(**CONFIG, capture_wait_s=30.0))
    outputs, cached, boundary = submit_together(engine, "together")
    assert boundary is not None and boundary > CONFIG["max_num_batched_tokens"]  # a chunked prefill
    assert cached["together0"] == 0
    assert [cached[f"together{i}"] for i in (1, 2, 3)] == [boundary] * 3
    stats = engine.stats().scheduler
    assert stats.capture_waits == 3 and stats.fetches_started == 0
    assert stats.prompt_tokens_restored == 3 * boundary
    for index, question in enumerate(QUESTIONS):  # exactly what each computes alone from scratch
        scratch = run(engine, f"scratch{index}", chat(SYSTEM, question), f"scratch{index}")
        assert scratch.cached == 0 and outputs[f"together{index}"] == scratch.tokens, question
    assert engine.pool_usage().idle


def test_with_capture_wait_off_requests_arriving_together_all_compute_the_instructions():
    engine = LLMEngine(EngineConfig(**CONFIG, capture_wait_s=0))
    _, cached, _ = submit_together(engine, "apart")
    assert engine.stats().scheduler.capture_waits == 0
    # the three admitted before the first one's capture was published compute the instructions
    assert [cached[f"apart{i}"] for i in (0, 1, 2)] == [0, 0, 0]


def test_a_waiter_whose_producer_is_aborted_restores_what_was_published_and_stays_exact():
    """Two requests with one prompt: the second waits for the first's prompt-end capture, still
    ahead of it; the first is aborted before it gets there, so the wait ends and the second
    restores the instruction checkpoint the first did publish, and computes the rest."""
    engine = LLMEngine(EngineConfig(**CONFIG, capture_wait_s=30.0))
    conversation = chat(SYSTEM, QUESTIONS[1])
    prompt = render(engine.tokenizer, conversation)
    boundary = find_instruction_boundary(engine.tokenizer, conversation, prompt).position
    for request_id in ("a0", "a1"):
        engine.add_request(GenerationRequest(request_id, prompt, GREEDY, cache_salt="abort",
                                             instruction_boundary=boundary))
    producer, waiter = engine.scheduler.requests["a0"], engine.scheduler.requests["a1"]
    for _ in range(5):  # a0's chunks fill the first steps' budget; then a1 is asked
        engine.step()
        if waiter.status is RequestStatus.FETCHING:
            break
    wait = engine.scheduler.waits.pending["a1"].fetch
    assert (wait.producer, wait.num_tokens) == (producer, len(prompt))
    assert producer.status is RequestStatus.RUNNING and producer.num_computed_tokens < len(prompt)
    engine.abort_request("a0")
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    drain(engine, outputs, cached)
    assert cached["a1"] == boundary and len(outputs["a1"]) == GREEDY.max_tokens
    scratch = run(engine, "scratch", conversation, "abort-scratch")
    assert outputs["a1"] == scratch.tokens
    assert engine.pool_usage().idle


class _Cache:
    block_size = 16


def _running(request_id: str, tokens: tuple[int, ...], namespace: Namespace, computed: int,
             boundary: int | None = None, breakpoints: tuple[int, ...] = ()) -> Request:
    request = Request(request_id, tokens, SamplingParams(max_tokens=1), namespace=namespace,
                      instruction_boundary=boundary, cache_breakpoints=breakpoints)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = computed
    return request


def test_in_flight_lookup_picks_the_longest_shared_capture_ahead_and_nothing_else():
    policy = CheckpointPolicy(_Cache(), frozenset(CheckpointKind))  # only its positions are asked
    ns, other_ns = Namespace("m", ""), Namespace("m", "salted")
    shared = tuple(range(100))
    producers = [
        _running("short", shared[:40] + (7,) * 10, ns, computed=10, boundary=40),
        _running("long", shared[:80] + (9,) * 10, ns, computed=20, boundary=40, breakpoints=(80,)),
        _running("salted", shared + (1,), other_ns, computed=0, boundary=90),
        _running("differs", (5,) + shared[1:], ns, computed=0, boundary=99),
    ]
    clock = iter([100.0, 200.0, 300.0]).__next__
    source = InFlightCaptures(policy, lambda: producers, max_wait_s=5.0, clock=clock)
    wait = source.lookup(ns, shared + (3,), have=0)
    assert wait is not None and wait.producer.request_id == "long" and wait.num_tokens == 80
    assert wait.deadline == 105.0 and wait.result() is None and not wait.done()
    assert source.lookup(ns, shared + (3,), have=80) is None  # nothing longer than what is held
    assert source.lookup(ns, shared[:60], have=0).num_tokens == 40  # the 80 is past its tokens
    # the producer computed past the prefix and no capture is pending: the wait is over
    wait.producer.num_computed_tokens = 85
    assert wait.done()
    wait.producer.num_computed_tokens = 20
    wait.producer.status = RequestStatus.WAITING  # preempted
    assert wait.done()


def test_a_failed_step_requeues_a_request_that_waits_for_its_own_pending_capture():
    """A request preempted after its chunk reserved a capture waits for that capture when it
    comes back (FETCHING); when the step with its chunk fails, requeue_failed takes it out of
    its wait and requeues it as a suspect, like any request of that step."""
    cache = CacheManager(64, 4, 16, checkpoint_bytes=1 << 20, sizing=BundleSizing(100, 10, 10))
    policy = CheckpointPolicy(cache, frozenset({CheckpointKind.PROMPT}))
    scheduler = Scheduler(cache, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=4096,
                          checkpoints=policy, capture_wait_s=30.0)
    request = Request("a", tuple(range(10, 30)), SamplingParams(max_tokens=2), namespace=Namespace("m", ""))
    scheduler.add_request(request)
    first = scheduler.schedule()  # the whole prompt: its prompt capture is reserved, pending
    assert [c.request_id for c in first.chunks] == ["a"] and policy.has_reserved_captures
    scheduler._preempt(request)
    second = scheduler.schedule()  # takes the capture; the request waits for it, off the queue
    assert request.status is RequestStatus.FETCHING and scheduler.stats.capture_waits == 1
    assert [c.num_tokens for c in second.captures] == [20]
    scheduler.abandon_step(first)
    scheduler.abandon_step(second)
    assert scheduler.requeue_failed([first, second]) == []
    assert request.status is RequestStatus.WAITING and list(scheduler.waiting) == [request]
    assert "a" in scheduler.suspects and not scheduler.waits.pending
    while scheduler.has_unfinished_requests():  # it runs again, alone, to its end
        out = scheduler.schedule()
        scheduler.update_from_output(out, RunnerOutput(
            sampled_token_ids={c.request_id: 7 for c in out.chunks if c.sample}))
    assert request.num_output_tokens == 2
