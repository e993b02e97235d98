"""An LLM server replica's side of the cluster index: what it holds, reported in batches.

`CheckpointReporter.run()` is a background task of the replica's event loop. Every
REPORT_PERIOD_S it drains the engine's checkpoint events (AsyncLLMEngine
.drain_checkpoint_events: bundles published, published bundles dropped), folds them into the
replica's own picture of what it holds, and sends what changed in ONE actor call (a
ReplicaReport). Nothing of this runs on a request's path or on the step thread.

The index may refuse a report (it restarted under a new incarnation, or someone removed this
replica): the next report is then a full one, every bundle the replica holds. So is the first
report, and any report after a failed call (the index actor down or restarting): a report the
index may or may not have applied is never followed by a delta. With nothing to report, a
report is still sent every HEARTBEAT_S, so a restarted index learns of quiet replicas too.

Hits (how often each held bundle was restored, AsyncLLMEngine.drain_checkpoint_hits) ride
along in the next report (ReplicaReport.hits) and are kept until one is accepted. With the
object-store tier on, a ReportListener (deployments/cluster/tier.py) sees every drained
batch and runs its exports after each accepted report, in this same task: the index knows
the records the exports attach to by then, and still nothing runs on a request's path.

Failures are logged once per run of failures and retried at the next period; they never stop
the task or touch the replica's requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from cache.index_messages import CheckpointRecord, ReplicaReport, ReportAck, token_digest
from engine.checkpoints.capture_events import CheckpointEvent

logger = logging.getLogger("ray.serve")

REPORT_PERIOD_S = 0.2
HEARTBEAT_S = 2.0
CALL_TIMEOUT_S = 10.0


class IndexClient(Protocol):
    """What the reporter needs of the index (the actor, or a fake in tests)."""

    async def report(self, report: ReplicaReport) -> ReportAck: ...

    def remove_replica(self, replica_id: str) -> None:
        """Fire and forget."""


class ReportListener(Protocol):
    """Told what the reporter drained, and called after each accepted report."""

    def fold(self, events: list[CheckpointEvent], hits: dict[int, int]) -> None: ...

    async def after_report(self) -> None: ...


class ActorIndexClient:
    """IndexClient over the index actor's handle (deployments/cluster/index.py)."""

    def __init__(self, handle) -> None:
        self._handle = handle

    async def report(self, report: ReplicaReport) -> ReportAck:
        return await self._handle.report.remote(report)

    def remove_replica(self, replica_id: str) -> None:
        self._handle.remove_replica.remote(replica_id)


class CheckpointReporter:
    def __init__(self, replica_id: str,
                 drain_events: Callable[[], Awaitable[list[CheckpointEvent]]],
                 connect: Callable[[], Awaitable[IndexClient]],
                 period_s: float = REPORT_PERIOD_S, heartbeat_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic,
                 drain_hits: Callable[[], Awaitable[dict[int, int]]] | None = None,
                 listener: ReportListener | None = None) -> None:
        """replica_id: serve.get_replica_context().replica_id.unique_id (what routers see as
        RunningReplica.replica_id.unique_id). drain_events: the engine's drain. connect: makes
        the index client; awaited at each report until it succeeds (the index may not exist
        yet, or be restarting). drain_hits: the engine's hit drain (none: no hits reported).
        listener: see the module doc."""
        self.replica_id = replica_id
        self._drain = drain_events
        self._connect = connect
        self._index: IndexClient | None = None
        self._period_s = period_s
        self._heartbeat_s = heartbeat_s
        self._clock = clock
        self.holdings: dict[int, CheckpointRecord] = {}  # bundle id -> record, what we hold
        self._published: dict[int, CheckpointRecord] = {}  # since the last accepted report
        self._dropped: set[int] = set()
        self._incarnation: str | None = None
        self._need_full = True
        self._last_sent = float("-inf")
        self._failing = False
        self._drain_hits = drain_hits
        self._listener = listener
        self._hits: dict[int, int] = {}  # bundle id -> hits not yet in an accepted report

    async def run(self) -> None:
        """Report every period until cancelled."""
        while True:
            await self.report_once()
            await asyncio.sleep(self._period_s)

    async def report_once(self) -> bool:
        """Drain the engine's events and send one report if there is anything to say (or a
        heartbeat is due); a refused report is followed at once by a full one. True when the
        index holds this replica's current picture afterwards."""
        try:
            events = await asyncio.wait_for(self._drain(), CALL_TIMEOUT_S)
            hits = {} if self._drain_hits is None else await asyncio.wait_for(
                self._drain_hits(), CALL_TIMEOUT_S)
        except Exception:
            self._log_failure("draining the engine's checkpoint events failed")
            return False
        self._fold(events)
        for bundle_id, count in hits.items():
            self._hits[bundle_id] = self._hits.get(bundle_id, 0) + count
        if self._listener is not None:
            self._listener.fold(events, hits)
        for _ in range(2):  # a refused delta is followed by a full report
            if not self._need_full and not self._published and not self._dropped \
                    and not self._hits and self._clock() - self._last_sent < self._heartbeat_s:
                await self._after_report()
                return True
            report = self._next_report()
            try:
                index = await self._client()
                ack = await asyncio.wait_for(index.report(report), CALL_TIMEOUT_S)
            except Exception:
                self._need_full = True  # it may or may not have been applied
                self._log_failure("reporting checkpoints to the cluster index failed")
                return False
            self._last_sent = self._clock()
            self._failing = False
            self._incarnation = ack.incarnation
            if ack.accepted:
                self._need_full = False
                self._published.clear()
                self._dropped.clear()
                self._hits.clear()
                await self._after_report()
                return True
            self._need_full = True
        return False

    async def _after_report(self) -> None:
        if self._listener is None:
            return
        try:
            await self._listener.after_report()
        except Exception:
            logger.warning("the checkpoint report listener failed", exc_info=True)

    def close(self) -> None:
        """The replica is stopping: ask the index to forget it (fire and forget)."""
        if self._index is not None:
            try:
                self._index.remove_replica(self.replica_id)
            except Exception:
                logger.warning("could not tell the cluster index this replica stops",
                               exc_info=True)

    # ---- internals ----------------------------------------------------------------------------

    def _fold(self, events: list[CheckpointEvent]) -> None:
        for event in events:
            if event.action == "published":
                record = CheckpointRecord(
                    namespace=(str(event.namespace[0]), str(event.namespace[1] or "")),
                    digest=token_digest(event.token_ids), length=len(event.token_ids),
                    kind=event.kind, num_bytes=event.num_bytes, replica_id=self.replica_id,
                    bundle_id=event.bundle_id)
                self.holdings[event.bundle_id] = record
                self._published[event.bundle_id] = record
                self._dropped.discard(event.bundle_id)
            elif self.holdings.pop(event.bundle_id, None) is not None:
                if self._published.pop(event.bundle_id, None) is None:
                    self._dropped.add(event.bundle_id)

    def _next_report(self) -> ReplicaReport:
        hits = tuple(sorted((b, n) for b, n in self._hits.items() if b in self.holdings))
        if self._need_full:
            return ReplicaReport(self.replica_id, self._incarnation,
                                 tuple(self.holdings.values()), full=True, hits=hits)
        return ReplicaReport(self.replica_id, self._incarnation, tuple(self._published.values()),
                             tuple(sorted(self._dropped)), hits=hits)

    async def _client(self) -> IndexClient:
        if self._index is None:
            self._index = await self._connect()
        return self._index

    def _log_failure(self, message: str) -> None:
        if not self._failing:
            logger.warning("%s; retrying every %.1f s", message, self._period_s, exc_info=True)
        self._failing = True
