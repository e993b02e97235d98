"""LLM server deployment: one model replica, which runs the engine's step loop itself.

    LLMServer (Serve replica)   AsyncLLMEngine: queues, block pool, state pool, step loop (a
                                thread of this replica); streams RequestOutputs to the ingress
                                and aborts a request whose stream is closed. With one rank
                                (tensor_parallel_size 1) the model runs here too.
      -> rank actors            only with tensor_parallel_size > 1: deployments.worker_group,
                                one RankActor per rank in a placement group (model shard and
                                its caches)

With rank actors the engine reaches them through RayWorkerExecutor: one actor call to rank 0
per step, which broadcasts the step to the other ranks (engine/execution/rank_worker.py). Why the step
loop, and with one rank the model, live in the replica: docs/design.md section 6.

With checkpoint_routing a background task reports the engine's published and dropped
checkpoints, and their hits, to the application's cluster index (deployments/
checkpoint_reporter.py), in one batched actor call every REPORT_PERIOD_S; without it the
engine records none (LLMEngine.record_checkpoint_events is never called).

With checkpoint_transfer the replica also runs its side of the object-store tier
(deployments/cluster/tier.py): the reporter's task exports instruction and hit checkpoints
after each report; the tier is one of the engine's checkpoint sources (engine/checkpoints/
sources.py): when its local IndexMirror lists a stored copy covering more of a prompt than the
engine holds, and FetchPolicy says it pays, the scheduler's request waits while the copy is
fetched and imported, then restores it (`generate` only submits and streams); the
constructor imports the application's hottest stored instruction checkpoints (warm start), and
`__del__`, which Serve awaits on a graceful stop after draining requests, exports what is worth
keeping within drain_export_timeout_s before the engine stops. With a host tier too, what the
host tier evicts is stored there (deployments/cluster/store_demotion.py), below the device and
the host: checkpoint_tier wires the host tier's on_evict before the engine serves requests.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

import torch
from ray import serve
from ray.actor import ActorHandle

from deployments.cluster.fetch_policy import FetchPolicy
from deployments.cluster.index import get_or_create_index
from deployments.cluster.index_mirror import ActorIndexSource, IndexMirror
from deployments.cluster.reporter import ActorIndexClient, CheckpointReporter
from deployments.cluster.store_demotion import DemotionCounters, StoreDemotion
from deployments.cluster.tier import CheckpointTier, TierCounters, TierSettings
from deployments.config import AppConfig
from deployments.frontend import ModelInfo
from deployments.http.errors import as_api_error
from deployments.engine_metrics import EngineMetricsExporter
from deployments.metrics import TierMetrics
from deployments.worker_group import RayWorkerExecutor, WorkerGroup
from engine.core.async_engine import AsyncLLMEngine
from engine.core.llm_engine import EngineStats, LLMEngine, PoolUsage, RequestOutput
from engine.interfaces.generation_request import GenerationRequest

# A step running longer than this makes the replica unhealthy (a hang that no collective
# timeout catches, e.g. outside the model's collectives).
STEP_STALL_S = 600.0
RANK_PING_TIMEOUT_S = 10.0
# The replica's event loop and the engine's step thread share the GIL, which Python hands
# between threads every 5 ms by default, so a request read or a token sent may wait up to that
# long behind the step thread's Python work. Two lean replicas side by side, one with each
# setting, 80 requests each in random order: 0.9 ms lower time to first token (p50) and 3%
# faster decode with 0.5 ms (docs/design.md section 6.1).
GIL_SWITCH_INTERVAL_S = 0.0005


async def replica_health(engine: AsyncLLMEngine, executor: RayWorkerExecutor | None) -> None:
    """Raise if the step loop or the executor died (a rank failed mid-step), a step has run for
    over STEP_STALL_S (TimeoutError: a hang no collective timeout catches), or, with rank actors
    (`executor`), one is gone (RayActorError) or does not answer within RANK_PING_TIMEOUT_S."""
    if not engine.is_alive():
        raise RuntimeError("the engine step loop or its executor is not running")
    if engine.step_running_for() > STEP_STALL_S:
        raise TimeoutError(f"a step has run for over {STEP_STALL_S:.0f} s")
    if executor is not None:
        await executor.check_health(RANK_PING_TIMEOUT_S)


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's identity and counters (operators and tests: which replica served what)."""

    replica_id: str
    engine: EngineStats
    tier: TierCounters | None  # None without checkpoint_transfer
    demotion: DemotionCounters | None = None  # None without checkpoint_transfer and a host tier


def index_connector(config: AppConfig):
    """An async function returning the application's index actor handle (created by the first
    replica that needs it, with the tier's budget). Call inside a Serve replica."""
    app_name = serve.get_replica_context().app_name
    budget = config.checkpoint_store_bytes if config.checkpoint_transfer else 0

    async def connect():
        return await asyncio.to_thread(get_or_create_index, app_name, store_budget_bytes=budget)

    return connect


def checkpoint_tier(engine: AsyncLLMEngine, config: AppConfig) -> tuple[CheckpointTier, StoreDemotion | None]:
    """This replica's side of the object-store tier, its IndexMirror started, and, when the
    engine has a host tier, what the host tier evicts goes to (set as its on_evict). Call
    inside a Serve replica, on its event loop, before the engine serves requests."""
    connect = index_connector(config)

    async def source() -> ActorIndexSource:
        return ActorIndexSource(await connect())

    mirror = IndexMirror(source)
    mirror.start()
    settings = TierSettings(
        policy=FetchPolicy(config.fetch_min_tokens_per_mib, config.fetch_min_tokens),
        fetch_timeout_s=config.fetch_timeout_s,
        warm_start_max_checkpoints=config.warm_start_max_checkpoints,
        warm_start_max_bytes=config.warm_start_max_bytes)
    replica_id = serve.get_replica_context().replica_id.unique_id
    metrics = TierMetrics()
    tier = CheckpointTier(engine, replica_id, config.engine.model_dir, settings, mirror, connect,
                          metrics, shards_by_reference=config.engine.tensor_parallel_size > 1)
    host = engine.engine.host_tier
    if host is None:
        return tier, None
    # what may wait to be stored: as much again as the host tier holds
    demotion = StoreDemotion(replica_id, mirror, connect, host.budget_bytes, metrics)
    host.on_evict = demotion.demote
    return tier, demotion


def checkpoint_reporter(engine: AsyncLLMEngine, config: AppConfig,
                        tier: CheckpointTier | None = None) -> CheckpointReporter:
    """This replica's reporter to its application's index; with the tier, it reports hits
    and runs the tier's exports. Call inside a Serve replica."""
    connect = index_connector(config)

    async def client() -> ActorIndexClient:
        return ActorIndexClient(await connect())

    return CheckpointReporter(
        serve.get_replica_context().replica_id.unique_id, engine.drain_checkpoint_events,
        client, drain_hits=engine.drain_checkpoint_hits, listener=tier)


class LLMServerReplica:
    """One model replica: runs the engine (and with one rank the model), streams generations.
    The classic path's LLMServer deployment; the lean path's LLMServerIngress
    (deployments/llm_server_ingress.py) is this class serving the OpenAI routes too.

    With tensor_parallel_size > 1 the replica starts and owns the rank actors and their
    placement group, so they go with it. `check_health` fails when the step loop or any rank
    is dead or stuck, and Serve then replaces the replica. build_app gives the replica the
    rank's resources when it runs the model itself (llm_server_resources).
    """

    async def __init__(self, config: AppConfig) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # this process is the replica's alone
        self._workers: WorkerGroup | None = None
        self._executor: RayWorkerExecutor | None = None
        if config.engine.tensor_parallel_size > 1:
            self._workers = await WorkerGroup.start(config.engine, config.worker_num_cpus)
            self._executor = RayWorkerExecutor(self._workers.ranks, config.fetch_timeout_s)
        elif not config.engine.device.startswith("cuda"):
            torch.set_num_threads(max(1, int(config.worker_num_cpus)))
        try:
            # loading the model, the tokenizer and sizing the caches blocks: keep the event
            # loop free (executor None: LLMEngine runs the model in this process)
            engine = await asyncio.to_thread(LLMEngine, config.engine, self._executor)
        except BaseException:
            if self._workers is not None:
                self._workers.shutdown()
            raise
        self._info = ModelInfo(max_model_len=engine.max_model_len, model_dir=config.engine.model_dir)
        self._engine = AsyncLLMEngine(engine)
        self._stream_interval = config.stream_interval
        self._num_aborted = 0
        # the engine's counters, pools and queues to Ray's metrics each second, off the step thread
        self._metrics_export = asyncio.create_task(EngineMetricsExporter(engine).run())
        self._reporter: CheckpointReporter | None = None
        self._tier: CheckpointTier | None = None
        self._drain_export_timeout_s = config.drain_export_timeout_s
        self._demotion: StoreDemotion | None = None
        if config.checkpoint_transfer:
            self._tier, self._demotion = checkpoint_tier(self._engine, config)
            await self._tier.warm_start(config.warm_start_timeout_s)
            await self._engine.add_checkpoint_source(self._tier)
        self._checkpoint_events: asyncio.Task | None = None
        if config.checkpoint_routing or config.checkpoint_transfer:
            engine.record_checkpoint_events()  # the reporter drains them (else none are kept)
            self._reporter = checkpoint_reporter(self._engine, config, self._tier)
            self._checkpoint_events = asyncio.create_task(self._reporter.run())

    def model_info(self) -> ModelInfo:
        return self._info

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's RequestOutputs (call with handle.options(stream=True)); the
        last one has finished=True. After the first, each carries AppConfig.stream_interval
        tokens or more (merged on the step thread), and outputs that pile up while the caller
        lags are merged (AsyncLLMEngine.generate's merge_backlog).

        Raises APIError (400 for requests the engine refuses, 503 once the executor died, 500
        otherwise). If the caller stops iterating (client disconnect, cancellation) the request
        is aborted in the engine, which frees its KV blocks and state slot.
        """
        finished = False
        outputs = self._engine.generate(request, self._stream_interval, merge_backlog=True)
        try:
            async with aclosing(outputs):  # closed now, not when collected: that aborts the request
                async for out in outputs:
                    finished = out.finished
                    yield out
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise as_api_error(exc) from None
        finally:
            if not finished:
                self._num_aborted += 1

    def pool_usage(self) -> PoolUsage:
        return self._engine.pool_usage()

    def engine_stats(self) -> EngineStats:
        """The engine's counters (checkpoints by kind, restored/computed prompt tokens,
        preemptions, bytes held). Read from this thread while the step thread runs: each field
        is consistent, the snapshot as a whole may be a step apart, which metrics tolerate."""
        return self._engine.engine.stats()

    def replica_stats(self) -> ReplicaStats:
        """This replica's id, engine counters and tier counters."""
        return ReplicaStats(serve.get_replica_context().replica_id.unique_id,
                            self._engine.engine.stats(),
                            replace(self._tier.counters) if self._tier is not None else None,
                            self._demotion.stats() if self._demotion is not None else None)

    def num_aborted_requests(self) -> int:
        """Streams that ended before their final output (client gone, cancelled, error)."""
        return self._num_aborted

    async def check_health(self) -> None:
        """Serve's health probe (replica_health)."""
        await replica_health(self._engine, self._executor)

    async def warming_up(self) -> bool:
        """The engine's start work still runs beside serving (AsyncLLMEngine.warming_up): the
        compiled CPU decode step compiling while decode steps run eagerly."""
        return self._engine.warming_up()

    def rank_actors(self) -> list[ActorHandle]:
        """The tensor-parallel rank actors, rank order (for operators and fault tests); none
        with one rank, whose model runs in this replica."""
        return list(self._workers.ranks) if self._workers is not None else []

    async def __del__(self) -> None:
        """Serve awaits this once on a graceful stop, after the replica's requests drained
        (ray/serve/_private/replica.py, call_destructor; an async __del__ is accepted there).
        With the tier: the checkpoints the host tier passed on and not yet stored are stored,
        then one last report, whose exports keep what is worth keeping, all bounded by
        drain_export_timeout_s. Then the index forgets this replica (its stored copies stay),
        and the engine and rank actors stop."""
        events = getattr(self, "_checkpoint_events", None)
        if events is not None:
            events.cancel()
        tier, reporter = getattr(self, "_tier", None), getattr(self, "_reporter", None)
        demotion = getattr(self, "_demotion", None)
        if tier is not None and reporter is not None:
            try:
                await asyncio.wait_for(self._drain_exports(reporter, demotion),
                                       self._drain_export_timeout_s)
            except Exception:  # timeout, index gone: what was not exported is lost, no more
                pass
        self._close()

    @staticmethod
    async def _drain_exports(reporter: CheckpointReporter, demotion: StoreDemotion | None) -> None:
        if demotion is not None:
            await demotion.drained()
        await reporter.report_once()

    def _close(self) -> None:
        tier = getattr(self, "_tier", None)
        if tier is not None:
            tier.close()
        demotion = getattr(self, "_demotion", None)
        if demotion is not None:
            demotion.close()
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.close()  # the index forgets this replica's checkpoints (fire and forget)
        events = getattr(self, "_checkpoint_events", None)
        if events is not None:
            events.cancel()
        try:
            self._engine.shutdown()
            if self._workers is not None:
                self._workers.shutdown()
        except Exception:  # interpreter shutdown, actors already gone
            pass


# The classic path's deployment (the lean path's is LLMServerIngress, under the same name).
LLMServer = serve.deployment(name="LLMServer")(LLMServerReplica)
