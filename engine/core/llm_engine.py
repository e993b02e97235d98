"""The in-process engine: one object that takes requests and yields outputs.

Tests, benchmarks and the GPU machine use it directly; the LLM server replica wraps it in
AsyncLLMEngine rather than re-implementing it (with tensor_parallel_size > 1, over an executor
that forwards steps to worker actors).

    engine = LLMEngine(EngineConfig())
    sampling = SamplingParams(max_tokens=8, temperature=0)
    engine.add_request(GenerationRequest("r1", prompt_token_ids, sampling))
    while engine.has_unfinished_requests():
        for output in engine.step():
            print(output.new_text, end="")
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import AutoTokenizer

from cache.cache_manager import CacheManager, PoolUsage
from cache.checkpoint_keys import CheckpointKind, Namespace
from cache.checkpoint_ledger import KindCounters
from cache.eviction import make_order
from engine.checkpoints.capture_events import CheckpointEvent, CheckpointEventFeed
from engine.checkpoints.host_tier import DeviceStaging, HostTier, HostTierCounters
from engine.checkpoints.import_checks import ImportExpectations, expected_shard_layout
from engine.checkpoints.policy import CheckpointPolicy
from engine.checkpoints.prefill_cost import prefill_cost
from engine.checkpoints.sources import CheckpointSource
from engine.checkpoints.transfer import ExportedCheckpoint, model_identity
from engine.core.checkpoint_exchange import CheckpointExchange, ImportResult, TransferCounters
from engine.core.host_demotion import HostDemotion
from engine.core.output_processor import OutputProcessor, RequestOutput
from engine.core.scheduler import Scheduler, SchedulerStats
from engine.engine_config import EngineConfig
from engine.execution.executor import DemotesToHost, ExecutorDiedError, ModelExecutor
from engine.execution.worker import Worker
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.request import FinishReason, Request
from engine.interfaces.sampling_params import InvalidRequestError, output_budget
from engine.interfaces.step_io import RunnerOutput, SchedulerOutput
from engine.models.registry import load_model_config
from engine.parallel.cache_capacity import drafter_kv_layers
from engine.parallel.kv_cache_format import kv_cache_format
from engine.parallel.tensor_parallel import TensorParallel
from engine.speculative.ngram import NgramDrafter
from engine.speculative.policy import AcceptanceGate, SpeculationChoice, resolve_speculation
from engine.speculative.scheduling import SpeculationStats, SpeculativeDecoding, WorkerProposals

__all__ = ["LLMEngine", "ModelExecutor", "RequestOutput", "PoolUsage"]

logger = logging.getLogger(__name__)

# What a request failed by the engine tells its client: nothing about the server's internals
# (the exception is logged with the request ids).
FAILED_REQUEST_MESSAGE = "the server failed while generating this request"


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters (the app exports them as metrics)."""

    scheduler: SchedulerStats
    checkpoints: dict[str, KindCounters]
    checkpoint_bytes: int
    num_checkpoints: int
    checkpoint_events_lost: int = 0  # events the bounded feed forgot, nobody having drained them
    transfers: TransferCounters = field(default_factory=TransferCounters)  # exports and imports
    host_tier: HostTierCounters | None = None  # None: no host tier
    host_tier_bytes: int = 0  # what the host tier holds now
    host_tier_checkpoints: int = 0
    speculation: SpeculationStats = field(default_factory=SpeculationStats)  # drafts proposed, accepted


@dataclass(frozen=True)
class StepTrace:
    """What a step ran and returned (for tests and diagnostics): LLMEngine.last_step is the
    step the last step() call collected, None if it collected none (with async_scheduling,
    the first call after the engine was idle)."""

    scheduler_output: SchedulerOutput
    runner_output: RunnerOutput


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: ModelExecutor | None = None) -> None:
        # speculation left unset is the policy's to decide (engine/speculative/policy.py); every
        # rank's worker resolves it alike from the same inputs
        config, self.speculation_choice = resolve_speculation(config, load_model_config(config.model_dir))
        self.config = config
        self.executor: ModelExecutor = executor if executor is not None else _local_executor(config)
        try:
            self._build(config)
        except BaseException:
            self.executor.shutdown()  # spawned rank processes must not outlive a failed start
            raise

    def _build(self, config: EngineConfig) -> None:
        """Everything beside the executor: tokenizer, scheduler sized from the executor's
        capacity, output processor."""
        capacity = self.executor.cache_capacity()
        self.max_model_len = capacity.max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
        model_config = load_model_config(config.model_dir)
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = _eos_token_ids(model_config.eos_token_ids, self.tokenizer.eos_token_id)
        self.checkpoint_events = CheckpointEventFeed(recording=False)  # record_checkpoint_events
        cache = CacheManager(
            capacity.num_blocks,
            capacity.num_state_slots,
            capacity.block_size,
            checkpoint_bytes=capacity.checkpoint_bytes,
            sizing=capacity.bundle_sizing,
            listener=self.checkpoint_events,
            order=make_order(config.checkpoint_eviction, prefill_cost(model_config),
                             config.checkpoint_value_half_life),
        )
        checkpoints = CheckpointPolicy(
            cache,
            kinds=frozenset(CheckpointKind(kind) for kind in config.checkpoint_slots),
            world_size=capacity.world_size,
            # the worker's capability; the config can only turn it off
            in_pass_capture=capacity.in_pass_capture and config.in_pass_capture,
        )
        self.scheduler = Scheduler(
            cache,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=capacity.max_model_len,
            checkpoints=checkpoints,
            speculation=_speculation(config, self.speculation_choice),
            capture_wait_s=config.capture_wait_s,
        )
        self.transfers = CheckpointExchange(
            cache, self.executor, _import_expectations(config, model_config, capacity),
            world_size=capacity.world_size, enabled=bool(config.checkpoint_slots),
            before_write=self._demote_evicted,
        )
        # The host tier (docs/design.md section 5, Tiers): asked first of the checkpoint sources
        self.host_tier: HostTier | None = None
        self._demotion: HostDemotion | None = None
        if capacity.host_checkpoint_bytes > 0 and config.checkpoint_slots and isinstance(self.executor, DemotesToHost):
            self.host_tier = HostTier(
                capacity.host_checkpoint_bytes,
                make_order(config.checkpoint_eviction, prefill_cost(model_config), config.checkpoint_value_half_life),
                DeviceStaging(torch.device(config.device)))
            self._demotion = HostDemotion(cache, self.executor, self.transfers, self.host_tier)
            self.scheduler.waits.add_source(self.host_tier)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_step: StepTrace | None = None
        # Steps submitted to the executor and not yet collected, oldest first (at most one
        # between step() calls with async_scheduling, none without).
        self._in_flight: deque[SchedulerOutput] = deque()
        self._pending_outputs: list[RequestOutput] = []

    def add_request(self, request: GenerationRequest) -> None:
        """Queue `request`. Raises InvalidRequestError if it can never run: an empty prompt,
        prompt or stop token ids outside the vocabulary, prompt + max_tokens beyond
        max_model_len, a request id still in use, or pause positions / an instruction boundary /
        cache breakpoints outside the prompt."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        namespace = Namespace.of(self.config.model_dir, request.cache_salt)
        # Only the ids past the longest published checkpoint in the namespace are checked (plain
        # ints, in range): a checkpoint's ids were checked when the request that computed them
        # was added, or when it was imported (engine/checkpoints/import_checks.py). Walking an
        # 8,000-token instruction prefix twice took 0.2 ms on the step thread before the
        # request's first launch (benchmarks/restore_host_time.py); the index walk takes a
        # tenth of that. C-level passes; bools and other int subclasses are refused.
        unchecked = prompt[self.longest_checkpoint(namespace, prompt):]
        if unchecked and (set(map(type, unchecked)) != {int} or min(unchecked) < 0
                          or max(unchecked) >= self.vocab_size):
            raise InvalidRequestError(f"prompt token ids must be ints in [0, {self.vocab_size})", "prompt")
        if any(t < 0 or t >= self.vocab_size for t in request.sampling.stop_token_ids):
            # the sampler masks them in the logits (min_tokens): an id outside would fail the step
            raise InvalidRequestError(f"stop token ids must be in [0, {self.vocab_size})", "stop_token_ids")
        output_budget(len(prompt), request.sampling.max_tokens, self.max_model_len)  # or raises
        request_id = request.request_id
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if any(chunk.request_id == request_id for step in self._in_flight for chunk in step.chunks):
            # its output would be taken for the new request's (async scheduling)
            raise InvalidRequestError(
                f"request id {request_id!r} is still in use by the step in flight; retry after the next step()")
        if any(not 0 < p <= len(prompt) for p in request.pause_positions):
            raise InvalidRequestError(f"pause positions must lie in [1, {len(prompt)}]")
        boundary = request.instruction_boundary
        if boundary is not None and not 0 < boundary < len(prompt):
            raise InvalidRequestError(f"instruction_boundary must lie in [1, {len(prompt) - 1}]")
        breakpoints = tuple(sorted(set(request.cache_breakpoints)))
        if any(not 0 < b < len(prompt) for b in breakpoints):
            raise InvalidRequestError(f"cache_breakpoints must lie in [1, {len(prompt) - 1}]")
        pauses = set(request.pause_positions)
        tracked = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=replace(request.sampling, eos_token_ids=self.eos_token_ids),
            pause_positions=tuple(sorted(pauses)),
            namespace=namespace,
            tenant=request.tenant,
            instruction_boundary=boundary,
            cache_breakpoints=breakpoints,
        )
        self.scheduler.add_request(tracked)
        self.output_processor.add_request(tracked)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request; its blocks and state slot are freed now and it yields a final
        output with finish_reason "abort" from the next step(). Unknown ids are ignored."""
        self._finish(request_id, FinishReason.ABORT)

    def fail_all(self, message: str) -> None:
        """End every request with finish_reason "error" (the executor failed)."""
        for request_id in list(self.scheduler.requests):
            self._finish(request_id, FinishReason.ERROR, message)

    def add_checkpoint_source(self, source: CheckpointSource) -> None:
        """Ask `source` for checkpoints this engine does not hold, at each request's first
        admission (engine/checkpoints/sources.py). Step thread only."""
        self.scheduler.waits.add_source(source)

    def only_fetching(self) -> bool:
        """Every unfinished request waits for a checkpoint fetch and nothing else is pending:
        a step() now does nothing but look at the fetches (a caller may pause a moment)."""
        scheduler = self.scheduler
        waiting = scheduler.waits.pending
        return (bool(waiting) and len(waiting) == len(scheduler.requests)
                and not (self._pending_outputs or self._in_flight or scheduler.has_pending_captures()))

    def has_unfinished_requests(self) -> bool:
        """Requests to run or outputs to emit, or checkpoint work the runner has not done yet."""
        return self.scheduler.has_pending_work() or bool(self._pending_outputs or self._in_flight)

    def shutdown(self) -> None:
        """Release the executor's ranks (spawned processes at tensor_parallel_size > 1)."""
        self.executor.shutdown()

    def warming_up(self) -> bool:
        """One-time start work still runs beside serving: the compiled CPU decode step's
        compile (engine/routes/cpu_decode.py). Every step is served meanwhile, decode steps
        eagerly (slower). Any thread."""
        return isinstance(self.executor, Worker) and self.executor.warming_up()

    def pool_usage(self) -> PoolUsage:
        return self.scheduler.usage()

    def stats(self) -> EngineStats:
        ledger = self.scheduler.cache.ledger
        return EngineStats(
            scheduler=replace(self.scheduler.stats),
            checkpoints={kind.value: replace(c) for kind, c in ledger.counters.items()},
            checkpoint_bytes=ledger.bytes_held,
            num_checkpoints=len(ledger),
            checkpoint_events_lost=self.checkpoint_events.num_lost,
            transfers=self.transfers.counters.copy(),
            host_tier=None if self.host_tier is None else self.host_tier.counters.copy(),
            host_tier_bytes=0 if self.host_tier is None else self.host_tier.bytes_held,
            host_tier_checkpoints=0 if self.host_tier is None else len(self.host_tier),
            speculation=self.scheduler.speculation.stats.copy(),
        )

    def record_checkpoint_events(self) -> None:
        """From now on, record the checkpoint events and hits that drain_checkpoint_events and
        drain_checkpoint_hits return (off until called: an engine nobody drains keeps none)."""
        self.checkpoint_events.recording = True

    def drain_checkpoint_events(self) -> list[CheckpointEvent]:
        """Bundles published and published bundles dropped since the last drain, oldest first
        (engine/checkpoints/capture_events.py). Step thread only."""
        return self.checkpoint_events.drain()

    def drain_checkpoint_hits(self) -> dict[int, int]:
        """{bundle id: times a lookup returned it} since the last drain (the cluster index's
        hotness and the replica's "worth exporting" signal). Step thread only."""
        return self.checkpoint_events.drain_hits()

    def longest_checkpoint(self, namespace: Namespace, token_ids: Sequence[int]) -> int:
        """Tokens covered by the longest published checkpoint that is a prefix of `token_ids`
        in `namespace` (0: none). Pins, touches and counts nothing. Step thread only."""
        return self.scheduler.cache.longest_checkpoint(Namespace.of(*namespace), tuple(token_ids))

    def export_checkpoint(self, namespace: Namespace, token_ids: Sequence[int]) -> ExportedCheckpoint | None:
        """The published checkpoint covering exactly `token_ids` in `namespace` ((model_dir,
        cache_salt or "")), with every rank's shard as CPU tensors, or None when none is held
        (docs/design.md section 5.1). Collects the steps in flight first (their outputs come
        with the next step()). Step thread only."""
        self._collect_in_flight()
        return self.transfers.export(Namespace.of(*namespace), tuple(token_ids))

    def import_checkpoint(self, exported: ExportedCheckpoint) -> ImportResult:
        """Check `exported` in full and publish it here, so the next request with its prefix
        restores it; a rejection (ImportResult.rejection) is counted by reason in
        stats().transfers and leaves the engine unchanged. Importing an endpoint already
        published is a no-op success. Collects the steps in flight first. Step thread only."""
        self._collect_in_flight()
        return self.transfers.import_checkpoint(exported)

    def step(self) -> list[RequestOutput]:
        """Schedule and submit one step of every running request; collect, update and emit the
        step before it (EngineConfig.overlaps_steps) or this one.

        A step the executor fails (its submit or collect raises) is abandoned with every step
        in flight, and the engine recovers (Scheduler.requeue_failed): its requests are
        recomputed, each alone until it samples again, and one that has been in
        MAX_FAILED_STEPS failed steps ends with finish_reason "error" and
        FAILED_REQUEST_MESSAGE, after its last token output; the others go on.
        ExecutorDiedError (a rank is gone) is raised instead: nothing can run any more. An
        exception of the engine's own (scheduler, output processor) is raised: the requests'
        state is unknown, the caller fails them (fail_all). Either way the outputs collected
        before it are returned by the next step() call, ahead of any later ones.
        """
        self.last_step = None
        outputs, self._pending_outputs = self._pending_outputs, []  # ends from between steps
        unsubmitted: SchedulerOutput | None = None
        try:
            self._import_fetched()
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.has_work:
                unsubmitted = scheduler_output
                self._demote_evicted()  # before this step may write the evicted bundles' blocks
                _runner_call(self.executor.submit, scheduler_output)
                unsubmitted = None
                self._in_flight.append(scheduler_output)
            keep = int(self.config.overlaps_steps and scheduler_output.has_work)
            while len(self._in_flight) > keep:
                outputs += self._collect_oldest()
        except ExecutorDiedError:
            self._abandon_in_flight(unsubmitted)
            self._pending_outputs = outputs + self._pending_outputs  # for whoever steps next
            raise
        except RunnerFailedError:
            self._recover(self._abandon_in_flight(unsubmitted))
        except BaseException:  # the engine's own: outputs so far stay ahead of what follows
            self._pending_outputs = outputs + self._pending_outputs
            raise
        failures, self._pending_outputs = self._pending_outputs, []
        return outputs + failures

    def _import_fetched(self) -> None:
        """Import the checkpoints whose fetches ended, before the step admits their requests
        (Scheduler.take_fetched put them back at the head of the queue); each source hears how
        its import went. A checkpoint the import checks reject, or whose import fails with an
        error of its own, is only a missed hit: its request recomputes. ExecutorDiedError is
        raised (nothing can run any more)."""
        for fetched in self.scheduler.take_fetched(time.monotonic()):
            if fetched.checkpoint is None:
                continue
            try:
                self._collect_in_flight()
                result = self.transfers.import_checkpoint(fetched.checkpoint, verified=fetched.fetch.verified)
            except ExecutorDiedError:
                raise
            except Exception:
                logger.exception("importing a fetched checkpoint failed; request %s recomputes",
                                 fetched.request_id)
                fetched.fetch.settle(False, 0)
                continue
            fetched.fetch.settle(result.accepted, result.num_bytes)

    def _demote_evicted(self) -> None:
        """Copy the bundles the ledger evicted into the host tier, if there is one
        (engine/core/host_demotion.py)."""
        if self._demotion is not None:
            self._demotion.demote_evicted()

    def _collect_in_flight(self) -> None:
        """Collect every step in flight, so the ranks are idle; their outputs wait in
        _pending_outputs for the next step(). A failed collect is handled as in step()."""
        earlier, self._pending_outputs = self._pending_outputs, []
        outputs: list[RequestOutput] = []
        try:
            while self._in_flight:
                outputs += self._collect_oldest()
        except ExecutorDiedError:
            self._abandon_in_flight(None)
            raise
        except RunnerFailedError:
            self._recover(self._abandon_in_flight(None))
        finally:
            self._pending_outputs = earlier + outputs + self._pending_outputs

    def _recover(self, failed: list[SchedulerOutput]) -> None:
        """Requeue the requests of abandoned steps, or fail those that reached the limit
        (Scheduler.requeue_failed); their outputs go to _pending_outputs."""
        logger.exception("the runner failed a step; requests %s requeued or failed",
                         sorted({c.request_id for step in failed for c in step.chunks}))
        for request_id in self.scheduler.requeue_failed(failed):  # after their last tokens
            self._finish(request_id, FinishReason.ERROR, FAILED_REQUEST_MESSAGE)

    def _collect_oldest(self) -> list[RequestOutput]:
        """Collect the oldest step in flight (it leaves _in_flight once collected), update the
        requests from it, emit their outputs."""
        scheduler_output = self._in_flight[0]
        runner_output = _runner_call(self.executor.collect)
        self._in_flight.popleft()
        self.last_step = StepTrace(scheduler_output, runner_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs = self.output_processor.process(updated, runner_output)
        for output in outputs:  # finished by a stop string, or held by update_from_output
            if output.finished and output.request_id in self.scheduler.requests:
                self.scheduler.finish_request(
                    output.request_id, FinishReason(output.finish_reason), output.num_output_tokens)
        return outputs

    def _abandon_in_flight(self, unsubmitted: SchedulerOutput | None) -> list[SchedulerOutput]:
        """Abandon the step whose submit failed (`unsubmitted`), else the oldest in flight
        (whose collect failed), with every other step in flight; those are collected first,
        their outputs ignored, so the executor holds no step of a failed sequence. Returns the
        abandoned steps, the failed one first."""
        in_flight = list(self._in_flight)
        self._in_flight.clear()
        for _ in in_flight[int(unsubmitted is None):]:
            try:
                self.executor.collect()
            except Exception:
                pass  # failed as well: abandoned all the same
        failed = ([unsubmitted] if unsubmitted is not None else []) + in_flight
        for step in failed:
            self.scheduler.abandon_step(step)
        return failed

    def _finish(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        request = self.scheduler.finish_request(request_id, reason)
        if request is not None:
            self._pending_outputs.append(self.output_processor.finish(request, error))


class RunnerFailedError(RuntimeError):
    """The executor raised while submitting or collecting a step (not ExecutorDiedError)."""


def _runner_call(method, *args):
    """`method(*args)` of the executor, its failures (but ExecutorDiedError) as
    RunnerFailedError: those the engine recovers from (LLMEngine.step)."""
    try:
        return method(*args)
    except ExecutorDiedError:
        raise
    except Exception as exc:
        raise RunnerFailedError(f"{type(exc).__name__}: {exc}") from exc


def _local_executor(config: EngineConfig) -> ModelExecutor:
    """The model in this process, or one spawned process per rank on this host."""
    if config.tensor_parallel_size == 1:
        return Worker(config)
    from engine.execution.multiprocess_executor import MultiprocessExecutor

    return MultiprocessExecutor(config)


def _speculation(config: EngineConfig, choice: SpeculationChoice | None) -> SpeculativeDecoding:
    """The scheduler's speculative decoding: off at num_speculative_tokens 0; the drafter is
    the n-gram prompt lookup (ngram) or the worker's proposals (mtp: engine/speculative/mtp.py).
    Turned on by the policy (`choice`), each request drafts while its acceptance pays
    (AcceptanceGate)."""
    if not config.num_speculative_tokens:
        return SpeculativeDecoding()
    drafters = {"ngram": NgramDrafter, "mtp": lambda: WorkerProposals("mtp")}
    return SpeculativeDecoding(config.num_speculative_tokens, drafters[config.speculative_drafter](),
                               config.speculative_max_batch_size,
                               gate=AcceptanceGate(choice) if choice is not None else None)


def _import_expectations(config: EngineConfig, model_config, capacity) -> ImportExpectations:
    """What this engine accepts of a checkpoint exported elsewhere: its own model, split, block
    size, KV format and every rank's shard layout."""
    world = capacity.world_size
    drafter_layers = drafter_kv_layers(config, model_config)
    kv_format = kv_cache_format(config, model_config, drafter_layers)
    return ImportExpectations(
        model=model_identity(config.model_dir, config.dtype, torch.device(config.device).type),
        tensor_parallel_size=world,
        block_size=capacity.block_size,
        layouts=tuple(expected_shard_layout(model_config, TensorParallel(rank, world), config.dtype,
                                            len(drafter_layers), kv_format.dtype_name)
                      for rank in range(world)),
        vocab_size=model_config.vocab_size,
        max_model_len=capacity.max_model_len,
        kv_cache=kv_format.identity(),
    )


def _eos_token_ids(config_eos: Sequence[int], tokenizer_eos: int | None) -> tuple[int, ...]:
    ids = list(config_eos)
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(tokenizer_eos)
    return tuple(ids)
