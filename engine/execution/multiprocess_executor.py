"""The engine's executor over one spawned process per tensor-parallel rank on this host.

Used where Ray is not: the in-process LLMEngine at tensor_parallel_size > 1, tests, and the
GPU machine (one process per GPU). The ranks are the same RankWorker the Ray actors run:

    engine process ──pipe──▶ rank 0 process ──torch.distributed──▶ rank 1 .. N-1 processes

A step is one pipe round trip to rank 0, which broadcasts it to the others; so is each
checkpoint transfer (export_shards, import_shards). On CUDA rank r uses
cuda:r; on CPU each rank runs OMP_NUM_THREADS torch threads when that is set, else an equal
share of this host's cores.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection

from engine.checkpoints.shards import ExportShardOp, ImportShardOp
from engine.checkpoints.transfer import CheckpointShard
from engine.engine_config import EngineConfig
from engine.execution.executor import ExecutorDiedError
from engine.interfaces.step_io import RunnerOutput, SchedulerOutput
from engine.parallel.cache_capacity import CacheCapacity

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.2


class MultiprocessExecutor:
    """ModelExecutor over config.tensor_parallel_size spawned rank processes (see module doc).

    The constructor returns once every rank has loaded its shard; it raises RuntimeError with
    rank 0's traceback if loading fails, or ExecutorDiedError if a rank process dies. Call
    shutdown() to stop the processes (they are daemons, so they also end with this process).
    """

    def __init__(self, config: EngineConfig) -> None:
        from engine.execution.rank_worker import Rendezvous

        context = multiprocessing.get_context("spawn")
        world_size = config.tensor_parallel_size
        rendezvous = Rendezvous.on_free_port("127.0.0.1", world_size)
        self._conn, rank0_conn = context.Pipe()
        self._processes = [
            context.Process(
                target=run_rank,
                args=(rank_config(config, rank), rank, rendezvous,
                      rank0_conn if rank == 0 else None),
                name=f"hybrid-serve-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()
        rank0_conn.close()
        self._dead: ExecutorDiedError | None = None
        try:
            self._capacity: CacheCapacity = self._receive(timeout_s=START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def cache_capacity(self) -> CacheCapacity:
        return self._capacity

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send the step to rank 0, which runs the steps it is sent in order (a step sent
        while the one before runs waits in the pipe)."""
        self._send("execute", scheduler_output)

    def collect(self) -> RunnerOutput:
        """Rank 0's answer to the oldest step sent."""
        return self._receive(timeout_s=None)

    def export_shards(self, op: ExportShardOp) -> list[CheckpointShard | None]:
        """Every rank's shard of op's bundle (no step may be in flight: the answer is the next
        one on the pipe)."""
        self._send("export", op)
        return self._receive(timeout_s=None)

    def import_shards(self, op: ImportShardOp, shards: list[CheckpointShard]) -> frozenset[int]:
        """The ranks that imported their shard (no step may be in flight)."""
        self._send("import", (op, list(shards)))
        return self._receive(timeout_s=None)

    def _send(self, command: str, payload) -> None:
        if self._dead is not None:
            raise ExecutorDiedError(str(self._dead))
        try:
            self._conn.send((command, payload))
        except OSError as exc:
            self._dead = ExecutorDiedError(f"rank 0 is gone: {exc!r}")
            raise self._dead from exc

    def shutdown(self) -> None:
        """Stop the rank processes (idempotent). Rank 0 stops on "stop" or on the pipe closing;
        it releases the followers while the group is sound (after a rank died they have
        exited or are exiting on their own). A process still alive after STOP_TIMEOUT_S is
        terminated."""
        if self._dead is None and self._processes and self._processes[0].is_alive():
            try:
                self._conn.send(("stop", None))
            except OSError:
                pass
        self._conn.close()
        for process in self._processes:
            process.join(timeout=STOP_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(timeout=STOP_TIMEOUT_S)
        self._processes = []

    def _receive(self, timeout_s: float | None):
        """Rank 0's answer; raises when a rank process dies first or rank 0 reports failure."""
        waited = 0.0
        while not self._conn.poll(POLL_S):
            dead = [p for p in self._processes if not p.is_alive()]
            if dead and self._conn.poll(POLL_S):
                break  # rank 0's last word (e.g. the traceback of a failed start) comes first
            if dead:
                self._dead = ExecutorDiedError(
                    f"tensor-parallel rank process {dead[0].name} exited (code {dead[0].exitcode})")
                raise self._dead
            waited += POLL_S
            if timeout_s is not None and waited >= timeout_s:
                raise TimeoutError(f"the rank processes did not answer within {timeout_s:.0f} s")
        try:
            status, payload = self._conn.recv()
        except EOFError as exc:
            self._dead = ExecutorDiedError("rank 0 closed its pipe (process died)")
            raise self._dead from exc
        if status == "died":
            self._dead = ExecutorDiedError(payload)
            raise self._dead
        if status == "error":
            raise RuntimeError(f"rank 0 failed:\n{payload}")
        return payload


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config rank `rank` builds its Worker from: on CUDA hosts, its own GPU."""
    if config.device == "cuda" and config.tensor_parallel_size > 1:
        return replace(config, device=f"cuda:{rank}")
    return config


def run_rank(config: EngineConfig, rank: int, rendezvous, conn: Connection | None) -> None:
    """A rank process's main: join the group, then lead (rank 0, commands from `conn`) or
    follow (ranks 1..) until stopped."""
    import torch

    from engine.execution.rank_worker import RankWorker

    if config.device == "cpu":
        share = max(1, (os.cpu_count() or 1) // rendezvous.world_size)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or share))
    try:
        rank_worker = RankWorker(config, rank, rendezvous)
    except BaseException:
        if conn is not None:
            conn.send(("error", traceback.format_exc()))
        raise
    if conn is None:
        rank_worker.follow()
        return
    conn.send(("ok", rank_worker.cache_capacity()))
    lead(rank_worker, conn)


def lead(rank_worker, conn: Connection) -> None:
    """Rank 0's loop: run each command the engine sends ("execute" a step, "export" or
    "import" a checkpoint), in order, until "stop" or the pipe closes. A thread takes the engine's messages off the pipe as they come: with async
    scheduling the engine sends step k+1 while step k runs, and if both that message and step
    k's answer outgrew the pipe's buffer, each end would block in send() on the other."""
    commands: queue.Queue = queue.Queue()

    def receive() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("stop", None)
            commands.put(message)
            if message[0] == "stop":
                return

    threading.Thread(target=receive, name="rank0-steps", daemon=True).start()
    while True:
        command, payload = commands.get()
        if command == "stop":
            rank_worker.stop()
            return
        try:
            conn.send(("ok", run_command(rank_worker, command, payload)))
        except ExecutorDiedError as exc:
            conn.send(("died", str(exc)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def run_command(rank_worker, command: str, payload):
    """Rank 0's answer to one command of the engine's pipe."""
    if command == "execute":
        return rank_worker.execute(payload)
    if command == "export":
        return rank_worker.export_shards(payload)
    if command == "import":
        op, shards = payload
        return rank_worker.import_shards(op, shards)
    raise ValueError(f"unknown command {command!r}")
