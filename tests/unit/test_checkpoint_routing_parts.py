"""The parts of checkpoint-aware routing that need no Ray: a replica's reporter against a fake
index, a router's mirror against a fake source, and the holder choice itself.

tests/cluster_checkpoints/ runs them together under Ray Serve.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cache.index_messages import LookupResult, ReplicaReport, token_digest
from cache.shared_index import SharedIndex
from deployments.cluster.reporter import CheckpointReporter
from deployments.cluster.router import (
    PLACEMENT_TTL_S,
    HolderChoice,
    RecentPlacements,
    choose_holders,
    generation_request,
)
from deployments.cluster.index_mirror import IndexMirror
from engine.checkpoints.capture_events import CheckpointEvent
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.sampling_params import SamplingParams

NS = ("models/tiny", "")
SYSTEM = tuple(range(200, 240))


def event(action, bundle_id, tokens=SYSTEM, kind="instruction"):
    return CheckpointEvent(action, NS, tuple(tokens), kind, 64, bundle_id)


class FakeIndex:
    """An index client over a real SharedIndex; `down` makes calls fail; `reports` logs them."""

    def __init__(self, incarnation="one"):
        self.index = SharedIndex(incarnation)
        self.down = False
        self.reports: list[ReplicaReport] = []
        self.removed: list[str] = []

    async def report(self, report):
        if self.down:
            raise ConnectionError("index actor down")
        self.reports.append(report)
        return self.index.apply_report(report)

    def remove_replica(self, replica_id):
        self.removed.append(replica_id)
        self.index.remove_replica(replica_id)

    async def changes_since(self, incarnation, version, wait_s):
        if self.down:
            raise ConnectionError("index actor down")
        delta = self.index.delta(incarnation, version)
        return delta if delta is not None else self.index.snapshot()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_reporter(fake, events, clock=None):
    async def drain():
        batch, events[:] = list(events), []
        return batch

    async def connect():
        return fake

    return CheckpointReporter("replica-a", drain, connect, clock=clock or Clock())


def run(coro):
    return asyncio.run(coro)


def test_reporter_sends_a_full_report_first_then_deltas():
    fake, events = FakeIndex(), [event("published", 1), event("published", 2, SYSTEM + (1,))]
    reporter = make_reporter(fake, events)
    assert run(reporter.report_once())
    assert fake.reports[0].full and len(fake.reports[0].published) == 2
    assert fake.index.lookup(NS, SYSTEM + (1, 2)).replica_ids == {"replica-a"}
    events += [event("dropped", 2), event("published", 3, SYSTEM + (7,)), event("dropped", 3)]
    assert run(reporter.report_once())
    delta = fake.reports[1]
    assert not delta.full and delta.incarnation == "one"
    assert delta.published == () and delta.dropped == (2,)  # 3 came and went between reports
    assert fake.index.lookup(NS, SYSTEM + (1, 2)).length == len(SYSTEM)
    assert run(reporter.report_once()) and len(fake.reports) == 2  # nothing new: no call


def test_reporter_heartbeats_and_resyncs_a_restarted_index():
    clock = Clock()
    fake, events = FakeIndex(), [event("published", 1)]
    reporter = make_reporter(fake, events, clock)
    run(reporter.report_once())
    restarted = fake.index = SharedIndex("two")  # the actor restarted empty
    clock.now = 5.0  # quiet replica: a heartbeat is due
    assert run(reporter.report_once())
    assert [r.full for r in fake.reports] == [True, False, True]  # refused delta, then full
    assert restarted.lookup(NS, SYSTEM).replica_ids == {"replica-a"}


def test_reporter_survives_a_down_index_and_sends_everything_after():
    fake, events = FakeIndex(), [event("published", 1)]
    reporter = make_reporter(fake, events)
    run(reporter.report_once())
    fake.down = True
    events += [event("published", 2, SYSTEM + (3,)), event("dropped", 1)]
    assert not run(reporter.report_once())
    fake.down = False
    assert run(reporter.report_once())
    last = fake.reports[-1]
    assert last.full and [r.bundle_id for r in last.published] == [2]
    assert fake.index.lookup(NS, SYSTEM + (3,)).length == len(SYSTEM) + 1
    assert fake.index.lookup(NS, SYSTEM) == LookupResult()


def test_reporter_survives_a_failing_drain():
    async def drain():
        raise RuntimeError("step loop gone")

    async def connect():
        return FakeIndex()

    assert not run(CheckpointReporter("r", drain, connect).report_once())


def test_records_carry_the_digest_of_the_covered_tokens():
    fake, events = FakeIndex(), [event("published", 9, SYSTEM + (5, 6))]
    run(make_reporter(fake, events).report_once())
    (record,) = fake.reports[0].published
    assert (record.namespace, record.length, record.digest, record.replica_id) == (
        NS, len(SYSTEM) + 2, token_digest(SYSTEM + (5, 6)), "replica-a")


def test_mirror_follows_the_index_and_goes_stale_when_it_is_down():
    clock = Clock()
    fake = FakeIndex()

    async def connect():
        return fake

    mirror = IndexMirror(connect, stale_after_s=15.0, clock=clock)
    assert mirror.lookup(NS, SYSTEM, among={"a"}) is None  # never synced
    fake.index.apply_report(ReplicaReport("a", None, (), full=True))
    assert run(mirror.sync_once())
    assert mirror.lookup(NS, SYSTEM, among={"a"}) == LookupResult()
    reporter = make_reporter(fake, [event("published", 1)])
    reporter.replica_id = "a"
    run(reporter.report_once())
    assert run(mirror.sync_once())  # a delta
    assert mirror.lookup(NS, SYSTEM + (1,), among={"a"}).replica_ids == {"a"}
    assert mirror.lookup(NS, SYSTEM + (1,), among={"b"}) == LookupResult()
    fake.index = SharedIndex("restarted")
    assert run(mirror.sync_once())  # a snapshot of the new incarnation
    assert mirror.lookup(NS, SYSTEM + (1,), among={"a"}) == LookupResult()
    fake.down = True
    assert not run(mirror.sync_once())
    clock.now = 16.0
    assert mirror.lookup(NS, SYSTEM, among={"a"}) is None
    mirror.forget_replicas(["a"])
    assert fake.removed == ["a"]


@pytest.mark.parametrize("match, lens, expected", [
    (None, {}, HolderChoice((), "index_unavailable")),
    (LookupResult(), {}, HolderChoice((), "no_holder")),
    (LookupResult(40, frozenset({"a", "b"})), {"a": 3, "b": 1}, HolderChoice(("b", "a"), "holder", 40)),
    (LookupResult(40, frozenset({"a", "b"})), {"a": 4, "b": None},
     HolderChoice((), "overloaded", 40, frozenset({"a", "b"}))),
    (LookupResult(40, frozenset({"a", "b"})), {"a": 9, "b": 2}, HolderChoice(("b",), "holder", 40)),
])
def test_choose_holders(match, lens, expected):
    assert choose_holders(match, lens, queue_threshold=4) == expected


def test_generation_request_is_found_in_args_or_kwargs_and_nothing_else():
    request = GenerationRequest("r1", (1, 2, 3), SamplingParams())
    assert generation_request(SimpleNamespace(args=[request], kwargs={})) is request
    assert generation_request(SimpleNamespace(args=[], kwargs={"request": request})) is request
    assert generation_request(SimpleNamespace(args=["text"], kwargs={})) is None
    assert generation_request(SimpleNamespace(args=None, kwargs=None)) is None
    assert generation_request(None) is None


def test_recent_placements_key_on_namespace_and_instructions_and_expire():
    clock = SimpleNamespace(now=0.0)
    placements = RecentPlacements(clock=lambda: clock.now)
    user_a = GenerationRequest("a", SYSTEM + (5, 6), SamplingParams(), instruction_boundary=len(SYSTEM))
    user_b = GenerationRequest("b", SYSTEM + (7, 8, 9), SamplingParams(), instruction_boundary=len(SYSTEM))
    other_system = GenerationRequest("c", SYSTEM[:-1] + (1, 5, 6), SamplingParams(),
                                     instruction_boundary=len(SYSTEM))
    no_boundary = GenerationRequest("d", SYSTEM + (5, 6), SamplingParams())
    assert RecentPlacements.key(NS, no_boundary) is None
    key = RecentPlacements.key(NS, user_a)
    assert key == RecentPlacements.key(NS, user_b)  # same instructions, other user message
    assert key != RecentPlacements.key(NS, other_system)
    assert key != RecentPlacements.key(("models/tiny", "salt"), user_a)
    assert placements.get(key) is None
    placements.record(key, "replica-2")
    clock.now = PLACEMENT_TTL_S
    assert placements.get(key) == "replica-2"
    assert placements.get(RecentPlacements.key(NS, other_system)) is None
    clock.now = PLACEMENT_TTL_S + 0.1
    assert placements.get(key) is None


def test_recent_placements_are_bounded_least_recent_first(monkeypatch):
    monkeypatch.setattr("deployments.cluster.router.MAX_PLACEMENTS", 3)
    placements = RecentPlacements(clock=lambda: 0.0)
    for key in (b"k1", b"k2", b"k3"):
        placements.record(key, key.decode())
    placements.record(b"k1", "again")  # refreshed: now the most recent
    placements.record(b"k4", "k4")
    assert [placements.get(k) for k in (b"k1", b"k2", b"k3", b"k4")] == ["again", None, "k3", "k4"]
