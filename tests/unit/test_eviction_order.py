"""The eviction orders of cache/eviction.py, and the ledger evicting in value order (pure Python)."""

from __future__ import annotations

import pytest

from cache.block_pool import BlockPool
from cache.checkpoint_keys import CheckpointKind
from cache.checkpoint_ledger import CheckpointLedger
from cache.eviction import LruOrder, PrefillCost, ValueOrder, choose_victims, fair_share, make_order

NS = ("model", "")
COST = PrefillCost(flops_per_token=100.0, flops_per_token_pair=1.0)


def test_lru_order_is_least_recently_touched_first():
    order = LruOrder()
    for key in "abc":
        order.add(key, 10, 10)
    order.touch("a")
    assert list(order) == ["b", "c", "a"] and list(order.below(1, 10**9)) == ["b", "c", "a"]
    order.remove("c")
    assert list(order) == ["b", "a"] and len(order) == 2


def test_value_order_keeps_what_saves_more_compute_per_byte():
    order = ValueOrder(COST, half_life=4)
    order.add("short", 10, 1000)  # 1,055 FLOPs saved: 1.1 a byte
    order.add("long", 1000, 10000)  # 600,500 FLOPs: 60 a byte
    assert list(order) == ["short", "long"]
    assert order.value_per_byte(1000, 10000) == pytest.approx((100 * 1000 + 1000 * 1001 / 2) / 10000)


def test_value_order_decays_an_unused_checkpoint_by_its_half_life():
    order = ValueOrder(PrefillCost(), half_life=2)  # FLOPs = tokens
    order.add("worth_4", 4, 1)
    order.add("worth_1", 1, 1)
    assert list(order) == ["worth_1", "worth_4"]  # log2 4 + 0/2 = 2 > log2 1 + 1/2
    for _ in range(4):  # four touches later worth_1 is 2.5 half-lives fresher
        order.touch("worth_1")
    assert list(order) == ["worth_4", "worth_1"]
    order.touch("worth_4")  # used again: counts as new
    assert list(order) == ["worth_1", "worth_4"]


def test_equal_values_go_least_recently_touched_first():
    order = ValueOrder(COST, half_life=8)
    for key in "abcd":
        order.add(key, 50, 500)
    order.touch("b")
    assert list(order) == ["a", "c", "d", "b"]
    order.remove("c")
    assert list(order) == ["a", "d", "b"] and len(order) == 3


def test_a_checkpoint_extending_another_is_worth_what_it_adds():
    order = ValueOrder(PrefillCost(), half_life=1000)
    order.add("instruction", 1000, 1000)  # 1 token a byte
    order.add("prompt", 1010, 20, prefix_tokens=1000)  # 10 more tokens for 20 bytes: 0.5
    assert list(order) == ["prompt", "instruction"]


def test_below_gives_only_what_a_newcomer_outranks():
    order = ValueOrder(PrefillCost(), half_life=1000)
    order.add("cheap", 2, 10)
    order.add("dear", 1000, 10)
    assert list(order.below(10, 10)) == ["cheap"]  # worth 1 a byte: more than 0.2, less than 100
    assert list(order.below(1, 1000)) == []
    assert list(order.below(10**6, 10)) == ["cheap", "dear"]


def test_the_heap_stays_small_under_many_touches():
    order = ValueOrder(COST, half_life=16)
    for key in range(10):
        order.add(key, 10 + key, 100)
    for i in range(10_000):
        order.touch(i % 10)
    assert len(order._heap) <= 2 * len(order) + 64
    assert sorted(order) == list(range(10))


def test_make_order_and_bad_half_life():
    assert isinstance(make_order("lru"), LruOrder)
    assert isinstance(make_order("value", COST, 3), ValueOrder)
    with pytest.raises(ValueError):
        make_order("random")
    with pytest.raises(ValueError, match="half_life"):
        ValueOrder(COST, half_life=0)


def test_choose_victims_keeps_other_owners_fair_share():
    owners = {"a1": "a", "a2": "a", "b1": "b"}
    sizes = {"a1": 30, "a2": 30, "b1": 30}
    held, share = fair_share({"a": 60, "b": 30}, "b", budget_bytes=60)
    assert share == 30
    victims = choose_victims(["a1", "a2", "b1"], 40, "b", held, share, sizes.__getitem__,
                             owners.__getitem__, evictable=lambda key: True)
    assert victims == ["a1", "b1"]  # after a1, a holds its share: a2 stays
    held, share = fair_share({"a": 60, "b": 30}, "b", budget_bytes=60)
    assert choose_victims(["a1", "a2"], 70, "b", held, share, sizes.__getitem__, owners.__getitem__,
                          evictable=lambda key: key != "a1") is None


def capture(pool, ledger, tokens, num_bytes, owner=""):
    """Make room as CacheManager.reserve_checkpoint does, reserve and publish."""
    if ledger.evict_until(num_bytes, owner, newcomer=(NS, tokens)) is None:
        return None
    blocks = pool.allocate(-(-len(tokens) // ledger.block_size))
    bundle_id = ledger.reserve(NS, tokens, CheckpointKind.PROMPT, num_bytes, blocks[: len(tokens) // ledger.block_size],
                               owner)
    pool.release(blocks)
    if bundle_id is not None:
        ledger.publish(bundle_id, {0}, world_size=1)
    return bundle_id


def value_ledger(budget, num_blocks=64, block_size=4):
    pool = BlockPool(num_blocks)
    return pool, CheckpointLedger(pool, block_size, budget, order=ValueOrder(PrefillCost(), half_life=1000),
                                  block_bytes=8)


def test_the_ledger_evicts_the_least_valuable_bundle_first():
    pool, ledger = value_ledger(budget=20)
    long = capture(pool, ledger, list(range(40)), 10)
    short = capture(pool, ledger, [1, 2], 10)
    capture(pool, ledger, list(range(100, 140)), 10)  # no room: the short one goes, not the older long one
    assert ledger.get(short) is None and ledger.get(long) is not None
    assert ledger.evict_one() == long  # then the older of two equal ones


def test_a_capture_worth_less_than_every_bundle_it_would_evict_is_refused():
    pool, ledger = value_ledger(budget=20)
    first = capture(pool, ledger, list(range(40)), 10)
    second = capture(pool, ledger, list(range(50, 90)), 10)
    assert ledger.evict_until(10, newcomer=(NS, [7, 8])) is None  # worth less than either
    assert ledger.get(first) is not None and ledger.get(second) is not None
    assert ledger.evict_until(10, newcomer=(NS, list(range(200, 300)))) == [first]


def test_value_eviction_keeps_each_tenants_fair_share():
    pool, ledger = value_ledger(budget=40)
    a_short = capture(pool, ledger, [1, 2], 20, owner="a")  # a's share is 20: within it
    b_long = capture(pool, ledger, list(range(40)), 20, owner="b")
    assert ledger.evict_until(20, owner="b") == [b_long]  # a's cheap one is protected by its share
    assert ledger.get(a_short) is not None
