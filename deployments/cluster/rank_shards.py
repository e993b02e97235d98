"""A Ray rank actor's own side of moving checkpoints through the object store (issue 20).

    export   put_shard(op)           this rank gathers its shard and ray.put()s it itself; the
                                     caller gets a RemoteShard (rank, bytes, the object's ref),
                                     never the bytes
    import   stage_shard(op, ref)    the caller passes the stored shard's ObjectRef as a top-level
                                     argument, so Ray resolves it here, from the object store;
                                     this rank checks it (check_shard) and holds it (ShardStage)
             import_staged(op, id)   every rank accepted: write the held shard into op's blocks
             discard_staged(id)      some rank rejected, or the engine gave up: drop it

The methods run in the actor's TRANSFER_GROUP thread, beside the step thread (rank 0) or
follow() (ranks 1..), only while no step is in flight: the engine collects its steps first and
sends no step until the transfer call returns, so the caches are idle while they are read or
written here.

Ownership: the object put_shard puts is owned by this actor, so it lives as long as the actor
(the replica's rank group) and a reference to it; the index actor keeps its own copy
(deployments/cluster/index.py `store_copy`), which outlives the replica.
"""

from __future__ import annotations

import logging

import ray

from engine.checkpoints.shards import ExportShardOp, ImportShardOp, ShardStage, ShardVerdict, StageShardOp
from engine.checkpoints.transfer import RemoteShard

logger = logging.getLogger(__name__)

# The rank actors' concurrency group for these calls: one thread, apart from steps and pings.
TRANSFER_GROUP = "transfers"
TRANSFER_THREADS = 1


class ObjectStoreShards:
    """Mixin for the RankWorker a Ray actor runs (deployments/worker_group.RankActor): uses its
    `rank` and `worker` (Worker.export_shard / import_shard)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stage = ShardStage(self.rank)

    def put_shard(self, op: ExportShardOp) -> RemoteShard | None:
        """This rank's shard of op's bundle, put into the object store by this actor (which owns
        it), as a reference; None when this rank does not hold the bundle. Reads the caches."""
        shard = self.worker.export_shard(op)
        if shard is None:
            return None
        return RemoteShard(self.rank, shard.nbytes, ray.put(shard))

    def stage_shard(self, op: StageShardOp, shard: object) -> ShardVerdict:
        """Check the shard Ray resolved for this rank (the caller passed its ObjectRef as this
        top-level argument) and hold it for op.transfer_id if it passes (ShardStage.stage).
        Changes no cache."""
        verdict = self._stage.stage(op, shard)
        if verdict.rejected is not None:
            logger.warning("rank %d rejects its shard (%s): %s", self.rank,
                           verdict.rejected.reason.value, verdict.rejected.detail)
        return verdict

    def import_staged(self, op: ImportShardOp, transfer_id: int) -> bool:
        """Write the shard held for `transfer_id` into op's blocks and keep it as op's bundle
        (Worker.import_shard, which looks at it against the caches once more); False, nothing
        written, when none is held or it does not fit."""
        shard = self._stage.take(transfer_id)
        if shard is None:
            logger.warning("rank %d holds no shard for transfer %d", self.rank, transfer_id)
            return False
        return self.worker.import_shard(op, shard)

    def discard_staged(self, transfer_id: int) -> None:
        """Drop the shard held for `transfer_id`, if any."""
        self._stage.discard(transfer_id)
