"""The checkpoint event feed (engine/checkpoint_events.py) as the ledger's listener: published
and evicted bundles are reported oldest first, bundles that never publish are not, and the
buffer is bounded (pure Python)."""

from __future__ import annotations

import pytest

from cache.block_pool import BlockPool
from cache.checkpoint_ledger import CheckpointKind, CheckpointLedger
from engine.checkpoint_events import CheckpointEvent, CheckpointEventFeed

NS = ("tiny-model", "salt")
BLOCK = 2


def make_ledger(feed: CheckpointEventFeed, budget: int = 100) -> tuple[BlockPool, CheckpointLedger]:
    pool = BlockPool(32)
    return pool, CheckpointLedger(pool, BLOCK, budget, listener=feed)


def reserve(pool: BlockPool, ledger: CheckpointLedger, tokens, kind=CheckpointKind.PROMPT,
            num_bytes=10, namespace=NS) -> int:
    """A request computes `tokens`, reserves a bundle over them and finishes."""
    blocks = pool.allocate(-(-len(tokens) // BLOCK))
    bundle_id = ledger.reserve(namespace, tokens, kind, num_bytes, blocks[: len(tokens) // BLOCK])
    pool.release(blocks)
    assert bundle_id is not None
    return bundle_id


def test_published_and_evicted_bundles_are_reported_oldest_first():
    feed = CheckpointEventFeed()
    pool, ledger = make_ledger(feed)
    first = reserve(pool, ledger, [1, 2, 3], CheckpointKind.INSTRUCTION, num_bytes=7)
    second = reserve(pool, ledger, [1, 2, 3, 4, 5], CheckpointKind.RESPONSE, namespace=("m", None))
    ledger.publish(first, {0, 1}, world_size=2)
    ledger.publish(second, {0}, world_size=1)
    assert ledger.evict_lru() == first
    assert feed.drain() == [
        CheckpointEvent("published", NS, (1, 2, 3), "instruction", 7, first),
        CheckpointEvent("published", ("m", ""), (1, 2, 3, 4, 5), "response", 10, second),
        CheckpointEvent("dropped", NS, (1, 2, 3), "instruction", 7, first),
    ]
    assert feed.drain() == []  # drained
    assert ledger.evict_until(ledger.budget_bytes) == [second]
    assert [(e.action, e.bundle_id) for e in feed.drain()] == [("dropped", second)]


def test_bundles_that_never_publish_produce_no_event():
    feed = CheckpointEventFeed()
    pool, ledger = make_ledger(feed)
    unconfirmed = reserve(pool, ledger, [1, 2, 3])
    kept = reserve(pool, ledger, [4, 5])
    duplicate = reserve(pool, ledger, [4, 5])
    ledger.publish(unconfirmed, {0}, world_size=2)  # rank 1 missing: dropped
    ledger.publish(kept, {0}, world_size=1)
    ledger.publish(duplicate, {0}, world_size=1)  # same endpoint: dropped
    assert [(e.action, e.bundle_id) for e in feed.drain()] == [("published", kept)]
    assert len(ledger) == 1 and pool.num_free == 31


def test_the_feed_keeps_the_newest_events_and_counts_the_lost():
    feed = CheckpointEventFeed(capacity=3)
    pool, ledger = make_ledger(feed, budget=1000)
    ids = [reserve(pool, ledger, [i, i + 1, i + 2]) for i in range(0, 50, 10)]
    for bundle_id in ids:
        ledger.publish(bundle_id, {0}, world_size=1)
    assert len(feed) == 3 and feed.num_lost == 2
    assert [e.bundle_id for e in feed.drain()] == ids[2:]
    assert feed.num_lost == 2  # cumulative: draining does not reset it


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        CheckpointEventFeed(capacity=0)
