"""Scheduler and cache pools, pure Python: no model, no torch forward."""

from __future__ import annotations

import pytest

from cache.block_pool import BlockPool
from cache.cache_manager import CacheManager
from engine.interfaces.request import FinishReason, Request, RequestStatus
from engine.interfaces.sampling_params import InvalidRequestError, SamplingParams
from engine.core.scheduler import Scheduler
from engine.interfaces.step_io import RunnerOutput, SchedulerOutput

EOS = 2


def make_scheduler(num_blocks=64, num_slots=4, block_size=16, budget=64, max_seqs=4, max_len=4096):
    cache = CacheManager(num_blocks, num_slots, block_size)
    return Scheduler(cache, max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len)


def make_request(rid, prompt_len, max_tokens=4, pauses=(), **sampling):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, eos_token_ids=(EOS,), **sampling)
    return Request(rid, tuple(range(10, 10 + prompt_len)), params, pause_positions=pauses)


def run_step(scheduler: Scheduler, token_for=lambda rid: 7) -> SchedulerOutput:
    """Schedule and feed back a token for every sampling chunk."""
    out = scheduler.schedule()
    sampled = {c.request_id: token_for(c.request_id) for c in out.chunks if c.sample}
    scheduler.update_from_output(out, RunnerOutput(sampled_token_ids=sampled))
    return out


def test_prefill_chunks_stop_exactly_at_a_pause_position():
    scheduler = make_scheduler(num_blocks=1024, budget=4096, block_size=16, max_len=16384)
    scheduler.add_request(make_request("a", 9000, pauses=(3000,)))
    lengths = [len(run_step(scheduler).chunks[0].token_ids) for _ in range(3)]
    assert lengths == [3000, 4096, 1904]


def test_capture_flag_is_set_only_on_the_chunk_ending_at_the_pause():
    scheduler = make_scheduler(budget=64)
    scheduler.add_request(make_request("a", 100, pauses=(50,)))
    first, second = run_step(scheduler).chunks[0], run_step(scheduler).chunks[0]
    assert (len(first.token_ids), first.capture_hidden, first.sample) == (50, True, False)
    assert (second.start_position, len(second.token_ids), second.capture_hidden, second.sample) == (
        50, 50, False, True)


def test_decode_tokens_and_prefill_chunks_share_the_budget():
    scheduler = make_scheduler(budget=20)
    scheduler.add_request(make_request("a", 5, max_tokens=10))
    run_step(scheduler)  # a: prefill 5 and sample
    scheduler.add_request(make_request("b", 40))
    out = run_step(scheduler)
    sizes = {c.request_id: len(c.token_ids) for c in out.chunks}
    assert sizes == {"a": 1, "b": 19}
    assert out.num_tokens <= 20
    b_chunk = next(c for c in out.chunks if c.request_id == "b")
    assert b_chunk.reset_state and not b_chunk.sample


def test_chunks_carry_the_right_tokens_and_positions_through_decode():
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(make_request("a", 12, max_tokens=3))
    tokens = iter([100, 101, 102])
    seen = []
    while scheduler.has_unfinished_requests():
        out = run_step(scheduler, token_for=lambda rid: next(tokens))
        seen += [(c.start_position, c.token_ids) for c in out.chunks]
    prompt = tuple(range(10, 22))
    assert seen == [(0, prompt[:8]), (8, prompt[8:]), (12, (100,)), (13, (101,))]


def test_admission_waits_when_no_state_slot_is_free_and_keeps_arrival_order():
    scheduler = make_scheduler(num_slots=1, budget=64)
    scheduler.add_request(make_request("a", 4, max_tokens=2))
    scheduler.add_request(make_request("b", 4, max_tokens=2))
    out = run_step(scheduler)
    assert [c.request_id for c in out.chunks] == ["a"]
    assert scheduler.waiting[0].request_id == "b"
    run_step(scheduler)  # a finishes (max_tokens=2)
    assert scheduler.requests.keys() == {"b"}
    assert [c.request_id for c in run_step(scheduler).chunks] == ["b"]


def test_allocate_returns_none_and_changes_nothing_when_blocks_do_not_fit():
    pool = BlockPool(4)
    assert pool.allocate(5) is None
    assert pool.num_free == 4
    blocks = pool.allocate(3)
    pool.share(blocks[:1])
    pool.release(blocks)
    assert pool.num_free == 3 and pool.ref_count(blocks[0]) == 1
    pool.release(blocks[:1])
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.release(blocks[:1])


def test_preemption_frees_the_newest_request_and_recomputes_it_from_scratch():
    # 6 blocks of 4 tokens: two requests of 10 prompt tokens fit (3 blocks each) but not
    # once both grow past 12 tokens.
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64, num_slots=2)
    scheduler.add_request(make_request("old", 10, max_tokens=6))
    scheduler.add_request(make_request("new", 10, max_tokens=6))
    preempted_chunk = None
    for _ in range(4):
        out = run_step(scheduler)
        for chunk in out.chunks:
            if chunk.request_id == "new" and chunk.start_position == 0 and chunk.sample and \
                    len(chunk.token_ids) > 10:
                preempted_chunk = chunk
    new = scheduler.requests["new"]
    assert new.num_preemptions >= 1
    # "old" was never preempted and kept its progress
    assert scheduler.requests["old"].num_preemptions == 0
    while scheduler.has_unfinished_requests():
        out = run_step(scheduler)
        for chunk in out.chunks:
            if chunk.request_id == "new" and chunk.start_position == 0 and len(chunk.token_ids) > 10:
                preempted_chunk = chunk
    # the recompute covered the prompt plus the tokens generated before preemption
    assert preempted_chunk is not None and preempted_chunk.reset_state
    assert preempted_chunk.token_ids[:10] == tuple(range(10, 20))
    assert set(preempted_chunk.token_ids[10:]) == {7}
    usage = scheduler.usage()
    assert (usage.free_blocks, usage.free_state_slots) == (6, 2)


@pytest.mark.parametrize(
    "kwargs, tokens, expected_len, reason",
    [
        ({}, [5, EOS, 5], 2, FinishReason.STOP),
        ({"ignore_eos": True}, [5, EOS, 5, 5], 4, FinishReason.LENGTH),
        ({"min_tokens": 3}, [EOS, EOS, EOS, 5], 3, FinishReason.STOP),
        ({"stop_token_ids": (9,)}, [5, 9], 2, FinishReason.STOP),
        ({}, [5, 5, 5, 5, 5], 4, FinishReason.LENGTH),
    ],
)
def test_token_level_stop_rules(kwargs, tokens, expected_len, reason):
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=4, **kwargs)
    scheduler.add_request(request)
    feed = iter(tokens)
    while scheduler.has_unfinished_requests():
        run_step(scheduler, token_for=lambda rid: next(feed))
    assert request.status is RequestStatus.FINISHED
    assert (request.num_output_tokens, request.finish_reason) == (expected_len, reason)


def test_context_length_ends_a_request():
    scheduler = make_scheduler(max_len=8)
    request = make_request("a", 6, max_tokens=50)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert request.num_tokens == 8 and request.finish_reason is FinishReason.LENGTH


def test_abort_frees_cache_and_reports_the_id_to_the_runner():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 40, max_tokens=50))
    run_step(scheduler)
    assert scheduler.usage().free_blocks < 64
    scheduler.finish_request("a", FinishReason.ABORT)
    out = scheduler.schedule()
    assert out.finished_request_ids == ("a",) and not out.chunks
    assert (scheduler.usage().free_blocks, scheduler.usage().free_state_slots) == (64, 4)
    assert scheduler.finish_request("a", FinishReason.ABORT) is None


def test_duplicate_request_ids_are_refused():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4))
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("a", 4))


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1},
     {"min_tokens": 5, "max_tokens": 2}, {"stop": ("",)}],
)
def test_invalid_sampling_params_are_refused(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_many_requests_under_pressure_all_finish_and_pools_return_to_idle():
    import random

    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=24, block_size=4, budget=16, num_slots=3, max_seqs=3)
    for i in range(20):
        scheduler.add_request(make_request(f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 8)))
    steps = 0
    while scheduler.has_unfinished_requests():
        out = run_step(scheduler, token_for=lambda rid: 5)
        assert out.num_tokens <= 16
        steps += 1
        assert steps < 2000
    usage = scheduler.usage()
    assert (usage.free_blocks, usage.free_state_slots, usage.num_requests) == (24, 3, 0)
