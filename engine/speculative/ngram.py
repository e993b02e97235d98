"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the
context's last n tokens (no model, no extra weights; any family).

The rule is `propose_reference`'s scan, every start position in turn. NgramDrafter.propose
gives the same drafts visiting only the positions where the context's last token occurs
(found from the end with tuple.index on the reversed context, in C, once for every n), since
it runs once per speculating request and step on the scheduler's thread: at 2,048 tokens of
context without a match the scan took 574 us a request, the search 22 us
(benchmarks/ngram_lookup.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.interfaces.request import Request
    from engine.interfaces.step_io import DraftProposal

NAME = "ngram"


@dataclass(frozen=True)
class NgramDrafter:
    """Proposes drafts from the request's own tokens (prompt and output so far).

    For n from max_ngram down to min_ngram: find the positions where the last n tokens
    occurred before (not the suffix itself), and propose the tokens that followed one of them,
    at most num_drafts and never past the end of the context. Longer matches win; among
    equal lengths the latest occurrence followed by num_drafts tokens, else the one followed
    by the most (the earliest): in a run that repeats itself (x x x x, or a loop of a few
    tokens) the latest occurrence ends one token before the context does. Deterministic, no
    state.
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
        num_drafts <= 0. The drafts propose_reference gives."""
        length = len(token_ids)
        if num_drafts <= 0 or length < 2:
            return ()
        tokens = tuple(token_ids)
        # every match ends at an earlier occurrence of the last token (by position length - 2,
        # leaving a token after it): the same ones for every n, found once, latest first
        occurrences = _Occurrences(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = tokens[length - n :]
            earliest = None
            for end in occurrences:
                start = end - n + 1
                if start >= 0 and tokens[start : start + n] == suffix:
                    if start + n + num_drafts <= length:  # the latest followed by num_drafts
                        return tokens[start + n : start + n + num_drafts]
                    earliest = start
            if earliest is not None:  # none followed by num_drafts: the earliest, followed by the most
                return tokens[earliest + n : earliest + n + num_drafts]
        return ()

    def draft(self, request: Request, proposal: DraftProposal | None, num_drafts: int) -> tuple[int, ...]:
        """Drafter.draft: propose() over the request's prompt and output tokens (there is no
        worker proposal)."""
        return self.propose(request.all_token_ids, num_drafts)


class _Occurrences:
    """The positions before the last at which tokens' last token occurs, latest first, found
    as they are asked for (tuple.index on the reversed tokens) and kept, so a second pass
    searches nothing again."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self._reversed, self._last = tokens[::-1], tokens[-1]  # position p is len - 1 - p there
        self._found: list[int] = []
        self._next_back = 1  # where the search in the reversed tokens goes on; None: done

    def __iter__(self) -> Iterator[int]:
        yield from self._found
        length = len(self._reversed)
        while self._next_back is not None:
            try:
                back = self._reversed.index(self._last, self._next_back)
            except ValueError:
                self._next_back = None
                return
            self._next_back = back + 1
            self._found.append(length - 1 - back)
            yield self._found[-1]


def propose_reference(drafter: NgramDrafter, token_ids: Sequence[int], num_drafts: int) -> tuple[int, ...]:
    """NgramDrafter's rule as a plain scan over the tokens, latest start first: what
    NgramDrafter.propose must equal (tests/engine/test_ngram_lookup.py), and its baseline in
    benchmarks/ngram_lookup.py."""
    length = len(token_ids)
    if num_drafts <= 0:
        return ()
    tokens = list(token_ids)
    for n in range(min(drafter.max_ngram, length - 1), drafter.min_ngram - 1, -1):
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
