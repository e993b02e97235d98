"""Requests that wait off the scheduler's queue for a longer prefix than this engine holds.

Before a request's admission the scheduler asks PrefixWaits whether the request should wait
(`start`): for a checkpoint a CheckpointSource starts fetching (engine/checkpoints/sources.py,
its first admission only), or for a capture in flight here that will publish a longer prefix
(InFlightCaptures, engine/checkpoints/in_flight.py, at every admission). A request that waits
is held here, in `pending`, until its fetch or capture ends or its deadline passes
(`take_ended`); a request that ends while waiting is dropped (`abandon`).

The scheduler keeps the queues and the request's status; this class keeps the waits. Pure
Python: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

from engine.checkpoints.in_flight import InFlightCaptures
from engine.checkpoints.policy import CheckpointPolicy
from engine.checkpoints.sources import CheckpointSource, FetchedCheckpoint, PendingFetch
from engine.interfaces.request import Request


class WaitKind(Enum):
    FETCH = "fetch"  # a CheckpointSource fetches a checkpoint to import
    CAPTURE = "capture"  # a capture in flight here will publish the prefix


class PrefixWaits:
    """The waits of one scheduler.

    policy: the scheduler's checkpoint policy (what this engine holds). running: the
    scheduler's running requests (read at each lookup, never changed here). sources: asked in
    order at a request's first admission (add_source adds one later). capture_wait_s: how
    long a request may wait for a running request's capture of a longer shared prefix (0:
    never waits for one).
    """

    def __init__(self, policy: CheckpointPolicy, running: Callable[[], Sequence[Request]],
                 sources: Sequence[CheckpointSource] = (), capture_wait_s: float = 0.0) -> None:
        self.policy = policy
        self.sources: list[CheckpointSource] = list(sources)
        self.captures_in_flight = (InFlightCaptures(policy, running, max_wait_s=capture_wait_s)
                                   if capture_wait_s > 0 else None)
        self.pending: dict[str, PendingFetch] = {}  # request id -> what it waits for

    def add_source(self, source: CheckpointSource) -> None:
        """Ask `source` too, after the others, from the next admission on."""
        self.sources.append(source)

    def start(self, request: Request) -> WaitKind | None:
        """Whether `request`, about to be admitted, waits for a longer prefix than this engine
        holds, and for what: a capture in flight here (a pending one at every admission; at
        the first, also one a running request is about to reserve), else, at the first
        admission only, a fetch a source starts for more than that. When it waits it is held
        in `pending`; the caller takes it off its queue. Marks the request asked_sources."""
        first = not request.asked_sources
        in_flight = self.captures_in_flight
        if not (self.policy.kinds and (in_flight or (first and self.sources))):
            return None
        request.asked_sources = True
        have = self.policy.longest(request)
        tokens = request.all_token_ids
        wait = in_flight.lookup(request.namespace, tokens, have, ahead=first) if in_flight else None
        soon = have if wait is None else wait.num_tokens
        sources = self.sources if first else ()
        fetch = next((f for f in (s.lookup(request.namespace, tokens, soon) for s in sources)
                      if f is not None), None)
        if fetch is None and wait is None:
            return None
        self.pending[request.request_id] = PendingFetch(request, fetch or wait)
        return WaitKind.FETCH if fetch is not None else WaitKind.CAPTURE

    def take_ended(self, now: float) -> list[FetchedCheckpoint]:
        """The waits that ended, or whose deadline is past `now` (abandoned: nothing to
        import), in the order their requests began waiting, removed from `pending`."""
        ended: list[FetchedCheckpoint] = []
        for request_id, waiting in list(self.pending.items()):
            fetch = waiting.fetch
            if fetch.done():
                checkpoint = fetch.result()
            elif now >= fetch.deadline:
                fetch.abandon()
                checkpoint = None
            else:
                continue
            del self.pending[request_id]
            ended.append(FetchedCheckpoint(request_id, fetch, checkpoint))
        return ended

    def abandon(self, request_id: str) -> None:
        """The request ends, or is requeued, while it waits: stop waiting for it."""
        self.pending.pop(request_id).fetch.abandon()
