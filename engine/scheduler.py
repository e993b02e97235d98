"""Continuous-batching scheduler: decides which tokens of which requests run in each step.

One progress rule (DESIGN.md section 4): every request's num_computed_tokens chases its
num_tokens under a per-step token budget. Running requests go first (decode tokens and the
rest of chunked prefills), then waiting requests are admitted in arrival order while a state
slot and KV blocks are available. When a running request cannot get a block, the most
recently arrived running request is preempted: its cache is freed and it is requeued to be
recomputed from scratch.

Pure Python: the scheduler sees the cache only through CacheManager's return values.
"""

from __future__ import annotations

from collections import deque

from cache.cache_manager import CacheManager, PoolUsage
from engine.request import FinishReason, Request, RequestStatus, token_stop_reason
from engine.step_io import RunnerOutput, ScheduledChunk, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.cache = cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0  # since start, for metrics

    # ----------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request (stop, length, abort or error) and free its cache.

        Returns the request, or None if it was unknown or already finished.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
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

    def usage(self) -> PoolUsage:
        return self.cache.usage(num_requests=len(self.requests))

    # ----------------------------------------------------------------- the step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks. Mutates block tables, state slots and the queues."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk_length(request, budget)
            if not self._grow_blocks_or_preempt(request, num_new):
                break  # the request itself was preempted; everything after it too
            chunks.append(self._make_chunk(request, num_new))
            budget -= num_new
            index += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = self._chunk_length(request, budget)
            if not self._admit(request, num_new):
                break  # first come, first served: nothing overtakes the head of the queue
            chunks.append(self._make_chunk(request, num_new))
            budget -= num_new

        finished, self._finished_since_last_step = self._finished_since_last_step, []
        return SchedulerOutput(chunks=tuple(chunks), finished_request_ids=tuple(finished))

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[Request]:
        """Advance progress by what ran; append sampled tokens and stop on token-level rules.

        Returns the requests that received a new token this step (finished ones included,
        with status FINISHED and their finish_reason set).
        """
        updated: list[Request] = []
        for chunk in scheduler_output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue  # finished while the step ran
            request.num_computed_tokens += len(chunk.token_ids)
            if not chunk.sample:
                continue
            request.output_token_ids.append(runner_output.sampled_token_ids[chunk.request_id])
            reason = token_stop_reason(request, self.max_model_len)
            if reason is not None:
                self.finish_request(request.request_id, reason)
            updated.append(request)
        return updated

    # ----------------------------------------------------------------- helpers

    def _chunk_length(self, request: Request, budget: int) -> int:
        """Tokens to compute now: the rest of the request, cut by the budget and by the next
        pause position so that a chunk never crosses it."""
        start = request.num_computed_tokens
        length = min(request.num_tokens - start, budget)
        pause = request.next_pause_after(start)
        if pause is not None and pause < start + length:
            length = pause - start
        return length

    def _make_chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        assert request.state_slot is not None
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_slice(start, end),
            start_position=start,
            block_table=tuple(request.block_ids),
            state_slot=request.state_slot,
            reset_state=start == 0,
            sample=end == request.num_tokens,
            sampling=request.sampling,
            num_output_tokens=request.num_output_tokens,
            capture_hidden=end in request.pause_positions,
        )

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

    def _admit(self, request: Request, num_new: int) -> bool:
        """Move the head of the waiting queue to running if a slot and blocks fit."""
        slot = self.cache.acquire_state_slot()
        if slot is None:
            return False
        blocks = self.cache.allocate_blocks(0, request.num_computed_tokens + num_new)
        if blocks is None:
            self.cache.release([], slot)
            return False
        self.waiting.popleft()
        request.state_slot = slot
        request.block_ids = blocks
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def _preempt(self, request: Request) -> None:
        """Free a running request's cache and put it first in line to be recomputed."""
        self.running.remove(request)
        self._release_cache(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _release_cache(self, request: Request) -> None:
        if request.block_ids or request.state_slot is not None:
            self.cache.release(request.block_ids, request.state_slot)
        request.block_ids = []
        request.state_slot = None
