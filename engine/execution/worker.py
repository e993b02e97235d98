"""The worker: holds the model, its KV and state tensors, and runs one step at a time.

In process it is called directly (submit() launches a step, collect() returns its output, so
the next step can be launched before this one's tokens are read back); under Ray each
tensor-parallel rank's actor holds one (engine/execution/rank_worker.py) and runs execute(), submit then
collect. It knows nothing of queues or requests beyond the SchedulerOutputs it is given and
the tokens its previous step sampled (which a PENDING_TOKEN stands for).

A step's forward pass runs through the first of its forward routes that accepts the step
(with speculation on, the verification graphs and pass of engine/speculative/; then
engine/routes/forward_routes.py's decode and prefill CUDA graphs, on the CPU with
cpu_compile_decode the compiled decode pass of engine/routes/cpu_decode.py, the capturing pass,
the eager pass), each of which builds its own inputs. With the MTP drafter (engine/speculative/mtp.py)
the worker also runs the model's MTP head after the forward and proposes drafts after
sampling. The worker keeps what outlives a step: the caches,
the checkpoints (CheckpointStore), every request's last hidden row (RowRef), the sampled
tokens and the steps in flight.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from engine.checkpoints.bundle_store import CheckpointStore
from engine.checkpoints.shards import (
    ExportShardOp, ImportShardOp, gather_host_shard, gather_shard, scatter_shard, shard_misfit,
)
from engine.checkpoints.transfer import CheckpointShard
from engine.engine_config import EngineConfig
from engine.execution.executor import DemotesToHost
from engine.execution.loader import load_model
from engine.execution.sampler import Sampler
from engine.execution.token_readback import PendingTokens, TokenReadback
from engine.interfaces.output_rows import RowRef, gather_rows
from engine.interfaces.step_io import CaptureOp, RunnerOutput, ScheduledChunk, SchedulerOutput
from engine.parallel.cache_capacity import CacheCapacity, size_caches
from engine.parallel.kv_cache_format import check_kv_cache_device, kv_cache_format
from engine.parallel.memory_budget import needs_free_memory, rank_free_memory
from engine.parallel.tensor_parallel import TensorParallel
from engine.routes.cpu_decode import CompiledDecodePass
from engine.routes.forward_routes import CapturingPass, EagerPass, ForwardRoute, GraphScratch, SampledTokens
from engine.routes.graph_routes import capture_graph_routes
from engine.speculative import worker_setup as speculation
from engine.speculative.mtp import PendingDrafts
from engine.speculative.policy import resolve_speculation
from engine.speculative.verify import verify_greedy

logger = logging.getLogger(__name__)

# A step's tokens are read back while the next one runs: at most two steps in flight.
_MAX_IN_FLIGHT = 2


def store_sampled(pool: torch.Tensor, tokens: torch.Tensor) -> None:
    """pool[:n] = tokens (n,), where the next step reads pending tokens. Nothing to do when they
    are there already (a decode graph's argmax is pool[:n] itself); when they are other rows of
    the same pool (a decode graph's argmax rows after one that sampled nothing), copied first,
    as the two ranges may overlap."""
    if tokens.data_ptr() == pool.data_ptr():
        return
    if tokens.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr():
        tokens = tokens.clone()
    pool[: tokens.shape[0]].copy_(tokens)


class Worker(DemotesToHost):
    """tp: the tensor-parallel rank this worker is (None: the only one). Every rank loads only
    its shard and allocates its own KV heads and state channels. The cache byte budgets are per
    rank; every rank holds as many KV heads, Mamba heads and groups as the others, so the
    capacity (blocks, slots) comes out the same on every rank."""

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        check_kv_cache_device(config, self.device)  # before the weights load: FP8 needs sm_89+
        self.model, self.model_config = load_model(
            config.model_dir, dtype=getattr(torch, config.dtype), device=self.device, tp=tp
        )
        self.rank = self.model.tp.rank
        # speculation left unset: the policy's choice, as LLMEngine resolves it (policy.py)
        config, _ = resolve_speculation(config, self.model_config)
        # budgets from memory_utilization are sized from what the weights left free
        memory = rank_free_memory(self.device, self.model.tp) if needs_free_memory(config) else None
        self.capacity = size_caches(config, self.model_config, self.model.tp, memory)
        # On one CUDA device decode steps and short single-chunk prefill steps replay CUDA
        # graphs (engine/routes/decode_graphs.py, engine/routes/prefill_graphs.py), whose padding rows need a
        # state slot and a KV block that the scheduler never hands out: one of each is
        # allocated past the capacity it is told about.
        graphs = self.device.type == "cuda" and self.model.tp.world_size == 1
        # Speculative decoding (engine/speculative/worker_setup.py): scratch state slots for
        # verification chunks and the MTP drafter's scratch blocks and KV layer, past the rest.
        speculation_needs = speculation.cache_needs(config, self.model, self.model_config, self.capacity)
        if config.num_speculative_tokens:
            # no in-pass captures beside verification chunks (engine/speculative/verify_gpu.py):
            # with speculation on, a capture ends its prefill chunk
            self.capacity = replace(self.capacity, in_pass_capture=False)
        first_scratch_slot = self.capacity.num_state_slots + int(graphs)
        first_draft_block = self.capacity.num_blocks + int(graphs)
        # The KV blocks' format: the model dtype, or FP8 with this rank's heads' static scales.
        kv_format = kv_cache_format(config, self.model_config, speculation_needs.drafter_layers)
        self.caches = self.model.allocate_caches(
            num_blocks=first_draft_block + speculation_needs.num_draft_blocks,
            block_size=self.capacity.block_size,
            num_state_slots=first_scratch_slot + speculation_needs.num_scratch_slots,
            device=self.device,
            drafter_layers=speculation_needs.drafter_layers,
            kv_scale=kv_format.rank_scales(self.model.layout),
        )
        # The forward routes, in the order submit() tries them (_routes): the verification
        # graphs and pass and the decode and prefill graphs where they exist (None otherwise),
        # the capturing pass, the eager pass.
        self.decode_graphs = self.prefill_graphs = None
        scratch = None
        if graphs:
            scratch = GraphScratch(
                max_blocks_per_seq=-(-self.capacity.max_model_len // self.capacity.block_size),
                scratch_slot=self.capacity.num_state_slots,
                scratch_block=self.capacity.num_blocks,
            )
            self.decode_graphs, self.prefill_graphs = capture_graph_routes(
                self.model, self.caches, scratch, config.max_num_seqs, config.max_num_batched_tokens,
            )
        self.capturing_pass = CapturingPass(self.model, self.caches, self.device)
        self.eager_pass = EagerPass(self.model, self.caches, self.device)
        # The CPU's counterpart of the decode graphs (engine/routes/cpu_decode.py), compiled on a
        # thread of its own while the eager pass serves every step: the engine serves at once.
        self.compiled_decode = None
        if config.cpu_compile_decode and self.device.type == "cpu" and self.model.tp.world_size == 1:
            self.compiled_decode = CompiledDecodePass(self.model, self.caches, self.eager_pass, config.max_num_seqs)
            self.compiled_decode.start_warm_up()
        speculative = speculation.build(config, self.model, self.caches, speculation_needs, self.eager_pass,
                                        first_scratch_slot, first_draft_block, scratch)
        self.verification, self.verify_pass = speculative.verification, speculative.verify_pass
        self.verify_graphs, self.drafter = speculative.verify_graphs, speculative.drafter
        self.sampler = Sampler(seed=config.seed, device=self.device)
        self.checkpoints = CheckpointStore(self.caches)
        # Last hidden row of every unfinished request a step computed: what a capture saves.
        # With async scheduling, a request's response capture may come two steps after the
        # last step that computed it (it stopped while the next one was in flight, without it).
        self._last_hidden: dict[str, RowRef] = {}
        # The previous step's sampled tokens on the device (row i: its i-th sampling chunk), in
        # the decode graphs' token pool where they read pending tokens from; request id -> row.
        num_sampled = max(config.max_num_seqs, 1)
        self._sampled = (
            self.decode_graphs.sampled_tokens if self.decode_graphs is not None
            else torch.zeros(num_sampled, dtype=torch.int64, device=self.device)
        )
        self._sampled_rows: dict[str, int] = {}
        self._in_flight: deque[_SubmittedStep] = deque()
        self._token_readback = TokenReadback(num_sampled, self.device, depth=_MAX_IN_FLIGHT)

    def cache_capacity(self) -> CacheCapacity:
        return self.capacity

    def warming_up(self) -> bool:
        """The compiled CPU decode step is still being compiled (steps run eagerly meanwhile)."""
        return self.compiled_decode is not None and self.compiled_decode.warming_up

    def shutdown(self) -> None:
        """Nothing to release in process (ModelExecutor protocol)."""

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step and return its output (submit, then collect); no step may be in flight."""
        if self._in_flight:
            raise RuntimeError("execute() with a step in flight: collect() it first")
        self.submit(scheduler_output)
        return self.collect()

    def collect(self) -> RunnerOutput:
        """The output of the oldest submitted step not yet collected: waits for its sampled
        tokens to reach the host (the step's only wait on the device)."""
        if not self._in_flight:
            raise RuntimeError("collect() with no step in flight")
        step = self._in_flight.popleft()
        started = time.perf_counter()
        tokens = step.tokens.read()
        output = step.output
        output.sampled_token_ids = dict(zip(step.sampled_ids, tokens))
        output.verified_token_ids = {rid: tuple(row.tolist()) for rid, row in output.verified_token_ids.items()}
        # rows asked for (return_logits, a pause position): copied on the device at submit
        output.logits = {rid: row.cpu() for rid, row in output.logits.items()}
        output.hidden_rows = {rid: row.cpu() for rid, row in output.hidden_rows.items()}
        if step.drafts is not None:  # computed before the tokens' copy started: done by now
            output.draft_proposals = step.drafts.read()
        output.worker_seconds += time.perf_counter() - started
        return output

    @torch.inference_mode()
    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Launch one step, in this order: free dropped bundles, commit kept verified positions
        (CommitOp), take captures (from what the previous step left), restore bundles into new
        requests, forward every chunk that has tokens (through the first route that accepts
        them; the MTP head's K/V after it), sample where asked (then the MTP drafter's
        proposals, RunnerOutput.draft_proposals, left on the device until collect); start
        copying the sampled tokens to the host and return without waiting for the device, but
        where the MTP drafter follows a verification chunk: where its drafts start depends on
        how many the chunk accepted, read from the device first. collect() returns the step's output
        (sampled tokens, this rank's capture confirmations); steps are collected in the order
        submitted, and at most two may be in flight.

        A verification chunk (num_draft_tokens) is not sampled: the argmax at each of its
        positions comes back in RunnerOutput.verified_token_ids.
        A chunk whose last token is PENDING_TOKEN is fed the token the previously submitted
        step sampled for its request (ValueError if it sampled none), read on the device."""
        if len(self._in_flight) >= _MAX_IN_FLIGHT:
            raise RuntimeError(f"submit() with {_MAX_IN_FLIGHT} steps in flight: collect() first")
        started = time.perf_counter()
        self.checkpoints.drop(scheduler_output.dropped_bundle_ids)
        for commit in scheduler_output.commits:  # kept verified positions, before any capture
            self._last_hidden[commit.request_id] = RowRef(self.verification.commit(commit), 0, owned=True)
        output = RunnerOutput()
        for capture in scheduler_output.captures:
            if capture.in_pass:
                continue  # taken inside this step's forward pass (CapturingPass)
            hidden_row = self._last_hidden.get(capture.request_id)
            if hidden_row is None:
                continue  # unconfirmed: the scheduler drops the bundle (fail closed)
            self._capture(capture, hidden_row.row(), output)
        computed = [chunk for chunk in scheduler_output.chunks if chunk.token_ids]
        last_hidden = self._rows_kept_over(scheduler_output, computed)
        for restore in scheduler_output.restores:
            restored = self.checkpoints.restore(restore.bundle_id, restore.state_slot, restore.tail_block)
            last_hidden[restore.request_id] = RowRef(restored[None], 0, owned=True)
        previous_sampled = SampledTokens(self._sampled, self._sampled_rows)
        step_logits: dict[str, RowRef] = {}  # logits rows this step's forward computed
        step_argmax: dict[str, RowRef] = {}  # and their argmax
        forward = None
        if computed:
            in_pass = [capture for capture in scheduler_output.captures if capture.in_pass]
            route = next(route for route in self._routes() if route.accepts(computed, in_pass))
            drafter = self.drafter
            rows_before = drafter.rows_before(computed, last_hidden, self._last_hidden) if drafter is not None else {}
            forward = route.run(computed, in_pass, previous_sampled)
            if drafter is not None:  # the MTP head's K/V of every computed position
                drafter.extend(computed, forward, rows_before, previous_sampled)
            for i, chunk in enumerate(computed):
                last_hidden[chunk.request_id] = RowRef(forward.hidden, forward.last_rows[i])
                if forward.logits is not None:
                    step_logits[chunk.request_id] = RowRef(forward.logits, i)
                    step_argmax[chunk.request_id] = RowRef(forward.argmax, i)
            for captured in forward.captured:
                self._capture(captured.capture, captured.hidden_row, output, state=captured.state)
            if self.verify_pass is not None:  # argmax at every position: to the host at collect
                output.verified_token_ids = verify_greedy(self.model, computed, forward, self.verification)
        self._last_hidden = last_hidden
        self.verification.forget(scheduler_output.finished_request_ids)

        for chunk in scheduler_output.chunks:
            if chunk.capture_hidden:
                row = last_hidden[chunk.request_id].row()
                output.hidden_rows[chunk.request_id] = row.to(torch.float32, copy=True)  # to the host at collect
        sampled = [chunk for chunk in scheduler_output.chunks if chunk.sample and not chunk.num_draft_tokens]
        tokens = self._sampled[:0]
        if sampled:
            if all(chunk.request_id in step_logits for chunk in sampled):
                logits = gather_rows([step_logits[chunk.request_id] for chunk in sampled])
                argmax = gather_rows([step_argmax[chunk.request_id] for chunk in sampled])
            else:
                rows = gather_rows([last_hidden[chunk.request_id] for chunk in sampled])
                logits, argmax = self.model.compute_logits(rows), None
            tokens = self._sample(sampled, logits, argmax, output)
            store_sampled(self._sampled, tokens)
        self._sampled_rows = {chunk.request_id: i for i, chunk in enumerate(sampled)}
        drafts = None
        if self.drafter is not None:
            starts = self.drafter.starts(
                scheduler_output.chunks, computed, forward, last_hidden, tokens, self._sampled_rows,
                output.verified_token_ids,
            )
            drafts = self.drafter.propose(starts)
        self._in_flight.append(_SubmittedStep(
            output, [chunk.request_id for chunk in sampled], self._token_readback.start(tokens), drafts,
        ))
        output.worker_seconds = time.perf_counter() - started

    # ---- checkpoint transfer (engine/checkpoints/shards.py); between steps only

    def export_shard(self, op: ExportShardOp) -> CheckpointShard | None:
        """This rank's shard of bundle op.bundle_id (CPU copies), or None if it holds no such
        bundle. Reads the caches and the store only."""
        self._check_idle("export_shard")
        bundle = self.checkpoints.get(op.bundle_id)
        if bundle is None:
            return None
        return gather_shard(self.caches, bundle, op.block_ids, op.num_tokens, self.rank, op.digest)

    @torch.inference_mode()
    def import_shard(self, op: ImportShardOp, shard: CheckpointShard) -> bool:
        """Write `shard` into the fresh blocks op.block_ids and keep it as bundle op.bundle_id;
        True when done. False, with nothing written, when it does not fit these caches (the
        engine checked it already; this is the rank's own look)."""
        self._check_idle("import_shard")
        misfit = shard_misfit(self.caches, shard, op, self.model_config.hidden_size, self.model.dtype)
        if misfit is not None or shard.rank != self.rank:
            logger.warning("rank %d refuses the shard of bundle %d: %s", self.rank, op.bundle_id,
                           misfit or f"it is rank {shard.rank}'s")
            return False
        self.checkpoints.insert(op.bundle_id, scatter_shard(self.caches, shard, op.block_ids))
        return True

    def demote_shards(self, op: ExportShardOp) -> tuple[list[CheckpointShard | None], object | None]:
        """DemotesToHost: this rank's shard of bundle op.bundle_id in host memory (pinned on
        cuda, copied by non-blocking copies on the current stream), and the event that follows
        them (None off cuda). Steps may be in flight: a published bundle's full blocks and
        tensors are written by no step (a request writes K/V only past its restored tokens),
        and the copies are queued before the next step's kernels."""
        bundle = self.checkpoints.get(op.bundle_id)
        if bundle is None:
            return [None], None
        shard = gather_host_shard(self.caches, bundle, op.block_ids, op.num_tokens, self.rank)
        if self.device.type != "cuda":
            return [shard], None
        event = torch.cuda.Event()
        event.record()
        return [shard], event

    def export_shards(self, op: ExportShardOp) -> list[CheckpointShard | None]:
        """ModelExecutor: the shards of every rank, in rank order (here: this one)."""
        return [self.export_shard(op)]

    def import_shards(self, op: ImportShardOp, shards: list[CheckpointShard]) -> frozenset[int]:
        """ModelExecutor: the ranks that imported their shard (here: this one, or none)."""
        return frozenset({self.rank}) if self.import_shard(op, shards[self.rank]) else frozenset()

    def _check_idle(self, what: str) -> None:
        if self._in_flight:
            raise RuntimeError(f"{what}() with a step in flight: collect() it first")

    def _routes(self) -> list[ForwardRoute]:
        """The forward routes in the order submit() tries them (the verification routes and
        the graphs where they exist; the verification routes first, as a lone verification
        chunk would fit a prefill graph); the eager pass takes any step."""
        optional = (self.verify_graphs, self.verify_pass, self.decode_graphs, self.prefill_graphs,
                    self.compiled_decode)
        return [*(route for route in optional if route is not None), self.capturing_pass, self.eager_pass]

    def _capture(
        self, capture: CaptureOp, hidden_row: torch.Tensor, output: RunnerOutput,
        state: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Save the capture's bundle (hidden_row (D,); state: taken in the forward pass, else
        copied from its state slot) and confirm it for this rank in output."""
        self.checkpoints.capture(
            capture.bundle_id, capture.state_slot, capture.num_tokens, capture.tail_block,
            hidden_row, state=state,
        )
        output.confirmed_captures[capture.bundle_id] = frozenset({self.rank})

    def _rows_kept_over(self, scheduler_output: SchedulerOutput, computed: list[ScheduledChunk]) -> dict[str, RowRef]:
        """The last hidden rows of unfinished requests this step neither computes nor restores,
        copied out of earlier steps' outputs (once) before this step's forward overwrites them."""
        replaced = {chunk.request_id for chunk in computed}
        replaced.update(restore.request_id for restore in scheduler_output.restores)
        replaced.update(scheduler_output.finished_request_ids)
        return {rid: ref.kept() for rid, ref in self._last_hidden.items() if rid not in replaced}

    def _sample(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor, argmax: torch.Tensor | None,
        output: RunnerOutput,
    ) -> torch.Tensor:
        """(n,) int64 on the device: one token per chunk from its (V,) logits row (argmax:
        their argmax, when the decode graph computed it); records rows asked for."""
        for i, chunk in enumerate(chunks):
            if chunk.sampling.return_logits:
                output.logits[chunk.request_id] = logits[i].clone()  # to the host at collect
        return self.sampler.sample(
            logits,
            params=[chunk.sampling for chunk in chunks],
            num_output_tokens=[chunk.num_output_tokens for chunk in chunks],
            argmax=argmax,
        )


@dataclass
class _SubmittedStep:
    """A step submitted and not yet collected: its output but for the sampled tokens and the
    MTP drafter's proposals, the request id of each sampled row, their copy to the host, and
    the proposals on the device (None: none)."""

    output: RunnerOutput
    sampled_ids: list[str]
    tokens: PendingTokens
    drafts: PendingDrafts | None = None
