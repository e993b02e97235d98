"""Turn the scheduler's per-token progress into client-facing outputs: text deltas and stops.

Per request it keeps an incremental detokenizer and a stop-string matcher (engine.detokenizer):
text that could still begin a stop string is held back while streaming and released when the
request ends for another reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.core.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.interfaces.request import FinishReason, Request, RequestStatus
from engine.interfaces.step_io import RunnerOutput


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request.

    new_text is a valid UTF-8 delta with stop strings cut; finish_reason is "stop", "length",
    "abort" or "error" on the last output, None before. new_token_ids holds one token, or
    several when a speculative verification kept several (a stop string among them keeps the
    tokens up to the one that completes it; num_output_tokens counts only the kept ones).
    logits holds the fp32 logits row of the new token when SamplingParams.return_logits is set
    (such a request never speculates: one token per output).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    logits: torch.Tensor | None = None


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one delta (token ids and text concatenated; the
    counters, finish state and logits are the last output's, so never merge outputs whose
    logits a caller reads)."""
    if len(outputs) == 1:
        return outputs[0]
    return replace(outputs[-1],
                   new_token_ids=tuple(t for out in outputs for t in out.new_token_ids),
                   new_text="".join(out.new_text for out in outputs))


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    num_tokens_seen: int = 0  # output tokens already turned into outputs


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add_request(self, request: Request) -> None:
        self._states[request.request_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, list(request.prompt_token_ids)),
            StopStringMatcher(request.sampling.stop),
        )

    def process(self, updated: list[Request], runner_output: RunnerOutput) -> list[RequestOutput]:
        """One output per request that received tokens (one, or several from a verification),
        taken token by token. An output whose text hit a stop string is marked finished with
        reason "stop" and keeps the tokens up to the one that completed it (its
        num_output_tokens says how many the request keeps); the caller ends that request, and
        one with held_finish the same way (finished by it where no stop string came first)."""
        outputs = []
        for request in updated:
            state = self._states[request.request_id]
            new_tokens = request.output_token_ids[state.num_tokens_seen :]
            state.num_tokens_seen = request.num_output_tokens
            finish = request.finish_reason if request.status is RequestStatus.FINISHED else request.held_finish
            finished = finish is not None
            reason = finish.value if finished else None
            text, kept = "", 0
            for i, token in enumerate(new_tokens):
                last = i == len(new_tokens) - 1
                kept += 1
                delta = "" if last and _is_stop_token(request, token, finish) else state.detokenizer.add_token(token)
                if finished and last:
                    delta += state.detokenizer.flush()
                piece, hit_stop_string = state.stop_matcher.feed(delta)
                text += piece
                if hit_stop_string:
                    finished, reason = True, FinishReason.STOP.value
                    break
                if finished and last:
                    text += state.stop_matcher.flush()
            if finished:
                del self._states[request.request_id]
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=tuple(new_tokens[:kept]),
                    new_text=text,
                    finished=finished,
                    finish_reason=reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_output_tokens=request.num_output_tokens - (len(new_tokens) - kept),
                    num_cached_tokens=request.num_cached_tokens or 0,
                    logits=runner_output.logits.get(request.request_id),
                )
            )
        return outputs

    def finish(self, request: Request, error: str | None = None) -> RequestOutput:
        """The final output of a request ended from outside (abort or error): no new tokens."""
        self._states.pop(request.request_id, None)
        assert request.finish_reason is not None
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=(),
            new_text="",
            finished=True,
            finish_reason=request.finish_reason.value,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
                    num_cached_tokens=request.num_cached_tokens or 0,
            error=error,
        )


def _is_stop_token(request: Request, token: int, finish: FinishReason | None) -> bool:
    """A finishing EOS or stop token id (the request ends by `finish`) produces no text."""
    if finish is not FinishReason.STOP:
        return False
    params = request.sampling
    return token in params.stop_token_ids or (not params.ignore_eos and token in params.eos_token_ids)
