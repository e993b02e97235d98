"""The worker's side of speculative decoding: verify a chunk of k + 1 tokens in one forward
pass, keep every position's recurrent state apart, and commit the one the scheduler keeps.

Exact rollback (docs/design.md section 10). Attention needs none: the K/V of rejected
positions lie past the request's kept tokens and are overwritten by its next chunk (the
scheduler frees the blocks that held only them). A recurrent state that consumed a rejected
token cannot be un-consumed, so a verification chunk never writes the request's state slot:
each recurrent mixer (Mamba2, gated delta-net) runs its positions with the per-token
recurrence (its one-token decode step, so every state equals plain decoding's) and writes the
state after position i into scratch slot i of the request (VerificationScratch.slots). When
the scheduler has settled the chunk, a CommitOp copies the kept position's scratch slot into
the request's own slot and makes that position's hidden row the request's last one.

This module is the PyTorch path (VerifyPass, the worker's route off CUDA); on one CUDA device
the worker takes engine/speculative/verify_gpu.py's route and verify_graphs.py's graphs
instead. The Worker refuses a model with a layer kind outside VERIFIABLE_LAYER_KINDS
(check_verifiable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from engine.interfaces.forward_batch import ModelCaches
from engine.interfaces.step_io import CaptureOp, CommitOp, ScheduledChunk
from engine.model_config import ATTENTION, GATED_DELTA_NET, HYBRID, MAMBA, MLP, MOE
from engine.routes.forward_routes import EagerPass, RouteOutput, SampledTokens

# Layer kinds whose mixers verify k + 1 tokens exactly: attention (KV past the kept tokens is
# overwritten), Mamba2 and the gated delta-net (mix_verification), Falcon-H1's HYBRID layers
# (both side by side), MLP and MoE blocks (no state).
VERIFIABLE_LAYER_KINDS = (ATTENTION, MAMBA, GATED_DELTA_NET, HYBRID, MLP, MOE)


def check_verifiable(layer_types: Sequence[str]) -> None:
    """ValueError naming num_speculative_tokens when a layer's mixer cannot verify drafts."""
    unsupported = sorted(set(layer_types) - set(VERIFIABLE_LAYER_KINDS))
    if unsupported:
        raise ValueError(
            f"num_speculative_tokens > 0: this model's {unsupported} layers cannot verify drafts "
            "yet (Mamba2, gated delta-net and attention can); set num_speculative_tokens to 0")


@dataclass(frozen=True)
class _Verified:
    """A verification chunk the worker ran and the scheduler has not committed yet: the
    hidden rows of its positions (n, D), a copy owned here."""

    hidden: torch.Tensor


class VerificationScratch:
    """The scratch state slots of verification chunks and the hidden rows of the ones not yet
    committed. Request slot s owns scratch slots first_slot + s * (k + 1) .. + k, allocated
    past the slots the scheduler hands out (Worker)."""

    def __init__(self, caches: ModelCaches, first_slot: int, num_speculative_tokens: int) -> None:
        self.caches = caches
        self.first_slot = first_slot
        self.positions = num_speculative_tokens + 1
        self._pending: dict[str, _Verified] = {}

    @staticmethod
    def num_scratch_slots(num_state_slots: int, num_speculative_tokens: int) -> int:
        """How many slots to allocate past the scheduler's num_state_slots."""
        return num_state_slots * (num_speculative_tokens + 1) if num_speculative_tokens else 0

    def slots(self, state_slot: int, num_tokens: int) -> tuple[int, ...]:
        """The scratch slots of a verification chunk of num_tokens tokens of state_slot."""
        assert num_tokens <= self.positions, "more drafts than num_speculative_tokens"
        first = self.first_slot + state_slot * self.positions
        return tuple(range(first, first + num_tokens))

    def keep(self, request_id: str, hidden: torch.Tensor) -> None:
        """Hold a verification chunk's hidden rows (n, D) until its commit (a copy: the next
        forward may overwrite `hidden`)."""
        self._pending[request_id] = _Verified(hidden.clone())

    def commit(self, op: CommitOp) -> torch.Tensor:
        """Copy the state after position op.index of request op.request_id's last
        verification into op.state_slot (every recurrent layer); returns that position's hidden
        row (1, D), owned. KeyError if no verification of it is held."""
        verified = self._pending.pop(op.request_id)
        scratch = self.first_slot + op.state_slot * self.positions + op.index
        self.caches.copy_state_slot(scratch, op.state_slot)
        return verified.hidden[op.index : op.index + 1]

    def forget(self, request_ids: Sequence[str]) -> None:
        """Requests that ended: their uncommitted verifications are dropped."""
        for request_id in request_ids:
            self._pending.pop(request_id, None)


class VerifyPass(EagerPass):
    """A step with verification chunks (num_draft_tokens > 0), on the PyTorch path: the eager
    pass, with each verification chunk's scratch slots in its SequenceChunk so the recurrent
    mixers keep every position's state apart (mix_verification)."""

    def __init__(self, model, caches: ModelCaches, device: torch.device, scratch: VerificationScratch) -> None:
        super().__init__(model, caches, device)
        self.scratch = scratch

    def accepts(self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp] = ()) -> bool:
        return any(chunk.num_draft_tokens for chunk in chunks) and not in_pass

    def run(
        self, chunks: list[ScheduledChunk], in_pass: Sequence[CaptureOp], sampled: SampledTokens
    ) -> RouteOutput:
        batch, plan = self.inputs(chunks, sampled)
        if plan is not None:
            raise ValueError("verification chunks run on the PyTorch (CPU) path only")
        sequences = tuple(
            replace(sequence, position_state_slots=self.scratch.slots(sequence.state_slot, sequence.num_tokens))
            if chunk.num_draft_tokens else sequence
            for chunk, sequence in zip(chunks, batch.chunks)
        )
        hidden = self.model(replace(batch, chunks=sequences), self.caches)  # (T, D)
        return RouteOutput(hidden, [end - 1 for end in batch.cu_seqlens[1:]])


def verify_greedy(
    model, chunks: list[ScheduledChunk], forward: RouteOutput, scratch: VerificationScratch
) -> dict[str, torch.Tensor]:
    """For each verification chunk of the step (chunks: the computed ones, in forward's row
    order): the argmax of the logits at each of its positions, (k + 1,) int64, and its hidden
    rows kept in `scratch` for the commit."""
    verified = {}
    for i, chunk in enumerate(chunks):
        if not chunk.num_draft_tokens:
            continue
        last = forward.last_rows[i]
        rows = forward.hidden[last + 1 - len(chunk.token_ids) : last + 1]  # (k + 1, D)
        verified[chunk.request_id] = torch.argmax(model.compute_logits(rows), dim=-1)
        scratch.keep(chunk.request_id, rows)
    return verified
