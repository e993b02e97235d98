"""The two messages of a step: what the scheduler asks the runner to do, and what comes back.

Both are plain dataclasses so they cross a Ray actor boundary (or torch.distributed broadcast)
unchanged. The runner sees nothing of the scheduler but a SchedulerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens [start_position, start_position + len(token_ids)) of one request.

    sample: the chunk reaches the end of the request's known tokens, so a token is sampled
        from its last row. A prefill chunk that stops short (budget, or a requested stop
        position) does not sample.
    num_output_tokens: tokens generated so far (for min_tokens).
    capture_hidden: return the final hidden row of this chunk (a stop at a requested position).
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


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    # Requests that ended since the last step: the runner drops their per-request state (RNGs).
    finished_request_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class RunnerOutput:
    """Per request id: the sampled token (only for chunks with sample=True)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Only for requests whose SamplingParams.return_logits is set: the fp32 logits row used.
    logits: dict[str, "torch.Tensor"] = field(default_factory=dict)
    # Only for chunks with capture_hidden: the final hidden row (after the final norm).
    hidden_rows: dict[str, "torch.Tensor"] = field(default_factory=dict)
