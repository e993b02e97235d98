"""Host tier -> object-store tier: the checkpoints a replica's host tier evicts are kept as
stored copies (checkpoint_transfer with a host tier; docs/design.md section 5, Tiers).

    engine step thread                       replica event loop
      HostTier evicts a checkpoint
        on_evict = StoreDemotion.demote  -->  queued (call_soon_threadsafe); demote returns
        (no Ray, no wait, no checksum)        at once. One task takes them in order:
                                                the mirror lists a stored copy already: skipped
                                                checksums (with_checksums, in a thread)
                                                index.store_copy(key, ..., record=...): the
                                                record is put if the index forgot it
      later, a request with that prefix: the host tier misses, CheckpointTier.lookup finds
      the stored copy in the mirror and fetches it; the engine imports it checked in full
      (checksums, shapes, model), like any stored copy

The record's key is (this replica, the device bundle the checkpoint was demoted from): the
same record the replica reported when it published the bundle. If the index still has it (the
bundle's drop not reported yet), the copy is attached to it and the drop then leaves it as a
stored copy only; if not, the record comes back with on_replica False. Either way the index
keeps one copy per checkpoint and its byte budget (SharedIndex.can_store).

Bounded: a checkpoint waiting here holds host memory outside the host tier's budget; at most
`max_pending_bytes` wait, and one beyond that is dropped (counted). Ordering: first in, first
out, one at a time. While a checkpoint waits here it is in no tier: a request that wants it
then recomputes (a miss, never a wrong answer). One evicted twice (recomputed and demoted
again meanwhile) is stored once: the second is skipped, or refused by the index as a copy of
a stored checkpoint. Failures (the checksum pass, the index call, its timeout) are counted by
outcome and logged, and cost that checkpoint only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cache.index_messages import CheckpointRecord, token_digest
from deployments.cluster.index_mirror import IndexMirror
from deployments.cluster.object_copies import store_exported
from engine.checkpoints.host_tier import EvictedCheckpoint, with_checksums

logger = logging.getLogger("ray.serve")

STORE_CALL_TIMEOUT_S = 10.0
OUTCOMES = ("stored", "already_stored", "refused", "dropped", "failed")


@dataclass
class DemotionCounters:
    """What the host tier passed on and what became of it, cumulative (ReplicaStats)."""

    handed: int = 0  # given by the host tier's on_evict
    outcomes: dict[str, int] = field(default_factory=dict)  # OUTCOMES -> count
    stored_bytes: int = 0
    store_seconds: float = 0.0  # checksums and the index's store, all stored copies

    def copy(self) -> DemotionCounters:
        return DemotionCounters(self.handed, dict(self.outcomes), self.stored_bytes, self.store_seconds)


class StoreDemotion:
    def __init__(self, replica_id: str, mirror: IndexMirror,
                 connect: Callable[[], Awaitable[object]], max_pending_bytes: int,
                 metrics=None) -> None:
        """replica_id: the replica's id in its reports. mirror: the replica's IndexMirror (what
        is stored already). connect: the index actor's handle (awaited when first needed).
        max_pending_bytes: what the checkpoints waiting may hold. metrics: a
        deployments.metrics.TierMetrics, or None (tests). Construct it on the replica's event
        loop, which runs the stores."""
        self.replica_id = replica_id
        self._mirror = mirror
        self._connect = connect
        self._index = None
        self._metrics = metrics
        self.max_pending_bytes = max_pending_bytes
        self.counters = DemotionCounters()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[EvictedCheckpoint] = asyncio.Queue()
        self._lock = threading.Lock()  # counters and _pending_bytes: the step thread and the loop
        self._pending_bytes = 0
        self._task = self._loop.create_task(self._run())

    # ---- the step thread ------------------------------------------------------------------

    def demote(self, evicted: EvictedCheckpoint) -> None:
        """HostTier.on_evict: queue `evicted` for the event loop to store. Returns at once and
        calls no Ray; never raises (a checkpoint it cannot queue is counted dropped, or failed
        when the event loop is closed)."""
        num_bytes = evicted.exported.nbytes
        with self._lock:
            self.counters.handed += 1
            fits = self._pending_bytes + num_bytes <= self.max_pending_bytes
            if fits:
                self._pending_bytes += num_bytes
            else:
                self._count("dropped")
        try:
            if fits:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, evicted)
            else:
                self._loop.call_soon_threadsafe(self._record, "dropped")
        except RuntimeError:  # the loop is closed: the replica is going
            if fits:
                with self._lock:
                    self._pending_bytes -= num_bytes
                    self._count("failed")

    # ---- the event loop --------------------------------------------------------------------

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def stats(self) -> DemotionCounters:
        """A copy of the counters (any thread)."""
        with self._lock:
            return self.counters.copy()

    async def drained(self) -> None:
        """Return once every checkpoint queued so far has been stored (or failed)."""
        await self._queue.join()

    def close(self) -> None:
        """Stop storing (what waits is dropped with the replica)."""
        self._task.cancel()

    async def _run(self) -> None:
        while True:
            evicted = await self._queue.get()
            try:
                outcome = await self._store(evicted)
            except Exception:
                logger.warning("keeping a checkpoint the host tier evicted failed", exc_info=True)
                outcome = "failed"
            finally:
                with self._lock:
                    self._pending_bytes -= evicted.exported.nbytes
                self._queue.task_done()
            with self._lock:
                self._count(outcome)
            self._record(outcome)

    async def _store(self, evicted: EvictedCheckpoint) -> str:
        """One checkpoint: the outcome it is counted under."""
        header = evicted.exported.header
        found = self._mirror.lookup_stored(header.namespace, header.token_ids)
        if found is not None and found.length == header.num_tokens:
            return "already_stored"
        started = time.monotonic()
        exported = await asyncio.to_thread(with_checksums, evicted.exported)
        namespace = (str(header.namespace[0]), str(header.namespace[1] or ""))
        record = CheckpointRecord(namespace=namespace, digest=token_digest(header.token_ids),
                                  length=header.num_tokens, kind=header.kind,
                                  num_bytes=exported.nbytes, replica_id=self.replica_id,
                                  bundle_id=evicted.bundle_id)
        if self._index is None:
            self._index = await self._connect()
        kept = await asyncio.wait_for(store_exported(self._index, record.key, exported, record),
                                      STORE_CALL_TIMEOUT_S)
        if not kept:
            return "refused"
        elapsed = time.monotonic() - started
        with self._lock:
            self.counters.stored_bytes += exported.nbytes
            self.counters.store_seconds += elapsed
        if self._metrics is not None:
            self._metrics.observe("demote", elapsed)
        return "stored"

    def _count(self, outcome: str) -> None:
        """Under the lock."""
        self.counters.outcomes[outcome] = self.counters.outcomes.get(outcome, 0) + 1

    def _record(self, outcome: str) -> None:
        """The metric of `outcome` (on the event loop: Ray's metrics stay off the step thread)."""
        if self._metrics is not None:
            self._metrics.demoted(outcome)
