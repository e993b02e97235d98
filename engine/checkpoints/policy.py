"""The checkpoint policy: which request-boundary checkpoints a step captures and how, what an
admitted request restores, and when a bundle is published or dropped (docs/design.md sections 2, 5).

The scheduler keeps progress, budget, blocks, slots and preemption, and asks this policy at
fixed points of its step:

    Scheduler.add_request        pause_positions          where prefill chunks must end
    Scheduler._make_chunk        reserve_after_chunk      instruction boundary, cache
                                                          breakpoints, prompt end
    Scheduler.finish_request     reserve_at_finish        response, on stop or length only
    Scheduler.schedule           take_reserved,           the captures the step takes
                                 take_in_pass
    Scheduler._admit             lookup, restore_op,      what the request starts from
                                 cancel_restore
    Scheduler.update_from_output settle                   publish or drop; unpin restores
    Scheduler.abandon_step       abandon                  drop what the failed step held

The worker executes two kinds of capture (CaptureOp):
  cut      a prefill chunk ends at the position; the capture is reserved then and taken at the
           start of the next step, from the state that chunk left behind. Cache breakpoints
           (the client's cache_control markers) are always captured this way.
  in-pass  the position lies strictly inside a chunk, which is not cut; the worker takes the
           capture during that chunk's forward pass. Only the instruction boundary is captured
           this way, and only when `in_pass_capture` is on: the worker reports that it can
           (CacheCapacity.in_pass_capture) and the configuration allows it
           (EngineConfig.in_pass_capture); LLMEngine combines the two when it builds the policy.

Every capture reserves a pending bundle in the cache (its byte budget and evictions are
CacheManager's). The bundle is published when the step that takes it settles and every rank
confirmed it, and dropped otherwise; while it is pending, its endpoint is not reserved again.

Pure Python: the policy sees the cache only through CacheManager's return values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from cache.cache_manager import CacheManager
from cache.checkpoint_keys import CheckpointKind, Namespace
from cache.checkpoint_ledger import Hit
from engine.interfaces.request import FinishReason, Request
from engine.interfaces.step_io import CaptureOp, RestoreOp, ScheduledChunk, SchedulerOutput

Endpoint = tuple[Namespace, tuple[int, ...]]  # what a bundle covers: namespace and token ids


class CheckpointPolicy:
    """Decides the captures and restores of the scheduler's steps; holds the cut captures
    reserved for the next step and the endpoints of pending bundles.

    kinds: the checkpoint kinds captured; empty turns checkpoints off (no capture, no lookup).
    world_size: the ranks that must each confirm a capture before its bundle is published.
    in_pass_capture: capture the instruction boundary inside the prefill chunk's forward pass
        instead of ending a chunk there (the worker can, and the configuration allows it).
    """

    def __init__(
        self,
        cache: CacheManager,
        kinds: frozenset[CheckpointKind] = frozenset(),
        world_size: int = 1,
        in_pass_capture: bool = False,
    ) -> None:
        self.cache = cache
        self.kinds = kinds
        self.world_size = world_size
        self.in_pass_capture = in_pass_capture
        self._reserved: list[CaptureOp] = []  # cut captures for the next step to take
        self._in_pass: list[CaptureOp] = []  # in-pass captures of the step being scheduled
        self._pending_endpoints: dict[int, Endpoint] = {}  # bundle id -> endpoint, until settled

    @property
    def has_reserved_captures(self) -> bool:
        """Cut captures are reserved that no scheduled step has taken yet."""
        return bool(self._reserved)

    # ----------------------------------------------------------------- where chunks end

    def pause_positions(self, request: Request) -> tuple[int, ...]:
        """request.pause_positions plus the positions where its prefill chunks must end so a
        cut capture can be taken there: its instruction boundary, when instruction checkpoints
        are on and not captured in-pass, and its cache breakpoints, when breakpoint checkpoints
        are on (a chunk holds at most one in-pass capture, and the instruction boundary may
        share a chunk with a breakpoint: breakpoints are always cut). The prompt end needs no
        pause (no chunk crosses the end of the known tokens). Mutates nothing."""
        pauses = set(request.pause_positions)
        boundary = request.instruction_boundary
        if boundary is not None and CheckpointKind.INSTRUCTION in self.kinds and not self.in_pass_capture:
            pauses.add(boundary)
        if CheckpointKind.BREAKPOINT in self.kinds:
            pauses.update(request.cache_breakpoints)
        return tuple(sorted(pauses))

    def capture_positions(self, request: Request) -> tuple[int, ...]:
        """The prompt positions at which `request` is to capture a checkpoint as its prefill
        reaches them (sorted): its instruction boundary, its cache breakpoints and its prompt
        end, each when its kind is on. Whether the cache accepts a capture is decided only
        when it is reserved. Mutates nothing."""
        positions = set()
        if request.instruction_boundary is not None and CheckpointKind.INSTRUCTION in self.kinds:
            positions.add(request.instruction_boundary)
        if CheckpointKind.BREAKPOINT in self.kinds:
            positions.update(request.cache_breakpoints)
        if CheckpointKind.PROMPT in self.kinds:
            positions.add(request.num_prompt_tokens)
        positions.discard(0)
        return tuple(sorted(positions))

    def is_pending(self, namespace: Namespace, token_ids: tuple[int, ...]) -> bool:
        """A capture of exactly `token_ids` in `namespace` is reserved and not yet settled."""
        return (namespace, token_ids) in self._pending_endpoints.values()

    def longest_pending(self, namespace: Namespace, token_ids: tuple[int, ...]) -> int:
        """Tokens of the longest capture reserved and not yet settled in `namespace` whose
        tokens are a prefix of `token_ids` (0: none). Mutates nothing."""
        longest = 0
        for pending_namespace, pending in self._pending_endpoints.values():
            size = len(pending)
            if size > longest and pending_namespace == namespace and token_ids[:size] == pending:
                longest = size
        return longest

    # ----------------------------------------------------------------- captures

    def reserve_after_chunk(self, request: Request, chunk: ScheduledChunk) -> None:
        """`chunk` of `request` was just scheduled: reserve the in-pass instruction capture when
        in_pass_capture is on and the boundary lies strictly inside the chunk, for this step
        to take (take_in_pass), and the cut captures that fall due where it ends, at the
        instruction boundary, at a cache breakpoint and at the end of the prompt, for the next
        step to take (an endpoint that is both the instruction boundary and a breakpoint is
        captured once, as the instruction checkpoint). A chunk of no tokens (a restore covered
        them) reserves nothing. Mutates the reserved captures and, for each reservation, the
        cache (a pending bundle)."""
        if not chunk.token_ids:
            return
        end = chunk.start_position + len(chunk.token_ids)
        boundary = request.instruction_boundary
        if self.in_pass_capture and boundary is not None and chunk.start_position < boundary < end:
            capture = self._reserve(request, CheckpointKind.INSTRUCTION, boundary, in_pass=True)
            if capture is not None:
                self._in_pass.append(capture)
        if end == boundary:
            self._reserve_cut(request, CheckpointKind.INSTRUCTION, end)
        if end in request.cache_breakpoints:
            self._reserve_cut(request, CheckpointKind.BREAKPOINT, end)
        if end == request.num_prompt_tokens:
            self._reserve_cut(request, CheckpointKind.PROMPT, end)

    def reserve_at_finish(self, request: Request, reason: FinishReason) -> None:
        """Running `request` ends by `reason`: reserve its response capture at
        num_computed_tokens for the next step to take, only if it ended by stop or length
        (never on abort or error). Call before the request releases its blocks: the pending
        bundle takes its own references to them. Mutates the reserved captures and the cache."""
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self._reserve_cut(request, CheckpointKind.RESPONSE, request.num_computed_tokens)

    def take_reserved(self) -> list[CaptureOp]:
        """The cut captures reserved since the last call, for the step being scheduled to take
        at its start (before its restores and forward pass), and forgets them. Call before the
        step's chunks are made: what they reserve belongs to the step after."""
        reserved, self._reserved = self._reserved, []
        return reserved

    def take_in_pass(self) -> list[CaptureOp]:
        """The in-pass captures reserve_after_chunk reserved for the chunks of the step being
        scheduled, for that same step to take during its forward pass, and forgets them. Call
        once all the step's chunks are made."""
        in_pass, self._in_pass = self._in_pass, []
        return in_pass

    # ----------------------------------------------------------------- restores

    def lookup(self, request: Request) -> Hit | None:
        """The longest published checkpoint whose tokens are an exact prefix of the request's
        known tokens, pinned in the cache (it and its blocks cannot be evicted) until the step
        that restores it settles, or cancel_restore. None when checkpoints are off or none
        matches (then nothing changed)."""
        if not self.kinds:
            return None
        return self.cache.lookup(request.namespace, request.all_token_ids)

    def longest(self, request: Request) -> int:
        """Tokens of the longest published checkpoint lookup would find for `request` now (0:
        none, or checkpoints are off). Pins and counts nothing."""
        if not self.kinds:
            return 0
        return self.cache.longest_checkpoint(request.namespace, request.all_token_ids)

    def cancel_restore(self, hit: Hit) -> None:
        """The request `hit` was looked up for is not admitted after all: unpin the bundle."""
        self.cache.unpin(hit.bundle_id)

    def restore_op(self, hit: Hit, request: Request) -> RestoreOp:
        """What the worker does to start `request`, just admitted on `hit` (its block_ids begin
        with hit.block_ids, then fresh blocks): copy the bundle's recurrent state into its state
        slot and, when hit.num_tokens is not a block multiple, its attention tail into the
        first fresh block. The pin is released when that step settles or is abandoned.
        Mutates nothing."""
        assert request.state_slot is not None
        tail_block = self._tail_block(request, hit.num_tokens)
        return RestoreOp(hit.bundle_id, request.request_id, request.state_slot, tail_block)

    # ----------------------------------------------------------------- settlement

    def settle(
        self, scheduler_output: SchedulerOutput, confirmed_captures: Mapping[int, frozenset[int]]
    ) -> None:
        """The step `scheduler_output` ran: publish each of its captures that every rank
        confirmed (confirmed_captures: bundle id -> ranks), drop the others (the cache hands
        their ids to the workers to free), and unpin its restores. Mutates the cache and the
        pending endpoints."""
        self._publish_or_drop(scheduler_output.captures, confirmed_captures)
        for restore in scheduler_output.restores:
            self.cache.unpin(restore.bundle_id)

    def abandon(self, scheduler_output: SchedulerOutput) -> None:
        """The runner failed `scheduler_output`: none of it is known to have happened. Drop its
        captures and the cut captures its chunks reserved for the next step (fail closed),
        unpin its restores, and give the cache back the dropped bundle ids the step carried, so
        the next step tells the workers to free them. (A step scheduled after it carries the
        captures its chunks reserved: the engine abandons every step in flight when one
        fails.) Mutates the cache, the reserved captures and the pending endpoints."""
        self.settle(scheduler_output, {})
        self.cache.return_dropped_bundles(scheduler_output.dropped_bundle_ids)
        failed = {chunk.request_id for chunk in scheduler_output.chunks}
        dropped = [capture for capture in self._reserved if capture.request_id in failed]
        self._reserved = [capture for capture in self._reserved if capture.request_id not in failed]
        self._publish_or_drop(dropped, {})

    # ----------------------------------------------------------------- helpers

    def _publish_or_drop(
        self, captures: Iterable[CaptureOp], confirmed_captures: Mapping[int, frozenset[int]]
    ) -> None:
        for capture in captures:
            confirmed = confirmed_captures.get(capture.bundle_id, frozenset())
            self.cache.publish(capture.bundle_id, set(confirmed), self.world_size)
            del self._pending_endpoints[capture.bundle_id]

    def _reserve_cut(self, request: Request, kind: CheckpointKind, position: int) -> None:
        capture = self._reserve(request, kind, position, in_pass=False)
        if capture is not None:
            self._reserved.append(capture)

    def _reserve(
        self, request: Request, kind: CheckpointKind, position: int, in_pass: bool
    ) -> CaptureOp | None:
        """Reserve a pending bundle for `request`'s first `position` tokens and return its
        CaptureOp, or None: the kind is off, nothing is computed, the request holds no cache,
        the endpoint is pending already, or the cache refuses (published there already, or over
        the checkpoint budget)."""
        if kind not in self.kinds or position == 0 or request.state_slot is None:
            return None
        # a capture covers only tokens whose values are known (token_slice puts PENDING_TOKEN
        # past num_known_tokens only; scanning the tokens for it took 50 us at 8,000)
        assert position <= request.num_known_tokens, "a capture covers only tokens whose values are known"
        tokens = request.token_slice(0, position)
        if self.is_pending(request.namespace, tokens):
            return None
        bundle_id = self.cache.reserve_checkpoint(request.namespace, tokens, kind, request.block_ids,
                                                  owner=request.tenant)
        if bundle_id is None:
            return None
        self._pending_endpoints[bundle_id] = (request.namespace, tokens)
        tail_block = self._tail_block(request, position)
        return CaptureOp(bundle_id, request.request_id, request.state_slot, position, tail_block, in_pass=in_pass)

    def _tail_block(self, request: Request, position: int) -> int | None:
        """The block holding the partial last block of `position` tokens; None at a block
        boundary."""
        block_size = self.cache.block_size
        return request.block_ids[position // block_size] if position % block_size else None
