"""A router's local mirror of the cluster checkpoint index, kept current in the background.

Routing a request looks up this mirror (a SharedIndex in the router's own process), never the
index actor: no actor call per request. `run()`, a task of the router's event loop, long-polls
the actor (`CheckpointIndex.changes_since`): each answer is a delta the mirror applies, or a
snapshot that replaces it (first sync, index restarted, mirror too far behind). An answer
comes at least every `wait_s`, so a mirror whose last sync is older than `stale_after_s` is
out of touch (the actor is down, or unreachable): `lookup` then answers None and the router
falls back to power-of-two choices until a sync succeeds again.

An LLM server replica's object-store tier also looks it up from the engine's step thread
(`lookup_stored`): lookups and the sync's changes take a lock, held only while the index is
read or changed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Protocol

from cache.checkpoint_keys import Namespace
from cache.index_messages import IndexDelta, IndexSnapshot, LookupResult
from cache.shared_index import SharedIndex

logger = logging.getLogger("ray.serve")

WAIT_S = 5.0
STALE_AFTER_S = 15.0
RETRY_S = 1.0


class IndexSource(Protocol):
    """What the mirror needs of the index (the actor, or a fake in tests)."""

    async def changes_since(self, incarnation: str | None, version: int,
                            wait_s: float) -> IndexDelta | IndexSnapshot: ...

    def remove_replica(self, replica_id: str) -> None:
        """Fire and forget."""


class ActorIndexSource:
    """IndexSource over the index actor's handle."""

    def __init__(self, handle) -> None:
        self._handle = handle

    async def changes_since(self, incarnation, version, wait_s):
        return await self._handle.changes_since.remote(incarnation, version, wait_s)

    def remove_replica(self, replica_id: str) -> None:
        self._handle.remove_replica.remote(replica_id)


class IndexMirror:
    def __init__(self, connect: Callable[[], Awaitable[IndexSource]], wait_s: float = WAIT_S,
                 stale_after_s: float = STALE_AFTER_S, retry_s: float = RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """connect: makes the source; awaited until it succeeds (the index actor may not
        exist yet: the LLM server replicas create it)."""
        self._connect = connect
        self._wait_s = wait_s
        self._stale_after_s = stale_after_s
        self._retry_s = retry_s
        self._clock = clock
        self._source: IndexSource | None = None
        self._index: SharedIndex | None = None
        self._lock = threading.Lock()  # _index: the sync task and the engine's step thread
        self._synced_at = float("-inf")
        self._task: asyncio.Task | None = None
        self._failing = False

    # ---- used by the router -------------------------------------------------------------------

    def start(self) -> None:
        """Start syncing on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run())

    def lookup(self, namespace: Namespace, token_ids: Sequence[int],
               among: Collection[str]) -> LookupResult | None:
        """The longest prefix of `token_ids` held by a replica in `among` (stored copies are
        of no use to a router), or None when the mirror is not current."""
        with self._lock:
            if self._index is None or self._clock() - self._synced_at > self._stale_after_s:
                return None
            return self._index.lookup(namespace, token_ids, among=among, stored=False)

    def lookup_stored(self, namespace: Namespace, token_ids: Sequence[int]) -> LookupResult | None:
        """The longest prefix of `token_ids` with a stored copy in the object-store tier (an
        LLM server replica deciding whether to fetch), or None when the mirror is not current."""
        with self._lock:
            if self._index is None or self._clock() - self._synced_at > self._stale_after_s:
                return None
            return self._index.lookup(namespace, token_ids, among=(), stored=True)

    def forget_replicas(self, replica_ids: Iterable[str]) -> None:
        """Tell the index these replicas are gone (fire and forget). Safe even if one is
        alive after all: the index then asks it for a full report."""
        if self._source is None:
            return
        for replica_id in replica_ids:
            try:
                self._source.remove_replica(replica_id)
            except Exception:
                logger.warning("could not tell the cluster index %s is gone", replica_id,
                               exc_info=True)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # ---- the sync loop ------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            if not await self.sync_once():
                await asyncio.sleep(self._retry_s)

    async def sync_once(self) -> bool:
        """One long poll; True when the mirror is current afterwards."""
        try:
            if self._source is None:
                self._source = await self._connect()
            incarnation = self._index.incarnation if self._index is not None else None
            version = self._index.version if self._index is not None else 0
            answer = await asyncio.wait_for(
                self._source.changes_since(incarnation, version, self._wait_s),
                self._wait_s + self._stale_after_s)
        except Exception:
            if not self._failing:
                logger.warning("checkpoint index mirror: sync failed; retrying every %.1f s",
                               self._retry_s, exc_info=True)
            self._failing = True
            return False
        with self._lock:
            if isinstance(answer, IndexSnapshot):
                self._index = SharedIndex.from_snapshot(answer)
            elif self._index is None or not self._index.apply_delta(answer):
                # not ours to apply (raced with a restart): ask again from scratch
                self._index = None
                return False
            self._synced_at = self._clock()
        self._failing = False
        return True
