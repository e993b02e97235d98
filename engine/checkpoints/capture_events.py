"""The engine's checkpoint event feed: which bundles became visible and which visible ones went.

The cluster index (issue 20) learns what a replica holds from this feed: LLMEngine passes a
CheckpointEventFeed to its CheckpointLedger as the BundleListener, and the serving layer drains it
(LLMEngine.drain_checkpoint_events, AsyncLLMEngine.drain_checkpoint_events) and reports the
events in batches, off the request path.

    "published"  a bundle became visible to lookups (captured and confirmed by every rank, or
                 imported from another engine)
    "dropped"    a published bundle left (evicted); a pending bundle that never publishes
                 (unconfirmed, duplicate, abandoned) produces no event at all

Hits (a lookup returned a published bundle) are not events: the feed counts them per bundle
(`drain_hits`), so a replica can tell which bundles are worth exporting and how hot each is,
at the cost of one integer per bundle hit since the last drain.

A feed records only once `recording` is on: LLMEngine starts with it off, and the serving
layer turns it on (LLMEngine.record_checkpoint_events) only where something drains it, so an
engine nobody reports for keeps nothing. Events come out oldest first. The feed is bounded: an engine nobody drains keeps the newest
`capacity` events, forgets older ones and counts them in `num_lost` (a reader that sees it grow
should resynchronise rather than trust its picture of the replica). Not thread-safe: the ledger
and the drain both run on the engine's step thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from cache.checkpoint_keys import CheckpointKind, Namespace

from cache.checkpoint_ledger import Bundle

DEFAULT_CAPACITY = 100_000

CheckpointAction = Literal["published", "dropped"]


@dataclass(frozen=True)
class CheckpointEvent:
    """One change in what the engine can restore."""

    action: CheckpointAction
    namespace: Namespace
    token_ids: tuple[int, ...]  # the tokens the bundle covers
    kind: CheckpointKind
    num_bytes: int  # the ledger's Bundle.num_bytes (outside the shared KV blocks)
    bundle_id: int


class CheckpointEventFeed:
    """A bounded, oldest-first buffer of CheckpointEvents; the ledger's BundleListener."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, recording: bool = True) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.recording = recording  # off: published, dropped and hit change nothing
        self.num_lost = 0  # events forgotten because nobody drained them in time
        self._events: deque[CheckpointEvent] = deque()
        self._hits: dict[int, int] = {}  # bundle id -> hits since the last drain_hits

    def __len__(self) -> int:
        return len(self._events)

    def published(self, bundle: Bundle) -> None:
        """The ledger published `bundle` (BundleListener)."""
        if self.recording:
            self._append(_event("published", bundle))

    def dropped(self, bundle: Bundle) -> None:
        """The ledger dropped the published `bundle` (BundleListener)."""
        if self.recording:
            self._append(_event("dropped", bundle))

    def hit(self, bundle: Bundle) -> None:
        """A lookup returned the published `bundle` (BundleListener): counted, no event. At
        most `capacity` bundles are counted between two drains (hits on others are lost)."""
        if not self.recording:
            return
        if bundle.bundle_id in self._hits or len(self._hits) < self.capacity:
            self._hits[bundle.bundle_id] = self._hits.get(bundle.bundle_id, 0) + 1

    def drain_hits(self) -> dict[int, int]:
        """{bundle id: hits} since the last drain_hits; empty afterwards. A bundle dropped since
        may still appear (its id is never reused)."""
        hits, self._hits = self._hits, {}
        return hits

    def drain(self) -> list[CheckpointEvent]:
        """Every event since the last drain, oldest first; the feed is empty afterwards."""
        events = list(self._events)
        self._events.clear()
        return events

    def _append(self, event: CheckpointEvent) -> None:
        if len(self._events) == self.capacity:
            self._events.popleft()
            self.num_lost += 1
        self._events.append(event)


def _event(action: CheckpointAction, bundle: Bundle) -> CheckpointEvent:
    return CheckpointEvent(
        action=action,
        namespace=Namespace.of(*bundle.namespace),
        token_ids=bundle.token_ids,
        kind=bundle.kind,
        num_bytes=bundle.num_bytes,
        bundle_id=bundle.bundle_id,
    )
