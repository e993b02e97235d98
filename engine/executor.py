"""What the engine needs from whatever runs its steps, and the one failure that ends it.

Three executors implement `ModelExecutor`:
  * engine.worker.Worker: the model in this process (tensor_parallel_size 1);
  * engine.multiprocess_executor.MultiprocessExecutor: one spawned process per rank on this host;
  * deployments.worker_group.RayWorkerGroup: one Ray actor per rank in a placement group.
Each step costs the engine one call, `execute`, whatever the number of ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.step_io import RunnerOutput, SchedulerOutput
    from engine.worker import CacheCapacity


class ModelExecutor(Protocol):
    def cache_capacity(self) -> CacheCapacity:
        """Blocks and state slots every rank allocated (the same on all ranks)."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step on every rank; rank 0's output with all ranks' capture confirmations.
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
