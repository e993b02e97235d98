"""Continuous-batching scheduler: decides which tokens of which requests run in each step.

One progress rule (docs/design.md section 4): every request's num_computed_tokens chases its
num_tokens under a per-step token budget. Running requests go first (decode tokens and the
rest of chunked prefills), then waiting requests are admitted in arrival order while a state
slot and KV blocks are available. When a running request cannot get a block, the most
recently arrived running request is preempted: its cache is freed and it is requeued to be
recomputed from scratch.

A step the runner fails (docs/design.md section 4.1) is abandoned; its requests are requeued to
be recomputed and each runs alone ("suspect") until it samples a token again, so a request
that breaks every step it is in fails alone until it reaches MAX_FAILED_STEPS and is failed,
while the others go on (`requeue_failed`).

Checkpoints (docs/design.md sections 2 and 5) are the CheckpointPolicy's: the scheduler asks it
where a request's prefill chunks must end, which captures a chunk or a finish makes, what an
admitted request restores, and hands it each step's outcome to publish or drop.

Checkpoints held elsewhere, or about to be published here: before a request's admission the
scheduler asks PrefixWaits (engine/checkpoints/prefix_waits.py) whether it waits for a longer
prefix, fetched from a CheckpointSource or captured by a running request. One that waits leaves
the queue while the others step; when its wait ends (take_fetched) the engine imports what came
and the request goes back to the head of the queue, to restore it or, when nothing came, to
recompute.

Speculative decoding (docs/design.md section 10) is SpeculativeDecoding's: it says which
running requests wait for a pending token and what a decode drafts (a verification chunk of
1 + k tokens against the same budget), turns a verification's result into output tokens and
the commit of the kept position, and trims at a stop string.

Pure Python: the scheduler sees the cache only through CacheManager's return values.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cache.cache_manager import CacheManager, PoolUsage
from engine.checkpoints.policy import CheckpointPolicy
from engine.checkpoints.prefix_waits import PrefixWaits, WaitKind
from engine.checkpoints.sources import CheckpointSource, FetchedCheckpoint
from engine.interfaces.request import FinishReason, Request, RequestStatus, token_stop_reason
from engine.interfaces.step_io import RestoreOp, RunnerOutput, ScheduledChunk, SchedulerOutput
from engine.speculative.scheduling import SpeculativeDecoding

# A request that was in this many failed steps is failed: one that breaks every step fails its
# solo retries and reaches it; a transient fault rarely hits the same request this often.
MAX_FAILED_STEPS = 3


@dataclass
class SchedulerStats:
    """Counters since start (exported as metrics)."""

    preemptions: int = 0
    prompt_tokens_restored: int = 0  # at first admission, from checkpoints
    prompt_tokens_computed: int = 0  # at first admission, left to prefill
    failed_steps: int = 0  # steps the runner failed (requeue_failed)
    requests_failed: int = 0  # requests failed by requeue_failed
    fetches_started: int = 0  # requests that waited for a checkpoint source (PrefixWaits)
    fetches_restored: int = 0  # of those, ended with a checkpoint to import
    capture_waits: int = 0  # requests that waited for a capture in flight here (PrefixWaits)


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        checkpoints: CheckpointPolicy | None = None,
        speculation: SpeculativeDecoding | None = None,
        sources: Sequence[CheckpointSource] = (),
        capture_wait_s: float = 0.0,
    ) -> None:
        """checkpoints: the policy of the request-boundary checkpoints, reserving in `cache`;
        None turns checkpoints off. speculation: None turns speculative decoding off.
        sources: where checkpoints this engine does not hold may come from, asked in order
        (waits.add_source adds one later). capture_wait_s: how long a request may wait for a
        running request's capture of a longer shared prefix (0: never waits)."""
        self.cache = cache
        self.checkpoints = checkpoints if checkpoints is not None else CheckpointPolicy(cache)
        assert self.checkpoints.cache is cache, "the policy reserves in the scheduler's cache"
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self.suspects: set[str] = set()  # requeued after a failed step: run alone until they sample
        self.stats = SchedulerStats()
        self.speculation = speculation if speculation is not None else SpeculativeDecoding()
        # requests off the queue, waiting for a longer prefix (status FETCHING)
        self.waits = PrefixWaits(self.checkpoints, lambda: self.running, sources, capture_wait_s)

    # ----------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        """Queue `request`; adds to its pause_positions those the checkpoint policy needs."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.pause_positions = self.checkpoints.pause_positions(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(
        self, request_id: str, reason: FinishReason, num_output_tokens: int | None = None
    ) -> Request | None:
        """End a request (stop, length, abort or error) and free its cache.

        num_output_tokens: keep only that many output tokens (a stop string ended the text
        inside the tokens its last verification chunk kept: SpeculativeDecoding.trim).
        A running request that ends by stop or length reserves its response checkpoint first
        (never on abort or error), over the tokens kept. Returns the request, or None if it
        was unknown or already finished.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if num_output_tokens is not None:
            self.speculation.trim(request, num_output_tokens)
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            self.speculation.forget(request_id)
        self.speculation.finished(request_id)
        if request.status is RequestStatus.RUNNING:
            self.checkpoints.reserve_at_finish(request, reason)
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.FETCHING:
            self.waits.abandon(request_id)
        self._release_cache(request)
        self.suspects.discard(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._finished_since_last_step.append(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_work(self) -> bool:
        """Requests to run, or checkpoint captures and drops the runner has not seen yet."""
        return bool(self.requests) or self.has_pending_captures()

    def has_pending_captures(self) -> bool:
        """Checkpoint captures or drops the runner has not seen yet."""
        return bool(self.checkpoints.has_reserved_captures or self._finished_since_last_step)

    def usage(self) -> PoolUsage:
        return self.cache.usage(num_requests=len(self.requests))

    # ----------------------------------------------------------------- the step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks. Mutates block tables, state slots and the queues, and
        advances each scheduled request as if its chunk had run (Request's docstring): the
        next schedule() may come before this step's update_from_output()."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # reserved before this step: taken at its start (this step's chunks reserve for the next)
        captures = self.checkpoints.take_reserved()
        commits = self.speculation.take_commits()  # likewise: what the last update kept
        self.speculation.begin_step(len(self.running))

        restores: list[RestoreOp] = []
        suspect_chunk = self._schedule_suspect(budget, restores) if self.suspects else None
        if suspect_chunk is not None:
            chunks.append(suspect_chunk)  # alone: nothing else runs in this step
            budget = 0
        admit = not self.suspects  # a suspect that does not fit yet waits at the head

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.sampled_all_it_may or self.speculation.waits(request):
                index += 1  # its last token is in flight: it stops by length when that returns
                continue  # (or it drafts once the token is known)
            drafts = self.speculation.drafts(request, budget, self.max_model_len)
            num_new = 1 + len(drafts) if drafts else self._chunk_length(request, budget)
            if not self._grow_blocks_or_preempt(request, num_new):
                break  # the request itself was preempted; everything after it too
            chunks.append(self._make_chunk(request, num_new, drafts))
            budget -= num_new
            index += 1

        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if self.speculation.waits(self.waiting[0]):
                break  # preempted with its verification in flight: admitted once that returns
            if self._wait_for_prefix(self.waiting[0]):
                continue  # it waits for a longer checkpoint off the queue; the next one is asked
            chunk = self._admit(self.waiting[0], budget, restores)
            if chunk is None:
                break  # first come, first served: nothing overtakes the head of the queue
            chunks.append(chunk)
            budget -= len(chunk.token_ids)

        self.speculation.end_step(bool(chunks))
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        captures += self.checkpoints.take_in_pass()
        return SchedulerOutput(
            chunks=tuple(chunks),
            finished_request_ids=tuple(finished),
            captures=tuple(captures),
            restores=tuple(restores),
            dropped_bundle_ids=self.cache.take_dropped_bundles(),
            commits=commits,
        )

    def take_fetched(self, now: float) -> list[FetchedCheckpoint]:
        """The waits for a longer prefix that ended, or whose deadline is past `now`
        (PrefixWaits.take_ended). Their requests go back to the head of the waiting queue in
        the order they began waiting, to be admitted first once the engine has imported what
        came (LLMEngine.step)."""
        ended = self.waits.take_ended(now)
        for fetched in reversed(ended):
            request = self.requests[fetched.request_id]
            request.status = RequestStatus.WAITING
            self.stats.fetches_restored += fetched.checkpoint is not None
            self.waiting.appendleft(request)
        return ended

    def abandon_step(self, scheduler_output: SchedulerOutput) -> None:
        """The runner failed `scheduler_output`: none of it is known to have happened. The
        checkpoint policy drops its captures and those its chunks reserved (fail closed),
        unpins its restores and hands the bundles it was to free to the next step
        (CheckpointPolicy.abandon); the requests it was to forget are handed to the next step
        again. Requests are left as they were; the caller fails them."""
        self.checkpoints.abandon(scheduler_output)
        self._finished_since_last_step.extend(scheduler_output.finished_request_ids)

    def requeue_failed(self, steps: list[SchedulerOutput]) -> list[str]:
        """The runner failed steps[0]; steps[1:] were in flight after it. All were abandoned
        (abandon_step), so none of their tokens will arrive. Returns the ids of the requests to
        fail: those that have now been in MAX_FAILED_STEPS failed steps. Every other request
        of these steps is requeued, first in line, to be recomputed from its known tokens
        (pending ones dropped), and runs alone until it samples a token again (a suspect): a
        request that breaks every step it is in reaches the limit alone, the others go on.
        Outputs stay exact: a recomputed request continues from the same tokens."""
        self.stats.failed_steps += 1
        to_fail: list[str] = []
        requeued: list[Request] = []
        # a request whose commit (CommitOp) was in a failed step is recomputed too: its state
        # slot may not hold what its last verification kept
        in_steps = [op.request_id for step in steps for op in (*step.chunks, *step.commits)]
        for request_id in dict.fromkeys(in_steps):
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished while the step ran
            request.num_failed_steps += 1
            if request.num_failed_steps >= MAX_FAILED_STEPS:
                to_fail.append(request_id)
            else:
                requeued.append(request)
        for request in reversed(requeued):
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
                self._release_cache(request)
            elif request.status is RequestStatus.FETCHING:  # preempted, then waiting for a capture
                self.waits.abandon(request.request_id)
            else:  # preempted in the step that failed: already waiting
                self.waiting.remove(request)
            request.num_computed_tokens = 0
            request.num_pending_tokens = 0
            self.speculation.forget(request.request_id, in_flight_lost=True)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            self.suspects.add(request.request_id)
        self.stats.requests_failed += len(to_fail)
        return to_fail

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[Request]:
        """Settle the step's checkpoints, resolve the tokens it sampled (schedule() counted
        them pending) and stop on token-level rules. Steps are updated in the order they were
        scheduled.

        Returns the requests that received a new token this step (finished ones included,
        with status FINISHED and their finish_reason set). One exception: a verification
        chunk's request with stop strings that a token-level rule ends stays running, with
        held_finish set, since a stop string may end its text at an earlier kept token; the
        caller finishes it (finish_request with that earlier point, else held_finish) before
        the next schedule().
        """
        self.checkpoints.settle(scheduler_output, runner_output.confirmed_captures)

        updated: list[Request] = []
        for chunk in scheduler_output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or not chunk.sample:
                continue  # finished while the step ran, or sampled nothing
            if chunk.num_draft_tokens:
                verified = runner_output.verified_token_ids[chunk.request_id]
                self.speculation.accept(request, chunk, verified, self.max_model_len)
                self._free_blocks_past_computed(request)
            else:
                request.resolve_pending_token(runner_output.sampled_token_ids[chunk.request_id])
            self.suspects.discard(request.request_id)  # it ran alone and sampled: cleared
            reason = token_stop_reason(request, self.max_model_len)
            if reason is not None and chunk.num_draft_tokens and request.sampling.stop:
                request.held_finish = reason
            elif reason is not None:
                self.finish_request(request.request_id, reason)
            elif chunk.propose_drafts and request.status is RequestStatus.RUNNING:
                self.speculation.receive(request, runner_output.draft_proposals.get(chunk.request_id))
            updated.append(request)
        return updated

    # ----------------------------------------------------------------- helpers

    def _chunk_length(self, request: Request, budget: int, start: int | None = None) -> int:
        """Tokens to compute now from `start` (default: what is computed): the rest of the
        request, cut by the budget and by the next pause position so no chunk crosses it."""
        start = request.num_computed_tokens if start is None else start
        length = min(request.num_tokens - start, budget)
        pause = request.next_pause_after(start)
        if pause is not None and pause < start + length:
            length = pause - start
        return length

    def _make_chunk(self, request: Request, num_new: int, drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        """The chunk of tokens [computed, computed + num_new); advances the request past it
        (one more pending token if it samples) and has the checkpoint policy reserve the
        captures that fall due where it ends, to be taken at the start of the next step.
        With drafts, a verification chunk: the last token then the drafts (num_new is
        1 + len(drafts)); the request advances past its last token only, the drafts being
        settled by update_from_output (SpeculativeDecoding.accept)."""
        start = request.num_computed_tokens
        end = start + num_new - len(drafts)
        assert request.state_slot is not None
        chunk = ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_slice(start, end) + drafts,
            start_position=start,
            block_table=tuple(request.block_ids),
            state_slot=request.state_slot,
            reset_state=start == 0,
            # (a request re-admitted with its last token pending computes it, samples nothing)
            sample=end == request.num_tokens and not request.sampled_all_it_may,
            sampling=request.sampling,
            num_output_tokens=request.num_output_tokens + request.num_pending_tokens,
            capture_hidden=end in request.pause_positions,
            num_draft_tokens=len(drafts),
        )
        if chunk.sample:  # the worker drafts after it when the drafter runs there (MTP)
            chunk = replace(chunk, propose_drafts=self.speculation.proposals_wanted(request))
        if drafts:
            self.speculation.verification_scheduled(request.request_id)
        request.num_computed_tokens = end
        request.num_pending_tokens += int(chunk.sample)
        self.checkpoints.reserve_after_chunk(request, chunk)
        return chunk

    def _schedule_suspect(self, budget: int, restores: list[RestoreOp]) -> ScheduledChunk | None:
        """The next chunk of the first suspect (running ones first, then the waiting queue,
        where it is moved to the head and admitted), or None if it does not fit now."""
        for request in self.running:
            if request.request_id in self.suspects:
                if request.sampled_all_it_may:
                    return None  # its last token is in flight
                num_new = self._chunk_length(request, budget)
                if not self._grow_blocks_or_preempt(request, num_new):
                    return None
                return self._make_chunk(request, num_new)
        request = next(r for r in self.waiting if r.request_id in self.suspects)
        if len(self.running) >= self.max_num_seqs:
            return None
        self.waiting.remove(request)
        self.waiting.appendleft(request)
        return self._admit(request, budget, restores)

    def _grow_blocks_or_preempt(self, request: Request, num_new: int) -> bool:
        """Give a running request blocks for num_new more tokens, preempting the newest
        running requests until they fit. False if `request` itself had to be preempted."""
        needed_tokens = request.num_computed_tokens + num_new
        while True:
            new_blocks = self.cache.allocate_blocks(len(request.block_ids), needed_tokens, request.tenant)
            if new_blocks is not None:
                request.block_ids.extend(new_blocks)
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False

    def _wait_for_prefix(self, request: Request) -> bool:
        """Whether the head of the queue waits for a longer prefix (PrefixWaits.start); if so
        it leaves the queue, FETCHING, until take_fetched hands it back."""
        kind = self.waits.start(request)
        if kind is None:
            return False
        self.waiting.popleft()
        request.status = RequestStatus.FETCHING
        if kind is WaitKind.FETCH:
            self.stats.fetches_started += 1
        else:
            self.stats.capture_waits += 1
        return True

    def _admit(
        self, request: Request, budget: int, restores: list[RestoreOp]
    ) -> ScheduledChunk | None:
        """Move the head of the waiting queue to running if a slot and blocks fit, restoring
        the longest checkpoint of its tokens first. Returns its first chunk, or None (nothing
        changed but possibly evicted checkpoints) when it does not fit."""
        slot = self.cache.acquire_state_slot()
        if slot is None:
            return None
        hit = self.checkpoints.lookup(request)
        restored = hit.num_tokens if hit is not None else 0
        shared_blocks = list(hit.block_ids) if hit is not None else []
        num_new = self._chunk_length(request, budget, start=restored)
        fresh_blocks = self.cache.allocate_blocks(len(shared_blocks), restored + num_new, request.tenant)
        if fresh_blocks is None:
            if hit is not None:
                self.checkpoints.cancel_restore(hit)
            self.cache.release([], slot)
            return None
        self.cache.share_blocks(shared_blocks)
        self.waiting.popleft()
        request.state_slot = slot
        request.block_ids = shared_blocks + fresh_blocks
        request.num_computed_tokens = restored
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = min(restored, request.num_prompt_tokens)
            self.stats.prompt_tokens_restored += request.num_cached_tokens
            self.stats.prompt_tokens_computed += request.num_prompt_tokens - request.num_cached_tokens
        if hit is not None:
            restores.append(self.checkpoints.restore_op(hit, request))
        return self._make_chunk(request, num_new)

    def _free_blocks_past_computed(self, request: Request) -> None:
        """A running request's blocks past its computed tokens (those its verification chunk's
        rejected drafts were written to, never shared) go back to the cache."""
        if request.status is not RequestStatus.RUNNING:
            return
        needed = -(-request.num_computed_tokens // self.cache.block_size)
        surplus = request.block_ids[needed:]
        if surplus:
            del request.block_ids[needed:]
            self.cache.release(surplus, None)

    def _preempt(self, request: Request) -> None:
        """Free a running request's cache and put it first in line to be recomputed."""
        self.speculation.forget(request.request_id)
        self.running.remove(request)
        self._release_cache(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _release_cache(self, request: Request) -> None:
        if request.block_ids or request.state_slot is not None:
            self.cache.release(request.block_ids, request.state_slot)
        request.block_ids = []
        request.state_slot = None
