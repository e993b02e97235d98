"""CheckpointPolicy on its own, over a real CacheManager: which captures it reserves, how, what
it restores, and what it publishes or drops. Pure Python."""

from __future__ import annotations

import pytest

from cache.cache_manager import BundleSizing, CacheManager
from cache.checkpoint_keys import CheckpointKind
from engine.checkpoints.policy import CheckpointPolicy
from engine.interfaces.request import FinishReason, Request
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk, SchedulerOutput

ALL_KINDS = frozenset(CheckpointKind)
BLOCK = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0, eos_token_ids=(2,))


def make_policy(kinds=ALL_KINDS, in_pass=False, world_size=1, checkpoint_bytes=1 << 20):
    cache = CacheManager(64, 4, BLOCK, checkpoint_bytes=checkpoint_bytes, sizing=BundleSizing(100, 10, 10))
    return CheckpointPolicy(cache, kinds, world_size=world_size, in_pass_capture=in_pass)


def admitted(policy, rid, prompt_len=40, boundary=None, pauses=(), first=0, breakpoints=()):
    """A request as the scheduler leaves it once admitted: a state slot and blocks for its prompt."""
    request = Request(rid, tuple(range(10, 10 + prompt_len)), PARAMS, pause_positions=pauses,
                      instruction_boundary=boundary, cache_breakpoints=breakpoints)
    request.state_slot = policy.cache.acquire_state_slot()
    request.block_ids = policy.cache.allocate_blocks(0, prompt_len)
    request.num_computed_tokens = first
    return request


def chunk_of(request, start, end):
    """The chunk [start, end) of `request`, advancing it as Scheduler._make_chunk does."""
    chunk = ScheduledChunk(request.request_id, request.token_slice(start, end), start,
                           tuple(request.block_ids), request.state_slot, start == 0,
                           sample=end == request.num_tokens, sampling=request.sampling)
    request.num_computed_tokens = end
    return chunk


def confirm_all(captures):
    return {capture.bundle_id: frozenset({0}) for capture in captures}


# ---------------------------------------------------------------- where chunks end


@pytest.mark.parametrize(
    "kinds, in_pass, expected",
    [
        (ALL_KINDS, False, (10, 25)),  # cut: the chunk must end at the boundary
        (ALL_KINDS, True, (10,)),  # in-pass: the chunk is not cut there
        (frozenset({CheckpointKind.PROMPT}), False, (10,)),  # instruction checkpoints off
    ],
)
def test_the_instruction_boundary_is_a_pause_only_when_captured_by_cutting(kinds, in_pass, expected):
    policy = make_policy(kinds, in_pass=in_pass)
    request = admitted(policy, "a", boundary=25, pauses=(10,))
    assert policy.pause_positions(request) == expected
    assert request.pause_positions == (10,)  # asked, not changed


@pytest.mark.parametrize("in_pass", [False, True])
@pytest.mark.parametrize("kinds, expected", [
    (ALL_KINDS, (12, 30)),  # always cut, in-pass capture or not
    (ALL_KINDS - {CheckpointKind.BREAKPOINT}, ()),  # breakpoint checkpoints off: ignored
])
def test_cache_breakpoints_are_pauses_when_breakpoint_checkpoints_are_on(kinds, expected, in_pass):
    policy = make_policy(kinds - {CheckpointKind.INSTRUCTION}, in_pass=in_pass)
    assert policy.pause_positions(admitted(policy, "a", breakpoints=(12, 30), boundary=20)) == expected


def test_no_boundary_adds_no_pause():
    policy = make_policy()
    assert policy.pause_positions(admitted(policy, "a", pauses=(30, 5))) == (5, 30)


# ---------------------------------------------------------------- captures after a chunk


def test_captures_fall_due_at_the_boundary_and_the_prompt_end_for_the_next_step():
    policy = make_policy()
    request = admitted(policy, "a", prompt_len=40, boundary=20)
    policy.reserve_after_chunk(request, chunk_of(request, 0, 10))
    assert not policy.has_reserved_captures  # the chunk ends at neither
    policy.reserve_after_chunk(request, chunk_of(request, 10, 20))
    policy.reserve_after_chunk(request, chunk_of(request, 20, 40))
    captures = policy.take_reserved()
    assert [(c.num_tokens, c.in_pass, c.request_id) for c in captures] == [(20, False, "a"), (40, False, "a")]
    assert captures[0].tail_block == request.block_ids[1]  # 20 % 16: the partial block
    assert captures[1].tail_block == request.block_ids[2]
    assert captures[0].state_slot == request.state_slot
    assert policy.take_reserved() == [] and not policy.has_reserved_captures
    ledger = policy.cache.ledger
    assert [ledger.get(c.bundle_id).kind for c in captures] == [CheckpointKind.INSTRUCTION, CheckpointKind.PROMPT]


def test_breakpoint_captures_fall_due_where_chunks_end_at_them():
    policy = make_policy()
    request = admitted(policy, "a", prompt_len=40, boundary=8, breakpoints=(8, 20, 30))
    for start, end in ((0, 8), (8, 20), (20, 25), (25, 30), (30, 40)):
        policy.reserve_after_chunk(request, chunk_of(request, start, end))
    captures = policy.take_reserved()
    ledger = policy.cache.ledger
    # the breakpoint at the instruction boundary is captured once, as the instruction checkpoint
    assert [(c.num_tokens, c.in_pass, ledger.get(c.bundle_id).kind) for c in captures] == [
        (8, False, CheckpointKind.INSTRUCTION), (20, False, CheckpointKind.BREAKPOINT),
        (30, False, CheckpointKind.BREAKPOINT), (40, False, CheckpointKind.PROMPT)]
    assert captures[1].tail_block == request.block_ids[1]  # 20 % 16: the partial block

    off = make_policy(ALL_KINDS - {CheckpointKind.BREAKPOINT})
    request = admitted(off, "b", prompt_len=40, breakpoints=(20,))
    off.reserve_after_chunk(request, chunk_of(request, 0, 20))
    assert not off.has_reserved_captures


def test_a_chunk_of_no_tokens_reserves_nothing():
    policy = make_policy()
    request = admitted(policy, "a", prompt_len=32, first=32)
    policy.reserve_after_chunk(request, chunk_of(request, 32, 32))
    assert not policy.has_reserved_captures


def test_kinds_that_are_off_reserve_nothing():
    policy = make_policy(frozenset({CheckpointKind.RESPONSE}))
    request = admitted(policy, "a", prompt_len=40, boundary=20)
    policy.reserve_after_chunk(request, chunk_of(request, 0, 20))
    policy.reserve_after_chunk(request, chunk_of(request, 20, 40))
    assert policy.take_reserved() == [] and len(policy.cache.ledger) == 0


def test_a_pending_duplicate_endpoint_is_not_reserved_twice():
    policy = make_policy()
    first, second = admitted(policy, "a"), admitted(policy, "b")  # same tokens, same namespace
    policy.reserve_after_chunk(first, chunk_of(first, 0, 40))
    policy.reserve_after_chunk(second, chunk_of(second, 0, 40))
    (capture,) = policy.take_reserved()
    assert capture.request_id == "a" and len(policy.cache.ledger) == 1

    # still pending while the step that takes it runs: not reserved again
    third = admitted(policy, "c")
    policy.reserve_after_chunk(third, chunk_of(third, 0, 40))
    assert not policy.has_reserved_captures

    # dropped (unconfirmed): the endpoint may be reserved again
    policy.settle(SchedulerOutput((), captures=(capture,)), {})
    assert capture.bundle_id in policy.cache.take_dropped_bundles()
    fourth = admitted(policy, "d")
    policy.reserve_after_chunk(fourth, chunk_of(fourth, 0, 40))
    (again,) = policy.take_reserved()
    assert again.request_id == "d"

    # published: the cache refuses it from then on
    policy.settle(SchedulerOutput((), captures=(again,)), confirm_all([again]))
    assert policy.cache.ledger.has_checkpoint(("", ""), fourth.prompt_token_ids)
    fifth = admitted(policy, "e")
    policy.reserve_after_chunk(fifth, chunk_of(fifth, 0, 40))
    assert not policy.has_reserved_captures


def test_captures_over_the_checkpoint_budget_are_not_reserved():
    policy = make_policy(checkpoint_bytes=50)  # a bundle needs at least 100 + 10 bytes
    request = admitted(policy, "a", prompt_len=32)
    policy.reserve_after_chunk(request, chunk_of(request, 0, 32))
    assert not policy.has_reserved_captures


# ---------------------------------------------------------------- captures at finish


@pytest.mark.parametrize(
    "reason, captured",
    [(FinishReason.STOP, True), (FinishReason.LENGTH, True), (FinishReason.ABORT, False), (FinishReason.ERROR, False)],
)
def test_the_response_is_captured_only_on_stop_or_length(reason, captured):
    policy = make_policy()
    request = admitted(policy, "a", prompt_len=30)
    request.output_token_ids = [5, 6, 7]
    request.block_ids += policy.cache.allocate_blocks(len(request.block_ids), 33)
    request.num_computed_tokens = 33
    policy.reserve_at_finish(request, reason)
    captures = policy.take_reserved()
    assert [(c.num_tokens, c.in_pass) for c in captures] == ([(33, False)] if captured else [])
    if captured:
        assert policy.cache.ledger.get(captures[0].bundle_id).kind is CheckpointKind.RESPONSE


# ---------------------------------------------------------------- in-pass or cut


def test_a_chunk_crossing_the_boundary_captures_in_pass_only_with_the_capability():
    for in_pass in (True, False):
        policy = make_policy(in_pass=in_pass)
        request = admitted(policy, "a", prompt_len=40, boundary=25)
        chunk = chunk_of(request, 0, 40)
        policy.reserve_after_chunk(request, chunk)
        captures = policy.take_in_pass()
        if in_pass:
            (capture,) = captures
            assert (capture.num_tokens, capture.in_pass, capture.tail_block) == (25, True, request.block_ids[1])
        else:
            assert captures == []
        # the prompt end is a chunk end: captured by cutting, for the next step, either way
        assert [(c.num_tokens, c.in_pass) for c in policy.take_reserved()] == [(40, False)]


def test_a_boundary_at_a_chunk_end_or_outside_it_is_not_captured_in_pass():
    policy = make_policy(in_pass=True)
    request = admitted(policy, "a", prompt_len=40, boundary=20)
    ends_there, after_it = chunk_of(request, 0, 20), chunk_of(request, 20, 40)
    policy.reserve_after_chunk(request, ends_there)
    policy.reserve_after_chunk(request, after_it)
    assert policy.take_in_pass() == []
    assert [(c.num_tokens, c.in_pass) for c in policy.take_reserved()] == [(20, False), (40, False)]


# ---------------------------------------------------------------- restores and settlement


def published(policy, prompt_len=40):
    """A published prompt checkpoint of the standard tokens, its capturing request finished."""
    request = admitted(policy, "writer", prompt_len=prompt_len)
    policy.reserve_after_chunk(request, chunk_of(request, 0, prompt_len))
    (capture,) = policy.take_reserved()
    policy.settle(SchedulerOutput((), captures=(capture,)), confirm_all([capture]))
    policy.cache.release(request.block_ids, request.state_slot)
    return capture.bundle_id


def test_a_lookup_restores_the_checkpoint_and_its_pin_is_released_at_settle():
    policy = make_policy()
    bundle_id = published(policy, prompt_len=40)
    reader = Request("r", tuple(range(10, 60)), PARAMS)
    hit = policy.lookup(reader)
    assert hit is not None and (hit.bundle_id, hit.num_tokens) == (bundle_id, 40)
    assert policy.cache.ledger.get(bundle_id).pin_count == 1
    # admitted as the scheduler does it: the hit's full blocks first, then fresh ones
    reader.state_slot = policy.cache.acquire_state_slot()
    policy.cache.share_blocks(hit.block_ids)
    reader.block_ids = list(hit.block_ids) + policy.cache.allocate_blocks(len(hit.block_ids), 50)
    restore = policy.restore_op(hit, reader)
    assert (restore.bundle_id, restore.request_id, restore.state_slot) == (bundle_id, "r", reader.state_slot)
    assert restore.tail_block == reader.block_ids[2]  # 40 % 16: the tail goes to the first fresh block
    policy.settle(SchedulerOutput((), restores=(restore,)), {})
    assert policy.cache.ledger.get(bundle_id).pin_count == 0


def test_a_cancelled_restore_unpins_and_an_abandoned_one_too():
    policy = make_policy()
    bundle_id = published(policy)
    reader = Request("r", tuple(range(10, 60)), PARAMS)
    policy.cancel_restore(policy.lookup(reader))
    assert policy.cache.ledger.get(bundle_id).pin_count == 0
    hit = policy.lookup(reader)
    reader.state_slot = policy.cache.acquire_state_slot()
    reader.block_ids = list(hit.block_ids) + policy.cache.allocate_blocks(len(hit.block_ids), 50)
    policy.abandon(SchedulerOutput((), restores=(policy.restore_op(hit, reader),)))
    assert policy.cache.ledger.get(bundle_id).pin_count == 0


def test_with_checkpoints_off_a_lookup_finds_nothing():
    policy = make_policy()
    published(policy)
    off = CheckpointPolicy(policy.cache)
    assert off.lookup(Request("r", tuple(range(10, 60)), PARAMS)) is None


def test_a_capture_is_published_only_when_every_rank_confirmed_it():
    policy = make_policy(world_size=2)
    request = admitted(policy, "a", prompt_len=40)
    policy.reserve_after_chunk(request, chunk_of(request, 0, 40))
    (capture,) = policy.take_reserved()
    policy.settle(SchedulerOutput((), captures=(capture,)), {capture.bundle_id: frozenset({0})})
    assert not policy.cache.ledger.has_checkpoint(("", ""), request.prompt_token_ids)
    assert policy.cache.take_dropped_bundles() == (capture.bundle_id,)


def test_on_abandon_the_step_captures_and_those_its_chunks_reserved_are_dropped():
    policy = make_policy()
    taken = admitted(policy, "a", prompt_len=40)
    policy.reserve_after_chunk(taken, chunk_of(taken, 0, 40))
    (in_step,) = policy.take_reserved()  # what the failed step was to capture
    failed, other = admitted(policy, "b", prompt_len=20), admitted(policy, "c", prompt_len=24)
    failed_chunk = chunk_of(failed, 0, 20)
    policy.reserve_after_chunk(failed, failed_chunk)  # reserved by the failed step's chunk
    policy.reserve_after_chunk(other, chunk_of(other, 0, 24))  # by a step that did not fail
    step = SchedulerOutput((failed_chunk,), captures=(in_step,), dropped_bundle_ids=(99,))

    policy.abandon(step)

    (kept,) = policy.take_reserved()
    assert kept.request_id == "c"
    # 99 is handed back (the next step still tells the workers to free it), then the step's
    # capture and the one its chunk reserved are dropped
    handed_back, dropped_in_step, dropped_reserved = policy.cache.take_dropped_bundles()
    assert (handed_back, dropped_in_step) == (99, in_step.bundle_id)
    assert dropped_reserved not in (in_step.bundle_id, kept.bundle_id)
    ledger = policy.cache.ledger
    assert ledger.get(dropped_in_step) is None and ledger.get(dropped_reserved) is None
    assert len(ledger) == 1 and ledger.get(kept.bundle_id) is not None
    assert not ledger.has_checkpoint(("", ""), taken.prompt_token_ids)
    # the dropped endpoints are no longer pending: they may be reserved again
    again = admitted(policy, "d", prompt_len=20)
    policy.reserve_after_chunk(again, chunk_of(again, 0, 20))
    assert [c.request_id for c in policy.take_reserved()] == ["d"]



# ---------------------------------------------------------------- captures in flight


def test_capture_positions_and_the_longest_pending_capture_of_a_prefix():
    policy = make_policy()
    request = admitted(policy, "a", prompt_len=40, boundary=20, breakpoints=(30,))
    assert policy.capture_positions(request) == (20, 30, 40)
    assert make_policy(kinds=frozenset({CheckpointKind.PROMPT})).capture_positions(request) == (40,)
    tokens = request.prompt_token_ids
    policy.reserve_after_chunk(request, chunk_of(request, 0, 20))
    policy.reserve_after_chunk(request, chunk_of(request, 20, 30))
    assert policy.longest_pending(request.namespace, tokens + (1, 2)) == 30
    assert policy.longest_pending(request.namespace, tokens[:25]) == 20  # the 30 is not its prefix
    assert policy.longest_pending(request.namespace, (0,) + tokens[1:]) == 0
    assert policy.is_pending(request.namespace, tokens[:20]) and not policy.is_pending(request.namespace, tokens[:25])
    captures = policy.take_reserved()
    policy.settle(SchedulerOutput((), captures=tuple(captures)), confirm_all(captures))
    assert policy.longest_pending(request.namespace, tokens) == 0  # published: pending no more
    assert policy.longest(request) == 30
