"""The object-store tier's format and moves: a stored checkpoint copy as separate Ray objects.

    replica (reporter task)                      CheckpointIndex actor
      engine.export_checkpoint -> ExportedCheckpoint
        (tp > 1: each rank put its own shard;
         the shards are RemoteShard refs)
      store_exported(index, key, exported) --->  store_copy(key, n, header, *shards):
        (refs as top-level arguments: Ray         Ray resolved each shard ref here, from the
         resolves them in the index actor)        object store; ray.put(header), ray.put(each
                                                  shard) -> StoredLocator, owned by the index
                                                  -> the record's StoredCopy
    replica (before a request / at start)
      fetch_stored(copy, by_reference=True) <- ray.get the header only -> ExportedCheckpoint
        of RemoteShards; engine.import_checkpoint hands rank r its shard's ref, the rank
        resolves and checks it (a bad copy is rejected, counted, nothing changed)
      fetch_stored(copy) (tp = 1: the replica is the rank) <- header and shard values

Ownership: Ray 2.60 no longer has `ray.put(..., _owner=...)` (removed in 2.56), so a replica
cannot put an object that another actor owns. The index actor puts the objects itself: the
shards reach `store_copy` as arguments (Ray moves them through the object store; the rank's
or caller's copies are freed once nothing refers to them), and the refs the actor's puts
return are owned by the index, so a stored copy outlives the replica that captured it. It
dies with the index actor (a restarted index starts empty: its copies are lost, fetches of
them fail and the request recomputes).

With tensor parallelism the shard bytes never pass through the replica's process: each rank
actor puts its own shard and the index actor resolves it (export), and each rank actor
resolves its own stored shard (import, deployments/cluster/rank_shards.py). With one rank the model,
and so the rank, is the replica. The shards are CPU tensors in Ray's plain object store, not
Ray's GPU tensor transport (RDT): an RDT object stays in the memory of the actor that created
it until fetched, so it cannot outlive the replica (docs/design.md 6.2).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray

from cache.index_messages import CheckpointRecord, RecordKey
from engine.checkpoints.transfer import CheckpointShard, ExportedCheckpoint, RemoteShard


@dataclass(frozen=True)
class StoredLocator:
    """A stored copy's objects: the CheckpointHeader's and each rank's CheckpointShard's refs
    (rank order). What StoredCopy.locator holds for this tier."""

    header: ray.ObjectRef
    shards: tuple[ray.ObjectRef, ...]
    shard_bytes: tuple[int, ...] = ()  # each shard's tensor bytes when it was put (0: not a shard)


class FetchFailed(Exception):
    """A stored copy could not be fetched: `reason` is "timeout", "lost" (its objects or their
    owner are gone) or "malformed" (not a StoredLocator)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


async def store_exported(index, key: RecordKey, exported: ExportedCheckpoint,
                         record: CheckpointRecord | None = None) -> bool:
    """Ask the index actor (`index`: its handle) to keep `exported` as the stored copy of the
    record `key`; True when it did (False: no such record, a copy of that checkpoint exists,
    or it exceeds the tier's budget). `record`: the record to put if the index has none (a
    checkpoint the replica no longer holds, CheckpointIndex.store_copy). Shards by reference
    go as the call's top-level arguments, their refs only: Ray resolves them inside the index
    actor, from the object store. Raises what the actor call raises."""
    shards = [shard.ref if isinstance(shard, RemoteShard) else shard for shard in exported.shards]
    return await index.store_copy.remote(key, exported.nbytes, exported.header, *shards, record=record)


def put_stored(header, shards: tuple) -> StoredLocator:
    """Put a copy's header and shards as separate objects owned by the calling process (the
    index actor). Blocking."""
    return StoredLocator(ray.put(header), tuple(ray.put(shard) for shard in shards),
                         tuple(s.nbytes if isinstance(s, CheckpointShard) else 0 for s in shards))


async def fetch_stored(locator: object, timeout_s: float, by_reference: bool = False) -> ExportedCheckpoint:
    """The stored copy behind `locator` as an ExportedCheckpoint (not yet checked: the engine's
    import checks it). by_reference: get the header only; the shards are RemoteShards of the
    stored objects, for an engine whose ranks resolve their own. Raises FetchFailed."""
    if not isinstance(locator, StoredLocator) or not all(
            isinstance(ref, ray.ObjectRef) for ref in (locator.header, *locator.shards)):
        raise FetchFailed("malformed", f"not a StoredLocator: {type(locator).__name__}")
    wanted = [locator.header] if by_reference else [locator.header, *locator.shards]
    try:
        header, *shards = await asyncio.wait_for(asyncio.gather(*wanted), timeout_s)
    except asyncio.TimeoutError:
        raise FetchFailed("timeout", f"over {timeout_s} s") from None
    except ray.exceptions.RayError as exc:  # ObjectLostError, OwnerDiedError, ...
        raise FetchFailed("lost", type(exc).__name__) from None
    if by_reference:
        sizes = locator.shard_bytes or (0,) * len(locator.shards)
        shards = [RemoteShard(rank, size, ref)
                  for rank, (size, ref) in enumerate(zip(sizes, locator.shards, strict=True))]
    return ExportedCheckpoint(header, tuple(shards))
