"""speculative_max_batch_size (engine/speculative/scheduling.py): a step that starts with more
running requests than the cap drafts for none of them, and they decode plainly, with async
scheduling's overlap; a request whose verification chunk is still in flight waits in any step,
since where its next token goes depends on how many of its drafts are accepted. Pure Python:
the scheduler with a drafter that always proposes the same tokens."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cache.cache_manager import CacheManager
from engine.engine_config import EngineConfig
from engine.interfaces.request import FinishReason, Request
from engine.interfaces.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.speculative.scheduling import SpeculativeDecoding
from engine.interfaces.step_io import RunnerOutput, SchedulerOutput

K = 2
DRAFT = 7  # the token the drafter always proposes


@dataclass(frozen=True)
class SameTokenDrafter:
    """Proposes DRAFT num_drafts times, whatever the request's tokens."""

    name: str = "same-token"
    on_worker: bool = False

    def draft(self, request, proposal, num_drafts):
        return (DRAFT,) * num_drafts


def make_scheduler(max_batch_size: int | None) -> Scheduler:
    speculation = SpeculativeDecoding(K, SameTokenDrafter(), max_batch_size)
    return Scheduler(CacheManager(64, 4, 16), max_num_batched_tokens=64, max_num_seqs=4,
                     max_model_len=4096, speculation=speculation)


def make_request(request_id: str) -> Request:
    return Request(request_id, tuple(range(10, 14)), SamplingParams(max_tokens=20, temperature=0))


def settle(scheduler: Scheduler, step: SchedulerOutput, accept_all: bool = True) -> None:
    """Feed `step` back: DRAFT at every position of a verification chunk (all its drafts
    accepted, DRAFT again as the bonus token) or 5 at its first (none accepted, 5 the bonus);
    5 for a chunk that samples one token."""
    verified, sampled = {}, {}
    for chunk in step.chunks:
        if chunk.num_draft_tokens:
            n = chunk.num_draft_tokens + 1
            verified[chunk.request_id] = [DRAFT] * n if accept_all else [5] + [DRAFT] * (n - 1)
        elif chunk.sample:
            sampled[chunk.request_id] = 5
    scheduler.update_from_output(step, RunnerOutput(sampled_token_ids=sampled, verified_token_ids=verified))


def drafts_by_request(step: SchedulerOutput) -> dict[str, int]:
    return {chunk.request_id: chunk.num_draft_tokens for chunk in step.chunks}


@pytest.mark.parametrize("cap, drafts_at_two", [(None, K), (2, K), (1, 0)])
def test_a_step_over_the_cap_drafts_for_no_request(cap, drafts_at_two):
    scheduler = make_scheduler(cap)
    for request_id in ("a", "b"):
        scheduler.add_request(make_request(request_id))
    settle(scheduler, scheduler.schedule())  # both prefill and sample their first token
    two_running = scheduler.schedule()
    assert drafts_by_request(two_running) == {"a": drafts_at_two, "b": drafts_at_two}
    settle(scheduler, two_running)
    scheduler.finish_request("b", FinishReason.ABORT)
    assert drafts_by_request(scheduler.schedule()) == {"a": K}  # one running: within every cap
    # the steps that started over the cap: the one with two running
    assert scheduler.speculation.stats.steps_over_batch_cap == int(drafts_at_two == 0)


def test_over_the_cap_requests_keep_the_async_overlap():
    """Over the cap a decoding request is scheduled again with its token still pending, as
    without speculation; within it, a speculating request waits for that token."""
    for cap, scheduled_again in ((1, {"a", "b"}), (None, set())):
        scheduler = make_scheduler(cap)
        for request_id in ("a", "b"):
            scheduler.add_request(make_request(request_id))
        settle(scheduler, scheduler.schedule())
        scheduler.schedule()  # in flight, not settled
        assert {chunk.request_id for chunk in scheduler.schedule().chunks} == scheduled_again


@pytest.mark.parametrize("accept_all", [True, False])
def test_a_verification_in_flight_waits_when_the_step_goes_over_the_cap(accept_all):
    scheduler = make_scheduler(1)
    scheduler.add_request(make_request("a"))
    settle(scheduler, scheduler.schedule())  # a prefills and samples
    verification = scheduler.schedule()  # a alone: within the cap, it drafts
    assert drafts_by_request(verification) == {"a": K}
    scheduler.add_request(make_request("b"))
    admit_b = scheduler.schedule()  # a's verification is in flight: only b, admitted
    assert drafts_by_request(admit_b) == {"b": 0}
    over_the_cap = scheduler.schedule()  # two running: nobody drafts, and a still waits
    assert drafts_by_request(over_the_cap) == {"b": 0}
    for step in (verification, admit_b, over_the_cap):
        settle(scheduler, step, accept_all)
    a = scheduler.requests["a"]
    kept = K + 1 if accept_all else 1
    assert a.num_output_tokens == 1 + kept and a.num_pending_tokens == 0
    next_step = {chunk.request_id: chunk for chunk in scheduler.schedule().chunks}
    # a decodes plainly from the token after the ones its verification kept
    assert next_step["a"].num_draft_tokens == 0
    assert next_step["a"].start_position == a.num_prompt_tokens + kept


def test_a_request_preempted_by_its_own_drafts_does_not_count_as_verifying():
    """b drafts, finds no block for them and is preempted (by its own growth): no verification
    chunk was made, so once re-admitted it keeps the overlap over the cap like everyone else."""
    speculation = SpeculativeDecoding(K, SameTokenDrafter(), 3)
    scheduler = Scheduler(CacheManager(8, 8, 8), max_num_batched_tokens=128, max_num_seqs=8,
                          max_model_len=4096, speculation=speculation)

    def request(request_id, prompt_len, temperature=0.0):
        return Request(request_id, tuple(range(10, 10 + prompt_len)),
                       SamplingParams(max_tokens=40, temperature=temperature))

    # 1 + 5 + 1 of the 8 blocks; n samples, so it never drafts
    for queued in (request("a", 7), request("n", 33, temperature=1.0), request("b", 7)):
        scheduler.add_request(queued)
    settle(scheduler, scheduler.schedule())
    # a takes the last block for its drafts; b finds none and is preempted, then re-admitted
    # in the same step to recompute its tokens (no drafts)
    within_the_cap = scheduler.schedule()
    assert drafts_by_request(within_the_cap) == {"a": K, "n": 0, "b": 0} and scheduler.stats.preemptions == 1
    scheduler.finish_request("n", FinishReason.ABORT)
    for request_id in ("c1", "c2", "c3"):
        scheduler.add_request(request(request_id, 1))
    admitting = scheduler.schedule()
    settle(scheduler, within_the_cap)
    over_the_cap = scheduler.schedule()  # five running
    settle(scheduler, admitting)
    again_over_the_cap = scheduler.schedule()  # b's token from the step before is still pending
    assert "b" in drafts_by_request(over_the_cap) and "b" in drafts_by_request(again_over_the_cap)
    assert set(drafts_by_request(again_over_the_cap).values()) == {0}


def test_a_failed_step_leaves_no_request_verifying():
    """The steps in flight are abandoned and their requests requeued: the verification chunk
    among them will never come back, so its request does not wait for it afterwards."""
    scheduler = make_scheduler(1)
    scheduler.add_request(make_request("a"))
    settle(scheduler, scheduler.schedule())
    verification = scheduler.schedule()  # a alone: within the cap, it drafts
    assert drafts_by_request(verification) == {"a": K}
    scheduler.add_request(make_request("b"))
    admit_b = scheduler.schedule()
    for step in (verification, admit_b):  # the runner failed the first; both are abandoned
        scheduler.abandon_step(step)
    assert scheduler.requeue_failed([verification, admit_b]) == []
    for request_id in ("a", "b"):  # each recomputes alone until it samples again
        step = scheduler.schedule()
        assert drafts_by_request(step) == {request_id: 0}
        settle(scheduler, step)
    scheduler.schedule()  # two running, over the cap: both decode, tokens in flight
    assert drafts_by_request(scheduler.schedule()) == {"a": 0, "b": 0}  # the overlap, a too


def test_only_steps_with_chunks_count_over_the_cap():
    scheduler = make_scheduler(1)
    for request_id in ("a", "b"):
        scheduler.add_request(make_request(request_id))
    settle(scheduler, scheduler.schedule())  # began with none running: within the cap
    first = scheduler.schedule()  # two running, both decode
    assert scheduler.speculation.stats.steps_over_batch_cap == 1
    for request_id in ("a", "b"):
        scheduler.requests[request_id].sampling = SamplingParams(max_tokens=2, temperature=0)
    nothing = scheduler.schedule()  # both have sampled all they may: nothing to run
    assert not nothing.chunks and scheduler.speculation.stats.steps_over_batch_cap == 1
    settle(scheduler, first)


@pytest.mark.parametrize("cap", [0, -1, True, 2.5])
def test_the_cap_is_refused_unless_a_positive_integer(cap):
    with pytest.raises(ValueError, match="speculative_max_batch_size must be an integer >= 1"):
        EngineConfig(speculative_max_batch_size=cap)
