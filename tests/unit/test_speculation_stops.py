"""Speculation and the stop rules (engine/speculative/scheduling.py): ending a request inside
the tokens one verification kept (trim, Scheduler.update_from_output's held finish), and
min_tokens, below which a request drafts nothing (waits, proposals_wanted). Pure Python: the
scheduler with a drafter that always proposes the same tokens
(tests/unit/test_speculation_batch_cap.py), or the worker's proposals' drafter."""

from __future__ import annotations

from cache.cache_manager import CacheManager
from cache.checkpoint_keys import CheckpointKind
from engine.checkpoints.policy import CheckpointPolicy
from engine.interfaces.request import FinishReason, Request, RequestStatus
from engine.interfaces.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.speculative.scheduling import SpeculativeDecoding, WorkerProposals
from tests.unit.test_speculation_batch_cap import DRAFT, K, SameTokenDrafter, settle

BLOCK = 4


def make_scheduler(num_blocks: int) -> Scheduler:
    cache = CacheManager(num_blocks, 4, BLOCK, checkpoint_bytes=1 << 30)
    return Scheduler(cache, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=4096,
                     checkpoints=CheckpointPolicy(cache, kinds=frozenset({CheckpointKind.RESPONSE})),
                     speculation=SpeculativeDecoding(K, SameTokenDrafter()))


def greedy(request_id: str, prompt_len: int, **sampling) -> Request:
    return Request(request_id, tuple(range(10, 10 + prompt_len)),
                   SamplingParams(**{"max_tokens": 20, "temperature": 0, **sampling}))


def test_a_stop_string_in_the_verification_of_a_request_preempted_meanwhile():
    """a's verification is in flight when the next step preempts it (x needs its block): the
    verification's tokens still arrive, and a stop string among them ends a there. Its kept
    tokens are cut with no commit to move (a computes from 0 again), nothing raises, and
    the cut tokens are counted as trimmed."""
    scheduler = make_scheduler(num_blocks=3)
    scheduler.add_request(Request("x", (1, 2, 3), SamplingParams(max_tokens=20, temperature=1.0)))
    scheduler.add_request(greedy("a", 4))
    settle(scheduler, scheduler.schedule())
    verification = scheduler.schedule()
    assert {c.request_id: c.num_draft_tokens for c in verification.chunks} == {"x": 0, "a": K}
    scheduler.schedule()  # x grows into a's block: a is preempted, its verification in flight
    a = scheduler.requests["a"]
    assert a.status is RequestStatus.WAITING and scheduler.stats.preemptions == 1
    settle(scheduler, verification)
    assert a.output_token_ids == [5] + [DRAFT] * (K + 1)
    trimmed = scheduler.speculation.stats.draft_tokens_trimmed
    finished = scheduler.finish_request("a", FinishReason.STOP, 2)
    assert finished.output_token_ids == [5, DRAFT] and finished.status is RequestStatus.FINISHED
    assert finished.num_computed_tokens == 0
    assert scheduler.speculation.stats.draft_tokens_trimmed == trimmed + K
    assert "a" not in scheduler.requests and a not in scheduler.waiting


def test_a_token_stop_in_a_verification_waits_for_the_stop_strings():
    """The verification keeps 5, DRAFT, DRAFT and reaches max_tokens at the last: a request
    with stop strings stays running with the finish held (a stop string may end its text at
    an earlier token), and finishing it at the second token takes the response checkpoint
    there; without stop strings it finishes at once, its checkpoint over all it kept."""
    for stop, keep in (((".",), 2), ((), None)):
        scheduler = make_scheduler(num_blocks=16)
        scheduler.add_request(greedy("a", 4, max_tokens=1 + K + 1, stop=stop))
        settle(scheduler, scheduler.schedule())
        verification = scheduler.schedule()
        settle(scheduler, verification)
        a = verification.chunks[0]
        assert a.num_draft_tokens == K
        request = scheduler.requests.get("a")
        if keep is None:
            assert request is None  # finished by length
            kept = 1 + K + 1
        else:
            assert request.status is RequestStatus.RUNNING and request.held_finish is FinishReason.LENGTH
            scheduler.finish_request("a", FinishReason.STOP, keep)
            kept = keep
        [capture] = scheduler.schedule().captures
        # the response checkpoint: prompt + kept tokens but the last (never fed)
        assert capture.num_tokens == 4 + kept - 1


def test_a_request_below_min_tokens_keeps_the_async_overlap():
    """A speculating request drafts only once min_tokens are generated, so below that it does
    not wait for its pending token: it is scheduled again with the token in flight, as
    without speculation (one step ahead of the one settled, as the engine runs), until its
    next chunk may draft; then it waits, and that chunk drafts."""
    scheduler = make_scheduler(num_blocks=16)
    scheduler.add_request(greedy("a", 4, min_tokens=3))
    steps = [scheduler.schedule()]  # the prefill samples output token 1
    for _ in range(3):
        steps.append(scheduler.schedule())
        settle(scheduler, steps[-2])
    # tokens 2 and 3 sampled with the one before pending; then 3 tokens are sampled, so the
    # next chunk may draft and the request waits for them
    assert [len(step.chunks) for step in steps] == [1, 1, 1, 0]
    settle(scheduler, steps[-1])
    [verification] = scheduler.schedule().chunks
    assert verification.num_draft_tokens == K


def test_the_worker_is_asked_for_drafts_once_min_tokens_are_sampled():
    """With the drafter on the worker (MTP), a chunk asks it to propose drafts only if the
    token the chunk samples brings the request to min_tokens: the proposal is for the next
    chunk, which drafts nothing below it."""
    cache = CacheManager(16, 4, BLOCK)
    scheduler = Scheduler(cache, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=4096,
                          speculation=SpeculativeDecoding(K, WorkerProposals("mtp")))
    scheduler.add_request(greedy("a", 4, min_tokens=3))
    steps = [scheduler.schedule()]
    for _ in range(2):
        steps.append(scheduler.schedule())
        settle(scheduler, steps[-2])
    # the chunks sample output tokens 1, 2 and 3
    assert [step.chunks[0].propose_drafts for step in steps] == [0, 0, K]
