"""NgramDrafter.propose (visiting only the earlier occurrences of the context's last token)
gives the drafts of propose_reference (the rule as a scan over every start position) on any
context: random contexts over tiny vocabularies, where n-grams repeat, matches overlap the
suffix and runs repeat themselves, and long ones over larger vocabularies."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.speculative.ngram import NgramDrafter, propose_reference

DRAFTERS = [NgramDrafter(), NgramDrafter(max_ngram=2, min_ngram=2), NgramDrafter(max_ngram=5, min_ngram=1)]


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 6), max_size=60), num_drafts=st.integers(-1, 8),
       which=st.sampled_from(range(len(DRAFTERS))))
def test_the_occurrence_search_equals_the_scan(tokens, num_drafts, which):
    drafter = DRAFTERS[which]
    assert drafter.propose(tokens, num_drafts) == propose_reference(drafter, tokens, num_drafts)


@pytest.mark.parametrize("vocab", [2, 5, 300, 70_000, 2**40])
def test_the_occurrence_search_equals_the_scan_on_long_contexts(vocab):
    rng = random.Random(vocab)
    drafter = NgramDrafter()
    for _ in range(30):
        tokens = tuple(rng.randrange(vocab) for _ in range(rng.randrange(1, 400)))
        for num_drafts in (1, 4, 16):
            assert drafter.propose(tokens, num_drafts) == propose_reference(drafter, tokens, num_drafts)
