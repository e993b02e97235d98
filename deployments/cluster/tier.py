"""An LLM server replica's side of the object-store tier (checkpoint_transfer, issue 20).

    export   what is worth keeping, off the request path: instruction checkpoints when they
             publish and any bundle that has been hit. Runs after each accepted report, in the
             reporter's task (ReportListener); the index actor puts the copy as objects it owns
             (deployments/cluster/object_copies.py).
    fetch    before a request reaches the engine (`prepare`): when this replica's IndexMirror
             lists a stored copy covering more of the prompt than the engine's own longest
             checkpoint, and FetchPolicy says the bytes are worth the prefill tokens saved,
             get the copy and import it; the request then restores it like a local one.
    warm     a starting replica imports its application's hottest stored instruction
             checkpoints (`warm_start`), before its constructor returns.
    drain    a stopping replica's last report (LLMServer.__del__) runs the same exports, within
             drain_export_timeout_s.

Every failure here costs a hit, never a request: a fetch that times out, finds its objects
gone, or whose copy the engine rejects (corrupted, truncated, another model...) is counted and
the request computes from scratch. Concurrent requests wanting the same copy share one fetch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cache.checkpoint_keys import CheckpointKind, Namespace
from cache.index_messages import token_digest
from deployments.cluster.object_copies import FetchFailed, fetch_stored, store_exported
from deployments.cluster.fetch_policy import FetchPolicy
from deployments.cluster.index_mirror import IndexMirror
from engine.core.async_engine import AsyncLLMEngine
from engine.checkpoints.capture_events import CheckpointEvent
from engine.interfaces.generation_request import GenerationRequest

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
        gets the header only and the import moves the shards, object store to rank."""
        self._engine = engine
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
        self._fetches: dict[tuple, asyncio.Task] = {}  # shared by concurrent requests
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

    # ---- fetch before a request -------------------------------------------------------------

    async def prepare(self, request: GenerationRequest) -> None:
        """Fetch and import a stored copy for `request` when one covers more of its prompt than
        this replica holds and the policy says it pays. Never raises."""
        try:
            await self._prepare(request)
        except Exception:
            logger.warning("preparing a stored checkpoint failed", exc_info=True)

    async def _prepare(self, request: GenerationRequest) -> None:
        namespace = Namespace.of(self._model_dir, request.cache_salt)
        prompt = tuple(request.prompt_token_ids)
        found = self._mirror.lookup_stored(namespace, prompt)
        if found is None or found.length == 0 or not found.stored_copies:
            return
        local = await self._engine.longest_checkpoint(namespace, prompt)
        if local >= found.length:
            return
        copy = found.stored_copies[0]
        if _locator_id(copy.locator) in self._refused:  # this engine rejected it before
            self._decided("recomputed")
            return
        if self.settings.policy.decide(found.length - local, copy.num_bytes) == "recompute":
            self._decided("recomputed")
            return
        key = (namespace, found.length, token_digest(prompt[: found.length]))
        task = self._fetches.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch_and_import(copy))
            self._fetches[key] = task
            task.add_done_callback(lambda _: self._fetches.pop(key, None))
        imported = await asyncio.shield(task)
        self._decided("fetched" if imported else "recomputed")

    async def _fetch_and_import(self, copy) -> bool:
        """True when the copy is published here afterwards."""
        started = time.monotonic()
        try:
            exported = await fetch_stored(copy.locator, self.settings.fetch_timeout_s, self._by_reference)
        except FetchFailed as failure:
            self._failed(failure.reason)
            return False
        fetched = time.monotonic()
        self.counters.fetch_seconds += fetched - started
        self._observe("fetch", fetched - started)
        try:
            result = await self._engine.import_checkpoint(exported)
        except Exception:  # the executor died: the health check reports it
            self._failed("error")
            return False
        imported = time.monotonic() - fetched
        self.counters.import_seconds += imported
        self._observe("import", imported)
        if not result.accepted:
            self._failed("rejected")
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


def _locator_id(locator: object) -> str:
    """A stored copy's identity (its header object's id), "" when it has none."""
    header = getattr(locator, "header", None)
    return header.hex() if hasattr(header, "hex") else ""
