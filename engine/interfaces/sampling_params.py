"""Per-request sampling parameters, validated once at the engine's edge."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses before scheduling it (the API turns this into HTTP 400)."""


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
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
