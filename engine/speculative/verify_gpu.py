"""Verification chunks on CUDA: the verification route of one CUDA device and the recurrent
mixers' part of it, Mamba2's and the gated delta-net's (docs/design.md section 10).

A verification chunk is the request's last token and its k drafts, n = k + 1 tokens. The
scheduler has settled nothing yet, so the chunk must leave the request's own state slot as
it was and put the state after each position i in scratch slot i of the request
(VerificationScratch.slots); the commit of the kept position copies one of them back later
(verify.py). The CPU path (engine/layers/verification.py mix_verification) runs this token by token per chunk;
here every verification chunk of the step runs at once:

- Attention, MLPs, norms: as a short prefill chunk that continues from the cached KV (the
  eager pass's GpuBatchPlan: a verification chunk is a paged-prefill chunk there). The K/V
  of rejected positions lie past the kept tokens and the next chunk overwrites them.
- Mamba2 (engine/layers/verification.py mix_verification_gpu): the step's other chunks run the mixer's ordinary GPU path
  over their own plan (VerificationPlan.rest), and the verification chunks run position by
  position: for i = 0..n-1 one launch of the fused one-token decode kernel
  (engine/kernels/gpu/mamba_decode.py conv_ssd_decode, the kernel plain decoding runs at up
  to FUSED_DECODE_MAX_ROWS rows, so the states are plain decoding's) over position i of every
  chunk, in place on scratch slot i, which first receives the state before position i: the
  SSM state copied from the request's slot (i = 0) or from scratch slot i - 1 just before the
  launch, the conv window (the last K-1 pre-conv inputs before position i) for every i before
  the first launch. The conv windows are data movement only: all of them come from one
  concatenation [old window | the chunk's inputs] (position_conv_windows), and after the n
  launches each scratch slot gets its window after position i. The request's slot is only
  read (index_select).
- Gated delta-net (engine/layers/verification.py mix_delta_rule_verification_gpu): the same split, and for each position i
  plain decoding's own two kernels over position i of every chunk as one-token chunks on
  scratch slot i: the varlen causal conv (engine/kernels/gpu/conv.py, which also moves the
  slot's window on) and fla-core's one-token recurrent kernel (engine/kernels/gpu/
  gated_delta_rule.py gated_delta_rule_decode). Scratch slot i first receives the conv
  window and the recurrent state before position i, both copied from the request's slot
  (i = 0) or from scratch slot i - 1; the request's slot is only read.

The decode kernel updates the SSM state of the slot it reads, so each position costs one
state copy (index_select + index_copy_, PyTorch) before its launch; a kernel reading one slot
and writing another would save that copy (not done: the kernel is shared with plain
decoding). The PyTorch copies between launches also keep the programmatic-dependent-launch
contract (engine/kernels/gpu/pdl.py): the decode kernel loads its slot's state before its
PDL wait, and a kernel launched without PDL ahead of it has finished before it starts.

Row order: the route puts the step's other chunks first and the verification chunks after
them (verification_order), so the other chunks' rows are [0, num_rest_rows) and their plan is
an ordinary one; RouteOutput.last_rows maps back to the worker's chunk order. Chunks of
different lengths (fewer drafts) are sorted longest first, so the chunks still running at
position i are a prefix (VerificationIndex.active).

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
    order = sorted(range(len(lengths)), key=lambda v: -lengths[v])
    n = max(lengths)
    lengths_sorted = int64_array([lengths[v] for v in order])
    firsts = int64_array([first_rows[v] for v in order])
    positions = np.arange(n, dtype=np.int64)[:, None]  # (n, 1)
    rows = firsts[None, :] + np.minimum(positions, lengths_sorted[None, :] - 1)
    scratch_slots = np.array([scratch.slots(state_slots[v], n) for v in order], dtype=np.int64).T
    active = tuple(int((lengths_sorted > i).sum()) for i in range(n))
    return VerificationIndex(rows, np.ascontiguousarray(scratch_slots),
                             int64_array([state_slots[v] for v in order]), active)


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
