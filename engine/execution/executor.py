"""What the engine needs from whatever runs its steps, and the one failure that ends it.

Three executors implement `ModelExecutor`:
  * engine.worker.Worker: the model in this process (tensor_parallel_size 1);
  * engine.multiprocess_executor.MultiprocessExecutor: one spawned process per rank on this host;
  * deployments.worker_group.RayWorkerExecutor: one Ray actor per rank in a placement group.
Each step costs the engine two calls, whatever the number of ranks: `submit` hands the step to
the ranks and returns without waiting for it; `collect` returns the oldest submitted step's
output. Between the two the engine may submit the next step (EngineConfig.overlaps_steps),
so the ranks start it as soon as they finish the one before, while the engine is still
updating its requests from that one's tokens.

Moving a checkpoint between engines (docs/design.md section 5.1) costs one call each way,
`export_shards` and `import_shards`, made only with no step in flight. An executor whose ranks
put their shards into an object store themselves (RayWorkerExecutor) also implements
`ShardsByReference`: its export gives references, and it imports references in two phases
(every rank checks its own shard, then all write), so no shard passes through the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.parallel.cache_capacity import CacheCapacity
    from engine.checkpoints.shards import ExportShardOp, ImportShardOp, ShardVerdict, StageShardOp
    from engine.checkpoints.transfer import CheckpointShard, RemoteShard
    from engine.interfaces.step_io import RunnerOutput, SchedulerOutput


class ModelExecutor(Protocol):
    def cache_capacity(self) -> CacheCapacity:
        """Blocks and state slots every rank allocated (the same on all ranks)."""
        ...

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start one step on every rank. Its chunks may end with PENDING_TOKEN: the token the
        step submitted just before sampled for the request. At most two steps are in flight
        (submitted, not collected). Raises ExecutorDiedError when a rank is gone."""
        ...

    def collect(self) -> RunnerOutput:
        """The oldest submitted step's output: rank 0's, with all ranks' capture confirmations.
        Raises ExecutorDiedError when a rank is gone or the ranks can no longer agree."""
        ...

    def export_shards(self, op: ExportShardOp) -> list[CheckpointShard | RemoteShard | None]:
        """Every rank's shard of a published bundle, in rank order (None where a rank does not
        hold it): values, or references for a ShardsByReference executor. No step may be in
        flight. Raises ExecutorDiedError when a rank is gone."""
        ...

    def import_shards(self, op: ImportShardOp, shards: list[CheckpointShard]) -> frozenset[int]:
        """Hand rank r shards[r] to write into op's blocks and keep as op's bundle; returns the
        ranks that did (the bundle is published only if all did). No step may be in flight.
        Raises ExecutorDiedError when a rank is gone."""
        ...

    def shutdown(self) -> None:
        """Release the ranks (processes, actors); idempotent."""
        ...


class ExecutorDiedError(RuntimeError):
    """A rank died or failed mid-step: the executor cannot run another step.

    Requests in flight cannot finish on this engine; the serving layer answers them with HTTP
    503, reports itself unhealthy and is replaced.
    """


class DemotesToHost(ABC):
    """An executor that copies a published bundle to host memory while steps are in flight
    (the model in this process): what the host tier needs to take a bundle the ledger just
    evicted before the next step reuses its blocks (docs/design.md section 5, Tiers)."""

    @abstractmethod
    def demote_shards(self, op: ExportShardOp) -> tuple[list[CheckpointShard | None], object | None]:
        """Every rank's shard of bundle op.bundle_id in host memory (None where a rank does
        not hold it), without checksums, and the event the copies record (None when they are
        done already): the tensors may be read on the host only after it. The copies are
        ordered after the steps in flight and before any step submitted later, so the bundle's
        blocks may be handed out again in the next step."""


class ShardsByReference(ABC):
    """An executor whose ranks take shards from an object store themselves (its export_shards
    gives RemoteShards each rank put). Importing references is two-phase, all with no step in
    flight: stage_shards, then import_staged or discard_staged."""

    @abstractmethod
    def stage_shards(self, op: StageShardOp, shards: Sequence[RemoteShard]) -> list[ShardVerdict]:
        """Rank r resolves shards[r] from the object store, checks it (ShardStage.stage) and
        holds it if it passes; one verdict per rank, in rank order (a rank that could not get
        its object within the executor's timeout answers `worker`). Changes no cache. Raises
        ExecutorDiedError when a rank is gone."""

    @abstractmethod
    def import_staged(self, op: ImportShardOp, transfer_id: int) -> frozenset[int]:
        """Every rank writes the shard it holds for `transfer_id` into op's blocks and keeps it
        as op's bundle; the ranks that did. Raises ExecutorDiedError when a rank is gone."""

    @abstractmethod
    def discard_staged(self, transfer_id: int) -> None:
        """The ranks drop what they hold for `transfer_id` (without waiting for them)."""
