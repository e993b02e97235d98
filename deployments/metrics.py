"""Prometheus metrics of the application, rendered by the ingress at GET /metrics.

Two sources, one exposition:
- the engine's counters live in the LLM server replica; each scrape fetches one EngineStats
  snapshot from the LLM server and EngineStatsCollector turns it into metric families
  (checkpoints by kind and event, prompt tokens restored vs computed, preemptions, bytes held);
- measured here, in the ingress: instruction boundary rejections, from each chat request's
  RenderedPrompt.boundary_rejection (so no second fetch from the renderer is needed), and the
  time to first token, from the GenerationRequest's arrival_time to its first output.

Limitation: with several replicas, a scrape sees the ingress replica that serves it and the LLM
server replica its handle call is routed to; the numbers are per replica, not sums. With one
replica of each (the default) they are the application's.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deployments.instruction_boundary import BoundaryRejection
from engine.llm_engine import EngineStats

PREFIX = "hybrid_serve"
CHECKPOINT_EVENTS = ("captured", "hit", "evicted", "deduplicated", "dropped")
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineStatsCollector(Collector):
    """Metric families from the latest EngineStats snapshot (none before the first one)."""

    def __init__(self) -> None:
        self.snapshot: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot
        if stats is None:
            return
        for event in CHECKPOINT_EVENTS:
            family = CounterMetricFamily(
                f"{PREFIX}_checkpoints_{event}", f"Checkpoints {event}, by kind (slot).",
                labels=["kind"])
            for kind, counters in sorted(stats.checkpoints.items()):
                family.add_metric([kind], getattr(counters, event))
            yield family
        yield CounterMetricFamily(
            f"{PREFIX}_prompt_tokens_restored",
            "Prompt tokens restored from checkpoints (at first admission).",
            value=stats.scheduler.prompt_tokens_restored)
        yield CounterMetricFamily(
            f"{PREFIX}_prompt_tokens_computed",
            "Prompt tokens left to prefill after restoring (at first admission).",
            value=stats.scheduler.prompt_tokens_computed)
        yield CounterMetricFamily(
            f"{PREFIX}_preemptions", "Requests preempted (blocks and state slot freed, requeued).",
            value=stats.scheduler.preemptions)
        yield GaugeMetricFamily(
            f"{PREFIX}_checkpoint_bytes",
            "Bytes held by checkpoints outside the shared KV blocks.", value=stats.checkpoint_bytes)
        yield GaugeMetricFamily(
            f"{PREFIX}_checkpoints", "Checkpoints held (published or pending).",
            value=stats.num_checkpoints)


class AppMetrics:
    """The ingress's registry: its boundary rejection counter and time-to-first-token
    histogram, plus the engine collector.

    Not thread safe across scrapes on purpose: the ingress calls `exposition` on its event loop
    with no await between setting the snapshot and rendering it.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.boundary_rejections = Counter(
            f"{PREFIX}_instruction_boundary_rejections",
            "Chat prompts without an instruction boundary, by reason (docs/design.md section 3).",
            ["reason"], registry=self.registry)
        for reason in BoundaryRejection:
            self.boundary_rejections.labels(reason=reason.value)  # export zeros from the start
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From the ingress receiving a request to its first output from the engine.",
            buckets=TTFT_BUCKETS_S, registry=self.registry)
        self._engine = EngineStatsCollector()
        self.registry.register(self._engine)

    def count_boundary_rejection(self, reason: str | None) -> None:
        if reason is not None:
            self.boundary_rejections.labels(reason=reason).inc()

    def observe_time_to_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(max(0.0, seconds))

    def exposition(self, stats: EngineStats) -> bytes:
        """The text exposition format of every metric, with `stats` as the engine's numbers."""
        self._engine.snapshot = stats
        return generate_latest(self.registry)
