"""The application's cluster checkpoint index: one named Ray actor wrapping a SharedIndex.

    LLM server replicas --report(ReplicaReport)--> CheckpointIndex <--changes_since-- routers
                        (batched, every ~0.2 s,                      (long poll; each keeps a
                         deployments/cluster/reporter.py)          local mirror)

One actor per Serve application, named from the application's name (`index_actor_name`) in
Serve's namespace, so every replica and every router of the application finds the same one
(`get_or_create_index`, `get_index`). It is detached (it belongs to no replica, so replicas
come and go under it) and Ray restarts it when it dies (max_restarts=-1): it then starts
empty under a new incarnation id, the replicas' next reports are refused, they send their
full holdings, and routers' mirrors take a snapshot. Until then lookups miss, never mislead.

With checkpoint_transfer it also owns the object-store tier (deployments/cluster/object_copies.py):
`store_copy` puts a replica's exported checkpoint (one it publishes or that was hit, or one its
host tier evicted) as objects this actor owns, within the
tier's byte budget (SharedIndex's store_budget_bytes: least recently used copies go first),
and `hottest_stored` ranks them for a starting replica's warm start.

The actor ends itself once its application has been gone from Serve for APP_GONE_CHECKS
checks in a row (serve.delete, serve.shutdown), so a deleted application leaves nothing
behind. It asks for INDEX_NUM_CPUS logical CPUs, and answers on one asyncio event loop (no
locks: every method runs between awaits).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import ray
from ray.actor import ActorHandle

from cache.checkpoint_keys import Namespace
from cache.index_messages import (
    CheckpointRecord,
    HotCopy,
    IndexDelta,
    IndexSnapshot,
    IndexStats,
    LookupResult,
    RecordKey,
    ReplicaReport,
    ReportAck,
    StoredCopy,
)
from cache.shared_index import DEFAULT_MAX_RECORDS, SharedIndex
from deployments.cluster.object_copies import put_stored
from deployments.metrics import IndexMetrics

logger = logging.getLogger("ray.serve")

SERVE_NAMESPACE = "serve"  # Ray namespace of Serve's controller and replicas
INDEX_NUM_CPUS = 0.01
APP_CHECK_PERIOD_S = 30.0
APP_GONE_CHECKS = 3


def index_actor_name(app_name: str) -> str:
    """The index actor's name for a Serve application."""
    return f"hybrid-serve-checkpoint-index:{app_name}"


class CheckpointIndex:
    """The actor (use `get_or_create_index`). Its methods are the SharedIndex's, plus a long
    poll for mirrors."""

    def __init__(self, app_name: str, max_records: int = DEFAULT_MAX_RECORDS,
                 store_budget_bytes: int = 0) -> None:
        self._app_name = app_name
        self._index = SharedIndex(uuid.uuid4().hex, max_records=max_records,
                                  store_budget_bytes=store_budget_bytes)
        self._changed: asyncio.Event | None = None  # made on the actor's loop, on first use
        self._metrics = IndexMetrics(app_name)
        self._watcher: asyncio.Task | None = None
        logger.info("checkpoint index of %r started (incarnation %s)", app_name,
                    self._index.incarnation)

    async def report(self, report: ReplicaReport) -> ReportAck:
        """SharedIndex.apply_report."""
        self._start_watching()
        version = self._index.version
        ack = self._index.apply_report(report)
        self._after_change(version)
        return ack

    async def remove_replica(self, replica_id: str) -> None:
        """SharedIndex.remove_replica (idempotent)."""
        version = self._index.version
        self._index.remove_replica(replica_id)
        self._after_change(version)

    async def set_stored_copy(self, key: RecordKey, copy: StoredCopy | None,
                              record: CheckpointRecord | None = None) -> bool:
        """SharedIndex.set_stored_copy (for the object-store tier)."""
        version = self._index.version
        found = self._index.set_stored_copy(key, copy, record)
        self._after_change(version)
        return found

    async def store_copy(self, key: RecordKey, num_bytes: int, header, *shards,
                         record: CheckpointRecord | None = None) -> bool:
        """Keep a replica's exported checkpoint (header and rank-ordered shards, resolved from
        the object store by Ray: with tensor parallelism the caller passes the refs of the
        objects its ranks put, so the shards come here straight from the ranks' objects, never
        through the replica) as the stored copy of record `key`: put as objects this actor
        owns, then attached (SharedIndex.set_stored_copy). `record`: the checkpoint's record,
        for one the replica no longer holds (passed on by its host tier), put if the index has
        forgotten it. False, nothing kept, when the record is unknown (and none is given), its
        checkpoint already has a copy, or it exceeds the budget."""
        if not self._index.can_store(key, num_bytes, record):
            return False
        locator = await asyncio.to_thread(put_stored, header, shards)
        return await self.set_stored_copy(key, StoredCopy(locator, num_bytes), record)

    async def hottest_stored(self, model_dir: str, kinds: list[str], max_count: int,
                             max_bytes: int) -> list[HotCopy]:
        """SharedIndex.hottest_stored (a starting replica's warm start)."""
        return self._index.hottest_stored(model_dir, kinds, max_count, max_bytes)

    async def records_covering(self, namespace: Namespace, token_ids: list[int]) -> list[CheckpointRecord]:
        """SharedIndex.records_covering (operators and tests)."""
        return self._index.records_covering(tuple(namespace), token_ids)

    async def changes_since(self, incarnation: str | None, version: int,
                            wait_s: float = 5.0) -> IndexDelta | IndexSnapshot:
        """For a mirror at (incarnation, version): the changes since, waiting up to `wait_s`
        for one when there is none yet (an empty delta after that); a snapshot when a delta
        cannot be given (another incarnation, too far behind)."""
        self._start_watching()
        if incarnation == self._index.incarnation and version == self._index.version:
            try:
                await asyncio.wait_for(self._change_event().wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        delta = self._index.delta(incarnation, version)
        return delta if delta is not None else self._index.snapshot()

    async def lookup(self, namespace: Namespace, token_ids: list[int]) -> LookupResult:
        """SharedIndex.lookup (operators and tests; routers use their mirror)."""
        return self._index.lookup(tuple(namespace), token_ids)

    async def stats(self) -> IndexStats:
        return self._index.stats()

    async def incarnation(self) -> str:
        return self._index.incarnation

    # ---- internals ----------------------------------------------------------------------------

    def _change_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _after_change(self, version_before: int) -> None:
        """If the index changed since `version_before` (a heartbeat changes nothing): wake the
        long polls, update the size gauges."""
        if self._index.version == version_before:
            return
        event, self._changed = self._change_event(), asyncio.Event()
        event.set()
        stats = self._index.stats()
        self._metrics.set(stats.records, stats.num_bytes, stats.stored_copies, stats.stored_bytes)

    def _start_watching(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_application())

    async def _watch_application(self) -> None:
        """End this actor (no restart) once the application has been missing from Serve for
        APP_GONE_CHECKS checks in a row."""
        missing = 0
        while True:
            await asyncio.sleep(APP_CHECK_PERIOD_S)
            try:
                present = await asyncio.to_thread(_application_exists, self._app_name)
            except Exception:  # the controller restarting: not evidence the app is gone
                logger.warning("checkpoint index: could not ask Serve for %r", self._app_name,
                               exc_info=True)
                continue
            missing = 0 if present else missing + 1
            if missing >= APP_GONE_CHECKS:
                logger.info("application %r is gone: ending its checkpoint index", self._app_name)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return


def _application_exists(app_name: str) -> bool:
    """Serve lists the application (False too when Serve itself is not running)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return app_name in serve.status().applications
    except RayServeException:  # no Serve instance: shut down
        return False


def get_or_create_index(app_name: str, max_records: int = DEFAULT_MAX_RECORDS,
                        store_budget_bytes: int = 0) -> ActorHandle:
    """The application's index actor, created if it does not exist yet (blocking: a GCS call;
    from an event loop run it in a thread). Whoever creates it sets `max_records` and the
    object-store tier's budget (0: no stored copies)."""
    actor = ray.remote(CheckpointIndex).options(
        name=index_actor_name(app_name), namespace=SERVE_NAMESPACE, get_if_exists=True,
        lifetime="detached", max_restarts=-1, num_cpus=INDEX_NUM_CPUS,
        max_concurrency=1000)
    return actor.remote(app_name, max_records, store_budget_bytes)


def get_index(app_name: str) -> ActorHandle:
    """The application's index actor; raises ValueError when there is none (blocking)."""
    return ray.get_actor(index_actor_name(app_name), namespace=SERVE_NAMESPACE)
