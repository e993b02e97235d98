"""An LLM server replica's side of the object-store tier (checkpoint_transfer, issue 20).

    export   what is worth keeping, off the request path: instruction checkpoints when they
             publish and any bundle that has been hit. Runs after each accepted report, in the
             reporter's task (ReportListener); the index actor puts the copy as objects it owns
             (deployments/cluster/object_copies.py).
    fetch    a CheckpointSource (engine/checkpoints/sources.py): when the engine's scheduler
             is about to admit a request and this replica's IndexMirror lists a stored copy
             covering more of its prompt than the engine holds, and FetchPolicy says the bytes
             are worth the prefill tokens saved, `lookup` starts getting the copy on the
             replica's event loop; the request waits in the scheduler, the engine imports the
             copy when it arrives, and the request restores it like a local one.
    warm     a starting replica imports its application's hottest stored instruction
             checkpoints (`warm_start`), before its constructor returns.
    drain    a stopping replica's last report (LLMServer.__del__) runs the same exports, within
             drain_export_timeout_s.

Every failure here costs a hit, never a request: a fetch that times out, finds its objects
gone, or whose copy the engine rejects (corrupted, truncated, another model...) is counted and
the request computes from scratch. Concurrent requests wanting the same copy share one fetch.
`lookup` runs on the engine's step thread, everything else on the replica's event loop: the
shared fetches are guarded by a lock, the mirror by its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cache.checkpoint_keys import CheckpointKind, Namespace
from cache.index_messages import token_digest
from deployments.cluster.fetch_policy import FetchPolicy
from deployments.cluster.index_mirror import IndexMirror
from deployments.cluster.object_copies import FetchFailed, fetch_stored, store_exported
from engine.checkpoints.capture_events import CheckpointEvent
from engine.checkpoints.transfer import ExportedCheckpoint
from engine.core.async_engine import AsyncLLMEngine

logger = logging.getLogger("ray.serve")

WORTH_EXPORTING_KINDS = frozenset({CheckpointKind.INSTRUCTION})  # exported when published; others once hit
INDEX_CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TierSettings:
    """The tier's AppConfig keys (deployments/config.py)."""

    policy: FetchPolicy
    fetch_timeout_s: float
    warm_start_max_checkpoints: int
    warm_start_max_bytes: int


@dataclass
class TierCounters:
    """What this replica's tier did, cumulative (LLMServer.tier_stats)."""

    exported: int = 0  # copies the index kept
    export_refused: int = 0  # the index refused (a copy exists, over budget, record unknown)
    export_failed: int = 0
    fetched: int = 0  # copies fetched and imported before a request
    recomputed: int = 0  # a longer stored copy existed; not worth it, or failed
    fetch_failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0  # getting the objects, all fetches (by reference: the headers)
    import_seconds: float = 0.0  # by reference: the ranks getting their shards too
    warm_imported: int = 0


@dataclass(frozen=True)
class _Held:
    """A bundle this replica holds, as the tier needs it to export."""

    namespace: Namespace
    token_ids: tuple[int, ...]
    kind: CheckpointKind


class CheckpointTier:
    def __init__(self, engine: AsyncLLMEngine, replica_id: str, model_dir: str,
                 settings: TierSettings, mirror: IndexMirror,
                 connect: Callable[[], Awaitable[object]], metrics=None,
                 shards_by_reference: bool = False) -> None:
        """connect: the index actor's handle (awaited when first needed). metrics: a
        deployments.metrics.TierMetrics, or None (tests). shards_by_reference: the engine's
        ranks are Ray actors that get their own shards (tensor_parallel_size > 1): a fetch
        gets the header only and the import moves the shards, object store to rank.
        Construct it on the replica's event loop, which runs the fetches."""
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._by_reference = shards_by_reference
        self.replica_id = replica_id
        self._model_dir = model_dir
        self.settings = settings
        self._mirror = mirror
        self._connect = connect
        self._index = None
        self._metrics = metrics
        self.counters = TierCounters()
        self._held: dict[int, _Held] = {}  # bundle id -> what it covers
        self._to_export: set[int] = set()  # held bundles worth a stored copy, not yet tried
        self._tried: set[int] = set()  # bundles exported (or refused) once: never again
        self._lock = threading.Lock()  # _fetches and _refused: the step thread and the loop
        self._fetches: dict[tuple, concurrent.futures.Future] = {}  # shared by concurrent requests
        self._refused: set[str] = set()  # copies this engine rejected: not fetched again

    # ---- ReportListener: exports in the reporter's task ------------------------------------

    def fold(self, events: list[CheckpointEvent], hits: dict[int, int]) -> None:
        """Track what this replica holds; instruction checkpoints and hit bundles become
        export candidates (once each)."""
        for event in events:
            if event.action == "published":
                self._held[event.bundle_id] = _Held(event.namespace, event.token_ids, event.kind)
                if event.kind in WORTH_EXPORTING_KINDS:
                    self._to_export.add(event.bundle_id)
            else:
                self._held.pop(event.bundle_id, None)
                self._to_export.discard(event.bundle_id)
        self._to_export.update(b for b in hits if b in self._held)
        self._to_export -= self._tried

    async def after_report(self) -> None:
        """Export the candidates (the index has their records now)."""
        await self.export_pending(deadline=None)

    async def export_pending(self, deadline: float | None) -> int:
        """Export every candidate not already stored (by anyone), oldest first, stopping at
        `deadline` (time.monotonic()). The number of copies the index kept."""
        kept = 0
        for bundle_id in sorted(self._to_export):
            if deadline is not None and time.monotonic() >= deadline:
                break
            self._to_export.discard(bundle_id)
            self._tried.add(bundle_id)
            held = self._held.get(bundle_id)
            if held is None or self._already_stored(held):
                continue
            kept += await self._export(bundle_id, held)
        return kept

    def close(self) -> None:
        """Stop the mirror's sync task."""
        self._mirror.stop()

    # ---- CheckpointSource: fetch for a request the scheduler is about to admit ---------------

    def lookup(self, namespace: Namespace, token_ids: tuple[int, ...], have: int) -> TierFetch | None:
        """A fetch of the stored copy covering the longest prefix of `token_ids`, when it is
        longer than `have` and FetchPolicy says the bytes pay for the tokens saved; it runs on
        the replica's event loop, shared with any request already waiting for the same copy.
        None otherwise. Step thread; never raises."""
        try:
            return self._lookup(namespace, token_ids, have)
        except Exception:
            logger.warning("looking up a stored checkpoint failed", exc_info=True)
            return None

    def _lookup(self, namespace: Namespace, token_ids: tuple[int, ...], have: int) -> TierFetch | None:
        found = self._mirror.lookup_stored(namespace, token_ids)
        if found is None or found.length <= have or not found.stored_copies:
            return None
        copy = found.stored_copies[0]
        locator = _locator_id(copy.locator)
        with self._lock:
            refused = locator in self._refused
        if refused or self.settings.policy.decide(found.length - have, copy.num_bytes) == "recompute":
            self._decided("recomputed")
            return None
        key = (namespace, found.length, token_digest(token_ids[: found.length]))
        with self._lock:
            future = self._fetches.get(key)
            if future is None:
                future = asyncio.run_coroutine_threadsafe(self._fetch(copy), self._loop)
                self._fetches[key] = future
                future.add_done_callback(lambda _: self._forget_fetch(key))
        deadline = time.monotonic() + self.settings.fetch_timeout_s
        return TierFetch(self, future, found.length, deadline, locator)

    def _forget_fetch(self, key: tuple) -> None:
        with self._lock:
            self._fetches.pop(key, None)

    def _settled(self, locator: str, accepted: bool, num_bytes: int) -> None:
        """The engine's import of a fetched copy: published, or rejected (never offered again)."""
        if accepted:
            self.counters.fetched_bytes += num_bytes
            self._decided("fetched")
            return
        self._failed("rejected")
        with self._lock:
            self._refused.add(locator)
        self._decided("recomputed")

    async def _fetch(self, copy) -> ExportedCheckpoint | None:
        """The stored copy's checkpoint (by reference: its header, each rank gets its own shard
        on import), or None when getting it failed (counted by reason)."""
        started = time.monotonic()
        try:
            exported = await fetch_stored(copy.locator, self.settings.fetch_timeout_s, self._by_reference)
        except FetchFailed as failure:
            self._failed(failure.reason)
            return None
        elapsed = time.monotonic() - started
        self.counters.fetch_seconds += elapsed
        self._observe("fetch", elapsed)
        return exported

    async def _fetch_and_import(self, copy) -> bool:
        """Warm start: fetch the copy and import it through the engine's step thread. True when
        it is published here afterwards."""
        exported = await self._fetch(copy)
        if exported is None:
            return False
        started = time.monotonic()
        try:
            result = await self._engine.import_checkpoint(exported)
        except Exception:  # the executor died: the health check reports it
            self._failed("error")
            return False
        self._observe_import(time.monotonic() - started)
        if not result.accepted:
            self._failed("rejected")
            with self._lock:
                self._refused.add(_locator_id(copy.locator))
            return False
        self.counters.fetched_bytes += result.num_bytes
        return True

    # ---- warm start ---------------------------------------------------------------------------

    async def warm_start(self, timeout_s: float) -> int:
        """Import the application's hottest stored instruction checkpoints of this model
        (bounded by warm_start_max_checkpoints and _bytes, and `timeout_s` in all). The number
        imported. Never raises."""
        settings = self.settings
        if settings.warm_start_max_checkpoints < 1:
            return 0
        deadline = time.monotonic() + timeout_s
        try:
            index = await asyncio.wait_for(self._index_handle(), timeout_s)
            hot = await asyncio.wait_for(index.hottest_stored.remote(
                self._model_dir, sorted(WORTH_EXPORTING_KINDS),
                settings.warm_start_max_checkpoints, settings.warm_start_max_bytes), timeout_s)
        except Exception:
            logger.warning("warm start: could not ask the cluster index", exc_info=True)
            return 0
        imported = 0
        for entry in hot:
            if time.monotonic() >= deadline:
                break
            try:
                imported += await asyncio.wait_for(self._fetch_and_import(entry.copy),
                                                   max(0.0, deadline - time.monotonic()))
            except Exception:
                self._failed("timeout")
        self.counters.warm_imported += imported
        logger.info("warm start: imported %d of %d hot checkpoints", imported, len(hot))
        return imported

    # ---- internals ----------------------------------------------------------------------------

    def _already_stored(self, held: _Held) -> bool:
        found = self._mirror.lookup_stored(held.namespace, held.token_ids)
        return found is not None and found.length == len(held.token_ids)

    async def _export(self, bundle_id: int, held: _Held) -> int:
        started = time.monotonic()
        try:
            exported = await self._engine.export_checkpoint(held.namespace, held.token_ids)
            if exported is None:  # evicted meanwhile
                return 0
            index = await self._index_handle()
            kept = await asyncio.wait_for(
                store_exported(index, (self.replica_id, bundle_id), exported),
                INDEX_CALL_TIMEOUT_S)
        except Exception:
            self.counters.export_failed += 1
            logger.warning("exporting checkpoint %d to the object store failed", bundle_id,
                           exc_info=True)
            return 0
        self._observe("export", time.monotonic() - started)
        if kept:
            self.counters.exported += 1
        else:
            self.counters.export_refused += 1
        return int(kept)

    async def _index_handle(self):
        if self._index is None:
            self._index = await self._connect()
        return self._index

    def _decided(self, decision: str) -> None:
        if decision == "fetched":
            self.counters.fetched += 1
        else:
            self.counters.recomputed += 1
        if self._metrics is not None:
            self._metrics.decided(decision)

    def _failed(self, reason: str) -> None:
        self.counters.fetch_failures[reason] = self.counters.fetch_failures.get(reason, 0) + 1
        if self._metrics is not None:
            self._metrics.failed(reason)

    def _observe(self, operation: str, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.observe(operation, seconds)

    def _observe_import(self, seconds: float) -> None:
        self.counters.import_seconds += seconds
        self._observe("import", seconds)


class TierFetch:
    """A CheckpointFetch of the object-store tier: a fetch running on the replica's event loop
    (shared by the requests that want the same copy), seen from the engine's step thread."""

    verified = False  # from another process: checked in full on import

    def __init__(self, tier: CheckpointTier, future: concurrent.futures.Future, num_tokens: int,
                 deadline: float, locator: str) -> None:
        self._tier = tier
        self._future = future
        self._locator = locator
        self._asked = time.monotonic()
        self.num_tokens = num_tokens
        self.deadline = deadline

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> ExportedCheckpoint | None:
        if self._future.cancelled() or self._future.exception() is not None:
            self._tier._failed("error")
            self._tier._decided("recomputed")
            return None
        exported = self._future.result()
        if exported is None:
            self._tier._decided("recomputed")  # the failure was counted by reason
        else:
            self._asked = time.monotonic()  # the import starts now
        return exported

    def settle(self, accepted: bool, num_bytes: int) -> None:
        self._tier._observe_import(time.monotonic() - self._asked)
        self._tier._settled(self._locator, accepted, num_bytes)

    def abandon(self) -> None:
        self._tier._decided("recomputed")


def _locator_id(locator: object) -> str:
    """A stored copy's identity (its header object's id), "" when it has none."""
    header = getattr(locator, "header", None)
    return header.hex() if hasattr(header, "hex") else ""
