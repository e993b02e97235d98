"""Radix index over token ids: exact-prefix semantics, namespaces, dedup, pruning (pure Python)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.radix_index import Match, RadixIndex

NS = ("tiny-model", None)
SALTED = ("tiny-model", "salt-b")


def test_checkpoint_matches_only_an_exact_token_prefix():
    index = RadixIndex()
    index.insert(NS, [1, 2, 3], 7)
    assert index.longest_prefix(NS, [1, 2, 4]) is None
    assert index.longest_prefix(NS, [1, 2]) is None
    assert index.longest_prefix(NS, [2, 1, 2, 3]) is None
    assert index.longest_prefix(NS, [1, 2, 3, 4, 5]) == Match(7, 3)


def test_longest_checkpoint_wins_and_full_length_match_is_allowed():
    index = RadixIndex()
    index.insert(NS, [1, 2], 1)
    index.insert(NS, [1, 2, 3, 4, 5, 6], 3)
    index.insert(NS, [1, 2, 3, 4], 2)  # splits the [3, 4, 5, 6] edge
    assert index.longest_prefix(NS, [1, 2, 3, 4, 5, 9]) == Match(2, 4)
    assert index.longest_prefix(NS, [1, 2, 3, 9]) == Match(1, 2)
    assert index.longest_prefix(NS, [1, 2, 3, 4, 5, 6]) == Match(3, 6)
    assert index.longest_prefix(NS, [1, 2, 3, 4, 5, 6, 7]) == Match(3, 6)
    assert index.longest_prefix(NS, []) is None


def test_namespaces_are_isolated():
    index = RadixIndex()
    index.insert(NS, [1, 2, 3], 1)
    assert index.longest_prefix(SALTED, [1, 2, 3, 4]) is None
    assert index.insert(SALTED, [1, 2, 3], 2) is None  # not a duplicate: another namespace
    assert index.longest_prefix(SALTED, [1, 2, 3]) == Match(2, 3)
    assert index.longest_prefix(NS, [1, 2, 3]) == Match(1, 3)
    assert index.remove(SALTED, 1) is False  # bundle 1 lives under NS only
    assert index.num_checkpoints(NS) == index.num_checkpoints(SALTED) == 1


def test_duplicate_endpoint_returns_the_existing_bundle_and_changes_nothing():
    index = RadixIndex()
    assert index.insert(NS, [5, 6, 7], 1) is None
    nodes = index.num_nodes(NS)
    assert index.insert(NS, (5, 6, 7), 2) == 1
    assert index.num_checkpoints(NS) == 1 and index.num_nodes(NS) == nodes
    assert 2 not in index and index.get(NS, [5, 6, 7]) == 1


def test_insert_rejects_empty_tokens_and_reused_bundle_ids():
    index = RadixIndex()
    with pytest.raises(ValueError):
        index.insert(NS, [], 1)
    index.insert(NS, [1], 1)
    with pytest.raises(ValueError):
        index.insert(NS, [2], 1)


def test_removal_prunes_and_merges_back_to_an_empty_tree():
    index = RadixIndex()
    index.insert(NS, [1, 2, 3, 4], 1)
    index.insert(NS, [1, 2, 5, 6], 2)  # root -> [1,2] -> {[3,4], [5,6]}
    assert index.num_nodes(NS) == 3
    assert index.remove(NS, 2) is True
    assert index.num_nodes(NS) == 1  # [1,2] merged back with [3,4]
    assert index.longest_prefix(NS, [1, 2, 5, 6]) is None
    assert index.longest_prefix(NS, [1, 2, 3, 4]) == Match(1, 4)
    assert index.remove_endpoint(NS, [1, 2, 3]) is None
    assert index.remove_endpoint(NS, [1, 2, 3, 4]) == 1
    assert index.num_nodes(NS) == 0 and len(index) == 0 and index.namespaces() == []


def test_removing_an_inner_checkpoint_keeps_the_ones_below():
    index = RadixIndex()
    index.insert(NS, [1, 2], 1)
    index.insert(NS, [1, 2, 3], 2)
    index.remove(NS, 1)
    assert index.num_nodes(NS) == 1
    assert index.longest_prefix(NS, [1, 2, 3, 4]) == Match(2, 3)
    assert index.longest_prefix(NS, [1, 2]) is None


def brute_force_longest(checkpoints: dict[tuple[int, ...], int], prompt: tuple[int, ...]) -> Match | None:
    best = None
    for tokens, bundle_id in checkpoints.items():
        if prompt[: len(tokens)] == tokens and (best is None or len(tokens) > best.num_tokens):
            best = Match(bundle_id, len(tokens))
    return best


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=7).map(tuple)
op_st = st.tuples(
    st.sampled_from(["insert", "remove", "remove_endpoint", "lookup"]), st.sampled_from([NS, SALTED]), tokens_st
)


@settings(max_examples=200, deadline=None)
@given(st.lists(op_st, max_size=40))
def test_index_agrees_with_a_dict_of_checkpoints(ops):
    index = RadixIndex()
    reference: dict[object, dict[tuple[int, ...], int]] = {NS: {}, SALTED: {}}
    next_id = 0
    for op, ns, tokens in ops:
        checkpoints = reference[ns]
        if op == "insert":
            expected = checkpoints.get(tokens)
            assert index.insert(ns, tokens, next_id) == expected
            if expected is None:
                checkpoints[tokens] = next_id
            next_id += 1
        elif op == "remove":  # remove the checkpoint at the longest prefix, by id
            match = brute_force_longest(checkpoints, tokens)
            if match is not None:
                assert index.remove(ns, match.bundle_id) is True
                del checkpoints[tokens[: match.num_tokens]]
        elif op == "remove_endpoint":
            assert index.remove_endpoint(ns, list(tokens)) == checkpoints.pop(tokens, None)
        for probe in (tokens, tokens[:-1], tokens + (0, 1)):
            assert index.longest_prefix(ns, probe) == brute_force_longest(checkpoints, probe)
        for each_ns, each in reference.items():
            assert index.num_checkpoints(each_ns) == len(each)
            assert index.num_nodes(each_ns) <= max(0, 2 * len(each) - 1)  # compact: pruned, merged
            for stored, bundle_id in each.items():
                assert index.get(each_ns, stored) == bundle_id


def test_long_edges_split_at_the_first_differing_token():
    """Edges of hundreds of tokens, prompts that leave them at every position: the index
    splits and matches exactly at the first token that differs (the prefix comparison bisects
    long edges by slices)."""
    edge = list(range(100, 400))
    for diverge_at in [0, 1, 15, 16, 17, 31, 150, 298, 299]:
        index = RadixIndex()
        index.insert(NS, edge, 1)
        query = edge[:diverge_at] + [7] + edge[diverge_at + 1:]
        index.insert(NS, query[: diverge_at + 1], 2)
        assert index.longest_prefix(NS, edge) == Match(1, len(edge))
        assert index.longest_prefix(NS, query) == Match(2, diverge_at + 1)
        if diverge_at:
            index.insert(NS, edge[:diverge_at], 3)
            assert index.longest_prefix(NS, query) == Match(2, diverge_at + 1)
            assert index.longest_prefix(NS, edge[:diverge_at] + [5]) == Match(3, diverge_at)
