"""The object-store tier's pure parts: the index's stored-copy budget and LRU eviction, hits
and warm-start ranking (cache/shared_index.py), and the fetch-or-recompute decision
(deployments/cluster/fetch_policy.py)."""

from __future__ import annotations

import pytest

from cache.index_messages import CheckpointRecord, ReplicaReport, StoredCopy, token_digest
from cache.shared_index import SharedIndex
from deployments.cluster.fetch_policy import MIB, FetchPolicy

NS = ("model", "")


def record(replica: str, bundle: int, tokens, kind="instruction", namespace=NS) -> CheckpointRecord:
    return CheckpointRecord(namespace, token_digest(tokens), len(tokens), kind, 10, replica, bundle)


def index_with(budget: int, *records: CheckpointRecord) -> SharedIndex:
    index = SharedIndex("inc", store_budget_bytes=budget)
    by_replica: dict[str, list] = {}
    for r in records:
        by_replica.setdefault(r.replica_id, []).append(r)
    for replica, held in by_replica.items():
        assert index.apply_report(ReplicaReport(replica, None, tuple(held), full=True)).accepted
    return index


def test_the_tier_stays_within_its_budget_least_recently_used_first():
    a, b, c = record("r1", 1, [1, 2]), record("r1", 2, [3, 4]), record("r1", 3, [5, 6])
    index = index_with(100, a, b, c)
    assert index.set_stored_copy(a.key, StoredCopy("A", 40))
    assert index.set_stored_copy(b.key, StoredCopy("B", 40))
    # a hit on a's checkpoint makes it the most recent: b goes when c needs room
    index.apply_report(ReplicaReport("r1", "inc", hits=((1, 3),)))
    assert index.set_stored_copy(c.key, StoredCopy("C", 40))
    stored = {r.key: r.stored_copy.locator for r in index.records() if r.stored_copy}
    assert stored == {a.key: "A", c.key: "C"}
    assert (index.stats().stored_copies, index.stats().stored_bytes) == (2, 80)
    assert not index.set_stored_copy(b.key, StoredCopy("too big", 101))
    assert index.stats().stored_bytes == 80


def test_an_evicted_copy_of_a_departed_replica_takes_its_record_along():
    a, b = record("r1", 1, [1, 2]), record("r2", 1, [3, 4])
    index = index_with(50, a, b)
    assert index.set_stored_copy(a.key, StoredCopy("A", 30))
    index.remove_replica("r1")  # a survives as a stored copy only
    assert index.lookup(NS, [1, 2, 9]).stored_copies == (StoredCopy("A", 30),)
    assert index.set_stored_copy(b.key, StoredCopy("B", 30))  # evicts A: its record goes
    assert index.lookup(NS, [1, 2, 9]).length == 0
    assert [r.key for r in index.records()] == [b.key]
    assert index.stats().stored_bytes == 30


def test_one_copy_per_checkpoint_and_ranking_by_hits():
    a, twin = record("r1", 1, [1, 2]), record("r2", 7, [1, 2])
    hot, prompt = record("r2", 8, [5, 6, 7]), record("r1", 2, [8, 9], kind="prompt")
    index = index_with(1000, a, twin, hot, prompt)
    assert index.set_stored_copy(a.key, StoredCopy("A", 10))
    assert not index.can_store(twin.key, 10) and index.can_store(hot.key, 10)
    assert not index.can_store(hot.key, 1001) and not index.can_store(("r9", 1), 1)
    assert index.set_stored_copy(hot.key, StoredCopy("H", 20))
    assert index.set_stored_copy(prompt.key, StoredCopy("P", 5))
    index.apply_report(ReplicaReport("r2", "inc", hits=((8, 5),)))
    index.apply_report(ReplicaReport("r1", "inc", hits=((1, 2),)))
    index.apply_report(ReplicaReport("r2", "inc", hits=((7, 1),)))  # the twin's hits count too
    ranked = index.hottest_stored("model", ["instruction"], 10, 1000)
    assert [(h.copy.locator, h.hits) for h in ranked] == [("H", 5), ("A", 3)]
    assert [h.copy.locator for h in index.hottest_stored("model", ["instruction"], 1, 1000)] == ["H"]
    assert [h.copy.locator for h in index.hottest_stored("model", ["instruction"], 10, 15)] == ["A"]
    assert index.hottest_stored("other-model", ["instruction"], 10, 1000) == []


def test_a_mirror_follows_the_sources_evictions():
    a, b = record("r1", 1, [1, 2]), record("r1", 2, [3, 4])
    index = index_with(50, a, b)
    mirror = SharedIndex.from_snapshot(index.snapshot())
    index.set_stored_copy(a.key, StoredCopy("A", 30))
    index.set_stored_copy(b.key, StoredCopy("B", 30))
    assert mirror.apply_delta(index.delta(mirror.incarnation, mirror.version))
    assert mirror.lookup(NS, [1, 2], among=(), stored=True).length == 0
    assert mirror.lookup(NS, [3, 4], among=(), stored=True).stored_copies == (StoredCopy("B", 30),)
    assert mirror.stats().stored_bytes == 30


@pytest.mark.parametrize("saved, nbytes, expected", [
    (0, 0, "recompute"),  # nothing saved
    (31, 1, "recompute"),  # below min_tokens
    (64, 16 * MIB, "fetch"),  # 4 tokens per MiB: the break-even
    (63, 16 * MIB, "recompute"),
    (1000, 100 * MIB, "fetch"),
    (1000, 300 * MIB, "recompute"),
])
def test_fetch_when_the_tokens_saved_pay_for_the_bytes(saved, nbytes, expected):
    assert FetchPolicy(min_tokens_per_mib=4.0, min_tokens=32).decide(saved, nbytes) == expected


def test_a_zero_ratio_fetches_whatever_saves_enough_tokens_and_bad_policies_are_refused():
    assert FetchPolicy(0.0, 1).decide(1, 10**12) == "fetch"
    with pytest.raises(ValueError):
        FetchPolicy(-1.0)
    with pytest.raises(ValueError):
        FetchPolicy(1.0, min_tokens=0)


def test_a_copy_passed_on_by_a_host_tier_brings_its_record_back():
    """A checkpoint its replica evicted (reported dropped) and passed on from its host tier:
    the copy comes with the record, put as a stored copy only; a twin copy is refused."""
    a = record("r1", 1, [1, 2])
    index = index_with(100, a)
    index.apply_report(ReplicaReport("r1", "inc", dropped=(1,)))
    assert index.records() == [] and not index.can_store(a.key, 10)
    assert not index.set_stored_copy(a.key, StoredCopy("A", 10))  # without its record: unknown
    assert index.can_store(a.key, 10, a) and not index.can_store(a.key, 101, a)
    assert index.set_stored_copy(a.key, StoredCopy("A", 10), a)
    (kept,) = index.records()
    assert kept.key == a.key and not kept.on_replica and kept.stored_copy == StoredCopy("A", 10)
    assert index.lookup(NS, [1, 2, 3]).stored_copies == (StoredCopy("A", 10),)
    assert index.lookup(NS, [1, 2, 3], stored=False).length == 0  # no replica holds it
    twin = record("r2", 5, [1, 2])
    assert not index.can_store(twin.key, 10, twin)
    assert not index.can_store(("r1", 9), 10, a)  # a record for another key is not taken


def test_a_copy_passed_on_before_the_drop_was_reported_stays_after_it():
    a = record("r1", 1, [1, 2])
    index = index_with(100, a)
    assert index.set_stored_copy(a.key, StoredCopy("A", 10), a)  # the record is still live: attached
    assert index.records()[0].on_replica
    index.apply_report(ReplicaReport("r1", "inc", dropped=(1,)))
    (kept,) = index.records()
    assert not kept.on_replica and kept.stored_copy == StoredCopy("A", 10)
    mirror = SharedIndex.from_snapshot(index.snapshot())
    assert mirror.lookup(NS, [1, 2], among=(), stored=True).stored_copies == (StoredCopy("A", 10),)
