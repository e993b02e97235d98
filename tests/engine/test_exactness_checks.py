"""The exactness suite's comparison (tests/engine/exactness.py) on synthetic outcomes: a token
mismatch that is not at a near-tie fails at once, near-ties are counted and fail the suite past
MAX_NEAR_TIE_FRACTION of the requests compared, and a run within both bounds passes."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine.exactness import (
    LOGITS_RTOL, MAX_NEAR_TIE_FRACTION, NEAR_TIE, Outcome, Tally, check_near_ties, compare,
)

VOCAB = 8


def logits_row(top: int, gap: float, runner_up: int) -> torch.Tensor:
    """Logits whose greedy token is `top`, `gap` above `runner_up`, both above the rest."""
    row = torch.zeros(VOCAB, dtype=torch.float64)
    row[top] = 10.0
    row[runner_up] = 10.0 - gap
    return row


def outcome(tokens: list[int], rows: list[torch.Tensor]) -> Outcome:
    return Outcome(token_ids=tokens, logits=rows, text="", cached_tokens=0)


def clear_margin() -> list[torch.Tensor]:
    return [logits_row(3, 1.0, 5), logits_row(4, 1.0, 6)]


def test_identical_outcomes_pass_and_are_counted():
    tally = Tally()
    compare(outcome([3, 4], clear_margin()), outcome([3, 4], clear_margin()), tally, "same")
    assert (tally.requests, tally.near_ties) == (1, 0)


def test_a_mismatch_not_at_a_near_tie_fails_at_once_naming_request_position_and_top2():
    scratch = outcome([3, 4], clear_margin())
    shared = outcome([3, 6], clear_margin())
    tally = Tally()
    with pytest.raises(AssertionError) as failure:
        compare(shared, scratch, tally, "req-7")
    message = str(failure.value)
    assert "req-7" in message and "output position 1" in message
    assert "token 4: 10" in message and "token 6: 9" in message  # the from-scratch top-2 logits
    assert tally.near_ties == 0


def test_a_mismatch_at_a_near_tie_is_counted_and_the_rest_is_not_compared(capsys):
    scratch_rows = [logits_row(3, NEAR_TIE / 2, 5), logits_row(4, 1.0, 6)]
    shared_rows = [logits_row(5, NEAR_TIE / 2, 3), logits_row(0, 1.0, 1)]  # differs after the tie
    tally = Tally()
    compare(outcome([5, 0, 1], shared_rows), outcome([3, 4], scratch_rows), tally, "req-8")
    assert (tally.requests, tally.near_ties) == (1, 1)
    assert "near-tie in req-8 at output position 0" in capsys.readouterr().out


def test_logits_beyond_the_tolerance_fail_even_with_equal_tokens():
    scratch = outcome([3], [logits_row(3, 1.0, 5)])
    drifted = logits_row(3, 1.0, 5)
    drifted[0] += 10.0 * LOGITS_RTOL * 2
    with pytest.raises(AssertionError, match="req-9: logits at output position 0"):
        compare(outcome([3], [drifted]), scratch, Tally(), "req-9")


def test_different_lengths_fail():
    rows = clear_margin()
    with pytest.raises(AssertionError, match="lengths differ"):
        compare(outcome([3], rows[:1]), outcome([3, 4], rows), Tally(), "req-10")


def run_with_near_ties(num_requests: int, num_near_ties: int) -> Tally:
    """Compare `num_requests` synthetic requests, the first `num_near_ties` diverging at a tie."""
    tally = Tally()
    tie = [logits_row(3, NEAR_TIE / 2, 5)]
    for index in range(num_requests):
        diverges = index < num_near_ties
        compare(outcome([5 if diverges else 3], tie), outcome([3], tie), tally, f"r{index}")
    return tally


def test_near_ties_within_the_bound_pass():
    allowed = math.floor(MAX_NEAR_TIE_FRACTION * 100)
    assert allowed == 2  # 2% of 100 requests
    tally = run_with_near_ties(100, allowed)
    assert (tally.requests, tally.near_ties) == (100, 2)
    check_near_ties(tally, "within bound")
    check_near_ties(run_with_near_ties(49, 0), "no ties")


def test_too_many_near_ties_fail_the_suite():
    with pytest.raises(AssertionError, match=r"too many: 3 near-ties in 100 requests"):
        check_near_ties(run_with_near_ties(100, 3), "too many")
    with pytest.raises(AssertionError, match="1 near-ties in 49 requests"):
        check_near_ties(run_with_near_ties(49, 1), "one in 49")  # 2% of 49 is below one
