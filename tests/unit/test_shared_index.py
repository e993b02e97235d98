"""The cluster checkpoint index (cache/shared_index.py), pure Python.

Unit tests for digests, lookups, reports and mirrors; a property-based machine drives the index
with random reports, removals, stored copies and lookups, checks every lookup against a brute
force over a plain model of what each replica holds, and keeps a mirror in step through
deltas and snapshots.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cache.index_messages import (
    CheckpointRecord,
    LookupResult,
    ReplicaReport,
    StoredCopy,
    prefix_digests,
    token_digest,
)
from cache.shared_index import SharedIndex

NS = ("tiny", "")
SALTED = ("tiny", "salt")
SYSTEM = tuple(range(100, 130))


def record(replica: str, bundle: int, tokens, ns=NS, kind="instruction", num_bytes=10):
    return CheckpointRecord(ns, token_digest(tokens), len(tokens), kind, num_bytes, replica, bundle)


def full(index: SharedIndex, replica: str, *records) -> None:
    ack = index.apply_report(ReplicaReport(replica, None, tuple(records), full=True))
    assert ack.accepted and ack.incarnation == index.incarnation


def test_prefix_digests_equal_digests_of_the_prefixes():
    tokens = list(range(50))
    got = prefix_digests(tokens, [50, 7, 0, 51, 7, 1])
    assert got == {n: token_digest(tokens[:n]) for n in (1, 7, 50)}
    assert token_digest([1, 2]) != token_digest([2, 1]) and token_digest([256]) != token_digest([1, 0])


def test_lookup_finds_the_longest_held_prefix_and_its_replicas():
    index = SharedIndex("a")
    full(index, "r1", record("r1", 1, SYSTEM), record("r1", 2, SYSTEM + (1, 2, 3)))
    full(index, "r2", record("r2", 7, SYSTEM))
    assert index.lookup(NS, SYSTEM + (1, 2, 3, 4)) == LookupResult(33, frozenset({"r1"}))
    assert index.lookup(NS, SYSTEM + (9,)) == LookupResult(30, frozenset({"r1", "r2"}))
    assert index.lookup(NS, SYSTEM) == LookupResult(30, frozenset({"r1", "r2"}))  # whole prompt
    assert index.lookup(NS, SYSTEM[:-1]) == LookupResult()
    assert index.lookup(SALTED, SYSTEM + (9,)) == LookupResult()  # namespaces never mix
    assert index.lookup(("unknown", ""), []) == LookupResult()
    # `among`: only replicas the caller can route to; a shorter prefix of a live one wins
    assert index.lookup(NS, SYSTEM + (1, 2, 3), among={"r2"}) == LookupResult(30, frozenset({"r2"}))
    assert index.lookup(NS, SYSTEM + (1, 2, 3), among=set()) == LookupResult()


def test_deltas_need_a_known_replica_and_the_current_incarnation():
    index = SharedIndex("a")
    delta = ReplicaReport("r1", "a", (record("r1", 1, SYSTEM),))
    assert not index.apply_report(delta).accepted  # first report must be full
    full(index, "r1")
    assert index.apply_report(delta).accepted
    assert not index.apply_report(ReplicaReport("r1", "old", (), (1,))).accepted
    assert index.lookup(NS, SYSTEM).replica_ids == {"r1"}
    assert index.apply_report(ReplicaReport("r1", "a", (), (1,))).accepted
    assert index.lookup(NS, SYSTEM) == LookupResult()
    with pytest.raises(ValueError):
        index.apply_report(ReplicaReport("r1", "a", (record("r2", 1, SYSTEM),)))


def test_a_full_report_replaces_what_the_replica_held():
    index = SharedIndex("a")
    full(index, "r1", record("r1", 1, SYSTEM), record("r1", 2, SYSTEM + (5,)))
    full(index, "r1", record("r1", 2, SYSTEM + (5,)))
    assert [r.bundle_id for r in index.replica_records("r1")] == [2]
    assert index.stats().records == 1 and index.stats().num_bytes == 10


def test_remove_replica_forgets_it_and_asks_for_a_full_report():
    index = SharedIndex("a")
    full(index, "r1", record("r1", 1, SYSTEM))
    full(index, "r2", record("r2", 1, SYSTEM))
    index.remove_replica("r1")
    assert index.lookup(NS, SYSTEM).replica_ids == {"r2"}
    assert not index.apply_report(ReplicaReport("r1", "a", (record("r1", 3, SYSTEM),))).accepted
    assert index.stats().replicas == 1


def test_stored_copies_outlive_the_replica_that_held_the_bundle():
    index = SharedIndex("a")
    full(index, "r1", record("r1", 1, SYSTEM))
    copy = StoredCopy(locator=("ref-0", "ref-1"), num_bytes=99)
    assert index.set_stored_copy(("r1", 1), copy)
    assert not index.set_stored_copy(("r1", 2), copy)
    full(index, "r1", record("r1", 1, SYSTEM))  # a re-report keeps the copy
    assert index.lookup(NS, SYSTEM).stored_copies == (copy,)
    index.remove_replica("r1")
    assert index.lookup(NS, SYSTEM) == LookupResult(30, frozenset(), (copy,))
    assert index.lookup(NS, SYSTEM, stored=False) == LookupResult()
    assert index.set_stored_copy(("r1", 1), None)  # neither replica nor copy: gone
    assert index.stats().records == 0


def test_the_oldest_records_go_beyond_max_records():
    index = SharedIndex("a", max_records=2)
    full(index, "r1", *(record("r1", b, SYSTEM[: 10 + b]) for b in range(3)))
    assert sorted(r.bundle_id for r in index.records()) == [1, 2]
    assert index.lookup(NS, SYSTEM[:10]) == LookupResult()


def test_a_mirror_behind_the_kept_changes_gets_a_snapshot():
    index = SharedIndex("a", max_changes=3)
    mirror = SharedIndex.from_snapshot(index.snapshot())
    full(index, "r1", record("r1", 1, SYSTEM))
    assert mirror.apply_delta(index.delta(mirror.incarnation, mirror.version))
    assert mirror.records() == index.records()
    for b in range(2, 6):
        index.apply_report(ReplicaReport("r1", "a", (record("r1", b, SYSTEM[:b]),)))
    assert index.delta(mirror.incarnation, mirror.version) is None
    assert index.delta("other", index.version) is None
    assert index.delta("a", index.version + 1) is None
    mirror = SharedIndex.from_snapshot(index.snapshot())
    assert mirror.records() == index.records() and mirror.version == index.version
    empty = index.delta("a", index.version)
    assert empty.changes == () and mirror.apply_delta(empty)
    index.apply_report(ReplicaReport("r1", "a", (), (5,)))
    index.apply_report(ReplicaReport("r1", "a", (), (4,)))
    assert not mirror.apply_delta(index.delta("a", index.version - 1))  # not its version
    assert mirror.apply_delta(index.delta("a", mirror.version))
    assert mirror.records() == index.records() and len(mirror.records()) == 3


# ---- property-based: the index against a plain model ------------------------------------------

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=6).map(tuple)
REPLICAS = st.sampled_from(["r1", "r2", "r3"])
NAMESPACES = st.sampled_from([NS, SALTED])


class IndexMachine(RuleBasedStateMachine):
    """Model: per replica, {bundle id: (namespace, tokens)} of what it holds and has reported;
    stored copies by record key. The index must answer every lookup as a brute force over the
    model does, and a mirror fed with deltas (snapshots when too far behind) must equal it."""

    @initialize()
    def start(self):
        self.index = SharedIndex("inc-1", max_records=1_000, max_changes=8)
        self.mirror = SharedIndex.from_snapshot(self.index.snapshot())
        self.held: dict[str, dict[int, tuple]] = {}
        self.known: set[str] = set()
        self.copies: dict[tuple[str, int], tuple] = {}  # key -> (namespace, tokens)
        self.next_bundle = 0

    def _record(self, replica, bundle, ns, tokens):
        return record(replica, bundle, tokens, ns=ns)

    @rule(replica=REPLICAS, ns=NAMESPACES, tokens=st.lists(TOKENS, max_size=3),
          drop=st.integers(0, 3), full_report=st.booleans())
    def report(self, replica, ns, tokens, drop, full_report):
        held = self.held.setdefault(replica, {})
        dropped = tuple(sorted(held)[:drop])
        published = []
        for t in tokens:
            self.next_bundle += 1
            published.append(self._record(replica, self.next_bundle, ns, t))
        if full_report:
            for b in dropped:
                del held[b]
            for r, t in zip(published, tokens):
                held[r.bundle_id] = (ns, t)
            everything = tuple(self._record(replica, b, *v) for b, v in held.items())
            ack = self.index.apply_report(ReplicaReport(replica, None, everything, full=True))
            assert ack.accepted
            self.known.add(replica)
            return
        ack = self.index.apply_report(ReplicaReport(replica, "inc-1", tuple(published), dropped))
        assert ack.accepted == (replica in self.known)
        if ack.accepted:
            for b in dropped:
                del held[b]
            for r, t in zip(published, tokens):
                held[r.bundle_id] = (ns, t)

    @rule(replica=REPLICAS)
    def remove(self, replica):
        self.index.remove_replica(replica)
        self.held.pop(replica, None)
        self.known.discard(replica)

    @rule(replica=REPLICAS, which=st.integers(0, 5), attach=st.booleans())
    def stored_copy(self, replica, which, attach):
        records = sorted((r for r in self.index.records() if r.replica_id == replica),
                         key=lambda r: r.key)
        if not records:
            return
        rec = records[which % len(records)]
        key = rec.key
        copy = StoredCopy(locator=key, num_bytes=1) if attach else None
        assert self.index.set_stored_copy(key, copy)
        if attach:
            ns = rec.namespace
            tokens = self.held.get(replica, {}).get(key[1], (ns, None))[1]
            if tokens is None:
                tokens = self.copies[key][1]
            self.copies[key] = (ns, tokens)
        else:
            self.copies.pop(key, None)

    @rule(ns=NAMESPACES, prompt=st.lists(st.integers(0, 3), max_size=8),
          among=st.none() | st.frozensets(REPLICAS), stored=st.booleans())
    def lookup(self, ns, prompt, among, stored):
        expected = LookupResult()
        holders = [(r, b, v) for r, held in self.held.items() for b, v in held.items()]
        for length in range(len(prompt), 0, -1):
            prefix = tuple(prompt[:length])
            replicas = frozenset(r for r, b, (n, t) in holders
                                 if n == ns and t == prefix and (among is None or r in among))
            copies = sorted(k for k, (n, t) in self.copies.items()
                            if stored and n == ns and t == prefix)
            if replicas or copies:
                expected = (length, replicas, copies)
                break
        got = self.index.lookup(ns, prompt, among=among, stored=stored)
        if expected == LookupResult():
            assert got == expected
        else:
            assert (got.length, got.replica_ids) == expected[:2]
            assert sorted(c.locator for c in got.stored_copies) == expected[2]

    @rule()
    def sync_mirror(self):
        delta = self.index.delta(self.mirror.incarnation, self.mirror.version)
        if delta is None or not self.mirror.apply_delta(delta):
            self.mirror = SharedIndex.from_snapshot(self.index.snapshot())
        assert self.mirror.records() == self.index.records()
        assert self.mirror.version == self.index.version

    @invariant()
    def records_match_the_model(self):
        live = {(r.replica_id, r.bundle_id) for r in self.index.records() if r.on_replica}
        assert live == {(r, b) for r, held in self.held.items() for b in held}
        assert {r.key for r in self.index.records() if not r.on_replica} <= set(self.copies)
        assert self.index.stats().num_bytes == 10 * len(self.index.records())

    @invariant()
    def mirror_never_runs_ahead(self):
        assert self.mirror.version <= self.index.version


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_index_machine = IndexMachine.TestCase
