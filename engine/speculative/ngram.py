"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the
context's last n tokens (no model, no extra weights; any family)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request
    from engine.step_io import DraftProposal

NAME = "ngram"


@dataclass(frozen=True)
class NgramDrafter:
    """Proposes drafts from the request's own tokens (prompt and output so far).

    For n from max_ngram down to min_ngram: find the positions where the last n tokens
    occurred before (not the suffix itself), and propose the tokens that followed one of them,
    at most num_drafts and never past the end of the context. Longer matches win; among
    equal lengths the latest occurrence followed by num_drafts tokens, else the one followed
    by the most (the earliest): in a run that repeats itself (x x x x, or a loop of a few
    tokens) the latest occurrence ends one token before the context does. Pure Python,
    deterministic, no state.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    name: str = NAME
    on_worker: bool = False  # drafts here, from the tokens (engine/speculative/scheduling.py Drafter)

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(self, token_ids: Sequence[int], num_drafts: int) -> tuple[int, ...]:
        """Up to num_drafts draft tokens to follow token_ids; () when no n-gram matches or
        num_drafts <= 0."""
        length = len(token_ids)
        if num_drafts <= 0:
            return ()
        tokens = list(token_ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = tokens[length - n :]
            followed = None  # the tokens after the latest match seen so far (the earliest: the most)
            # a match starting at `start` must leave at least one token after it
            for start in range(length - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    followed = tokens[start + n : start + n + num_drafts]
                    if len(followed) == num_drafts:
                        break
            if followed is not None:
                return tuple(followed)
        return ()

    def draft(self, request: Request, proposal: DraftProposal | None, num_drafts: int) -> tuple[int, ...]:
        """Drafter.draft: propose() over the request's prompt and output tokens (there is no
        worker proposal)."""
        return self.propose(request.all_token_ids, num_drafts)
