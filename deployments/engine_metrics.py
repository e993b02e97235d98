"""The LLM server replica's export of its engine's numbers (deployments/metrics.py lists the
metrics): counters as increments since the last export, pools and queues as gauges, every
EXPORT_PERIOD_S on the replica's event loop; nothing on a request's path or the step thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from deployments.metrics import (
    CAPTURE_WAITS, CHECKPOINTS, CHECKPOINT_BYTES, CHECKPOINT_EVENTS, CHECKPOINT_EVENTS_TOTAL,
    ENGINE_REQUESTS, EXPORT_PERIOD_S, FAILED_STEPS, HOST_TIER_BYTES, HOST_TIER_CHECKPOINTS,
    HOST_TIER_EVENTS, HOST_TIER_EVENT_BYTES, HOST_TIER_EVENT_NAMES, IMPORT_REJECTIONS, KV_BLOCKS,
    MetricSpec, PREEMPTIONS, PROMPT_TOKENS_COMPUTED, PROMPT_TOKENS_RESTORED, REQUESTS_FAILED,
    SPECULATIVE_ACCEPTANCE_LENGTHS, SPECULATIVE_DEPTH_ACCEPTED, SPECULATIVE_DEPTH_PROPOSED,
    SPECULATIVE_DRAFTS_ACCEPTED, SPECULATIVE_DRAFTS_PROPOSED, SPECULATIVE_DRAFTS_REJECTED,
    SPECULATIVE_DRAFTS_TRIMMED, SPECULATIVE_STEPS_OVER_BATCH_CAP, SPECULATIVE_VERIFICATION_CHUNKS,
    STATE_SLOTS, TRANSFERS, TRANSFER_BYTES,
)
from engine.speculative.scheduling import SpeculationStats

logger = logging.getLogger("ray.serve")


class EngineMetricsExporter:
    """Exports one engine's numbers from an LLM server replica: counters as increments since
    the last export, pools and queues as gauges. Create inside the replica, then run `run()` as
    a task of its event loop.

    Reads the engine from the event loop's thread while the step thread runs, as
    LLMServer.engine_stats does: each number is one the engine held, the set may be a step
    apart. A read that fails (a structure resized mid-read) is retried at the next export.
    """

    def __init__(self, engine, create: Callable[[MetricSpec], Any] = MetricSpec.create) -> None:
        """engine: the replica's LLMEngine (read only: stats(), pool_usage(), its scheduler's
        running and waiting queues). create: makes each metric (Ray's, MetricSpec.create; a
        test passes one that records the increments and values)."""
        self._engine = engine
        self._exported: dict[tuple, int] = {}  # (metric name, tag values) -> value exported
        self._counters = {spec.name: create(spec) for spec in (
            CHECKPOINT_EVENTS_TOTAL, PROMPT_TOKENS_RESTORED, PROMPT_TOKENS_COMPUTED, CAPTURE_WAITS,
            PREEMPTIONS,
            FAILED_STEPS, REQUESTS_FAILED, TRANSFERS, TRANSFER_BYTES, IMPORT_REJECTIONS,
            HOST_TIER_EVENTS, HOST_TIER_EVENT_BYTES, SPECULATIVE_VERIFICATION_CHUNKS,
            SPECULATIVE_DRAFTS_PROPOSED, SPECULATIVE_DRAFTS_ACCEPTED, SPECULATIVE_DRAFTS_REJECTED, SPECULATIVE_DRAFTS_TRIMMED,
            SPECULATIVE_STEPS_OVER_BATCH_CAP, SPECULATIVE_ACCEPTANCE_LENGTHS,
            SPECULATIVE_DEPTH_PROPOSED, SPECULATIVE_DEPTH_ACCEPTED)}
        self._gauges = {spec.name: create(spec) for spec in (
            ENGINE_REQUESTS, KV_BLOCKS, STATE_SLOTS, CHECKPOINTS, CHECKPOINT_BYTES,
            HOST_TIER_CHECKPOINTS, HOST_TIER_BYTES)}

    async def run(self, period_s: float = EXPORT_PERIOD_S) -> None:
        """Export every `period_s` until cancelled; a failed export logs once per run of
        failures and is retried."""
        failing = False
        while True:
            try:
                self.export()
                failing = False
            except Exception:
                if not failing:
                    logger.warning("exporting the engine's metrics failed; retrying", exc_info=True)
                failing = True
            await asyncio.sleep(period_s)

    def export(self) -> None:
        """Record the engine's numbers now."""
        stats = self._engine.stats()
        usage = self._engine.pool_usage()
        scheduler = self._engine.scheduler
        running = len(scheduler.running)
        waiting = list(scheduler.waiting)  # one C-level copy: never sees the deque mid-change
        preempted = sum(1 for request in waiting if request.num_preemptions > 0)

        for kind, counters in stats.checkpoints.items():
            for event in CHECKPOINT_EVENTS:
                self._count(CHECKPOINT_EVENTS_TOTAL, getattr(counters, event),
                            {"kind": kind, "event": event})
        self._count(PROMPT_TOKENS_RESTORED, stats.scheduler.prompt_tokens_restored)
        self._count(PROMPT_TOKENS_COMPUTED, stats.scheduler.prompt_tokens_computed)
        self._count(CAPTURE_WAITS, stats.scheduler.capture_waits)
        self._count(PREEMPTIONS, stats.scheduler.preemptions)
        self._count(FAILED_STEPS, stats.scheduler.failed_steps)
        self._count(REQUESTS_FAILED, stats.scheduler.requests_failed)

        held_by_requests = usage.total_blocks - usage.free_blocks - usage.checkpoint_only_blocks
        self._set(ENGINE_REQUESTS, {"running": running, "waiting": len(waiting) - preempted,
                                    "preempted": preempted})
        self._set(KV_BLOCKS, {"free": usage.free_blocks, "requests": held_by_requests,
                              "checkpoints": usage.checkpoint_only_blocks})
        self._set(STATE_SLOTS, {"free": usage.free_state_slots,
                                "used": usage.total_state_slots - usage.free_state_slots})
        transfers = stats.transfers
        self._count(TRANSFERS, transfers.exported, {"direction": "export"})
        self._count(TRANSFERS, transfers.imported, {"direction": "import"})
        self._count(TRANSFER_BYTES, transfers.exported_bytes, {"direction": "export"})
        self._count(TRANSFER_BYTES, transfers.imported_bytes, {"direction": "import"})
        for reason, count in transfers.rejected.items():
            self._count(IMPORT_REJECTIONS, count, {"reason": reason})
        self._gauges[CHECKPOINTS.name].set(stats.num_checkpoints)
        self._gauges[CHECKPOINT_BYTES.name].set(stats.checkpoint_bytes)
        self._export_host_tier(stats)
        self._count_speculation(stats.speculation)

    def _export_host_tier(self, stats) -> None:
        """The host tier's counters and size; nothing while there is none (no series)."""
        host = stats.host_tier
        if host is None:
            return
        for event in HOST_TIER_EVENT_NAMES:
            self._count(HOST_TIER_EVENTS, getattr(host, event), {"event": event})
        self._count(HOST_TIER_EVENT_BYTES, host.demoted_bytes, {"event": "demoted"})
        self._count(HOST_TIER_EVENT_BYTES, host.promoted_bytes, {"event": "promoted"})
        self._gauges[HOST_TIER_CHECKPOINTS.name].set(stats.host_tier_checkpoints)
        self._gauges[HOST_TIER_BYTES.name].set(stats.host_tier_bytes)

    def _count_speculation(self, speculation: SpeculationStats) -> None:
        """Speculative decoding's counters, tagged with the drafter. Off (no drafter), they
        stay zero and nothing is recorded: no series until speculation verifies a chunk."""
        if not speculation.drafter:
            return
        drafter = {"drafter": speculation.drafter}
        self._count(SPECULATIVE_VERIFICATION_CHUNKS, speculation.verification_chunks, drafter)
        self._count(SPECULATIVE_DRAFTS_PROPOSED, speculation.draft_tokens_proposed, drafter)
        self._count(SPECULATIVE_DRAFTS_ACCEPTED, speculation.draft_tokens_accepted, drafter)
        self._count(SPECULATIVE_DRAFTS_REJECTED, speculation.draft_tokens_rejected, drafter)
        self._count(SPECULATIVE_DRAFTS_TRIMMED, speculation.draft_tokens_trimmed, drafter)
        self._count(SPECULATIVE_STEPS_OVER_BATCH_CAP, speculation.steps_over_batch_cap, drafter)
        for accepted, chunks in enumerate(speculation.acceptance_lengths):
            self._count(SPECULATIVE_ACCEPTANCE_LENGTHS, chunks,
                        {**drafter, "accepted": str(accepted)})
        for depth, (proposed, accepted) in enumerate(
                zip(speculation.depth_proposed, speculation.depth_accepted), start=1):
            self._count(SPECULATIVE_DEPTH_PROPOSED, proposed, {**drafter, "depth": str(depth)})
            self._count(SPECULATIVE_DEPTH_ACCEPTED, accepted, {**drafter, "depth": str(depth)})

    def _count(self, spec: MetricSpec, total: int, tags: dict[str, str] | None = None) -> None:
        """Increment `spec`'s counter by what `total` (the engine's cumulative value) grew."""
        key = (spec.name, tuple(sorted((tags or {}).items())))
        delta = total - self._exported.get(key, 0)
        if delta > 0:
            self._counters[spec.name].inc(delta, tags=tags)
            self._exported[key] = total

    def _set(self, spec: MetricSpec, by_state: dict[str, int]) -> None:
        for state, value in by_state.items():
            self._gauges[spec.name].set(value, tags={"state": state})
