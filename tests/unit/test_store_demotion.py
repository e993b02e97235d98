"""The host tier -> object-store hand-off (deployments/cluster/store_demotion.py) without Ray:
a fake index actor and mirror. demote() (the host tier's on_evict, on the engine's step
thread) returns at once even while the index call hangs; the event loop stores first in,
first out, with checksums and the checkpoint's record; what waits stays within its byte
bound; every outcome is counted. tests/cluster_checkpoints/test_tier_demotion.py runs it
against the real index actor and an engine."""

from __future__ import annotations

import asyncio
import threading

from cache.index_messages import LookupResult, StoredCopy
from deployments.cluster.store_demotion import StoreDemotion
from engine.checkpoints.host_tier import EvictedCheckpoint
from engine.checkpoints.transfer import shard_checksum
from tests.unit.test_host_tier_bookkeeping import NS, checkpoint


class FakeIndex:
    """The index actor's store_copy: waits for `open`, then answers `answers` in turn (True kept,
    False refused, an exception raised), recording each call."""

    def __init__(self, answers: list) -> None:
        self.answers = list(answers)
        self.calls: list[tuple] = []
        self.open = asyncio.Event()
        self.store_copy = self  # index.store_copy.remote(...)

    async def _call(self, key, num_bytes, header, *shards, record=None):
        await self.open.wait()
        self.calls.append((key, num_bytes, header, shards, record))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def remote(self, *args, **kwargs):
        return self._call(*args, **kwargs)


class FakeMirror:
    def __init__(self, stored: set[tuple[int, ...]] = frozenset()) -> None:
        self.stored = stored

    def lookup_stored(self, namespace, token_ids) -> LookupResult:
        tokens = tuple(token_ids)
        if tokens in self.stored:
            return LookupResult(len(tokens), stored_copies=(StoredCopy("x", 1),))
        return LookupResult()


def evicted(tokens: tuple[int, ...], bundle_id: int) -> EvictedCheckpoint:
    return EvictedCheckpoint(checkpoint(tokens), bundle_id)


def from_another_thread(demote, items) -> None:
    """What the engine's step thread does: on_evict for each, in order."""
    thread = threading.Thread(target=lambda: [demote(item) for item in items])
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_step_thread_hands_off_at_once_and_the_loop_stores_in_order_with_checksums():
    async def scenario():
        index = FakeIndex([True, True])
        demotion = StoreDemotion("replica-1", FakeMirror(), _connect(index), max_pending_bytes=1 << 20)
        items = [evicted((1, 2, 3), 7), evicted((4, 5), 9)]
        from_another_thread(demotion.demote, items)  # returns while the index call cannot answer
        assert demotion.stats().handed == 2 and index.calls == []
        assert demotion.pending_bytes == sum(i.exported.nbytes for i in items)
        index.open.set()
        await asyncio.wait_for(demotion.drained(), 10)
        demotion.close()
        return index, demotion, items

    index, demotion, items = asyncio.run(scenario())
    assert [call[0] for call in index.calls] == [("replica-1", 7), ("replica-1", 9)]  # first in, first out
    for (key, num_bytes, header, shards, record), item in zip(index.calls, items):
        assert header == item.exported.header and num_bytes == item.exported.nbytes
        (shard,) = shards
        assert shard.checksum == shard_checksum(0, header.digest, shard.tensors()) != ""
        assert record.key == key and record.namespace == NS and record.length == header.num_tokens
        assert record.kind == "instruction" and record.num_bytes == num_bytes
    stats = demotion.stats()
    assert stats.outcomes == {"stored": 2} and stats.stored_bytes == sum(i.exported.nbytes for i in items)
    assert demotion.pending_bytes == 0


def test_what_waits_stays_within_its_bound_and_every_outcome_is_counted():
    async def scenario():
        index = FakeIndex([False, RuntimeError("the index actor died"), True])
        demotion = StoreDemotion("r", FakeMirror(stored={(9, 9)}), _connect(index),
                                 max_pending_bytes=4 * checkpoint((1, 2)).nbytes)
        items = [evicted((1, 2), 1), evicted((9, 9), 2), evicted((3, 4), 3), evicted((5, 6), 4),
                 evicted((7, 8), 5)]
        from_another_thread(demotion.demote, items)  # the fifth does not fit beside four waiting
        index.open.set()
        await asyncio.wait_for(demotion.drained(), 10)
        await asyncio.sleep(0)  # the dropped one's metric is recorded on the loop
        demotion.close()
        return index, demotion

    index, demotion = asyncio.run(scenario())
    assert [call[0][1] for call in index.calls] == [1, 3, 4]  # (9, 9) was stored already: no call
    stats = demotion.stats()
    assert stats.handed == 5
    assert stats.outcomes == {"refused": 1, "already_stored": 1, "failed": 1, "stored": 1, "dropped": 1}
    assert demotion.pending_bytes == 0


def test_outcomes_reach_the_tier_metrics():
    class Metrics:
        def __init__(self):
            self.outcomes, self.observed = [], []

        def demoted(self, outcome):
            self.outcomes.append(outcome)

        def observe(self, operation, seconds):
            self.observed.append(operation)

    async def scenario(metrics):
        index = FakeIndex([True])
        index.open.set()
        demotion = StoreDemotion("r", FakeMirror(), _connect(index), checkpoint((1, 2)).nbytes, metrics)
        from_another_thread(demotion.demote, [evicted((1, 2), 1), evicted((3, 4), 2)])
        await asyncio.wait_for(demotion.drained(), 10)
        await asyncio.sleep(0)
        demotion.close()

    metrics = Metrics()
    asyncio.run(scenario(metrics))
    assert sorted(metrics.outcomes) == ["dropped", "stored"] and metrics.observed == ["demote"]


def _connect(index):
    async def connect():
        return index
    return connect


def test_the_replica_wires_the_host_tier_to_the_store_only_when_it_has_one(monkeypatch):
    """deployments/llm_server.py checkpoint_tier: with a host tier its on_evict becomes the
    StoreDemotion's demote, bounded by the host budget; without one there is no demotion.
    (Serve's replica context, the index and Ray's metrics are stand-ins: nothing starts Ray.)"""
    from types import SimpleNamespace

    import deployments.llm_server as llm_server
    from deployments.config import AppConfig

    class Mirror:
        def __init__(self, source):
            self.started = False

        def start(self):
            self.started = True

        def stop(self):
            pass

    context = SimpleNamespace(app_name="app", replica_id=SimpleNamespace(unique_id="replica-7"))
    monkeypatch.setattr(llm_server.serve, "get_replica_context", lambda: context)
    monkeypatch.setattr(llm_server, "IndexMirror", Mirror)
    monkeypatch.setattr(llm_server, "TierMetrics", lambda: None)
    config = AppConfig(checkpoint_transfer=True)

    async def wire(host_tier):
        engine = SimpleNamespace(engine=SimpleNamespace(host_tier=host_tier))
        tier, demotion = llm_server.checkpoint_tier(engine, config)
        tier.close()
        if demotion is not None:
            demotion.close()
        return tier, demotion

    host = SimpleNamespace(budget_bytes=12345, on_evict=None)
    tier, demotion = asyncio.run(wire(host))
    assert host.on_evict == demotion.demote and demotion.max_pending_bytes == 12345
    assert demotion.replica_id == tier.replica_id == "replica-7"
    assert asyncio.run(wire(None))[1] is None
