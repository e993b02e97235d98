"""The checkpoint event feed (engine/checkpoints/capture_events.py) as the ledger's listener: published
and evicted bundles are reported oldest first, bundles that never publish are not, and the
buffer is bounded (pure Python)."""

from __future__ import annotations

import pytest

from cache.checkpoint_keys import CheckpointKind
from cache.block_pool import BlockPool
from cache.checkpoint_ledger import CheckpointLedger
from engine.checkpoints.capture_events import CheckpointEvent, CheckpointEventFeed

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
    assert ledger.evict_one() == first
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


def test_a_feed_that_is_not_recording_keeps_nothing():
    feed = CheckpointEventFeed(recording=False)
    pool, ledger = make_ledger(feed)
    bundle_id = reserve(pool, ledger, [1, 2, 3])
    ledger.publish(bundle_id, {0}, world_size=1)
    assert ledger.lookup(NS, [1, 2, 3, 4]) is not None  # a hit
    assert len(feed) == 0 and feed.drain() == [] and feed.drain_hits() == {}
    feed.recording = True
    assert ledger.lookup(NS, [1, 2, 3, 5]) is not None
    assert feed.drain_hits() == {bundle_id: 1}


def test_hits_are_counted_for_at_most_capacity_bundles_between_drains():
    feed = CheckpointEventFeed(capacity=2)
    pool, ledger = make_ledger(feed, budget=1000)
    ids = [reserve(pool, ledger, [i, i + 1, i + 2]) for i in range(0, 30, 10)]
    for bundle_id in ids:
        ledger.publish(bundle_id, {0}, world_size=1)
    for i in (0, 10, 20, 0):
        assert ledger.lookup(NS, [i, i + 1, i + 2, 99]) is not None
    assert feed.drain_hits() == {ids[0]: 2, ids[1]: 1}  # the third bundle's hit is not counted
