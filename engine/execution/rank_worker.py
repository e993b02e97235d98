"""One rank of a tensor-parallel worker group: joins torch.distributed and holds its Worker shard.

Rank 0 leads every step. It receives the SchedulerOutput (one Ray actor call, or one pipe
message from the engine process), broadcasts it to ranks 1.. over the group's CPU channel
(gloo), runs its own shard, and gathers the other ranks' capture confirmations. Ranks 1.. follow:
`follow()` loops on that broadcast until rank 0 calls `stop()`. A step therefore costs the engine
one round trip whatever the number of ranks.

    ranks:        0                        1 .. N-1
                  execute(step) ───bcast──▶ follow(): receive step
                  Worker.execute ◀─coll.──▶ Worker.execute      (model collectives)
                  gather confirmations ◀─── send confirmations  (only when the step captures)

A checkpoint transfer between steps (docs/design.md section 5.1) travels the same way: rank 0
broadcasts an ExportShardOp and gathers every rank's shard, or broadcasts an ImportShardOp,
scatters each rank its own shard and gathers who imported it.

Failure is fail-fast, because ranks that stop agreeing on the step sequence would wait for each
other in a collective forever: a rank >0 whose step fails exits its process at once (its peers'
collectives then fail on the closed connection), and rank 0 raises ExecutorDiedError for the
failed step and every later one. A single rank (world_size 1) never broadcasts; a failed step
raises for that step only and the engine goes on, as in process (it fails the requests then
unfinished, LLMEngine.fail_all).

The model's collectives use the default group (NCCL on CUDA, gloo on CPU; COLLECTIVE_TIMEOUT);
steps and confirmations travel over a gloo group of their own (IDLE_TIMEOUT), so they never
touch the GPU and an idle server never times out.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.checkpoints.shards import ExportShardOp, ImportShardOp
from engine.checkpoints.transfer import CheckpointShard
from engine.engine_config import EngineConfig
from engine.execution.executor import ExecutorDiedError
from engine.execution.worker import Worker
from engine.interfaces.step_io import RunnerOutput, SchedulerOutput
from engine.parallel.cache_capacity import CacheCapacity
from engine.parallel.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

# How long joining the group, or one of the model's collectives within a step, may wait for a
# peer: a rank that never joins, or a hung collective, fails the group after this instead of
# hanging it (a dead gloo peer fails a collective at once; NCCL's watchdog enforces this one).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# Followers wait for the next step in a broadcast on their own gloo group: an idle server must
# not time out.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet: rank 0's host and a port that was free there."""

    host: str
    port: int
    world_size: int

    @classmethod
    def on_free_port(cls, host: str, world_size: int) -> Rendezvous:
        """A rendezvous on a port the OS hands out as free on `host` (never a fixed port).

        The port is released before the ranks bind it; another process could take it in
        between, in which case joining fails with a clear error and the group is started again.
        """
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        return cls(host=host, port=port, world_size=world_size)


def distributed_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class RankWorker:
    """Rank `rank` of the group that `rendezvous` describes; builds its shard of the model.

    The constructor blocks until all world_size ranks have joined (they must be constructed
    concurrently). config.device is this rank's device ("cuda:3", or "cuda" where the
    launcher already made one GPU visible, or "cpu").
    """

    def __init__(self, config: EngineConfig, rank: int, rendezvous: Rendezvous) -> None:
        backend = distributed_backend(config.device)
        if backend == "nccl":  # "cuda" alone: the one GPU the launcher made visible
            torch.cuda.set_device(torch.device(config.device).index or 0)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{rendezvous.host}:{rendezvous.port}",
            rank=rank,
            world_size=rendezvous.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self._steps = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.rank = rank
        self.world_size = rendezvous.world_size
        self.worker = Worker(config, TensorParallel(rank=rank, world_size=self.world_size))
        self._failure: BaseException | None = None

    def cache_capacity(self) -> CacheCapacity:
        return self.worker.cache_capacity()

    def ping(self) -> int:
        """Liveness probe (answers while a follower is inside follow())."""
        return self.rank

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Rank 0: run one step on every rank. Returns this rank's output, with
        confirmed_captures listing, per bundle, every rank that holds its shard.

        Raises ExecutorDiedError (world_size > 1) if this step or an earlier one failed.
        """
        if self.rank != 0:
            raise RuntimeError(f"execute() is rank 0's; this is rank {self.rank}")
        if self.world_size == 1:
            return self.worker.execute(scheduler_output)
        if self._failure is not None:
            raise ExecutorDiedError(f"the worker group failed earlier: {self._failure!r}")
        try:
            dist.broadcast_object_list([scheduler_output], src=0, group=self._steps)
            output = self.worker.execute(scheduler_output)
            if scheduler_output.captures:
                output.confirmed_captures = self._gather_confirmations(output.confirmed_captures)
        except Exception as exc:
            self._failure = exc
            raise ExecutorDiedError(f"a tensor-parallel step failed: {exc!r}") from exc
        return output

    def export_shards(self, op: ExportShardOp) -> list[CheckpointShard | None]:
        """Rank 0, between steps: every rank's shard of op's bundle, in rank order (None where a
        rank does not hold it). Raises ExecutorDiedError (world_size > 1) as execute() does."""
        if self.world_size == 1:
            return self.worker.export_shards(op)

        def transfer() -> list[CheckpointShard | None]:
            dist.broadcast_object_list([op], src=0, group=self._steps)
            return self._gather(self.worker.export_shard(op))

        return self._lead(transfer)

    def import_shards(self, op: ImportShardOp, shards: list[CheckpointShard]) -> frozenset[int]:
        """Rank 0, between steps: each rank imports its own shard (scattered, not broadcast);
        returns the ranks that did. Raises ExecutorDiedError (world_size > 1) as execute() does."""
        if self.world_size == 1:
            return self.worker.import_shards(op, shards)

        def transfer() -> frozenset[int]:
            dist.broadcast_object_list([op], src=0, group=self._steps)
            mine: list[CheckpointShard | None] = [None]
            dist.scatter_object_list(mine, list(shards), src=0, group=self._steps)
            imported = self._gather(self.worker.import_shard(op, mine[0]))
            return frozenset(rank for rank, done in enumerate(imported) if done)

        return self._lead(transfer)

    def follow(self) -> None:
        """Ranks 1..: run each step (or checkpoint transfer) rank 0 broadcasts until it
        broadcasts the stop message.

        Any failure (the step, or rank 0 gone) ends this process: a rank that cannot take part
        in the next collective must not leave its peers waiting for it.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 leads; it does not follow")
        try:
            while True:
                box: list[SchedulerOutput | ExportShardOp | ImportShardOp | None] = [None]
                dist.broadcast_object_list(box, src=0, group=self._steps)
                message = box[0]
                if message is None:
                    break
                if isinstance(message, ExportShardOp):
                    self._gather(self.worker.export_shard(message))
                elif isinstance(message, ImportShardOp):
                    mine: list[CheckpointShard | None] = [None]
                    dist.scatter_object_list(mine, None, src=0, group=self._steps)
                    self._gather(self.worker.import_shard(message, mine[0]))
                else:
                    output = self.worker.execute(message)
                    if message.captures:
                        self._gather_confirmations(output.confirmed_captures)
        except BaseException:
            logger.exception("tensor-parallel rank %d failed; exiting", self.rank)
            os._exit(1)
        dist.destroy_process_group()

    def stop(self) -> None:
        """Rank 0: release the followers from follow() and leave the group (idempotent)."""
        if not dist.is_initialized():
            return
        if self.rank == 0 and self.world_size > 1 and self._failure is None:
            dist.broadcast_object_list([None], src=0, group=self._steps)
        dist.destroy_process_group()

    def _lead(self, transfer):
        """Rank 0: run `transfer` (collectives with every rank); a failure ends the group."""
        if self.rank != 0:
            raise RuntimeError(f"transfers are led by rank 0; this is rank {self.rank}")
        if self._failure is not None:
            raise ExecutorDiedError(f"the worker group failed earlier: {self._failure!r}")
        try:
            return transfer()
        except Exception as exc:
            self._failure = exc
            raise ExecutorDiedError(f"a tensor-parallel checkpoint transfer failed: {exc!r}") from exc

    def _gather(self, mine):
        """Every rank sends `mine`; rank 0 gets the list in rank order, the others None."""
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self._steps)
        return gathered

    def _gather_confirmations(self, mine: dict[int, frozenset[int]]) -> dict[int, frozenset[int]]:
        """Every rank sends the bundle ids it captured; rank 0 returns bundle -> ranks."""
        gathered: list[set[int] | None] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(set(mine), gathered, dst=0, group=self._steps)
        if gathered is None:
            return mine
        holders: dict[int, set[int]] = {}
        for rank, bundle_ids in enumerate(gathered):
            for bundle_id in bundle_ids or ():
                holders.setdefault(bundle_id, set()).add(rank)
        return {bundle_id: frozenset(ranks) for bundle_id, ranks in holders.items()}
