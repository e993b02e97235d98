"""Checkpoint ledger: two-phase publish, pins, LRU byte budget, block references (pure Python).

The property-based part drives the ledger and a BlockPool with random capture / publish / lookup /
pin / unpin / evict sequences and compares them with a plain reference model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cache.checkpoint_keys import CheckpointKind
from cache.block_pool import BlockPool
from cache.checkpoint_ledger import BundleState, CheckpointLedger, PublishOutcome

NS = ("tiny-model", None)
SALTED = ("tiny-model", "salt-b")
PROMPT, RESPONSE, INSTRUCTION = CheckpointKind.PROMPT, CheckpointKind.RESPONSE, CheckpointKind.INSTRUCTION


def make_ledger(num_blocks=16, block_size=2, budget=100):
    pool = BlockPool(num_blocks)
    return pool, CheckpointLedger(pool, block_size, budget)


def capture(pool, ledger, tokens, num_bytes=10, kind=PROMPT, ns=NS, publish=True, owner=""):
    """A request computes `tokens` in fresh blocks, reserves a bundle, finishes, then publishes."""
    request_blocks = pool.allocate(-(-len(tokens) // ledger.block_size))
    full = request_blocks[: len(tokens) // ledger.block_size]
    bundle_id = ledger.reserve(ns, tokens, kind, num_bytes, full, owner)
    pool.release(request_blocks)
    if publish and bundle_id is not None:
        assert ledger.publish(bundle_id, {0, 1}, world_size=2) is PublishOutcome.PUBLISHED
    return bundle_id


def test_pending_bundle_is_invisible_until_every_rank_confirms():
    pool, ledger = make_ledger()
    bundle_id = capture(pool, ledger, [1, 2, 3, 4, 5], publish=False)
    assert ledger.lookup(NS, [1, 2, 3, 4, 5, 6]) is None
    assert ledger.publish(bundle_id, {1, 0}, world_size=2) is PublishOutcome.PUBLISHED
    hit = ledger.lookup(NS, [1, 2, 3, 4, 5, 6])
    assert (hit.bundle_id, hit.num_tokens, hit.kind) == (bundle_id, 5, PROMPT)
    assert [pool.ref_count(b) for b in hit.block_ids] == [1, 1]  # one reference each, the bundle's


@pytest.mark.parametrize("confirmed", [{0}, set(), {0, 2}, {0, 1, 2}])
def test_publish_without_exactly_every_rank_drops_and_releases_blocks(confirmed):
    pool, ledger = make_ledger()
    bundle_id = capture(pool, ledger, [1, 2, 3, 4, 5], kind=INSTRUCTION, publish=False)
    assert pool.num_free == 16 - 2 and ledger.bytes_held == 10
    assert ledger.publish(bundle_id, confirmed, world_size=2) is PublishOutcome.UNCONFIRMED
    assert pool.num_free == 16 and ledger.bytes_held == 0 and len(ledger) == 0
    assert ledger.lookup(NS, [1, 2, 3, 4, 5]) is None
    assert ledger.counters[INSTRUCTION].dropped == 1 and ledger.counters[INSTRUCTION].captured == 0
    with pytest.raises(ValueError):
        ledger.publish(bundle_id, {0, 1}, world_size=2)


def test_an_unconfirmed_publish_releases_a_pending_bundle():
    pool, ledger = make_ledger()
    bundle_id = capture(pool, ledger, [1, 2, 3, 4], publish=False)
    assert ledger.publish(bundle_id, set(), world_size=1) is PublishOutcome.UNCONFIRMED
    assert pool.num_free == 16 and ledger.bytes_held == 0 and len(ledger) == 0


def test_duplicate_endpoint_at_publish_keeps_the_first_bundle():
    pool, ledger = make_ledger()
    first = capture(pool, ledger, [1, 2, 3], publish=False)
    second = capture(pool, ledger, [1, 2, 3], kind=RESPONSE, publish=False)
    assert ledger.publish(first, {0}, world_size=1) is PublishOutcome.PUBLISHED
    assert ledger.publish(second, {0}, world_size=1) is PublishOutcome.DUPLICATE
    assert ledger.get(second) is None and len(ledger) == 1 and ledger.bytes_held == 10
    assert pool.num_free == 16 - 1
    assert ledger.lookup(NS, [1, 2, 3, 9]).bundle_id == first
    assert ledger.counters[RESPONSE].deduplicated == 1


def test_reserve_checks_blocks_and_budget():
    pool, ledger = make_ledger(budget=20)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError):  # 5 tokens with block size 2 need exactly 2 full blocks
        ledger.reserve(NS, [1, 2, 3, 4, 5], PROMPT, 1, blocks[:1])
    with pytest.raises(ValueError):  # a free block cannot be referenced
        ledger.reserve(NS, [1, 2, 3, 4, 5], PROMPT, 1, [blocks[0], 15])
    assert ledger.reserve(NS, [1, 2, 3, 4, 5], PROMPT, 21, blocks) is None
    held = ledger.reserve(NS, [1], PROMPT, 15, [])
    assert ledger.reserve(NS, [1, 2, 3, 4, 5], PROMPT, 6, blocks) is None  # 15 + 6 > 20
    ledger.publish(held, set(), world_size=1)  # abandoned: dropped
    assert [pool.ref_count(b) for b in (blocks[0], blocks[1], 15)] == [1, 1, 0]  # nothing changed


def test_sharing_a_free_block_changes_no_count():
    """BlockPool.share checks every block before it adds a reference to any."""
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    with pytest.raises(ValueError, match="block 7 is free"):
        pool.share([*blocks, 7])
    assert [pool.ref_count(b) for b in (*blocks, 7)] == [1, 1, 1, 0]
    pool.share(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2, 2] and pool.all_allocated(blocks)
    assert not pool.all_allocated([blocks[0], 7]) and pool.all_allocated([])


def test_lookup_pins_and_pinned_bundles_are_never_evicted():
    pool, ledger = make_ledger(budget=30)
    a = capture(pool, ledger, [1, 2, 3])
    b = capture(pool, ledger, [4, 5, 6])
    hit = ledger.lookup(NS, [1, 2, 3, 7])
    assert hit.bundle_id == a and ledger.get(a).pin_count == 1
    assert ledger.evict_until(30) is None  # only b is evictable: 10 free + 10 < 30
    assert ledger.get(b) is not None and ledger.bytes_held == 20  # atomic: nothing evicted
    assert ledger.evict_until(20) == [b]
    assert ledger.evict_one() is None
    ledger.unpin(a)
    with pytest.raises(ValueError):
        ledger.unpin(a)
    assert ledger.evict_one() == a
    assert pool.num_free == 16 and ledger.counters[PROMPT].evicted == 2


def test_eviction_is_least_recently_used_first():
    pool, ledger = make_ledger(budget=30)
    old, middle, new = (capture(pool, ledger, [t, t]) for t in (1, 2, 3))
    ledger.unpin(ledger.lookup(NS, [1, 1]).bundle_id)  # `old` becomes most recently used
    assert ledger.evict_until(10) == [middle]
    assert ledger.evict_until(25) == [new, old]
    assert ledger.evict_until(0) == []


def test_a_tenant_keeps_its_fair_share_against_another_tenants_captures():
    """Budget 100, two tenants: each keeps 50 bytes against the other. Tenant a holds 40 (within
    its share); tenant b fills the rest and goes on capturing: b evicts only its own bundles,
    never a's, though a's are the least recently used."""
    pool, ledger = make_ledger(num_blocks=64, budget=100)
    a_ids = [capture(pool, ledger, (1, i), owner="a") for i in range(4)]  # 40 bytes
    b_ids = [capture(pool, ledger, (2, i), owner="b") for i in range(6)]  # 60: budget full
    for i in range(6, 30):  # b keeps capturing: each needs room
        assert ledger.evict_until(10, owner="b") is not None
        capture(pool, ledger, (2, i), owner="b")
    assert all(ledger.get(bundle_id) is not None for bundle_id in a_ids)
    assert not any(ledger.get(bundle_id) is not None for bundle_id in b_ids)


def test_a_tenant_above_its_share_loses_only_the_surplus():
    """a took 70 of 100 bytes while the budget was empty; b's captures evict a's least recently
    used bundles down to a's share (50), then only b's own."""
    pool, ledger = make_ledger(num_blocks=64, budget=100)
    a_ids = [capture(pool, ledger, (1, i), owner="a") for i in range(7)]
    b_ids = [capture(pool, ledger, (2, i), owner="b") for i in range(3)]
    for i in range(3, 13):
        assert ledger.evict_until(10, owner="b") is not None
        capture(pool, ledger, (2, i), owner="b")
    assert [ledger.get(i) is not None for i in a_ids] == [False] * 2 + [True] * 5
    assert not any(ledger.get(i) is not None for i in b_ids)


def test_a_lone_tenant_may_take_the_budget_and_a_newcomer_only_its_share():
    pool, ledger = make_ledger(num_blocks=64, budget=50)
    ids = [capture(pool, ledger, (1, i), owner="a") for i in range(5)]
    assert ledger.evict_until(20, owner="a") == ids[:2]
    # a holds 30, 20 are free; a newcomer's share is 25 each: it gets the free 20, but evicting
    # one of a's (30 - 10 < 25) is not allowed, so a capture needing 30 does not fit
    assert ledger.evict_until(20, owner="newcomer") == []
    assert ledger.evict_until(30, owner="newcomer") is None
    assert all(ledger.get(i) is not None for i in ids[2:])


def test_block_pressure_evicts_the_needy_tenants_own_checkpoints_first():
    pool, ledger = make_ledger(num_blocks=64, budget=100)
    a_old = capture(pool, ledger, (1, 1), owner="a")
    b_own = capture(pool, ledger, (2, 1), owner="b")
    assert ledger.evict_one(owner="b") == b_own  # a's is older but within a's share
    assert ledger.evict_one(owner="b") == a_old  # nothing else left: a running request comes first
    assert ledger.evict_one(owner="b") is None


def test_a_block_stays_allocated_while_any_bundle_references_it():
    """Every bundle, pending or published, holds one reference per block: the pool frees a
    block only once the last bundle over it is dropped, never from under a bundle."""
    pool, ledger = make_ledger()
    a = capture(pool, ledger, [1, 2, 3, 4])
    hit = ledger.lookup(NS, [1, 2, 3, 4, 5, 6])  # a request restores a, shares its blocks, extends
    request_blocks = list(hit.block_ids) + pool.allocate(1)
    pool.share(list(hit.block_ids))
    ledger.unpin(a)
    b = ledger.reserve(NS, [1, 2, 3, 4, 5, 6], RESPONSE, 10, request_blocks)
    assert ledger.num_blocks_held_alone() == 0  # the request still holds all three
    pool.release(request_blocks)
    assert ledger.num_blocks_held_alone() == 3
    pending = ledger.reserve(NS, [1, 2, 9], PROMPT, 10, hit.block_ids[:1])
    assert ledger.publish(b, {0}, world_size=1) is PublishOutcome.PUBLISHED
    shared = hit.block_ids[0]
    assert ledger.bundles_for_block(shared) == {a, b, pending} and pool.ref_count(shared) == 3

    assert ledger.evict_one() == a
    ledger.publish(pending, set(), world_size=1)  # abandoned: dropped
    assert ledger.bundles_for_block(shared) == {b} and pool.ref_count(shared) == 1
    assert ledger.num_blocks_held_alone() == 3
    assert shared not in pool.allocate(pool.num_free)  # every free block, but not this one
    assert ledger.lookup(NS, [1, 2, 3, 4, 5, 6]).bundle_id == b
    ledger.unpin(b)
    assert ledger.evict_one() == b
    assert pool.ref_count(shared) == 0 and ledger.bundles_for_block(shared) == frozenset()
    assert ledger.num_blocks_held_alone() == 0
    assert ledger.bytes_held == 0 and len(ledger) == 0
    assert ledger.counters[PROMPT].evicted == 1 and ledger.counters[RESPONSE].evicted == 1
    assert ledger.counters[PROMPT].dropped == 1


def test_namespaces_are_isolated_and_full_prompt_hits_are_returned():
    pool, ledger = make_ledger()
    capture(pool, ledger, [1, 2, 3], ns=NS)
    assert ledger.lookup(SALTED, [1, 2, 3]) is None
    assert ledger.lookup(NS, [1, 2, 3]).num_tokens == 3
    assert ledger.counters[PROMPT].hit == 1 and ledger.has_checkpoint(NS, [1, 2, 3])


# ---- property-based: the ledger against a reference model ---------------------------------------

BLOCK_SIZE, NUM_BLOCKS, BUDGET = 2, 12, 40
NAMESPACES = [NS, SALTED]
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=7).map(tuple)


@dataclass
class RefBundle:
    ns: object
    tokens: tuple[int, ...]
    num_bytes: int
    blocks: tuple[int, ...]


@dataclass
class Model:
    published: dict[int, RefBundle] = field(default_factory=dict)
    pending: dict[int, RefBundle] = field(default_factory=dict)
    lru: list[int] = field(default_factory=list)  # published, least recently used first
    pins: Counter = field(default_factory=Counter)

    def longest(self, ns, prompt):
        best = None
        for bundle_id, ref in self.published.items():
            if ref.ns == ns and prompt[: len(ref.tokens)] == ref.tokens:
                if best is None or len(ref.tokens) > len(self.published[best].tokens):
                    best = bundle_id
        return best

    def touch(self, bundle_id):
        self.lru.remove(bundle_id)
        self.lru.append(bundle_id)

    def drop_published(self, bundle_id):
        assert self.pins[bundle_id] == 0, "a pinned bundle was dropped"
        del self.published[bundle_id]
        self.lru.remove(bundle_id)

    def bytes_held(self):
        return sum(r.num_bytes for r in [*self.published.values(), *self.pending.values()])


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.ledger = CheckpointLedger(self.pool, BLOCK_SIZE, BUDGET)
        self.model = Model()

    def check_lookup(self, ns, prompt):
        """Look up and pin as a restoring request does; check it against the model."""
        hit = self.ledger.lookup(ns, prompt)
        expected = self.model.longest(ns, prompt)
        assert (None if hit is None else hit.bundle_id) == expected
        if hit is not None:
            ref = self.model.published[expected]
            assert (hit.num_tokens, hit.block_ids) == (len(ref.tokens), ref.blocks)
            self.model.pins[expected] += 1
            self.model.touch(expected)
        return hit

    def check_evict_one(self):
        expected = next((b for b in self.model.lru if self.model.pins[b] == 0), None)
        assert self.ledger.evict_one() == expected
        if expected is not None:
            self.model.drop_published(expected)
        return expected

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st, kind=st.sampled_from(CheckpointKind),
          num_bytes=st.integers(0, 15), publish_now=st.booleans())
    def capture(self, ns, tokens, kind, num_bytes, publish_now):
        """A request restores from its best hit, computes the rest, reserves a bundle, finishes.

        With `publish_now` every rank confirms right away; otherwise the bundle stays pending.
        """
        hit = self.check_lookup(ns, tokens)
        restored = list(hit.block_ids) if hit else []
        self.pool.share(restored)
        missing = -(-len(tokens) // BLOCK_SIZE) - len(restored)
        while self.pool.num_free < missing and self.check_evict_one() is not None:
            pass  # KV pressure: evict bundles until the request's blocks fit
        if hit:
            self.ledger.unpin(hit.bundle_id)
            self.model.pins[hit.bundle_id] -= 1
        new = self.pool.allocate(missing)
        if new is None:
            self.pool.release(restored)
            return
        request_blocks = restored + new
        full = tuple(request_blocks[: len(tokens) // BLOCK_SIZE])
        self.check_evict_until_fits(num_bytes)
        bundle_id = self.ledger.reserve(ns, tokens, kind, num_bytes, full)
        self.pool.release(request_blocks)  # the request ends before its capture is confirmed
        assert (bundle_id is None) == (num_bytes > BUDGET - self.model.bytes_held())
        if bundle_id is not None:
            self.model.pending[bundle_id] = RefBundle(ns, tokens, num_bytes, full)
            if publish_now:
                self.check_publish(bundle_id, {0, 1}, world_size=2, fault=False)

    @precondition(lambda self: self.model.pending)
    @rule(data=st.data(), world_size=st.integers(1, 3), fault=st.sampled_from(["none", "missing", "extra"]))
    def confirm(self, data, world_size, fault):
        bundle_id = data.draw(st.sampled_from(sorted(self.model.pending)))
        ranks = set(range(world_size))
        if fault == "missing":
            ranks.discard(data.draw(st.integers(0, world_size - 1)))
        elif fault == "extra":
            ranks.add(world_size)
        self.check_publish(bundle_id, ranks, world_size, fault=fault != "none")

    def check_publish(self, bundle_id, ranks, world_size, fault):
        ref = self.model.pending.pop(bundle_id)
        same_endpoint = [b for b, r in self.model.published.items() if (r.ns, r.tokens) == (ref.ns, ref.tokens)]
        existing = same_endpoint[0] if same_endpoint else None
        if fault:
            expected = PublishOutcome.UNCONFIRMED
        elif existing is not None:
            expected = PublishOutcome.DUPLICATE
            self.model.touch(existing)
        else:
            expected = PublishOutcome.PUBLISHED
            self.model.published[bundle_id] = ref
            self.model.lru.append(bundle_id)
        assert self.ledger.publish(bundle_id, ranks, world_size) is expected

    @precondition(lambda self: self.model.pending)
    @rule(data=st.data())
    def abandon(self, data):
        bundle_id = data.draw(st.sampled_from(sorted(self.model.pending)))
        del self.model.pending[bundle_id]
        assert self.ledger.publish(bundle_id, set(), world_size=1) is PublishOutcome.UNCONFIRMED

    @precondition(lambda self: self.model.published)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=4).map(tuple),
          kind=st.sampled_from(CheckpointKind), num_bytes=st.integers(0, 15))
    def continue_conversation(self, data, suffix, kind, num_bytes):
        """A later turn resends a checkpointed prefix plus new tokens (shares its blocks)."""
        ref = self.model.published[data.draw(st.sampled_from(sorted(self.model.published)))]
        self.capture(ref.ns, ref.tokens + suffix, kind, num_bytes, publish_now=True)

    @rule(ns=st.sampled_from(NAMESPACES), prompt=tokens_st)
    def lookup(self, ns, prompt):
        self.check_lookup(ns, prompt)

    @precondition(lambda self: +self.model.pins)
    @rule(data=st.data())
    def unpin(self, data):
        bundle_id = data.draw(st.sampled_from(sorted(+self.model.pins)))
        self.ledger.unpin(bundle_id)
        self.model.pins[bundle_id] -= 1

    @rule(bytes_needed=st.integers(0, BUDGET + 5))
    def evict_until(self, bytes_needed):
        self.check_evict_until_fits(bytes_needed)

    def check_evict_until_fits(self, bytes_needed):
        shortfall = bytes_needed - (BUDGET - self.model.bytes_held())
        victims = []
        for bundle_id in self.model.lru:
            if shortfall <= 0:
                break
            if self.model.pins[bundle_id] == 0:
                victims.append(bundle_id)
                shortfall -= self.model.published[bundle_id].num_bytes
        evicted = self.ledger.evict_until(bytes_needed)
        if shortfall > 0:
            assert evicted is None
            return
        assert evicted == victims and self.ledger.free_bytes >= bytes_needed
        for bundle_id in victims:
            self.model.drop_published(bundle_id)

    @invariant()
    def pool_counts_exactly_the_bundle_references(self):
        bundles = {**self.model.published, **self.model.pending}
        holders = Counter(block for ref in bundles.values() for block in ref.blocks)
        for block in range(NUM_BLOCKS):
            assert self.pool.ref_count(block) == holders[block] >= 0
            assert self.ledger.bundles_for_block(block) == {b for b, r in bundles.items() if block in r.blocks}
        # every reference in this pool is a bundle's: each referenced block is held alone
        assert self.ledger.num_blocks_held_alone() == len(+holders)

    @invariant()
    def ledger_matches_model(self):
        assert len(self.ledger) == len(self.model.published) + len(self.model.pending)
        assert self.ledger.bytes_held == self.model.bytes_held() <= BUDGET
        for bundle_id in self.model.published:
            bundle = self.ledger.get(bundle_id)
            assert bundle.state is BundleState.PUBLISHED
            assert bundle.pin_count == self.model.pins[bundle_id]
        assert all(count >= 0 for count in self.model.pins.values())
        assert all(b in self.model.published for b in +self.model.pins)  # pinned ones survive
        for ns in NAMESPACES:
            expected = sum(r.ns == ns for r in self.model.published.values())
            assert self.ledger.index.num_checkpoints(ns) == expected

    def teardown(self):
        for bundle_id, count in (+self.model.pins).items():
            for _ in range(count):
                self.ledger.unpin(bundle_id)
            self.model.pins[bundle_id] = 0
        for bundle_id in list(self.model.pending):
            self.ledger.publish(bundle_id, set(), world_size=1)
        while self.check_evict_one() is not None:  # evict_until(BUDGET) would keep 0-byte bundles
            pass
        assert self.pool.num_free == NUM_BLOCKS
        assert all(self.pool.ref_count(b) == 0 for b in range(NUM_BLOCKS))
        assert len(self.ledger) == 0 and self.ledger.bytes_held == 0 and len(self.ledger.index) == 0


LedgerMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestLedgerAgainstModel = LedgerMachine.TestCase
