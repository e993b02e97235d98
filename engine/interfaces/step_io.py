"""The two messages of a step: what the scheduler asks the runner to do, and what comes back.

Both are plain dataclasses so they cross a Ray actor boundary (or torch.distributed broadcast)
unchanged. The runner sees nothing of the scheduler but a SchedulerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from engine.interfaces.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens [start_position, start_position + len(token_ids)) of one request.

    sample: the chunk reaches the end of the request's known tokens, so a token is sampled
        from its last row. A prefill chunk that stops short (budget, or a requested stop
        position) does not sample. A chunk with no tokens (a restore covered everything)
        samples from the restored hidden row.
    num_output_tokens: tokens generated so far, pending ones included (for min_tokens).
    token_ids may end with PENDING_TOKEN (engine/interfaces/request.py): the token the step submitted
    just before sampled for this request, which the worker reads on the device.
    capture_hidden: return the final hidden row of this chunk (a stop at a requested position).
    num_draft_tokens: k > 0 makes this a verification chunk (engine/speculative/): token_ids
        is the request's last known token then k draft tokens; the runner returns the argmax
        at each of the k + 1 positions (RunnerOutput.verified_token_ids) instead of sampling,
        and leaves the request's state slot as it was until a CommitOp names the position kept.
    propose_drafts: k > 0 (a chunk that samples, of a request that speculates with a drafter
        the worker runs: MTP): after the step the worker proposes up to k draft tokens to
        follow the token it sampled, or, for a verification chunk, the bonus token after the
        drafts the greedy rule accepts (RunnerOutput.draft_proposals).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    state_slot: int
    reset_state: bool
    sample: bool
    sampling: SamplingParams
    num_output_tokens: int = 0
    capture_hidden: bool = False
    num_draft_tokens: int = 0
    propose_drafts: int = 0


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens the worker proposed to follow the first `follows` tokens of a request (its
    prompt and output tokens, the one the step sampled or kept last included)."""

    follows: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class CommitOp:
    """Keep position `index` (0: the chunk's first token) of the verification chunk the
    runner last ran for request_id: its recurrent state into state_slot and its hidden row as
    the request's last hidden row; the states of the other positions are forgotten. Applied at
    the very start of the step, before its captures (a response capture of a request that
    stopped in that verification reads what the commit wrote)."""

    request_id: str
    state_slot: int
    index: int


@dataclass(frozen=True)
class CaptureOp:
    """Save the state of a request that stands exactly at num_tokens into bundle `bundle_id`
    (a pending bundle CheckpointPolicy reserved; the worker confirms it in
    RunnerOutput.confirmed_captures, or it is dropped).

    Taken at the start of the step, before restores and the forward pass, from what the
    previous step left: the state slot, the K/V of positions num_tokens - num_tokens % B ..
    num_tokens - 1 in tail_block (None when num_tokens % B == 0), and the last hidden row the
    previous step computed for request_id.

    in_pass: instead, num_tokens lies strictly inside this step's chunk of request_id and the
    state there is taken during this step's forward pass (the chunk is not cut; CUDA path only);
    the tail and hidden row are read after the pass.
    """

    bundle_id: int
    request_id: str
    state_slot: int
    num_tokens: int
    tail_block: int | None
    in_pass: bool = False


@dataclass(frozen=True)
class RestoreOp:
    """Copy bundle `bundle_id` into a newly admitted request: its recurrent state into
    state_slot and its attention tail into the fresh tail_block (None: no tail). Runs after the
    step's captures and before its forward pass. The bundle's hidden row becomes the request's
    last hidden row, so a chunk of zero tokens can sample from it. The bundle stays pinned
    (CheckpointPolicy.lookup) until the step settles."""

    bundle_id: int
    request_id: str
    state_slot: int
    tail_block: int | None


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    # Requests that ended since the last step: the runner drops their per-request state (RNGs).
    finished_request_ids: tuple[str, ...] = ()
    captures: tuple[CaptureOp, ...] = ()
    restores: tuple[RestoreOp, ...] = ()
    # Bundles the scheduler forgot (evicted, duplicate, unconfirmed): the runner frees them.
    dropped_bundle_ids: tuple[int, ...] = ()
    # Verified positions to keep (speculative decoding), applied first.
    commits: tuple[CommitOp, ...] = ()

    @property
    def has_work(self) -> bool:
        return bool(self.chunks or self.finished_request_ids or self.captures or self.dropped_bundle_ids
                    or self.commits)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class RunnerOutput:
    """Per request id: the sampled token (only for chunks with sample=True)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Bundle id -> the ranks that hold their shard of it, for every CaptureOp at least one
    # rank completed. The scheduler publishes a bundle only when every rank is listed.
    confirmed_captures: dict[int, frozenset[int]] = field(default_factory=dict)
    # Verification chunks only (num_draft_tokens > 0): the argmax at each of its positions.
    verified_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Chunks with propose_drafts only: what the worker's drafter proposed after the step.
    draft_proposals: dict[str, DraftProposal] = field(default_factory=dict)
    # Only for requests whose SamplingParams.return_logits is set: the fp32 logits row used.
    logits: dict[str, "torch.Tensor"] = field(default_factory=dict)
    # Only for chunks with capture_hidden: the final hidden row (after the final norm).
    hidden_rows: dict[str, "torch.Tensor"] = field(default_factory=dict)
    # Seconds rank 0 spent in Worker.submit and Worker.collect for this step (captures,
    # restores, launching the forward pass and sampling, then waiting for the tokens): the
    # step's model time. Everything else a step costs is overhead (scheduling, transport).
    worker_seconds: float = 0.0
