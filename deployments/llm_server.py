"""LLM server deployment and the two Ray actors it owns.

    LLMServer (Serve replica)         streams RequestOutputs to the ingress, aborts on disconnect
      -> SchedulerActor (Ray actor)   AsyncLLMEngine: queues, block pool, state pool, step loop
           -> rank actors             deployments.worker_group: one RankWorker per tensor-parallel
                                      rank in a placement group (model shard and its caches)

The scheduler reaches the ranks through RayWorkerExecutor: one actor call to rank 0 per step,
which broadcasts the step to the other ranks (engine/rank_worker.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, replace

import ray
from ray import serve
from ray.actor import ActorHandle

from deployments.config import AppConfig
from deployments.errors import as_api_error
from deployments.worker_group import RayWorkerExecutor, WorkerGroup
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine, PoolUsage, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")

HEALTH_CHECK_TIMEOUT_S = 20.0
# Outputs the scheduler actor may stream ahead of this replica; beyond that it waits and
# coalesces (see `coalesce`), so a lagging consumer receives fewer, larger deltas.
STREAM_BACKPRESSURE_OBJECTS = 2


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one delta (token ids and text concatenated; the
    counters, finish state and logits are the last output's; the API never asks for logits)."""
    if len(outputs) == 1:
        return outputs[0]
    return replace(outputs[-1],
                   new_token_ids=tuple(t for out in outputs for t in out.new_token_ids),
                   new_text="".join(out.new_text for out in outputs))


async def coalesce(outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
    """Re-yield `outputs`, merging all outputs already waiting into one delta.

    A consumer that keeps up gets one output per engine step; one that lags (a busy event loop,
    a slow hop downstream) gets fewer, larger deltas instead of a growing backlog of messages.
    The first output is never delayed. Errors from `outputs` are raised after the outputs that
    preceded them. Closing this generator cancels the reader, which closes `outputs`.
    """
    ready: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()

    async def read() -> None:
        try:
            async for out in outputs:
                ready.put_nowait(out)
        except Exception as exc:  # e.g. InvalidRequestError: hand it to the consumer
            ready.put_nowait(exc)

    reader = asyncio.create_task(read())
    try:
        while True:
            batch = [await ready.get()]
            while not ready.empty():
                batch.append(ready.get_nowait())
            outs = [item for item in batch if not isinstance(item, Exception)]
            if outs:
                merged = merge_outputs(outs)
                yield merged
                if merged.finished:
                    return
            for item in batch:
                if isinstance(item, Exception):
                    raise item
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


@dataclass(frozen=True)
class ModelInfo:
    """What the API layer needs to know about the loaded model."""

    max_model_len: int
    model_dir: str


@ray.remote
class SchedulerActor:
    """Runs AsyncLLMEngine (step loop in a background thread) over the rank actors.

    Async actor: each `generate` call is a streaming generator running concurrently with the
    others on the actor's event loop. Closing or cancelling the stream aborts the request in
    the engine, which frees its KV blocks and state slot.
    """

    def __init__(self, config: EngineConfig, ranks: list[ActorHandle]) -> None:
        self._executor = RayWorkerExecutor(ranks)
        engine = LLMEngine(config, executor=self._executor)
        self._info = ModelInfo(max_model_len=engine.max_model_len, model_dir=config.model_dir)
        self._engine = AsyncLLMEngine(engine)
        self._num_aborted = 0

    def model_info(self) -> ModelInfo:
        return self._info

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        cache_salt: str | None = None,
        instruction_boundary: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; the last one has finished=True.

        Raises InvalidRequestError (first item) when the engine refuses the request.
        """
        outputs = self._engine.generate(request_id, prompt_token_ids, sampling,
                                        cache_salt=cache_salt,
                                        instruction_boundary=instruction_boundary)
        finished = False
        try:
            async for out in coalesce(outputs):
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._num_aborted += 1

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still running (no-op for unknown or finished ids)."""
        self._engine.abort(request_id)

    def pool_usage(self) -> PoolUsage:
        return self._engine.pool_usage()

    def engine_stats(self) -> EngineStats:
        """The engine's counters (checkpoints by kind, restored/computed prompt tokens,
        preemptions, bytes held). Read from this thread while the step thread runs: each field
        is consistent, the snapshot as a whole may be a step apart, which metrics tolerate."""
        return self._engine.engine.stats()

    def num_aborted_requests(self) -> int:
        """Streams that ended before their final output (client gone, cancelled, error)."""
        return self._num_aborted

    async def check_health(self) -> None:
        """Raise if the step loop died, the executor died (a rank failed mid-step), or a rank
        actor is gone (RayActorError) or does not answer."""
        if not self._engine.is_alive():
            raise RuntimeError("the engine step loop or its executor is not running")
        await self._executor.check_health(HEALTH_CHECK_TIMEOUT_S / 2)

    def shutdown(self) -> None:
        self._engine.shutdown()


@serve.deployment
class LLMServer:
    """One model replica: creates its rank actors and scheduler actor and streams generations.

    The actors and the ranks' placement group are owned by this replica, so they go with it;
    `check_health` fails when any of them is dead, and Serve then replaces the replica.
    """

    async def __init__(self, config: AppConfig) -> None:
        engine_config = config.engine_config()
        self._workers = await WorkerGroup.start(engine_config, config.worker_num_cpus)
        self._scheduler = SchedulerActor.options(num_cpus=config.scheduler_num_cpus).remote(
            engine_config, self._workers.ranks)
        self._info: ModelInfo = await self._scheduler.model_info.remote()

    def model_info(self) -> ModelInfo:
        return self._info

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        cache_salt: str | None = None,
        instruction_boundary: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's RequestOutputs (call with handle.options(stream=True)).

        cache_salt: checkpoints are shared only between requests with the same salt.
        instruction_boundary: the renderer-verified end of the leading instructions, or None.
        Raises APIError (400 for requests the engine refuses, 500 otherwise). If the caller
        stops iterating (client disconnect, cancellation) the request is aborted in the engine.
        """
        stream = self._scheduler.generate.options(
            num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKPRESSURE_OBJECTS,
        ).remote(request_id, tuple(prompt_token_ids), sampling, cache_salt, instruction_boundary)
        finished = False
        try:
            async for ref in stream:
                out: RequestOutput = await ref
                finished = out.finished
                yield out
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise as_api_error(exc) from None
        finally:
            if not finished:
                ray.cancel(stream)
                self._scheduler.abort.remote(request_id)

    async def pool_usage(self) -> PoolUsage:
        return await self._scheduler.pool_usage.remote()

    async def num_aborted_requests(self) -> int:
        return await self._scheduler.num_aborted_requests.remote()

    async def engine_stats(self) -> EngineStats:
        return await self._scheduler.engine_stats.remote()

    async def check_health(self) -> None:
        """Serve's health probe: raises if the scheduler or a rank actor is dead or stuck."""
        await asyncio.wait_for(self._scheduler.check_health.remote(), HEALTH_CHECK_TIMEOUT_S)

    def rank_actors(self) -> list[ActorHandle]:
        """The tensor-parallel rank actors, rank order (for operators and fault tests)."""
        return list(self._workers.ranks)

    def __del__(self) -> None:
        try:
            ray.kill(self._scheduler)
            self._workers.shutdown()
        except Exception:  # interpreter shutdown, actors already gone
            pass
