"""Verification chunks on CUDA: the verification route of one CUDA device (docs/design.md
section 10).

A verification chunk is the request's last token and its k drafts, n = k + 1 tokens. The
scheduler has settled nothing yet, so the chunk must leave the request's own state slot as
it was and put the state after each position i in scratch slot i of the request
(VerificationScratch.slots); the commit of the kept position copies one of them back later
(verify.py). The CPU path (engine/layers/verification.py mix_verification) runs this token by
token per chunk; here every verification chunk of the step runs at once:

- Attention, MLPs, norms: as a short prefill chunk that continues from the cached KV (the
  eager pass's GpuBatchPlan: a verification chunk is a paged-prefill chunk there). The K/V
  of rejected positions lie past the kept tokens and the next chunk overwrites them.
- Mamba2 and the gated delta-net (engine/layers/verification.py mix_verification_gpu,
  mix_delta_rule_verification_gpu): the step's other chunks run the mixer's ordinary GPU path
  over their own plan (VerificationPlan.rest), and the verification chunks run in one launch
  of a one-pass kernel per layer (engine/kernels/gpu/mamba_verify.py, delta_rule_verify.py):
  one program per (chunk, head block) runs the chunk's positions in order, its state in
  registers, and stores the conv window and the recurrent state after each position into
  that position's scratch slot. The request's slot is only read.

Row order: the route puts the step's other chunks first and the verification chunks after
them (verification_order), so the other chunks' rows are [0, num_rest_rows) and their plan is
an ordinary one; RouteOutput.last_rows maps back to the worker's chunk order.

Every index is built on the host (verification_index, pure numpy, tested on the CPU) and
copied with the plan; the forward does not wait for the device. A step of verification
chunks only replays a CUDA graph instead (verify_graphs.py, the same mixer path over static
buffers); this route takes the others. In-pass captures are off when speculation is on (the
Worker turns CacheCapacity.in_pass_capture off): a step with one is refused here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from engine.interfaces.forward_batch import ForwardBatch, ModelCaches
from engine.interfaces.host_index import int64_array
from engine.interfaces.step_io import CaptureOp, ScheduledChunk
from engine.kernels.gpu.batch_plan import (
    VerificationIndex, VerificationPlan, build_gpu_batch_plan, build_verification_plan,
)
from engine.routes.forward_routes import EagerPass, RouteOutput, SampledTokens
from engine.speculative.verify import VerificationScratch

def verification_order(chunks: Sequence[ScheduledChunk]) -> tuple[list[int], int]:
    """(order, num_rest): the step's chunk indices with the chunks that are not verification
    chunks first (num_rest of them), then the verification chunks, each group in the given
    order."""
    rest = [i for i, chunk in enumerate(chunks) if not chunk.num_draft_tokens]
    verifying = [i for i, chunk in enumerate(chunks) if chunk.num_draft_tokens]
    return rest + verifying, len(rest)


def last_rows_in_order(order: Sequence[int], cu_seqlens: Sequence[int]) -> list[int]:
    """The row of each chunk's last token, in the step's chunk order, for a batch laid out in
    `order` (batch chunk j is step chunk order[j]) with chunk bounds cu_seqlens."""
    position = {chunk_index: j for j, chunk_index in enumerate(order)}
    return [cu_seqlens[position[i] + 1] - 1 for i in range(len(order))]


def verification_index(
    first_rows: Sequence[int], lengths: Sequence[int], state_slots: Sequence[int],
    scratch: VerificationScratch,
) -> VerificationIndex:
    """The VerificationIndex of V verification chunks: chunk v's rows first_rows[v] ..
    + lengths[v] - 1, its state slot state_slots[v], its scratch slots scratch.slots(...)."""
    n = max(lengths)
    scratch_slots = np.array([scratch.slots(slot, n) for slot in state_slots], dtype=np.int64).T
    return VerificationIndex(int64_array(first_rows), int64_array(lengths), int64_array(state_slots),
                             np.ascontiguousarray(scratch_slots))


class GpuVerifyPass(EagerPass):
    """A step with verification chunks (num_draft_tokens > 0) on one CUDA device: the eager
    pass over the chunks reordered (verification_order), its plan extended with the recurrent
    mixers' VerificationPlan (module docstring). Takes any such step without in-pass captures
    (ValueError with one: speculation turns them off)."""

    def __init__(self, model, caches: ModelCaches, device: torch.device, scratch: VerificationScratch) -> None:
        super().__init__(model, caches, device)
        self.scratch = scratch

    def accepts(self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp] = ()) -> bool:
        return any(chunk.num_draft_tokens for chunk in chunks)

    def run(
        self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp], sampled: SampledTokens
    ) -> RouteOutput:
        if in_pass:
            raise ValueError("an in-pass capture in a step with verification chunks")
        order, num_rest = verification_order(chunks)
        ordered = [chunks[i] for i in order]
        batch, plan = self.inputs(ordered, sampled)
        plan = replace(plan, verification=self.verification_plan(batch, num_rest))
        hidden = self.model(batch, self.caches, gpu_plan=plan)  # (T, D)
        return RouteOutput(hidden, last_rows_in_order(order, batch.cu_seqlens))

    def verification_plan(self, batch: ForwardBatch, num_rest: int) -> VerificationPlan:
        """The VerificationPlan of `batch`, whose first num_rest chunks are the others."""
        rest_rows = batch.cu_seqlens[num_rest]
        rest = None
        if num_rest:
            rest_batch = ForwardBatch(
                batch.input_ids[:rest_rows], batch.positions[:rest_rows], batch.slot_mapping[:rest_rows],
                batch.chunks[:num_rest], batch.cu_seqlens[: num_rest + 1],
            )
            rest = build_gpu_batch_plan(rest_batch, self.caches.block_size, self.device,
                                        fold_gated_norm=self.fold_gated_norm)
        verifying = batch.chunks[num_rest:]
        index = verification_index(
            batch.cu_seqlens[num_rest:-1], [c.num_tokens for c in verifying],
            [c.state_slot for c in verifying], self.scratch,
        )
        return build_verification_plan(index, rest, rest_rows, self.device)
