"""EngineMetricsExporter's host tier series (deployments/metrics.py): each export records what
the host tier's cumulative counters (EngineStats.host_tier) grew since the last one, and sets
its size gauges; without a host tier nothing is recorded.

tests/engine/test_host_tier.py checks the same against a real engine that demotes and promotes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from types import SimpleNamespace

from cache.cache_manager import PoolUsage
from deployments.engine_metrics import EngineMetricsExporter
from deployments.metrics import (
    HOST_TIER_BYTES, HOST_TIER_CHECKPOINTS, HOST_TIER_EVENT_BYTES, HOST_TIER_EVENT_NAMES,
    HOST_TIER_EVENTS,
)
from engine.checkpoints.host_tier import HostTierCounters
from engine.core.llm_engine import EngineStats
from engine.core.scheduler import SchedulerStats
from tests.unit.recording_metrics import RecordingMetrics


class HostTierSequence:
    """An engine whose stats() returns the next of a fixed sequence of (host tier counters,
    checkpoints held, bytes held); everything else zero, pools idle."""

    def __init__(self, sequence) -> None:
        self._sequence = iter(sequence)
        self.scheduler = SimpleNamespace(running=[], waiting=deque())

    def stats(self) -> EngineStats:
        counters, held, held_bytes = next(self._sequence)
        return EngineStats(scheduler=SchedulerStats(), checkpoints={}, checkpoint_bytes=0,
                           num_checkpoints=0, host_tier=counters, host_tier_bytes=held_bytes,
                           host_tier_checkpoints=held)

    def pool_usage(self) -> PoolUsage:
        return PoolUsage(free_blocks=8, total_blocks=8, free_state_slots=2, total_state_slots=2)


START = HostTierCounters()
SEQUENCE = [  # cumulative, as LLMEngine.stats() returns them
    (START, 0, 0),
    (replace(START, demoted=3, demoted_bytes=300, refused=1), 3, 300),
    (replace(START, demoted=3, demoted_bytes=300, refused=1), 3, 300),  # idle: nothing grows
    (replace(START, demoted=5, demoted_bytes=500, refused=1, promoted=2, promoted_bytes=200,
             already_held=1, evicted=2, passed_on=1, promotion_failed=1), 3, 300),
]


def exported_events(recorded: RecordingMetrics, spec=HOST_TIER_EVENTS) -> dict[str, float]:
    return {dict(tags)["event"]: total for tags, total in recorded.series(spec).items()}


def test_each_export_records_the_growth_so_the_series_equal_the_tier_counters():
    recorded = RecordingMetrics()
    exporter = EngineMetricsExporter(HostTierSequence(SEQUENCE), create=recorded)
    for counters, held, held_bytes in SEQUENCE:
        exporter.export()
        assert exported_events(recorded) == {event: getattr(counters, event)
                                             for event in HOST_TIER_EVENT_NAMES if getattr(counters, event)}
        assert recorded.series(HOST_TIER_CHECKPOINTS) == {(): held}
        assert recorded.series(HOST_TIER_BYTES) == {(): held_bytes}
    assert exported_events(recorded) == {"demoted": 5, "refused": 1, "promoted": 2, "already_held": 1,
                                         "evicted": 2, "passed_on": 1, "promotion_failed": 1}
    assert exported_events(recorded, HOST_TIER_EVENT_BYTES) == {"demoted": 500, "promoted": 200}


def test_without_a_host_tier_nothing_is_recorded():
    recorded = RecordingMetrics()
    exporter = EngineMetricsExporter(HostTierSequence([(None, 0, 0), (None, 0, 0)]), create=recorded)
    exporter.export()
    exporter.export()
    for spec in (HOST_TIER_EVENTS, HOST_TIER_EVENT_BYTES, HOST_TIER_CHECKPOINTS, HOST_TIER_BYTES):
        assert recorded.series(spec) == {}
