"""The forward routes of a step: each takes the step's computed chunks, builds its own inputs,
runs the model's forward pass and returns the rows the worker keeps.

A route answers two questions (ForwardRoute): does it take this step (`accepts`), and what
did the forward compute (`run`, a RouteOutput). The worker tries its routes in one order and
runs the first that accepts the step:

  DecodeGraphRunner (engine/routes/decode_graphs.py)    every chunk one token; one CUDA device;
                                                inputs staged into its graphs' static buffers
  PrefillGraphRunner (engine/routes/prefill_graphs.py) one short prefill chunk, no in-pass capture;
                                                one CUDA device; its graphs' static buffers
  CompiledDecodePass (engine/routes/cpu_decode.py) every chunk one token; the CPU, one rank,
                                                cpu_compile_decode on; graphs compiled at start
  CapturingPass                                 a step with in-pass captures (CUDA, one rank)
  EagerPass                                     any step: a ForwardBatch, and on CUDA a
                                                GpuBatchPlan copied to the device

Every route decides the step's kernel choices once, when it builds its plan (GpuBatchPlan's
kernel_choices), and hands the plan to the model; the layers read it. The one choice left to
a layer is the single-row GEMM, which the linear layers take by the operands' shapes
(routes_to_skinny in engine/layers/parallel_linear.py), because the same layer serves every
route. The
worker keeps what outlives a step (caches, checkpoints, hidden-row lifetimes, sampled tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches, build_forward_batch
from engine.interfaces.host_index import int64_array, to_device
from engine.interfaces.request import PENDING_TOKEN
from engine.interfaces.step_io import CaptureOp, ScheduledChunk
from engine.kernels.gpu.batch_plan import GpuBatchPlan, build_gpu_batch_plan, with_in_pass_captures


@dataclass(frozen=True)
class SampledTokens:
    """The previous step's sampled tokens, which a chunk's PENDING_TOKEN stands for: pool (S,)
    int64 on the device (row i: that step's i-th sampling chunk) and rows, request id -> its
    row."""

    pool: torch.Tensor
    rows: dict[str, int]


@dataclass(frozen=True)
class CapturedState:
    """An in-pass capture taken during the forward: the hidden row at its position (D,) and
    the recurrent state there, every recurrent layer's state slot (conv (L_r, C, K-1), ssm
    (L_r, *recurrent slot) fp32: Mamba2's (H, P, N) or the gated delta-net's (Hv, dk, dv))."""

    capture: CaptureOp
    hidden_row: torch.Tensor
    state: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class RouteOutput:
    """What a route's forward computed for the step's n chunks: hidden (R, D) rows of the model's
    output, last_rows[i] the row of chunk i's last token; logits (n, V) fp32 and their argmax
    (n,) int64 when the route ran the LM head too (row i = chunk i), else None; captured: the
    in-pass captures it took. Rows that a CUDA graph wrote are valid until its next replay."""

    hidden: torch.Tensor
    last_rows: Sequence[int]
    logits: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    captured: tuple[CapturedState, ...] = ()


class ForwardRoute(Protocol):
    def accepts(self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp] = ()) -> bool:
        """Whether this route runs a step of these chunks (each with tokens) and in-pass
        captures."""
        ...

    def run(
        self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp], sampled: SampledTokens
    ) -> RouteOutput:
        """The step's forward pass (accepts() must hold): writes the chunks' KV and state slots
        in the caches; a chunk's PENDING_TOKEN is read from `sampled` (ValueError if it has no
        row there)."""
        ...


@dataclass(frozen=True)
class GraphScratch:
    """Where a CUDA graph runner's padding rows go, and how wide its block tables are: a state
    slot and a KV block no request ever owns (the worker allocates them past the capacity it
    reports to the scheduler); a chunk with a longer block table runs eagerly."""

    max_blocks_per_seq: int
    scratch_slot: int
    scratch_block: int


class EagerPass:
    """Any step, without graphs: the chunks flattened into a ForwardBatch, each pending token
    read on the device from the previous step's sampled tokens, and on CUDA the batch's
    GpuBatchPlan (one host-to-device copy); then the model's forward. On CUDA the Mamba
    mixers' gated-norm fold is asked of the model once, here (its weights are loaded)."""

    def __init__(self, model, caches: ModelCaches, device: torch.device) -> None:
        self.model = model
        self.caches = caches
        self.device = device
        self.fold_gated_norm = device.type == "cuda" and model.folds_gated_norm()

    def accepts(self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp] = ()) -> bool:
        return True

    def run(
        self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp], sampled: SampledTokens
    ) -> RouteOutput:
        batch, plan = self.inputs(chunks, sampled)
        hidden = self.model(batch, self.caches, gpu_plan=plan)  # (T, D)
        return RouteOutput(hidden, [end - 1 for end in batch.cu_seqlens[1:]])

    def inputs(
        self, chunks: list[ScheduledChunk], sampled: SampledTokens
    ) -> tuple[ForwardBatch, GpuBatchPlan | None]:
        """The step's ForwardBatch, pending tokens fed, and its plan (None off CUDA)."""
        batch = self.batch(chunks, sampled)
        return batch, self.plan(batch)

    def batch(self, chunks: list[ScheduledChunk], sampled: SampledTokens) -> ForwardBatch:
        """The ForwardBatch of `chunks`, each pending token fed from `sampled` on the device."""
        batch = build_forward_batch(chunks, self.caches.block_size, self.device)
        _feed_pending_tokens(batch, chunks, sampled)
        return batch

    def plan(self, batch: ForwardBatch) -> GpuBatchPlan | None:
        """`batch`'s GpuBatchPlan on CUDA (one host-to-device copy), None off CUDA."""
        if self.device.type != "cuda":
            return None
        return build_gpu_batch_plan(
            batch, self.caches.block_size, self.device, fold_gated_norm=self.fold_gated_norm
        )


class CapturingPass(EagerPass):
    """A step with in-pass captures (at most one per chunk, each strictly inside its request's
    prefill chunk): the eager pass whose plan also says where each recurrent layer (Mamba2 or
    gated delta-net) writes the states at the capture positions, in buffers shaped as the
    caches' state slots (the model's recurrent_state_shape). CUDA path only (ValueError
    elsewhere)."""

    def accepts(self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp] = ()) -> bool:
        return bool(in_pass)

    def run(
        self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp], sampled: SampledTokens
    ) -> RouteOutput:

        batch, plan = self.inputs(chunks, sampled)
        if plan is None:
            raise ValueError("in-pass capture needs the CUDA path")
        index = {chunk.request_id: i for i, chunk in enumerate(chunks)}
        splits = {index[c.request_id]: c.num_tokens - chunks[index[c.request_id]].start_position
                  for c in in_pass}
        if len(splits) != len(in_pass):
            raise ValueError("more than one in-pass capture in one chunk")
        layers = sorted(self.caches.conv_state)
        conv0, ssm0 = self.caches.conv_state[layers[0]], self.caches.ssm_state[layers[0]]
        conv_all = conv0.new_empty(len(layers), len(in_pass), *conv0.shape[1:])  # (L_r, Sc, C, K-1)
        ssm_all = ssm0.new_empty(len(layers), len(in_pass), *ssm0.shape[1:])  # (L_r, Sc, *recurrent slot)
        plan = with_in_pass_captures(
            plan, batch, splits, {l: conv_all[j] for j, l in enumerate(layers)},
            {l: ssm_all[j] for j, l in enumerate(layers)},
        )
        hidden = self.model(batch, self.caches, gpu_plan=plan)  # (T, D)
        order = [split.chunk for split in plan.in_pass.splits]
        captured = []
        for capture in in_pass:
            i = index[capture.request_id]
            c = order.index(i)
            # a lone capture's bundle keeps the buffers themselves (views of all of them)
            state = (conv_all[:, c], ssm_all[:, c])
            if len(in_pass) > 1:
                state = (state[0].clone(), state[1].clone())
            hidden_row = hidden[batch.cu_seqlens[i] + splits[i] - 1]
            captured.append(CapturedState(capture, hidden_row, state))
        return RouteOutput(hidden, [end - 1 for end in batch.cu_seqlens[1:]], captured=tuple(captured))


def _feed_pending_tokens(batch: ForwardBatch, chunks: list[ScheduledChunk], sampled: SampledTokens) -> None:
    """Write into batch.input_ids, on the device, the token the previous step sampled for
    each chunk that ends with PENDING_TOKEN (ValueError if it sampled none)."""
    pending = [i for i, chunk in enumerate(chunks) if chunk.token_ids[-1] == PENDING_TOKEN]
    if not pending:
        return
    missing = [chunks[i].request_id for i in pending if chunks[i].request_id not in sampled.rows]
    if missing:
        raise ValueError(f"{missing[0]}: a pending token, but the previous step sampled none for it")
    flat = [batch.cu_seqlens[i + 1] - 1 for i in pending]
    rows = [sampled.rows[chunks[i].request_id] for i in pending]
    flat_t, rows_t = to_device([int64_array(flat), int64_array(rows)], batch.input_ids.device)
    batch.input_ids[flat_t] = sampled.pool[rows_t]


