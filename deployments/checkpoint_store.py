"""The object-store tier's format and moves: a stored checkpoint copy as separate Ray objects.

    replica (reporter task)                      CheckpointIndex actor
      engine.export_checkpoint -> ExportedCheckpoint
      store_exported(index, key, exported) --->  store_copy(key, header, *shards):
                                                   ray.put(header), ray.put(each shard)
                                                   -> StoredLocator, owned by the index
                                                   -> the record's StoredCopy
    replica (before a request / at start)
      fetch_stored(copy) <- ray.get header and shards -> ExportedCheckpoint
      engine.import_checkpoint (checks everything; a bad copy is rejected, counted)

Ownership: Ray 2.60 no longer has `ray.put(..., _owner=...)` (removed in 2.56), so a replica
cannot put an object that another actor owns. The index actor puts the objects itself: the
replica passes the header and shards as arguments of `store_copy` (Ray moves them through the
object store; the caller's argument copies are freed when the call ends), and the refs the
actor's puts return are owned by the index, so a stored copy outlives the replica that
captured it. It dies with the index actor (a restarted index starts empty: its copies are
lost, fetches of them fail and the request recomputes).

The header and every rank's shard are separate objects, so a rank could fetch only its own.
Today rank 0 gathers all shards at export and scatters them at import (engine/rank_worker.py);
rank-by-rank puts and gets from the rank actors are a follow-up. The shards are CPU tensors:
Ray's GPU tensor transport (`_tensor_transport`, RDT) is not used, since nothing is on a GPU
when it moves (docs/design.md 6.2).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray

from cache.shared_index import RecordKey
from engine.checkpoint_transfer import ExportedCheckpoint


@dataclass(frozen=True)
class StoredLocator:
    """A stored copy's objects: the CheckpointHeader's and each rank's CheckpointShard's refs
    (rank order). What StoredCopy.locator holds for this tier."""

    header: ray.ObjectRef
    shards: tuple[ray.ObjectRef, ...]


class FetchFailed(Exception):
    """A stored copy could not be fetched: `reason` is "timeout", "lost" (its objects or their
    owner are gone) or "malformed" (not a StoredLocator)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


async def store_exported(index, key: RecordKey, exported: ExportedCheckpoint) -> bool:
    """Ask the index actor (`index`: its handle) to keep `exported` as the stored copy of the
    record `key`; True when it did (False: no such record, a copy of that checkpoint exists,
    or it exceeds the tier's budget). Raises what the actor call raises."""
    return await index.store_copy.remote(key, exported.nbytes, exported.header, *exported.shards)


def put_stored(header, shards: tuple) -> StoredLocator:
    """Put a copy's header and shards as separate objects owned by the calling process (the
    index actor). Blocking."""
    return StoredLocator(ray.put(header), tuple(ray.put(shard) for shard in shards))


async def fetch_stored(locator: object, timeout_s: float) -> ExportedCheckpoint:
    """The stored copy behind `locator` as an ExportedCheckpoint (not yet checked: the engine's
    import checks it). Raises FetchFailed."""
    if not isinstance(locator, StoredLocator) or not all(
            isinstance(ref, ray.ObjectRef) for ref in (locator.header, *locator.shards)):
        raise FetchFailed("malformed", f"not a StoredLocator: {type(locator).__name__}")
    try:
        header, *shards = await asyncio.wait_for(
            asyncio.gather(locator.header, *locator.shards), timeout_s)
    except asyncio.TimeoutError:
        raise FetchFailed("timeout", f"over {timeout_s} s") from None
    except ray.exceptions.RayError as exc:  # ObjectLostError, OwnerDiedError, ...
        raise FetchFailed("lost", type(exc).__name__) from None
    return ExportedCheckpoint(header, shards)
