"""Captures in flight in this engine, offered as a checkpoint source.

Requests that share a prefix often arrive together: four questions about one document, a
burst of chats with the same few-shot examples. The first one admitted captures the shared
prefix, but the others are admitted in the same step or the next, before that capture is
published, find nothing, and compute the prefix again. InFlightCaptures is the source that
lets them wait instead. Asked at a request's admission (engine/checkpoints/sources.py), it
answers with a CaptureWait for the longest prefix of the request, longer than what this
engine holds, that is either

  pending   reserved by a capture that is not yet settled (its step is being scheduled or
            runs): always asked, also when a preempted request comes back, so a request never
            recomputes a prefix whose checkpoint is about to be published; or
  ahead     the instruction boundary, a cache breakpoint or the prompt end of a running
            request that shares it and whose prefill has not reached it yet: asked at a
            request's first admission only.

The waiting request leaves the queue (PrefixWaits.pending) while the others step. The wait
ends when the capture is settled (published or dropped), when a producer that had not
reserved it yet stops running (finished, preempted) or computes past it with no capture
pending (the cache refused it), or at the deadline. Nothing is imported: the request goes
back to the head of the queue and restores the published checkpoint like any other, or
recomputes when there is none.

A producer is only ever a running request and a waiter is never running, so no request waits
for one that waits; a pending capture is settled by the next step or the one after. Pure
Python: no torch, no Ray.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache.checkpoint_keys import Namespace
from engine.checkpoints.policy import CheckpointPolicy
from engine.interfaces.request import Request, RequestStatus

# A waiter recomputes if the producer has not captured the shared prefix by then: long enough
# for a long prefill in a loaded step loop, short enough that a stuck producer costs little.
DEFAULT_MAX_WAIT_S = 10.0


@dataclass
class CaptureWait:
    """A request waiting for a capture of its first num_tokens tokens in `namespace`: a
    pending one, or the one `producer` will reserve when its prefill reaches them. Follows
    the CheckpointFetch protocol; result() is always None (the checkpoint is published here,
    not imported)."""

    policy: CheckpointPolicy
    namespace: Namespace
    token_ids: tuple[int, ...]  # the shared prefix
    producer: Request | None  # None: the capture was pending when the wait began
    deadline: float
    verified: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def done(self) -> bool:
        """No capture of the prefix is pending, and none is still to come from a producer
        that runs and has not reached the prefix's end."""
        if self.policy.is_pending(self.namespace, self.token_ids):
            return False
        producer = self.producer
        return (producer is None or producer.status is not RequestStatus.RUNNING
                or producer.num_computed_tokens >= self.num_tokens)

    def result(self) -> None:
        return None

    def settle(self, accepted: bool, num_bytes: int) -> None:
        """Never called: there is nothing to import."""

    def abandon(self) -> None:
        """Nothing to stop: the capture goes on for others."""


class InFlightCaptures:
    """The CheckpointSource of captures this engine is about to publish.

    running: the scheduler's running requests (read at each lookup, never changed here).
    """

    def __init__(
        self,
        policy: CheckpointPolicy,
        running: Callable[[], Sequence[Request]],
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.running = running
        self.max_wait_s = max_wait_s
        self.clock = clock

    def lookup(
        self, namespace: Namespace, token_ids: tuple[int, ...], have: int, ahead: bool = True
    ) -> CaptureWait | None:
        """A CaptureWait for the longest prefix of `token_ids` longer than `have` whose capture
        is pending, or, with `ahead`, that a running request in `namespace` shares and will
        capture when its prefill reaches it; None when there is none."""
        best, producer = self.policy.longest_pending(namespace, token_ids), None
        if ahead:
            found = self._longest_ahead(namespace, token_ids, max(have, best))
            if found is not None:
                best, producer = found
        if best <= have:
            return None
        return CaptureWait(self.policy, namespace, token_ids[:best], producer,
                           deadline=self.clock() + self.max_wait_s)

    def _longest_ahead(
        self, namespace: Namespace, token_ids: tuple[int, ...], have: int
    ) -> tuple[int, Request] | None:
        """The longest capture position past `have` of a running request in `namespace` that
        shares token_ids up to it and has not computed past it, with that request. Compares a
        candidate's last token before the whole prefix, so requests that share nothing cost
        little."""
        best: tuple[int, Request] | None = None
        for producer in self.running():
            if producer.namespace != namespace:
                continue
            prompt = producer.prompt_token_ids
            for position in reversed(self.policy.capture_positions(producer)):
                if position <= have or (best is not None and position <= best[0]):
                    break
                if position > len(token_ids) or producer.num_computed_tokens >= position:
                    continue  # past its tokens; or reached (pending ones are counted apart)
                if prompt[position - 1] == token_ids[position - 1] and prompt[:position] == token_ids[:position]:
                    best = (position, producer)
                    break
        return best
