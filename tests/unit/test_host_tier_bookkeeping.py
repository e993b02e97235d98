"""The host tier's bookkeeping (engine/checkpoints/host_tier.py) on small synthetic checkpoints:
its budget and order, the next tier, lookups, settlement and tenants' shares."""

from __future__ import annotations

import itertools

import torch

from cache.eviction import LruOrder, PrefillCost, ValueOrder
from engine.checkpoints.host_tier import DeviceStaging, HostTier, with_checksums
from engine.checkpoints.transfer import (
    CheckpointHeader, CheckpointShard, ExportedCheckpoint, ModelIdentity, ShardLayout, checkpoint_digest,
    shard_checksum,
)

NS = ("model", "")
LAYOUT = ShardLayout(conv_state=(1, 4, 3), ssm_state=(1, 2, 2, 2), kv_row=(1, 1, 4), hidden_size=4, dtype="float32")
MODEL = ModelIdentity("model", "c", "w", "float32", "cpu")


def checkpoint(tokens: tuple[int, ...], owner: str = "") -> ExportedCheckpoint:
    """A checkpoint over `tokens` whose tensors are filled from its first token, no checksum."""
    fill = float(tokens[0])
    shard = CheckpointShard(rank=0, conv_state=torch.full((1, 4, 3), fill), ssm_state=torch.full((1, 2, 2, 2), fill),
                            kv=torch.full(LAYOUT.kv_shape(len(tokens)), fill), hidden_row=torch.full((4,), fill),
                            checksum="")
    header = CheckpointHeader(NS, tokens, checkpoint_digest(NS, tokens), "instruction", owner, MODEL, 1, 4, (LAYOUT,))
    return ExportedCheckpoint(header, (shard,))


BUNDLE_IDS = itertools.count()


def demoted(tokens: tuple[int, ...], owner: str = "") -> tuple[ExportedCheckpoint, int]:
    """HostTier.add's arguments for a checkpoint over `tokens` demoted from a new device bundle."""
    return checkpoint(tokens, owner), next(BUNDLE_IDS)


def tier(budget: int, order=None, on_evict=None) -> HostTier:
    return HostTier(budget, order if order is not None else LruOrder(), DeviceStaging(torch.device("cpu")), on_evict=on_evict)


def test_layout_bytes_are_the_shards_bytes():
    assert LAYOUT.nbytes(10) == checkpoint(tuple(range(1, 11))).nbytes


def test_over_budget_the_least_recent_goes_to_the_next_tier_unchecksummed_with_its_bundle_id():
    size = LAYOUT.nbytes(3)
    passed = []
    host = tier(2 * size, on_evict=passed.append)
    a, b, c = (1, 2, 3), (4, 5, 6), (7, 8, 9)
    assert host.add(checkpoint(a), bundle_id=10) and host.add(checkpoint(b), bundle_id=11)
    assert host.touch_if_held(NS, a) and not host.touch_if_held(NS, c)  # a is now the most recent
    assert host.add(checkpoint(c), bundle_id=12)
    assert not host.holds(NS, b) and host.holds(NS, a) and host.holds(NS, c)
    (gone,) = passed
    assert gone.bundle_id == 11 and gone.exported.header.token_ids == b
    assert gone.exported.shards[0].checksum == ""  # the receiver adds it, off the step thread
    shard = with_checksums(gone.exported).shards[0]
    assert shard.checksum == shard_checksum(0, gone.exported.header.digest, shard.tensors())
    counters = host.counters
    assert (counters.demoted, counters.evicted, counters.passed_on, counters.already_held) == (3, 1, 1, 1)
    assert host.bytes_held == 2 * size and len(host) == 2


def test_a_failing_next_tier_costs_that_checkpoint_only():
    def fail(evicted):
        raise RuntimeError("the next tier is gone")

    host = tier(LAYOUT.nbytes(3), on_evict=fail)
    assert host.add(*demoted((1, 2, 3))) and host.add(*demoted((4, 5, 6)))
    assert host.holds(NS, (4, 5, 6)) and (host.counters.evicted, host.counters.passed_on) == (1, 0)


def test_a_checkpoint_larger_than_the_budget_is_refused():
    host = tier(LAYOUT.nbytes(3) - 1)
    assert not host.admits(NS, (1, 2, 3), LAYOUT.nbytes(3), "")
    assert not host.add(*demoted((1, 2, 3))) and host.counters.refused == 1 and len(host) == 0


def test_value_order_refuses_what_is_worth_less_than_what_it_would_evict():
    size = LAYOUT.nbytes(8)
    host = tier(size + LAYOUT.nbytes(2), order=ValueOrder(PrefillCost(), half_life=1000))
    assert host.add(*demoted(tuple(range(1, 9))))  # 8 tokens
    assert host.add(*demoted((20, 21)))  # fits beside it
    assert not host.add(*demoted((30,)))  # one token: worth less than either
    assert host.add(*demoted(tuple(range(40, 49))))  # 9 tokens: takes the place of both
    assert [host.holds(NS, t) for t in (tuple(range(1, 9)), (20, 21), tuple(range(40, 49)))] == [False, False, True]


def test_lookup_promotes_the_longest_prefix_longer_than_what_the_device_holds():
    host = tier(1 << 20)
    host.add(*demoted((1, 2)))
    host.add(*demoted((1, 2, 3, 4)))
    prompt = (1, 2, 3, 4, 5)
    assert host.lookup(NS, prompt, have=4) is None
    fetch = host.lookup(NS, prompt, have=2)
    assert fetch.num_tokens == 4 and fetch.verified and fetch.done()
    exported = fetch.result()
    assert exported.header.token_ids == (1, 2, 3, 4)
    assert torch.equal(exported.shards[0].kv, checkpoint((1, 2, 3, 4)).shards[0].kv)
    fetch.settle(True, exported.nbytes)
    host.lookup(NS, prompt, have=0).settle(True, 0)  # a second promotion deduplicated: not counted
    assert host.counters.promoted == 1 and host.holds(NS, (1, 2, 3, 4))  # inclusive: still held
    host.lookup(NS, prompt, have=2).settle(False, 0)  # no room on the device: offered again later
    assert host.holds(NS, (1, 2, 3, 4)) and host.counters.promotion_failed == 1
    assert host.lookup(NS, prompt, have=0).num_tokens == 4


def test_a_tenant_within_its_share_keeps_its_checkpoints():
    size = LAYOUT.nbytes(3)
    host = tier(2 * size)
    host.add(*demoted((1, 2, 3), owner="a"))
    host.add(*demoted((4, 5, 6), owner="b"))
    assert host.add(*demoted((7, 8, 9), owner="b"))  # b may evict its own, not a's
    assert host.holds(NS, (1, 2, 3)) and not host.holds(NS, (4, 5, 6))


def test_with_checksums_fills_every_shard():
    exported = with_checksums(checkpoint((1, 2, 3)))
    shard = exported.shards[0]
    assert shard.checksum == shard_checksum(0, exported.header.digest, shard.tensors())
