"""Scheduler with in-pass capture (GPU path): a prefill chunk crossing the instruction boundary
is not cut, and the instruction capture rides in the same step as CaptureOp.in_pass; with the
flag off the chunk is cut there as before. Pure Python."""

from __future__ import annotations

from cache.cache_manager import BundleSizing, CacheManager
from cache.checkpoint_keys import CheckpointKind
from engine.checkpoints.policy import CheckpointPolicy
from engine.interfaces.request import Request
from engine.interfaces.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.interfaces.step_io import RunnerOutput

KINDS = frozenset({CheckpointKind.INSTRUCTION, CheckpointKind.PROMPT})


def _scheduler(in_pass: bool, budget=4096) -> Scheduler:
    cache = CacheManager(1024, 4, 16, checkpoint_bytes=1 << 20, sizing=BundleSizing(100, 10, 10))
    return Scheduler(cache, max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=16384,
                     checkpoints=CheckpointPolicy(cache, KINDS, in_pass_capture=in_pass))


def _request(boundary: int, prompt_len=300, pauses=()) -> Request:
    params = SamplingParams(max_tokens=2, temperature=0, eos_token_ids=(2,))
    # Scheduler.add_request adds the boundary to the pauses where the policy cuts there
    return Request("a", tuple(range(10, 10 + prompt_len)), params, pause_positions=pauses,
                   instruction_boundary=boundary)


def _step(scheduler: Scheduler, confirm=True):
    out = scheduler.schedule()
    sampled = {c.request_id: 7 for c in out.chunks if c.sample}
    bundles = {c.bundle_id: frozenset({0}) for c in out.captures} if confirm else {}
    scheduler.update_from_output(out, RunnerOutput(sampled_token_ids=sampled, confirmed_captures=bundles))
    return out


def test_in_pass_does_not_cut_and_captures_in_the_same_step():
    scheduler = _scheduler(in_pass=True)
    scheduler.add_request(_request(boundary=203))
    first = _step(scheduler)
    assert [len(c.token_ids) for c in first.chunks] == [300]
    (capture,) = first.captures
    assert capture.in_pass and capture.num_tokens == 203 and capture.request_id == "a"
    assert capture.tail_block == first.chunks[0].block_table[203 // 16]
    second = _step(scheduler)  # the prompt capture at 300 comes from the previous step, as before
    assert [(c.num_tokens, c.in_pass) for c in second.captures] == [(300, False)]
    assert scheduler.cache.lookup(("", ""), tuple(range(10, 10 + 203)) + (5,)).num_tokens == 203


def test_split_path_unchanged_without_the_flag():
    scheduler = _scheduler(in_pass=False)
    scheduler.add_request(_request(boundary=203))
    first, second = _step(scheduler), _step(scheduler)
    assert [len(c.token_ids) for c in first.chunks] == [203] and first.captures == ()
    assert [(c.num_tokens, c.in_pass) for c in second.captures] == [(203, False)]


def test_other_pauses_still_cut():
    scheduler = _scheduler(in_pass=True, budget=100)
    scheduler.add_request(_request(boundary=200, pauses=(150,)))
    steps = [_step(scheduler) for _ in range(3)]
    assert [len(o.chunks[0].token_ids) for o in steps] == [100, 50, 100]
    assert steps[0].captures == () and steps[1].captures == ()
    assert [(c.num_tokens, c.in_pass) for c in steps[2].captures] == [(200, True)]


def test_a_boundary_at_a_chunk_end_is_captured_the_split_way():
    scheduler = _scheduler(in_pass=True, budget=100)
    scheduler.add_request(_request(boundary=200))
    steps = [_step(scheduler) for _ in range(3)]
    assert [len(o.chunks[0].token_ids) for o in steps] == [100, 100, 100]
    assert steps[0].captures == () and steps[1].captures == ()
    assert [(c.num_tokens, c.in_pass) for c in steps[2].captures] == [(200, False)]
