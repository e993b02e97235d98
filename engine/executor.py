"""What the engine needs from whatever runs its steps, and the one failure that ends it.

Three executors implement `ModelExecutor`:
  * engine.worker.Worker: the model in this process (tensor_parallel_size 1);
  * engine.multiprocess_executor.MultiprocessExecutor: one spawned process per rank on this host;
  * deployments.worker_group.RayWorkerExecutor: one Ray actor per rank in a placement group.
Each step costs the engine two calls, whatever the number of ranks: `submit` hands the step to
the ranks and returns without waiting for it; `collect` returns the oldest submitted step's
output. Between the two the engine may submit the next step (EngineConfig.async_scheduling),
so the ranks start it as soon as they finish the one before, while the engine is still
updating its requests from that one's tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.step_io import RunnerOutput, SchedulerOutput
    from engine.cache_capacity import CacheCapacity


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

    def shutdown(self) -> None:
        """Release the ranks (processes, actors); idempotent."""
        ...


class ExecutorDiedError(RuntimeError):
    """A rank died or failed mid-step: the executor cannot run another step.

    Requests in flight cannot finish on this engine; the serving layer answers them with HTTP
    503, reports itself unhealthy and is replaced.
    """
