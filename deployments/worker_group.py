"""The tensor-parallel worker actors of one LLM server replica, and the executor over them.

    WorkerGroup.start(config)        placement group (one bundle per rank, STRICT_PACK: one node),
                                     a rendezvous on a free port of bundle 0's node, and one
                                     RankActor per bundle; ranks 1.. enter follow()
    RankActor                        the RankWorker a Ray actor runs; rank 0 runs steps in the
                                     order they were submitted (StepsInOrder)
    RayWorkerExecutor(ranks)         the engine's ModelExecutor inside the LLM server replica: one
                                     actor call to rank 0 per step; health pings every rank;
                                     checkpoint shards by reference, one call per rank (each rank
                                     puts and takes its own shard: deployments/cluster/rank_shards.py)

The replica (LLMServer) owns the group, so the actors and the placement group go with it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.cluster.rank_shards import TRANSFER_GROUP, TRANSFER_THREADS, ObjectStoreShards
from engine.checkpoints.import_checks import ImportRejection, Rejected
from engine.checkpoints.shards import ExportShardOp, ImportShardOp, ShardVerdict, StageShardOp
from engine.checkpoints.transfer import CheckpointShard, RemoteShard
from engine.engine_config import EngineConfig
from engine.execution.executor import ExecutorDiedError, ShardsByReference
from engine.execution.rank_worker import RankWorker, Rendezvous
from engine.interfaces.step_io import RunnerOutput, SchedulerOutput
from engine.parallel.cache_capacity import CacheCapacity

logger = logging.getLogger(__name__)

# Reserving the bundles may wait for the autoscaler to add a node.
PLACEMENT_TIMEOUT_S = 600.0
# Every rank joined and loaded its shard (rank_worker.COLLECTIVE_TIMEOUT bounds the join).
START_TIMEOUT_S = 900.0
# How long a step waits for the steps before it to reach rank 0 (StepsInOrder); one that never
# arrives ends the group instead of blocking every later step.
STEP_ORDER_TIMEOUT_S = 600.0
# A threaded actor: ranks 1.. sit in follow() while health pings still get answered.
RANK_ACTOR_CONCURRENCY = 2
# Rank 0's steps run in a concurrency group of STEP_THREADS threads, and
# StepsInOrder.execute_in_order runs them one at a time, in submission order. A step waiting
# for its turn holds a thread, so there must be a thread for every step that can be queued:
# the engine keeps at most two in flight (ModelExecutor), tools and tests may queue more.
STEP_GROUP = "steps"
STEP_THREADS = 8
# How long the ranks may take to get their shards from the object store on an import by
# reference before the import is rejected (`worker`) and the request computes from scratch.
SHARD_FETCH_TIMEOUT_S = 30.0


class WorkerGroupStartError(RuntimeError):
    """The placement group could not be reserved or a rank failed to load its shard."""


@ray.remote(num_cpus=0)
def _rendezvous_on_this_node(world_size: int) -> Rendezvous:
    return Rendezvous.on_free_port(ray.util.get_node_ip_address(), world_size)


class StepsInOrder:
    """Mixin for an actor whose `execute(scheduler_output)` runs steps: `execute_in_order` runs
    them in the order they were submitted. Ray may start two calls of one caller out of order
    on a threaded actor (each as soon as its arguments have arrived), so rank 0's steps carry
    their submission index and wait for their turn here: step k+1 can be sent while step k
    runs, and still runs after it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._turn = threading.Condition()
        self._next_step = 0

    def execute_in_order(self, step_index: int, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """execute(scheduler_output), once every step with a lower index has run (or failed);
        indices start at 0 and have no gaps (RayWorkerExecutor numbers its submissions)."""
        with self._turn:
            if not self._turn.wait_for(lambda: self._next_step == step_index, STEP_ORDER_TIMEOUT_S):
                raise ExecutorDiedError(f"step {self._next_step} never reached rank 0; step "
                                        f"{step_index} waited {STEP_ORDER_TIMEOUT_S:.0f} s for it")
        try:
            return self.execute(scheduler_output)
        finally:
            with self._turn:
                self._next_step += 1
                self._turn.notify_all()


class RankActor(StepsInOrder, ObjectStoreShards, RankWorker):
    """The RankWorker each Ray rank actor runs, putting and taking its own checkpoint shards."""


@dataclass
class WorkerGroup:
    """One replica's ranks: `ranks[r]` is the RankActor of rank r."""

    ranks: list[ActorHandle]
    placement: PlacementGroup

    @classmethod
    async def start(cls, config: EngineConfig, num_cpus_per_rank: float) -> WorkerGroup:
        """Reserve one bundle per rank ({"CPU": n} on CPU, {"GPU": 1, "CPU": n} on CUDA), start
        the ranks and wait until every rank has loaded its shard."""
        world_size = config.tensor_parallel_size
        on_gpu = config.device.startswith("cuda")
        bundle = {"CPU": num_cpus_per_rank, **({"GPU": 1} if on_gpu else {})}
        placement = placement_group([dict(bundle) for _ in range(world_size)], strategy="STRICT_PACK")
        try:
            await asyncio.wait_for(placement.ready(), PLACEMENT_TIMEOUT_S)
        except asyncio.TimeoutError:
            remove_placement_group(placement)
            raise WorkerGroupStartError(
                f"could not reserve {world_size} x {bundle} on one node within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s (tensor_parallel_size={world_size})"
            ) from None

        def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index)

        rendezvous = await _rendezvous_on_this_node.options(
            scheduling_strategy=in_bundle(0)).remote(world_size)
        rank_actor = ray.remote(concurrency_groups={STEP_GROUP: STEP_THREADS,
                                                    TRANSFER_GROUP: TRANSFER_THREADS})(RankActor)
        ranks = [
            rank_actor.options(
                num_cpus=num_cpus_per_rank, num_gpus=1 if on_gpu else 0,
                max_concurrency=RANK_ACTOR_CONCURRENCY, scheduling_strategy=in_bundle(rank),
            ).remote(config, rank, rendezvous)
            for rank in range(world_size)
        ]
        group = cls(ranks=ranks, placement=placement)
        try:
            await asyncio.wait_for(asyncio.gather(*(actor.ping.remote() for actor in ranks)),
                                   START_TIMEOUT_S)
        except Exception as exc:
            group.shutdown()
            raise WorkerGroupStartError(f"a tensor-parallel rank failed to start: {exc}") from exc
        for actor in ranks[1:]:  # runs until rank 0 stops it; health comes from pings, not this call
            actor.follow.remote()
        return group

    def shutdown(self) -> None:
        for actor in self.ranks:
            ray.kill(actor)
        remove_placement_group(self.placement)


class RayWorkerExecutor(ShardsByReference):
    """The engine's ModelExecutor over a WorkerGroup's actors: one call to rank 0 per step.

    Checkpoint shards move by reference: export_shards gives the RemoteShards each rank put,
    and an import hands each rank its shard's ObjectRef (stage_shards, import_staged), so no
    shard's bytes pass through the engine's process. import_shards (shards by value) is
    rank 0's scatter over the group.

    Called from the engine's step thread (never from an event loop), so the blocking ray.get
    is intended: the step cannot proceed without rank 0's output. shard_timeout_s bounds the
    ranks' fetch of their shards on an import by reference.
    """

    def __init__(self, ranks: list[ActorHandle], shard_timeout_s: float = SHARD_FETCH_TIMEOUT_S) -> None:
        self._ranks = ranks
        self._shard_timeout_s = shard_timeout_s
        self._submitted = 0
        self._in_flight: deque[ray.ObjectRef] = deque()  # rank 0's answers, not yet collected

    def cache_capacity(self) -> CacheCapacity:
        return ray.get(self._ranks[0].cache_capacity.remote())

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send the step to rank 0 without waiting. It is sent at once, even while the step
        before still runs, so it starts the moment that one ends; its index keeps it behind
        that step (StepsInOrder.execute_in_order)."""
        call = self._ranks[0].execute_in_order.options(concurrency_group=STEP_GROUP).remote(
            self._submitted, scheduler_output)
        self._submitted += 1
        self._in_flight.append(call)

    def collect(self) -> RunnerOutput:
        answer = self._in_flight[0]
        try:
            return ray.get(answer)
        except RayActorError as exc:
            raise ExecutorDiedError(f"tensor-parallel rank 0 died: {exc}") from None
        except ExecutorDiedError as exc:  # raised by rank 0, wrapped by Ray
            raise ExecutorDiedError(str(getattr(exc, "cause", exc))) from None
        finally:
            self._in_flight.popleft()

    def export_shards(self, op: ExportShardOp) -> list[RemoteShard | None]:
        """Every rank's shard of a published bundle as a reference to the object that rank put
        (ObjectStoreShards.put_shard, owned by the rank actor: valid while the group lives);
        the engine calls it with no step in flight."""
        return self._call_all([actor.put_shard.options(concurrency_group=TRANSFER_GROUP).remote(op)
                               for actor in self._ranks])

    def import_shards(self, op: ImportShardOp, shards: list[CheckpointShard]) -> frozenset[int]:
        """Shards by value: the ranks that imported theirs (RankWorker.import_shards on rank 0,
        which scatters them); the engine calls it with no step in flight."""
        return self._call_all([self._ranks[0].import_shards.remote(op, list(shards))])[0]

    def stage_shards(self, op: StageShardOp, shards: Sequence[RemoteShard]) -> list[ShardVerdict]:
        """ShardsByReference: rank r gets shards[r].ref as a top-level argument, so Ray resolves
        the object inside the rank actor; each checks and holds its own. A rank whose object
        is lost, or not there within shard_timeout_s, answers `worker`."""
        calls = [actor.stage_shard.options(concurrency_group=TRANSFER_GROUP).remote(op, shard.ref)
                 for actor, shard in zip(self._ranks, shards, strict=True)]
        deadline = time.monotonic() + self._shard_timeout_s
        verdicts = []
        for rank, call in enumerate(calls):
            try:
                verdicts.append(ray.get(call, timeout=max(0.0, deadline - time.monotonic())))
            except RayActorError as exc:
                raise ExecutorDiedError(f"tensor-parallel rank {rank} died: {exc}") from None
            except (GetTimeoutError, RayError) as exc:  # ObjectLostError, OwnerDiedError, ...
                logger.warning("rank %d could not stage its shard", rank, exc_info=True)
                verdicts.append(ShardVerdict(rank, Rejected(
                    ImportRejection.WORKER, f"rank {rank} could not get its shard: {type(exc).__name__}")))
        return verdicts

    def import_staged(self, op: ImportShardOp, transfer_id: int) -> frozenset[int]:
        """ShardsByReference: the ranks that wrote the shard they hold for `transfer_id`."""
        written = self._call_all([
            actor.import_staged.options(concurrency_group=TRANSFER_GROUP).remote(op, transfer_id)
            for actor in self._ranks])
        return frozenset(rank for rank, done in enumerate(written) if done)

    def discard_staged(self, transfer_id: int) -> None:
        """ShardsByReference: every rank drops what it holds for `transfer_id` (not awaited)."""
        for actor in self._ranks:
            actor.discard_staged.options(concurrency_group=TRANSFER_GROUP).remote(transfer_id)

    @staticmethod
    def _call_all(answers: list[ray.ObjectRef]) -> list:
        """The ranks' answers, in order; a dead rank raises ExecutorDiedError."""
        try:
            return ray.get(answers)
        except RayActorError as exc:
            raise ExecutorDiedError(f"a tensor-parallel rank died: {exc}") from None
        except ExecutorDiedError as exc:  # raised by rank 0, wrapped by Ray
            raise ExecutorDiedError(str(getattr(exc, "cause", exc))) from None

    async def check_health(self, timeout_s: float) -> None:
        """Raise RayActorError if any rank is dead, TimeoutError if one does not answer."""
        pings = [actor.ping.remote() for actor in self._ranks]
        try:
            await asyncio.wait_for(asyncio.gather(*pings), timeout_s)
        except (asyncio.TimeoutError, GetTimeoutError):
            raise TimeoutError(f"a tensor-parallel rank did not answer within {timeout_s} s") from None

    def shutdown(self) -> None:
        """The replica owns the actors (WorkerGroup.shutdown); nothing to do here."""
