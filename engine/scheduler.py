"""Continuous-batching scheduler: decides which tokens of which requests run in each step.

One progress rule (DESIGN.md section 4): every request's num_computed_tokens chases its
num_tokens under a per-step token budget. Running requests go first (decode tokens and the
rest of chunked prefills), then waiting requests are admitted in arrival order while a state
slot and KV blocks are available. When a running request cannot get a block, the most
recently arrived running request is preempted: its cache is freed and it is requeued to be
recomputed from scratch.

Checkpoints (DESIGN.md sections 2 and 5): admission restores the longest checkpoint that is an
exact prefix of the request's tokens; a request that stands exactly at its instruction boundary
or at the end of its prompt after a step, or that finishes by stop or length, reserves a
checkpoint there. The capture is taken by the runner at the start of the next step (before any
restore or forward can overwrite what it copies) and published once the runner confirms it.

Pure Python: the scheduler sees the cache only through CacheManager's return values.
"""

from __future__ import annotations

from collections import deque

from dataclasses import dataclass

from cache.cache_manager import CacheManager, PoolUsage
from cache.checkpoint_ledger import CheckpointKind
from engine.request import PENDING_TOKEN, FinishReason, Request, RequestStatus, token_stop_reason
from engine.step_io import CaptureOp, RestoreOp, RunnerOutput, ScheduledChunk, SchedulerOutput


@dataclass
class SchedulerStats:
    """Counters since start (exported as metrics)."""

    preemptions: int = 0
    prompt_tokens_restored: int = 0  # at first admission, from checkpoints
    prompt_tokens_computed: int = 0  # at first admission, left to prefill


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        checkpoint_kinds: frozenset[CheckpointKind] = frozenset(),
        world_size: int = 1,
        in_pass_capture: bool = False,
    ) -> None:
        self.cache = cache
        # For workers on the CUDA path only: a prefill chunk is not cut at the instruction
        # boundary; the worker captures there inside the chunk's forward pass (CaptureOp.in_pass).
        self.in_pass_capture = in_pass_capture
        self.checkpoint_kinds = checkpoint_kinds
        self.world_size = world_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self._captures: list[CaptureOp] = []  # reserved; taken at the start of the next step
        self._pending_endpoints: dict[int, tuple] = {}  # bundle id -> (namespace, tokens) until published
        self.stats = SchedulerStats()

    # ----------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request (stop, length, abort or error) and free its cache.

        A running request that ends by stop or length reserves its response checkpoint first
        (never on abort or error). Returns the request, or None if it was unknown or already
        finished.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            if reason in (FinishReason.STOP, FinishReason.LENGTH):
                self._reserve_capture(request, CheckpointKind.RESPONSE)
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release_cache(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._finished_since_last_step.append(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_work(self) -> bool:
        """Requests to run, or checkpoint captures and drops the runner has not seen yet."""
        return bool(self.requests or self._captures or self._finished_since_last_step)

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
        captures, self._captures = self._captures, []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.sampled_all_it_may:
                index += 1  # its last token is in flight: it stops by length when that returns
                continue
            num_new = self._chunk_length(request, budget)
            if not self._grow_blocks_or_preempt(request, num_new):
                break  # the request itself was preempted; everything after it too
            chunks.append(self._make_chunk(request, num_new))
            budget -= num_new
            index += 1

        restores: list[RestoreOp] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            chunk = self._admit(self.waiting[0], budget, restores)
            if chunk is None:
                break  # first come, first served: nothing overtakes the head of the queue
            chunks.append(chunk)
            budget -= len(chunk.token_ids)

        finished, self._finished_since_last_step = self._finished_since_last_step, []
        if self.in_pass_capture:
            captures += self._in_pass_captures(chunks)
        return SchedulerOutput(
            chunks=tuple(chunks),
            finished_request_ids=tuple(finished),
            captures=tuple(captures),
            restores=tuple(restores),
            dropped_bundle_ids=self.cache.take_dropped_bundles(),
        )

    def abandon_step(self, scheduler_output: SchedulerOutput) -> None:
        """The runner failed `scheduler_output`: none of it is known to have happened. Its
        captures are dropped (fail closed), and so are those its chunks reserved for the next
        step; its restores' pins are released, and the bundles it was to free and the requests
        it was to forget are handed to the next step again. Requests are left as they were;
        the caller fails them. (A step scheduled after it carries the captures its chunks
        reserved: the engine abandons every step in flight when one fails.)"""
        self._settle_checkpoints(scheduler_output, {})
        self.cache.return_dropped_bundles(scheduler_output.dropped_bundle_ids)
        self._finished_since_last_step.extend(scheduler_output.finished_request_ids)
        failed = {chunk.request_id for chunk in scheduler_output.chunks}
        reserved = [capture for capture in self._captures if capture.request_id in failed]
        self._captures = [capture for capture in self._captures if capture.request_id not in failed]
        self._settle_checkpoints(SchedulerOutput((), captures=tuple(reserved)), {})

    def _settle_checkpoints(
        self, scheduler_output: SchedulerOutput, confirmed_captures: dict[int, frozenset[int]]
    ) -> None:
        """Publish each capture every rank confirmed (drop the others); unpin restores."""
        for capture in scheduler_output.captures:
            confirmed = confirmed_captures.get(capture.bundle_id, frozenset())
            self.cache.publish(capture.bundle_id, set(confirmed), self.world_size)
            del self._pending_endpoints[capture.bundle_id]
        for restore in scheduler_output.restores:
            self.cache.unpin(restore.bundle_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[Request]:
        """Settle the step's checkpoints, resolve the tokens it sampled (schedule() counted
        them pending) and stop on token-level rules. Steps are updated in the order they were
        scheduled.

        Returns the requests that received a new token this step (finished ones included,
        with status FINISHED and their finish_reason set).
        """
        self._settle_checkpoints(scheduler_output, runner_output.confirmed_captures)

        updated: list[Request] = []
        for chunk in scheduler_output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or not chunk.sample:
                continue  # finished while the step ran, or sampled nothing
            request.resolve_pending_token(runner_output.sampled_token_ids[chunk.request_id])
            reason = token_stop_reason(request, self.max_model_len)
            if reason is not None:
                self.finish_request(request.request_id, reason)
            updated.append(request)
        return updated

    # ----------------------------------------------------------------- helpers

    def _chunk_length(self, request: Request, budget: int, start: int | None = None) -> int:
        """Tokens to compute now from `start` (default: what is computed): the rest of the
        request, cut by the budget and by the next pause position so no chunk crosses it."""
        start = request.num_computed_tokens if start is None else start
        length = min(request.num_tokens - start, budget)
        pause = request.next_pause_after(start)
        if self.in_pass_capture and pause is not None and pause == request.instruction_boundary:
            pause = request.next_pause_after(pause)  # captured inside the chunk instead
        if pause is not None and pause < start + length:
            length = pause - start
        return length

    def _make_chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        """The chunk of tokens [computed, computed + num_new); advances the request past it
        (one more pending token if it samples) and reserves the captures that fall due where
        it ends, to be taken at the start of the next step."""
        start = request.num_computed_tokens
        end = start + num_new
        assert request.state_slot is not None
        chunk = ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_slice(start, end),
            start_position=start,
            block_table=tuple(request.block_ids),
            state_slot=request.state_slot,
            reset_state=start == 0,
            # (a request re-admitted with its last token pending computes it, samples nothing)
            sample=end == request.num_tokens and not request.sampled_all_it_may,
            sampling=request.sampling,
            num_output_tokens=request.num_output_tokens + request.num_pending_tokens,
            capture_hidden=end in request.pause_positions,
        )
        request.num_computed_tokens = end
        request.num_pending_tokens += int(chunk.sample)
        if num_new:
            self._reserve_boundary_captures(request)
        return chunk

    def _grow_blocks_or_preempt(self, request: Request, num_new: int) -> bool:
        """Give a running request blocks for num_new more tokens, preempting the newest
        running requests until they fit. False if `request` itself had to be preempted."""
        needed_tokens = request.num_computed_tokens + num_new
        while True:
            new_blocks = self.cache.allocate_blocks(len(request.block_ids), needed_tokens)
            if new_blocks is not None:
                request.block_ids.extend(new_blocks)
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False

    def _admit(
        self, request: Request, budget: int, restores: list[RestoreOp]
    ) -> ScheduledChunk | None:
        """Move the head of the waiting queue to running if a slot and blocks fit, restoring
        the longest checkpoint of its tokens first. Returns its first chunk, or None (nothing
        changed but possibly evicted checkpoints) when it does not fit."""
        slot = self.cache.acquire_state_slot()
        if slot is None:
            return None
        hit = self.cache.lookup(request.namespace, request.all_token_ids) if self.checkpoint_kinds else None
        restored = hit.num_tokens if hit is not None else 0
        shared_blocks = list(hit.block_ids) if hit is not None else []
        num_new = self._chunk_length(request, budget, start=restored)
        fresh_blocks = self.cache.allocate_blocks(len(shared_blocks), restored + num_new)
        if fresh_blocks is None:
            if hit is not None:
                self.cache.unpin(hit.bundle_id)
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
            tail_block = fresh_blocks[0] if restored % self.cache.block_size else None
            restores.append(RestoreOp(hit.bundle_id, request.request_id, slot, tail_block))
        return self._make_chunk(request, num_new)

    def _reserve_boundary_captures(self, request: Request) -> None:
        """After a chunk: capture where the request now stands if that is its instruction
        boundary or the end of its prompt."""
        position = request.num_computed_tokens
        if position == request.instruction_boundary:
            self._reserve_capture(request, CheckpointKind.INSTRUCTION)
        if position == request.num_prompt_tokens:
            self._reserve_capture(request, CheckpointKind.PROMPT)

    def _reserve_capture(self, request: Request, kind: CheckpointKind) -> None:
        """Reserve a checkpoint of `request` at num_computed_tokens, to be taken at the start of
        the next step. Skipped when the kind is off, nothing is computed, the endpoint is
        already published or pending, or it does not fit the checkpoint budget."""
        capture = self._make_capture(request, kind, request.num_computed_tokens, in_pass=False)
        if capture is not None:
            self._captures.append(capture)

    def _in_pass_captures(self, chunks: list[ScheduledChunk]) -> list[CaptureOp]:
        """In-pass instruction captures of this step's chunks that cross their request's
        instruction boundary (strictly inside the chunk); same skips as _reserve_capture."""
        captures = []
        for chunk in chunks:
            request = self.requests[chunk.request_id]
            boundary = request.instruction_boundary
            end = chunk.start_position + len(chunk.token_ids)
            if boundary is not None and chunk.start_position < boundary < end:
                capture = self._make_capture(request, CheckpointKind.INSTRUCTION, boundary, in_pass=True)
                if capture is not None:
                    captures.append(capture)
        return captures

    def _make_capture(
        self, request: Request, kind: CheckpointKind, position: int, in_pass: bool
    ) -> CaptureOp | None:
        """Reserve a pending bundle for `request`'s first `position` tokens and return its
        CaptureOp, or None (kind off, nothing computed, endpoint published or pending, budget)."""
        if kind not in self.checkpoint_kinds or position == 0 or request.state_slot is None:
            return None
        tokens = request.token_slice(0, position)
        assert PENDING_TOKEN not in tokens, "a capture covers only tokens whose values are known"
        endpoint = (request.namespace, tokens)
        if endpoint in self._pending_endpoints.values():
            return None
        bundle_id = self.cache.reserve_checkpoint(request.namespace, tokens, kind, request.block_ids)
        if bundle_id is None:
            return None
        self._pending_endpoints[bundle_id] = endpoint
        block_size = self.cache.block_size
        tail_block = request.block_ids[position // block_size] if position % block_size else None
        return CaptureOp(
            bundle_id, request.request_id, request.state_slot, position, tail_block, in_pass=in_pass
        )

    def _preempt(self, request: Request) -> None:
        """Free a running request's cache and put it first in line to be recomputed."""
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
