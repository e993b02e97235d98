"""CacheManager.reserve_import: an imported checkpoint takes fresh KV blocks and bytes as a
capture would, evicting least recently used checkpoints, or nothing at all (pure Python)."""

from __future__ import annotations

from cache.cache_manager import BundleSizing, CacheManager
from cache.checkpoint_keys import CheckpointKind

NS = ("model", "")
BLOCK = 4
SIZING = BundleSizing(state_bytes=100, kv_bytes_per_token=10, hidden_row_bytes=10)


def test_an_import_holds_its_blocks_alone_until_published():
    cache = CacheManager(8, 2, BLOCK, checkpoint_bytes=1000, sizing=SIZING)
    bundle_id, blocks = cache.reserve_import(NS, list(range(10)), CheckpointKind.INSTRUCTION)
    assert len(blocks) == 2 and all(cache.blocks.ref_count(b) == 1 for b in blocks)
    assert cache.ledger.bytes_held == 100 + 2 * 10 + 10  # state, a tail of 2 tokens, hidden row
    assert cache.lookup(NS, list(range(12))) is None  # pending: invisible
    assert cache.publish(bundle_id, {0}, world_size=1)
    hit = cache.lookup(NS, list(range(12)))
    assert (hit.bundle_id, hit.num_tokens, hit.block_ids) == (bundle_id, 10, blocks)
    cache.unpin(bundle_id)
    assert cache.usage().idle


def test_an_import_evicts_least_recently_used_checkpoints_for_blocks_and_bytes():
    cache = CacheManager(4, 2, BLOCK, checkpoint_bytes=300, sizing=SIZING)
    old, _ = cache.reserve_import(NS, list(range(8)), CheckpointKind.PROMPT)
    cache.publish(old, {0}, world_size=1)
    assert cache.blocks.num_free == 2
    new, blocks = cache.reserve_import(("model", "b"), list(range(100, 112)), CheckpointKind.PROMPT)
    assert len(blocks) == 3  # needed the old bundle's blocks
    assert cache.ledger.get(old) is None and cache.take_dropped_bundles() == (old,)
    assert cache.ledger.get(new) is not None


def test_an_import_that_cannot_fit_holds_nothing():
    cache = CacheManager(4, 2, BLOCK, checkpoint_bytes=50, sizing=SIZING)
    assert cache.reserve_import(NS, list(range(6)), CheckpointKind.PROMPT) is None  # bytes
    assert cache.blocks.num_free == 4 and len(cache.ledger) == 0
    roomy = CacheManager(4, 2, BLOCK, checkpoint_bytes=1000, sizing=SIZING)
    held = roomy.allocate_blocks(0, 12)  # a running request holds 3 blocks
    assert roomy.reserve_import(NS, list(range(8)), CheckpointKind.PROMPT) is None  # blocks
    assert roomy.blocks.num_free == 1 and len(roomy.ledger) == 0
    roomy.release(held, None)
