"""Per-request sampling parameters, validated once at the engine's edge, and the output-token
budget (output_budget): the one rule of how many tokens a request may generate."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request refused before it runs (the API turns this into HTTP 400). param: the request
    field at fault where known ("prompt", "max_tokens", ...), named in the API's error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def output_budget(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *,
    max_prompt_tokens: int | None = None, max_output_tokens: int | None = None,
    prompt_param: str = "prompt",
) -> int:
    """How many tokens a request may generate; the engine (add_request) and the API (the
    ingress, with its server limits) both ask this.

    max_tokens: what the request asked for (the API's max_completion_tokens or max_tokens;
    None: it gave none; when given, >= 1, as SamplingParams and the API models require).
    max_model_len bounds prompt plus output. max_prompt_tokens and max_output_tokens are a
    server's limits (None: no limit). Returns max_tokens when given, else the room the prompt
    leaves (max_model_len - num_prompt_tokens) capped by max_output_tokens.

    A request that cannot complete is refused up front, never truncated. Raises
    InvalidRequestError, checking in this order, for
      1. a prompt longer than max_prompt_tokens                        (param prompt_param)
      2. a max_tokens above max_output_tokens                          (param "max_tokens")
      3. a prompt that leaves no room (num_prompt_tokens >= max_model_len) (param prompt_param)
      4. a max_tokens above that room                                  (param "max_tokens")
    prompt_param names the request's prompt field in those errors ("messages" for chat).
    """
    if max_prompt_tokens is not None and num_prompt_tokens > max_prompt_tokens:
        raise InvalidRequestError(
            f"the prompt has {num_prompt_tokens} tokens; this server accepts at most "
            f"{max_prompt_tokens} (max_prompt_tokens)", prompt_param)
    if max_tokens is not None and max_output_tokens is not None and max_tokens > max_output_tokens:
        raise InvalidRequestError(
            f"max_tokens is {max_tokens}; this server generates at most "
            f"{max_output_tokens} tokens a request (max_output_tokens)", "max_tokens")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens, leaving no room to generate.", prompt_param)
    if max_tokens is None:
        return room if max_output_tokens is None else min(max_output_tokens, room)
    if max_tokens > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion).", "max_tokens")
    return max_tokens


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature == 0 means greedy. top_k <= 0 means no top-k cut. seed makes sampling
    reproducible per request. stop strings are matched on the detokenized output and are not
    included in the returned text; stop_token_ids end the request and are not returned as text.
    min_tokens suppresses EOS and stop token ids until that many tokens were generated.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Return the processed logits row of every sampled token (tests and debugging only).
    return_logits: bool = False
    # Filled by the engine from the model's generation config; not set by API users.
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        """Raises InvalidRequestError naming the field at fault (the API's name for it)."""
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}", "top_k")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                "min_tokens")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
