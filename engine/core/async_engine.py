"""An asyncio face for LLMEngine: a background thread runs the step loop.

Callers on an event loop `generate()` and iterate outputs. Commands (add, abort) reach the
step thread through a queue and are applied between steps, so the engine is only ever touched
by one thread. A stream with a stream_interval above 1 gets its outputs after the first merged
on the step thread until they carry that many tokens, so its event loop wakes once per
stream_interval tokens rather than once per step. Closing or cancelling a generate() iterator
aborts its request, which frees its blocks and state slot.

A step the executor fails is recovered inside LLMEngine.step: a request that breaks every
step it is in ends with an error, the others go on. An exception of the engine's own fails every unfinished
request (LLMEngine.fail_all: their state is unknown) and the loop goes on. When the executor
died (ExecutorDiedError: a tensor-parallel rank is gone) every open stream raises that error,
every later request is refused with it, and is_alive() turns False so the replica is replaced.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from cache.cache_manager import PoolUsage
from engine.checkpoints.capture_events import CheckpointEvent
from engine.checkpoints.sources import CheckpointSource
from engine.checkpoints.transfer import ExportedCheckpoint
from engine.core.checkpoint_exchange import ImportResult
from engine.core.llm_engine import FAILED_REQUEST_MESSAGE, LLMEngine
from engine.core.output_processor import RequestOutput, merge_outputs
from engine.execution.executor import ExecutorDiedError
from engine.interfaces.generation_request import GenerationRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")

# While every open request waits for a checkpoint fetch, the loop looks at the fetches this often
# instead of stepping back to back.
FETCH_POLL_S = 0.001


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    interval: int = 1  # tokens per delivered output after the first
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    held: list[RequestOutput] = field(default_factory=list)
    held_tokens: int = 0
    sent_first: bool = False

    def take(self, output: RequestOutput) -> RequestOutput | None:
        """Step thread: the output to deliver now, merged with those held before it, or None
        while it is held. After the first, outputs are held until they carry `interval` tokens;
        the finished one (an error too) and one with logits are never held."""
        tokens = self.held_tokens + len(output.new_token_ids)
        if self.sent_first and tokens < self.interval and not output.finished and output.logits is None:
            self.held.append(output)
            self.held_tokens = tokens
            return None
        merged = merge_outputs([*self.held, output]) if self.held else output
        self.held, self.held_tokens, self.sent_first = [], 0, True
        return merged


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._dead: ExecutorDiedError | None = None
        self._step_started: float | None = None  # time.monotonic() when the running step() began
        self._thread = threading.Thread(target=self._run_loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    async def generate(self, request: GenerationRequest, stream_interval: int = 1,
                       merge_backlog: bool = False) -> AsyncIterator[RequestOutput]:
        """Add `request` (LLMEngine.add_request) and yield its outputs until the finished one.
        stream_interval: after the first output, each one carries at least this many tokens
        (the outputs of several steps merged), except the finished one. merge_backlog: the
        outputs that piled up while the caller was away are yielded merged into one (a caller
        that lags gets larger deltas, not a growing backlog); outputs with logits never are.

        Raises InvalidRequestError (before yielding anything) if the engine refuses it, and
        ExecutorDiedError (at any point) once the executor has died.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, max(1, stream_interval))
        accepted: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            try:
                if self._dead is not None:
                    raise ExecutorDiedError(str(self._dead))
                self.engine.add_request(request)
            except Exception as exc:  # handed back to the caller, who raises it
                loop.call_soon_threadsafe(_settle, accepted, exc)
                return
            self._streams[request.request_id] = stream
            loop.call_soon_threadsafe(_settle, accepted, None)

        self._submit(add)
        try:
            await accepted  # a refused request raises here
        except asyncio.CancelledError:
            self.abort(request.request_id)  # the add may still have gone through
            raise
        finished = False
        died: ExecutorDiedError | None = None  # found behind outputs merged from the backlog
        try:
            while not finished:
                if died is not None:
                    raise died
                output = await stream.outputs.get()
                if isinstance(output, ExecutorDiedError):
                    raise output
                if merge_backlog and output.logits is None:
                    output, died = _merge_waiting(output, stream.outputs)
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op if unknown or already finished)."""
        self._submit(lambda: self.engine.abort_request(request_id))

    async def drain_checkpoint_events(self) -> list[CheckpointEvent]:
        """LLMEngine.drain_checkpoint_events, run on the step thread between steps."""
        return await self._on_step_thread(self.engine.drain_checkpoint_events)

    async def drain_checkpoint_hits(self) -> dict[int, int]:
        """LLMEngine.drain_checkpoint_hits, run on the step thread between steps."""
        return await self._on_step_thread(self.engine.drain_checkpoint_hits)

    async def longest_checkpoint(self, namespace: tuple[str, str], token_ids: tuple[int, ...]) -> int:
        """LLMEngine.longest_checkpoint, run on the step thread between steps."""
        return await self._on_step_thread(lambda: self.engine.longest_checkpoint(namespace, token_ids))

    async def export_checkpoint(
        self, namespace: tuple[str, str], token_ids: tuple[int, ...],
    ) -> ExportedCheckpoint | None:
        """LLMEngine.export_checkpoint, run on the step thread between steps."""
        return await self._on_step_thread(lambda: self.engine.export_checkpoint(namespace, token_ids))

    async def import_checkpoint(self, exported: ExportedCheckpoint) -> ImportResult:
        """LLMEngine.import_checkpoint, run on the step thread between steps. Raises
        ExecutorDiedError once the executor has died."""
        def run() -> ImportResult:
            if self._dead is not None:
                raise ExecutorDiedError(str(self._dead))
            return self.engine.import_checkpoint(exported)

        return await self._on_step_thread(run)

    async def add_checkpoint_source(self, source: CheckpointSource) -> None:
        """LLMEngine.add_checkpoint_source, run on the step thread between steps."""
        await self._on_step_thread(lambda: self.engine.add_checkpoint_source(source))

    def pool_usage(self) -> PoolUsage:
        return self.engine.pool_usage()

    def warming_up(self) -> bool:
        """LLMEngine.warming_up: start work (a compile) still runs beside serving."""
        return self.engine.warming_up()

    def is_alive(self) -> bool:
        """The step loop runs and its executor has not died."""
        return self._thread.is_alive() and self._dead is None

    def step_running_for(self) -> float:
        """Seconds the step loop has been inside its current LLMEngine.step() (0.0 between
        steps): a step that never returns (a hang no collective timeout catches) shows here."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def shutdown(self) -> None:
        """Stop the step loop, then the engine's executor."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # ------------------------------------------------------------------ step thread

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    async def _on_step_thread(self, function: Callable[[], T]) -> T:
        """function() run on the step thread between steps; its result, or what it raised."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = function()
            except Exception as exc:  # handed back to the caller, who raises it
                loop.call_soon_threadsafe(_settle, done, exc)
                return
            loop.call_soon_threadsafe(_resolve, done, result)

        self._submit(command)
        return await done

    def _run_loop(self) -> None:
        while not self._stopped:
            while not self._commands.empty():
                self._commands.get()()
            if self._dead is not None or not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            self._step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            except ExecutorDiedError as exc:
                logger.error("the executor died; failing every open request: %s", exc)
                self._dead = exc
                for stream in self._streams.values():
                    stream.loop.call_soon_threadsafe(stream.outputs.put_nowait,
                                                     ExecutorDiedError(str(exc)))
                self._streams.clear()
                continue
            except Exception:  # fails the unfinished requests, never the loop
                logger.exception("engine step failed; failing every unfinished request")
                self.engine.fail_all(FAILED_REQUEST_MESSAGE)
                continue
            finally:
                self._step_started = None
            self._deliver(outputs)
            if self.engine.only_fetching():
                self._wakeup.wait(FETCH_POLL_S)  # a new command still wakes the loop at once
                self._wakeup.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams (those a stream holds wait, _Stream.take):
        at most one wake-up of each event loop per step, however many of its streams got an
        output."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            ready = stream.take(output)
            if ready is not None:
                by_loop.setdefault(stream.loop, []).append((stream.outputs, ready))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_put_all, deliveries)


def _merge_waiting(first: RequestOutput, waiting: asyncio.Queue) -> tuple[RequestOutput, ExecutorDiedError | None]:
    """`first` merged with the outputs already waiting behind it (up to a finished one), and the
    ExecutorDiedError found behind them, if any (the stream's last item)."""
    batch = [first]
    while not batch[-1].finished and not waiting.empty():
        item = waiting.get_nowait()
        if isinstance(item, ExecutorDiedError):
            return merge_outputs(batch), item
        batch.append(item)
    return merge_outputs(batch), None


def _put_all(deliveries: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for outputs, output in deliveries:
        outputs.put_nowait(output)


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
