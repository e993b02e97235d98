"""A request as the scheduler tracks it: its tokens, its progress and the cache it holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cache.checkpoint_keys import Namespace
from engine.interfaces.sampling_params import SamplingParams


# Stands for a sampled token whose value the scheduler does not know yet (Request docstring).
PENDING_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    FETCHING = "fetching"  # off the queue, waiting for a checkpoint from a source (PrefixWaits.pending)
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # the engine failed while running it


@dataclass
class Request:
    """One generation request.

    Progress rule: num_computed_tokens chases num_tokens. Prefill, chunked prefill and decode
    are the same rule; a chunk that reaches num_tokens samples a token, which makes num_tokens
    one larger.

    Both counts move when a chunk is scheduled, not when its step's output comes back: the
    engine may schedule the next step before it has the tokens of the step in flight
    (EngineConfig.overlaps_steps). Until its value arrives, a sampled token is pending
    (num_pending_tokens, at most the last two positions): it counts in num_tokens, and
    token_slice gives PENDING_TOKEN for it, which the worker replaces on the device with the
    token its previous step sampled for the request.

    block_ids cover positions [0, num_computed_tokens + scheduled tokens); state_slot is the
    recurrent state row, None while the request holds no cache (waiting or preempted).
    pause_positions: positions at which a prefill chunk must end (sorted, ascending), so the
    request's recurrent state and last hidden row can be read exactly there; Scheduler.add_request
    adds those its checkpoint policy needs (CheckpointPolicy.pause_positions).
    namespace: checkpoints are shared only within one namespace (model id, cache_salt).
    instruction_boundary: prompt position after the leading system/developer messages, as
    verified by the renderer; None when there is none.
    cache_breakpoints: prompt positions of the client's verified cache_control markers (sorted,
    unique, inside the prompt); () when there are none.
    num_cached_tokens: prompt tokens restored from a checkpoint at first admission.
    namespace and the prompt are what the checkpoint sources are asked for, once, before the first
    admission (PrefixWaits.start).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    pause_positions: tuple[int, ...] = ()
    namespace: Namespace = Namespace("", "")
    tenant: str = ""  # owner of its checkpoints (GenerationRequest.tenant)
    instruction_boundary: int | None = None
    cache_breakpoints: tuple[int, ...] = ()
    num_cached_tokens: int | None = None
    asked_sources: bool = False  # the scheduler asked the checkpoint sources (once, at first admission)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    num_preemptions: int = 0
    num_failed_steps: int = 0  # failed steps it was in (Scheduler.requeue_failed)
    num_pending_tokens: int = 0
    # A token-level rule ended it inside the tokens a verification kept, and a stop string
    # may end its text at an earlier one: the engine finishes it (by the earlier stop, else
    # by this reason) once the output processor has judged them (Scheduler.update_from_output).
    held_finish: FinishReason | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens whose values are known (pending ones not counted)."""
        return len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt, known output and pending tokens."""
        return self.num_known_tokens + self.num_pending_tokens

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        """Prompt and known output tokens."""
        return self.prompt_token_ids + tuple(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """Token ids at positions [start, end) of prompt + output, PENDING_TOKEN at the
        positions of pending tokens."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        head = self.prompt_token_ids[start:prompt_len] if start < prompt_len else ()
        tail = self.output_token_ids[max(start - prompt_len, 0) : end - prompt_len]
        pending = max(0, end - max(start, self.num_known_tokens))
        return tuple(head) + tuple(tail) + (PENDING_TOKEN,) * pending

    @property
    def sampled_all_it_may(self) -> bool:
        """max_tokens output tokens are sampled, pending ones included: it samples no more and
        stops by length once they are known."""
        return self.num_output_tokens + self.num_pending_tokens >= self.sampling.max_tokens

    def resolve_pending_token(self, token: int) -> None:
        """The oldest pending token's value has arrived."""
        assert self.num_pending_tokens > 0, f"{self.request_id}: no pending token to resolve"
        self.output_token_ids.append(token)
        self.num_pending_tokens -= 1

    def next_pause_after(self, position: int) -> int | None:
        """The first pause position strictly after `position`, or None."""
        for pause in self.pause_positions:
            if pause > position:
                return pause
        return None


def token_stop_reason(request: Request, max_model_len: int) -> FinishReason | None:
    """Why the request must stop after its latest output token, judged on token ids alone.

    EOS (unless ignore_eos) and stop token ids count only once min_tokens were generated.
    Stop strings are judged on text by the output processor, not here.
    """
    params = request.sampling
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in params.eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
    if request.num_output_tokens >= params.max_tokens or request.num_known_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
