"""The application's metrics, exported through Ray's metrics (ray.serve.metrics).

Each replica records into Ray's metrics; the metrics agent of each node serves them to
Prometheus at that node's metrics export port (`ray start --metrics-export-port`, or
`ray.init(_metrics_export_port=...)`), with every name prefixed `ray_` by Ray's exporter and
tagged with the deployment, replica and application (Serve's tags) and the worker id (Ray's).
Each replica's series are its own, so `sum(...)` in PromQL adds up replicas and nodes.

    ingress replica      RequestMetrics: requests by status, output tokens, time to first
                         token, inter-token and end-to-end latency (it sees each whole stream),
                         instruction boundary and cache breakpoint rejections
    LLM server replica   EngineMetricsExporter (deployments/engine_metrics.py): every
                         EXPORT_PERIOD_S, on the replica's event
                         loop, the engine's cumulative counters (EngineStats) become Counter
                         increments (the delta since the last export) and its pools and queues
                         gauges; nothing on a request's path, nothing on the step thread. With
                         a host tier, its counters and size; with speculative decoding on,
                         its counters too, per drafter
    checkpoint router    RoutingMetrics (in each process that routes to the LLM server, the
                         ingress): requests sent to a checkpoint's holder, fallbacks by reason
    checkpoint index     IndexMetrics (the application's index actor, not a Serve replica: it
                         sets the `application` tag itself): records and bytes it describes,
                         the object-store tier's copies and bytes
    object-store tier    TierMetrics (each LLM server replica with checkpoint_transfer): the
                         time of exports, fetches, imports and demotions from the host tier,
                         fetch-vs-recompute decisions, failed fetches, demotions by outcome;
                         exports, imports, their bytes and import rejections
                         come from the engine's counters through EngineMetricsExporter

METRICS lists every metric; `exported_names()` the names Prometheus sees (dashboards/ uses
them). Ray's histograms export `_sum` from bucket midpoints, so only the buckets and `_count`
are exact. A counter appears once it has been incremented (Ray cannot export a zero).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from deployments.http.request_log import RequestRecord

# What GET /metrics at the ingress answers: a valid exposition without samples, since a
# replica's own numbers are not the application's once there are several.
METRICS_ELSEWHERE = (
    "# hybrid-serve exports its metrics through Ray: the metrics agent of each node serves them\n"
    "# at http://<node>:<metrics export port>/metrics (ray start --metrics-export-port), named\n"
    "# ray_hybrid_serve_*, one series per replica; sum them (README.md, section Metrics).\n")
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RAY_PREFIX = "ray_"  # Ray's exporter prepends it to every application metric
EXPORT_PERIOD_S = 1.0
CHECKPOINT_EVENTS = ("captured", "hit", "evicted", "deduplicated", "dropped")


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its name as recorded (Ray adds RAY_PREFIX), kind, help and tags."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()  # histogram buckets (upper bounds, seconds)

    def exported_names(self) -> tuple[str, ...]:
        """The sample names Prometheus scrapes: `_total` for a counter, `_bucket`, `_count` and
        `_sum` for a histogram, the name itself for a gauge."""
        name = RAY_PREFIX + self.name
        if self.kind == "counter":
            return (name + "_total",)
        if self.kind == "histogram":
            return (name + "_bucket", name + "_count", name + "_sum")
        return (name,)

    def create(self):
        """The Ray metric (call inside a Serve replica, which adds Serve's tags)."""
        from ray.serve import metrics

        if self.kind == "counter":
            return metrics.Counter(self.name, self.description, tag_keys=self.tag_keys)
        if self.kind == "gauge":
            return metrics.Gauge(self.name, self.description, tag_keys=self.tag_keys)
        return metrics.Histogram(self.name, self.description, boundaries=list(self.boundaries),
                                 tag_keys=self.tag_keys)


# ----- measured by the ingress, one record per request when it ends
REQUESTS = MetricSpec(
    "hybrid_serve_requests", "counter",
    "Requests that reached a generation route, by status (ok, error, cancelled), HTTP status "
    "class (2xx, 4xx, 5xx; none when cancelled) and finish reason (none if unfinished).",
    ("status", "http_status", "finish_reason"))
OUTPUT_TOKENS = MetricSpec(
    "hybrid_serve_output_tokens", "counter", "Output tokens streamed to clients (at request end).")
TIME_TO_FIRST_TOKEN = MetricSpec(
    "hybrid_serve_time_to_first_token_seconds", "histogram",
    "From the ingress receiving a request to its first output from the engine.",
    boundaries=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
INTER_TOKEN_LATENCY = MetricSpec(
    "hybrid_serve_inter_token_latency_seconds", "histogram",
    "Per request with two or more output tokens: (end-to-end - time to first token) / "
    "(output tokens - 1).",
    boundaries=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
REQUEST_LATENCY = MetricSpec(
    "hybrid_serve_request_latency_seconds", "histogram",
    "End-to-end: from the ingress receiving a request to its stream ending.",
    boundaries=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0))
BOUNDARY_REJECTIONS = MetricSpec(
    "hybrid_serve_instruction_boundary_rejections", "counter",
    "Chat prompts without an instruction boundary, by reason (docs/design.md section 3).",
    ("reason",))
BREAKPOINT_REJECTIONS = MetricSpec(
    "hybrid_serve_cache_breakpoint_rejections", "counter",
    "cache_control markers dropped because the renderer could not verify their position "
    "(not_a_prefix, render_error; docs/design.md section 3).", ("reason",))

# ----- exported by each LLM server replica from its engine
CHECKPOINT_EVENTS_TOTAL = MetricSpec(
    "hybrid_serve_checkpoint_events", "counter",
    "Checkpoint events by kind (prompt, response, instruction, breakpoint) and event (captured, "
    "hit, evicted, deduplicated, dropped).", ("kind", "event"))
PROMPT_TOKENS_RESTORED = MetricSpec(
    "hybrid_serve_prompt_tokens_restored", "counter",
    "Prompt tokens restored from checkpoints (at first admission).")
PROMPT_TOKENS_COMPUTED = MetricSpec(
    "hybrid_serve_prompt_tokens_computed", "counter",
    "Prompt tokens left to prefill after restoring (at first admission).")
CAPTURE_WAITS = MetricSpec(
    "hybrid_serve_capture_waits", "counter",
    "Requests that waited for a running request's capture of a prefix they share instead of "
    "computing it again (engine/checkpoints/in_flight.py).")
PREEMPTIONS = MetricSpec(
    "hybrid_serve_preemptions", "counter",
    "Requests preempted (blocks and state slot freed, requeued to be recomputed).")
FAILED_STEPS = MetricSpec(
    "hybrid_serve_failed_steps", "counter",
    "Engine steps the executor failed and the engine recovered from (docs/design.md 4.1).")
REQUESTS_FAILED = MetricSpec(
    "hybrid_serve_requests_failed", "counter",
    "Requests failed by the engine after MAX_FAILED_STEPS failed steps (HTTP 500).")
ENGINE_REQUESTS = MetricSpec(
    "hybrid_serve_engine_requests", "gauge",
    "Requests in the engine by state: running, waiting (never preempted), preempted (waiting "
    "again to be recomputed).", ("state",))
KV_BLOCKS = MetricSpec(
    "hybrid_serve_kv_blocks", "gauge",
    "KV blocks by state: free, requests (held by a request, maybe shared with checkpoints), "
    "checkpoints (held by checkpoints alone, evictable).", ("state",))
STATE_SLOTS = MetricSpec(
    "hybrid_serve_state_slots", "gauge", "Recurrent state slots by state: free, used.", ("state",))
CHECKPOINTS = MetricSpec(
    "hybrid_serve_checkpoints", "gauge", "Checkpoints held (published or pending).")
CHECKPOINT_BYTES = MetricSpec(
    "hybrid_serve_checkpoint_bytes", "gauge",
    "Bytes held by checkpoints outside the shared KV blocks.")

# ----- the host tier (engine/checkpoints/host_tier.py HostTierCounters), exported by each LLM
# server replica with its engine's counters; no series while it is off (host_checkpoint_bytes 0)
HOST_TIER_EVENT_NAMES = ("demoted", "already_held", "refused", "promoted", "promotion_failed",
                         "evicted", "passed_on")
HOST_TIER_EVENTS = MetricSpec(
    "hybrid_serve_host_tier_events", "counter",
    "Host tier events by event: demoted (copied in from the device), already_held (evicted from "
    "the device while held: no copy), refused (not worth what it would evict, or over the "
    "budget), promoted (imported back to the device), promotion_failed (no room on the "
    "device), evicted (out of the host budget), passed_on (of those, handed to the "
    "object-store tier).", ("event",))
HOST_TIER_EVENT_BYTES = MetricSpec(
    "hybrid_serve_host_tier_event_bytes", "counter",
    "Shard bytes demoted into or promoted out of the host tier, by event (demoted, promoted).",
    ("event",))
HOST_TIER_CHECKPOINTS = MetricSpec(
    "hybrid_serve_host_tier_checkpoints", "gauge", "Checkpoints the host tier holds.")
HOST_TIER_BYTES = MetricSpec(
    "hybrid_serve_host_tier_bytes", "gauge",
    "Bytes the host tier holds (every shard's state, K/V of all its tokens and hidden row), "
    "within host_checkpoint_bytes.")

# ----- speculative decoding, per drafter (engine/speculative/scheduling.py SpeculationStats);
# exported by each LLM server replica with its engine's counters, no series while it is off
SPECULATIVE_VERIFICATION_CHUNKS = MetricSpec(
    "hybrid_serve_speculative_verification_chunks", "counter",
    "Verification chunks (a decode of the last token and 1..k drafts, one forward pass), by "
    "drafter.", ("drafter",))
SPECULATIVE_DRAFTS_PROPOSED = MetricSpec(
    "hybrid_serve_speculative_draft_tokens_proposed", "counter",
    "Draft tokens the drafter proposed and a verification chunk checked, by drafter.",
    ("drafter",))
SPECULATIVE_DRAFTS_ACCEPTED = MetricSpec(
    "hybrid_serve_speculative_draft_tokens_accepted", "counter",
    "Draft tokens equal to the model's argmax (the greedy rule), by drafter; accepted / "
    "proposed is the acceptance rate.", ("drafter",))
SPECULATIVE_DRAFTS_REJECTED = MetricSpec(
    "hybrid_serve_speculative_draft_tokens_rejected", "counter",
    "Draft tokens the greedy rule rejected (the first draft unequal to the model's argmax and "
    "every draft after it), by drafter; proposed = accepted + rejected.", ("drafter",))
SPECULATIVE_DRAFTS_TRIMMED = MetricSpec(
    "hybrid_serve_speculative_draft_tokens_trimmed", "counter",
    "Tokens of accepted draft runs dropped by a stop inside the run (EOS, a stop token or "
    "string, max_model_len), by drafter; per chunk at most its accepted drafts.", ("drafter",))
SPECULATIVE_STEPS_OVER_BATCH_CAP = MetricSpec(
    "hybrid_serve_speculative_steps_over_batch_cap", "counter",
    "Engine steps that started with more running requests than speculative_max_batch_size, in "
    "which no request drafted, by drafter.", ("drafter",))
# A counter per acceptance length rather than a histogram: the engine counts chunks by length
# exactly (0..k, a handful of integers), and a counter exports those counts as they are, through
# the same deltas as every engine counter. A Ray histogram would replay each chunk as an
# observe(), with `_sum` estimated from bucket midpoints, and histogram_quantile would
# interpolate fractional lengths inside integer buckets. In PromQL the distribution is
# `sum by (accepted) (rate(...))`, the share of chunks that accepted at least j drafts filters
# on `accepted`, and the mean length is accepted drafts / verification chunks.
SPECULATIVE_ACCEPTANCE_LENGTHS = MetricSpec(
    "hybrid_serve_speculative_acceptance_lengths", "counter",
    "Verification chunks by the number of their drafts accepted (accepted = 0..k), by drafter.",
    ("drafter", "accepted"))
# Acceptance per depth: draft d of a chunk (d = 1..k) is accepted only if drafts 1..d-1 were,
# so the share falls with the depth; accepted / proposed at each depth is the curve the
# speculation policy (engine/speculative/policy.py) reads its expected tokens per step from.
SPECULATIVE_DEPTH_PROPOSED = MetricSpec(
    "hybrid_serve_speculative_depth_drafts_proposed", "counter",
    "Verification chunks that carried a draft at depth d (depth = 1..k), by drafter.",
    ("drafter", "depth"))
SPECULATIVE_DEPTH_ACCEPTED = MetricSpec(
    "hybrid_serve_speculative_depth_drafts_accepted", "counter",
    "Verification chunks whose draft at depth d was accepted (depth = 1..k), by drafter; "
    "divided by the proposed ones at the same depth, the acceptance at that depth.",
    ("drafter", "depth"))

# ----- checkpoint-aware routing (deployments/cluster/router.py) and the cluster index
ROUTED_TO_HOLDER = MetricSpec(
    "hybrid_serve_routed_to_checkpoint_holder", "counter",
    "Generation requests the checkpoint-aware router sent to a replica holding the prompt's "
    "longest checkpoint.")
ROUTING_FALLBACKS = MetricSpec(
    "hybrid_serve_routing_fallbacks", "counter",
    "Generation requests the checkpoint-aware router did not send to a reported holder, by "
    "reason: recent_placement (sent where it sent the same instructions seconds ago, before the "
    "index heard of the capture), no_holder (no replica holds a prefix), overloaded (every holder at routing_queue_threshold "
    "or more), no_tokens (no prompt token ids), index_unavailable (no current index mirror).",
    ("reason",))
INDEX_RECORDS = MetricSpec(
    "hybrid_serve_checkpoint_index_records", "gauge",
    "Checkpoints the application's cluster index lists (one per replica holding it).",
    ("application",))
INDEX_BYTES = MetricSpec(
    "hybrid_serve_checkpoint_index_bytes", "gauge",
    "Bytes of the checkpoints the cluster index lists (the bundles' own bytes, outside shared "
    "KV blocks).", ("application",))

INDEX_STORED_COPIES = MetricSpec(
    "hybrid_serve_checkpoint_store_copies", "gauge",
    "Checkpoint copies in the application's object-store tier (checkpoint_transfer).",
    ("application",))
INDEX_STORED_BYTES = MetricSpec(
    "hybrid_serve_checkpoint_store_bytes", "gauge",
    "Bytes of the checkpoint copies in the object-store tier (within checkpoint_store_bytes).",
    ("application",))

# ----- the object-store tier, per LLM server replica (deployments/cluster/tier.py)
TRANSFERS = MetricSpec(
    "hybrid_serve_checkpoint_transfers", "counter",
    "Checkpoints exported from or imported into this replica's engine, by direction (export, "
    "import).", ("direction",))
TRANSFER_BYTES = MetricSpec(
    "hybrid_serve_checkpoint_transfer_bytes", "counter",
    "Shard bytes of the checkpoints exported or imported, by direction.", ("direction",))
IMPORT_REJECTIONS = MetricSpec(
    "hybrid_serve_checkpoint_import_rejections", "counter",
    "Checkpoint imports the engine refused, by reason (engine/checkpoints/import_checks.py).",
    ("reason",))
TRANSFER_SECONDS = MetricSpec(
    "hybrid_serve_checkpoint_transfer_seconds", "histogram",
    "Time of one tier operation: export (engine export and the index's puts), fetch (getting a "
    "stored copy's objects), import (the engine's checks and restore), demote (a checkpoint "
    "the host tier evicted: its checksums and the index's puts).", ("operation",),
    boundaries=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
FETCH_DECISIONS = MetricSpec(
    "hybrid_serve_checkpoint_fetch_decisions", "counter",
    "Requests for which a stored copy covered more than this replica held, by decision: "
    "fetched (imported, the request restores it), recomputed (not worth its bytes, or the "
    "fetch or import failed: see hybrid_serve_checkpoint_fetch_failures).", ("decision",))
FETCH_FAILURES = MetricSpec(
    "hybrid_serve_checkpoint_fetch_failures", "counter",
    "Fetches of stored copies that did not end in an import, by reason: timeout, lost, "
    "malformed, rejected (the engine refused it), error.", ("reason",))
DEMOTIONS = MetricSpec(
    "hybrid_serve_checkpoint_demotions", "counter",
    "Checkpoints the host tier evicted and passed on to the object-store tier, by outcome: "
    "stored, already_stored (a copy was there), refused (by the index: a copy exists, over "
    "checkpoint_store_bytes), dropped (too many bytes waiting to be stored), failed.",
    ("outcome",))

METRICS = (REQUESTS, OUTPUT_TOKENS, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, REQUEST_LATENCY,
           BOUNDARY_REJECTIONS, BREAKPOINT_REJECTIONS, CHECKPOINT_EVENTS_TOTAL, PROMPT_TOKENS_RESTORED,
           PROMPT_TOKENS_COMPUTED, CAPTURE_WAITS, PREEMPTIONS, FAILED_STEPS, REQUESTS_FAILED,
           ENGINE_REQUESTS, KV_BLOCKS, STATE_SLOTS, CHECKPOINTS, CHECKPOINT_BYTES, HOST_TIER_EVENTS,
           HOST_TIER_EVENT_BYTES, HOST_TIER_CHECKPOINTS, HOST_TIER_BYTES,
           SPECULATIVE_VERIFICATION_CHUNKS, SPECULATIVE_DRAFTS_PROPOSED,
           SPECULATIVE_DRAFTS_ACCEPTED, SPECULATIVE_DRAFTS_REJECTED, SPECULATIVE_DRAFTS_TRIMMED,
           SPECULATIVE_STEPS_OVER_BATCH_CAP, SPECULATIVE_ACCEPTANCE_LENGTHS,
           SPECULATIVE_DEPTH_PROPOSED, SPECULATIVE_DEPTH_ACCEPTED, ROUTED_TO_HOLDER,
           ROUTING_FALLBACKS, INDEX_RECORDS, INDEX_BYTES, INDEX_STORED_COPIES, INDEX_STORED_BYTES,
           TRANSFERS, TRANSFER_BYTES, IMPORT_REJECTIONS, TRANSFER_SECONDS, FETCH_DECISIONS,
           FETCH_FAILURES, DEMOTIONS)
ROUTING_FALLBACK_REASONS = ("recent_placement", "no_holder", "overloaded", "no_tokens",
                            "index_unavailable")


def exported_names() -> frozenset[str]:
    """Every sample name Prometheus scrapes from the application (with Ray's prefix)."""
    return frozenset(name for spec in METRICS for name in spec.exported_names())


class RequestMetrics:
    """The ingress replica's metrics. Create inside the replica (Serve's tags); `create` makes
    each metric (Ray's, MetricSpec.create; a test passes one that records what is recorded)."""

    def __init__(self, create: Callable[[MetricSpec], Any] = MetricSpec.create) -> None:
        self._requests = create(REQUESTS)
        self._output_tokens = create(OUTPUT_TOKENS)
        self._ttft = create(TIME_TO_FIRST_TOKEN)
        self._itl = create(INTER_TOKEN_LATENCY)
        self._latency = create(REQUEST_LATENCY)
        self._boundary_rejections = create(BOUNDARY_REJECTIONS)
        self._breakpoint_rejections = create(BREAKPOINT_REJECTIONS)

    def count_boundary_rejection(self, reason: str | None) -> None:
        """Count a chat prompt's RenderedPrompt.boundary_rejection (None: it has a boundary)."""
        if reason is not None:
            self._boundary_rejections.inc(tags={"reason": str(reason)})

    def count_breakpoint_rejections(self, reasons: tuple[str, ...]) -> None:
        """Count a chat prompt's RenderedPrompt.breakpoint_rejections, one per dropped marker."""
        for reason in reasons:
            self._breakpoint_rejections.inc(tags={"reason": str(reason)})

    def record_request(self, record: RequestRecord) -> None:
        """Record an ended request from its RequestRecord (deployments/http/request_log.py):
        refused ones count by status only; ones that reached the engine also observe their
        latencies and output tokens."""
        if record.status == "cancelled":
            http_status = "none"
        else:
            http_status = f"{(record.http_status or 200) // 100}xx"
        self._requests.inc(tags={"status": record.status, "http_status": http_status,
                                 "finish_reason": record.finish_reason or "none"})
        if record.output_tokens > 0:
            self._output_tokens.inc(record.output_tokens)
        if record.ttft_s is None:
            return
        self._ttft.observe(max(0.0, record.ttft_s))
        self._latency.observe(max(0.0, record.duration_s))
        if record.output_tokens >= 2:
            decode_s = max(0.0, record.duration_s - record.ttft_s)
            self._itl.observe(decode_s / (record.output_tokens - 1))


class RoutingMetrics:
    """The checkpoint-aware router's decisions. Create in the routing process (the ingress
    replica, which adds Serve's tags)."""

    def __init__(self) -> None:
        self._to_holder = ROUTED_TO_HOLDER.create()
        self._fallbacks = ROUTING_FALLBACKS.create()

    def record(self, reason: str) -> None:
        """Count one request: "holder", or one of ROUTING_FALLBACK_REASONS."""
        if reason == "holder":
            self._to_holder.inc()
        else:
            self._fallbacks.inc(tags={"reason": reason})


class IndexMetrics:
    """The cluster index's size, set by the index actor after each change."""

    def __init__(self, app_name: str) -> None:
        self._tags = {"application": app_name}
        self._records = INDEX_RECORDS.create()
        self._bytes = INDEX_BYTES.create()
        self._stored_copies = INDEX_STORED_COPIES.create()
        self._stored_bytes = INDEX_STORED_BYTES.create()

    def set(self, records: int, num_bytes: int, stored_copies: int = 0,
            stored_bytes: int = 0) -> None:
        self._records.set(records, tags=self._tags)
        self._bytes.set(num_bytes, tags=self._tags)
        self._stored_copies.set(stored_copies, tags=self._tags)
        self._stored_bytes.set(stored_bytes, tags=self._tags)


class TierMetrics:
    """An LLM server replica's object-store tier: operation times and fetch decisions (the
    counts and bytes of exports, imports and rejections come from the engine's counters,
    EngineMetricsExporter). Create inside the replica."""

    def __init__(self) -> None:
        self._seconds = TRANSFER_SECONDS.create()
        self._decisions = FETCH_DECISIONS.create()
        self._failures = FETCH_FAILURES.create()
        self._demotions = DEMOTIONS.create()

    def observe(self, operation: str, seconds: float) -> None:
        self._seconds.observe(seconds, tags={"operation": operation})

    def decided(self, decision: str) -> None:
        self._decisions.inc(tags={"decision": decision})

    def failed(self, reason: str) -> None:
        self._failures.inc(tags={"reason": reason})

    def demoted(self, outcome: str) -> None:
        """A checkpoint the host tier passed on (deployments/cluster/store_demotion.py)."""
        self._demotions.inc(tags={"outcome": outcome})
