"""EngineMetricsExporter's speculative decoding counters (deployments/metrics.py): each export
records, per drafter, what the engine's cumulative SpeculationStats grew since the last one, so
the series always add up to the engine's counters; with speculation off nothing is recorded.

tests/engine/test_speculative.py checks the same against a real engine that speculates.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from cache.cache_manager import PoolUsage
from deployments.engine_metrics import EngineMetricsExporter
from deployments.metrics import (
    SPECULATIVE_ACCEPTANCE_LENGTHS, SPECULATIVE_DEPTH_ACCEPTED, SPECULATIVE_DEPTH_PROPOSED,
    SPECULATIVE_DRAFTS_ACCEPTED, SPECULATIVE_DRAFTS_PROPOSED, SPECULATIVE_DRAFTS_REJECTED,
    SPECULATIVE_DRAFTS_TRIMMED, SPECULATIVE_STEPS_OVER_BATCH_CAP, SPECULATIVE_VERIFICATION_CHUNKS,
)
from engine.core.llm_engine import EngineStats
from engine.core.scheduler import SchedulerStats
from engine.speculative.scheduling import SpeculationStats
from tests.unit.recording_metrics import RecordingMetrics


class StatsSequence:
    """An engine whose stats() returns the next of a fixed sequence of speculation counters
    (everything else zero, pools idle): what the exporter reads of an LLMEngine."""

    def __init__(self, sequence: list[SpeculationStats]) -> None:
        self._sequence = iter(sequence)
        self.scheduler = SimpleNamespace(running=[], waiting=deque())

    def stats(self) -> EngineStats:
        return EngineStats(scheduler=SchedulerStats(), checkpoints={}, checkpoint_bytes=0,
                           num_checkpoints=0, speculation=next(self._sequence))

    def pool_usage(self) -> PoolUsage:
        return PoolUsage(free_blocks=8, total_blocks=8, free_state_slots=2, total_state_slots=2)


def exported_speculation(recorded: RecordingMetrics) -> dict[str, dict]:
    """The recorded speculation series: drafter -> counter -> total, and "lengths" -> the
    per-length totals by `accepted` tag."""
    by_drafter: dict[str, dict] = {}
    for field, spec in (("verification_chunks", SPECULATIVE_VERIFICATION_CHUNKS),
                        ("draft_tokens_proposed", SPECULATIVE_DRAFTS_PROPOSED),
                        ("draft_tokens_accepted", SPECULATIVE_DRAFTS_ACCEPTED),
                        ("draft_tokens_rejected", SPECULATIVE_DRAFTS_REJECTED),
                        ("draft_tokens_trimmed", SPECULATIVE_DRAFTS_TRIMMED),
                        ("steps_over_batch_cap", SPECULATIVE_STEPS_OVER_BATCH_CAP)):
        for tags, total in recorded.series(spec).items():
            by_drafter.setdefault(dict(tags)["drafter"], {})[field] = total
    for tags, total in recorded.series(SPECULATIVE_ACCEPTANCE_LENGTHS).items():
        tags = dict(tags)
        by_drafter.setdefault(tags["drafter"], {}).setdefault("lengths", {})[int(tags["accepted"])] = total
    for key, spec in (("depth_proposed", SPECULATIVE_DEPTH_PROPOSED), ("depth_accepted", SPECULATIVE_DEPTH_ACCEPTED)):
        for tags, total in recorded.series(spec).items():
            tags = dict(tags)
            by_drafter.setdefault(tags["drafter"], {}).setdefault(key, {})[int(tags["depth"])] = total
    return by_drafter


def as_exported(stats: SpeculationStats) -> dict:
    """What the series of `stats` should add up to (zero counters have no series)."""
    fields = {name: getattr(stats, name) for name in (
        "verification_chunks", "draft_tokens_proposed", "draft_tokens_accepted",
        "draft_tokens_rejected", "draft_tokens_trimmed", "steps_over_batch_cap") if getattr(stats, name)}
    for key, values, first in (("lengths", stats.acceptance_lengths, 0), ("depth_proposed", stats.depth_proposed, 1),
                               ("depth_accepted", stats.depth_accepted, 1)):
        by_index = {i: n for i, n in enumerate(values, start=first) if n}
        if by_index:
            fields[key] = by_index
    return fields


def ngram(chunks, proposed, accepted, trimmed, lengths, over_cap=0, depths=((0, 0, 0), (0, 0, 0))) -> SpeculationStats:
    return SpeculationStats("ngram", chunks, proposed, accepted, trimmed, list(lengths), over_cap,
                            list(depths[0]), list(depths[1]))


SEQUENCE = [  # k = 3; cumulative, as LLMEngine.stats() returns them
    ngram(0, 0, 0, 0, [0, 0, 0, 0]),
    # one chunk rejected its 2 drafts, one accepted all 3
    ngram(2, 5, 3, 0, [1, 0, 0, 1], depths=((2, 2, 1), (1, 1, 1))),
    ngram(2, 5, 3, 0, [1, 0, 0, 1], depths=((2, 2, 1), (1, 1, 1))),  # idle: nothing grows
    # three more chunks (3, 2 and 2 drafts; 1, 2 and 0 accepted); a stop dropped 2 accepted drafts
    ngram(5, 12, 6, 2, [2, 1, 1, 1], depths=((5, 5, 2), (3, 2, 1))),
    # four steps over speculative_max_batch_size
    ngram(5, 12, 6, 2, [2, 1, 1, 1], over_cap=4, depths=((5, 5, 2), (3, 2, 1))),
    ngram(9, 24, 15, 2, [2, 2, 2, 3], over_cap=6, depths=((9, 9, 6), (7, 5, 3))),
]


def test_each_export_records_the_growth_so_the_series_equal_the_engine_counters():
    recorded = RecordingMetrics()
    exporter = EngineMetricsExporter(StatsSequence(SEQUENCE), create=recorded)
    for stats in SEQUENCE:
        exporter.export()
        want = as_exported(stats)
        assert exported_speculation(recorded) == ({"ngram": want} if want else {})
    assert recorded.series(SPECULATIVE_ACCEPTANCE_LENGTHS) == {
        (("accepted", str(a)), ("drafter", "ngram")): n for a, n in enumerate([2, 2, 2, 3])}
    assert recorded.series(SPECULATIVE_DRAFTS_REJECTED) == {(("drafter", "ngram"),): 24 - 15}
    assert recorded.series(SPECULATIVE_DEPTH_ACCEPTED) == {
        (("depth", str(d)), ("drafter", "ngram")): n for d, n in enumerate([7, 5, 3], start=1)}


def test_depth_counters_follow_the_greedy_rule():
    """SpeculationStats.count_chunk: a draft at depth d counts as accepted only when the
    first d drafts were, and every draft past the last accepted one counts as rejected."""
    stats = SpeculationStats("ngram", acceptance_lengths=[0] * 4, depth_proposed=[0] * 3, depth_accepted=[0] * 3)
    for num_drafts, accepted in ((3, 3), (3, 1), (2, 0), (1, 1)):
        stats.count_chunk(num_drafts, accepted)
    assert stats.depth_proposed == [4, 3, 2] and stats.depth_accepted == [3, 1, 1]
    assert stats.draft_tokens_proposed == 9 and stats.draft_tokens_accepted == 5 and stats.draft_tokens_rejected == 4
    assert stats.acceptance_lengths == [1, 2, 0, 1] and stats.verification_chunks == 4
    assert stats.acceptance_by_depth() == [0.75, 1 / 3, 0.5]


def test_an_export_that_fails_is_caught_up_by_the_next():
    """A failed read (the replica retries at the next period) loses no increment."""
    engine = StatsSequence([SEQUENCE[1], SEQUENCE[3], SEQUENCE[5]])
    recorded = RecordingMetrics()
    exporter = EngineMetricsExporter(engine, create=recorded)
    exporter.export()
    engine.pool_usage = lambda: (_ for _ in ()).throw(RuntimeError("resized mid-read"))
    with pytest.raises(RuntimeError):
        exporter.export()  # read SEQUENCE[3]'s stats, recorded nothing
    del engine.pool_usage  # the class's again
    assert exported_speculation(recorded) == {"ngram": as_exported(SEQUENCE[1])}
    exporter.export()
    assert exported_speculation(recorded) == {"ngram": as_exported(SEQUENCE[5])}


def test_speculation_off_records_no_series():
    off = SpeculationStats()  # what an engine at num_speculative_tokens 0 reports
    recorded = RecordingMetrics()
    exporter = EngineMetricsExporter(StatsSequence([off, off]), create=recorded)
    exporter.export()
    exporter.export()
    assert exported_speculation(recorded) == {}
