"""A stand-in for Ray's metrics that remembers what was recorded, for tests that drive
deployments/metrics.py's exporters without Ray: pass a RecordingMetrics as their `create`."""

from __future__ import annotations

from deployments.metrics import MetricSpec

Tags = tuple[tuple[str, str], ...]  # sorted (tag, value) pairs


def tag_key(tags: dict[str, str] | None) -> Tags:
    return tuple(sorted((tags or {}).items()))


class RecordingMetric:
    """One counter, gauge or histogram: a counter's series hold the sum of its increments, a
    gauge's the last value set, a histogram's the list of values observed. inc() refuses what
    Ray's Counter refuses (a value not above zero)."""

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.series: dict[Tags, float | list[float]] = {}

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        assert self.spec.kind == "histogram", self.spec.name
        self.series.setdefault(tag_key(tags), []).append(value)

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        assert self.spec.kind == "counter", self.spec.name
        if value <= 0:
            raise ValueError(f"{self.spec.name}: increment {value} is not above zero")
        key = tag_key(tags)
        self.series[key] = self.series.get(key, 0) + value

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        assert self.spec.kind == "gauge", self.spec.name
        self.series[tag_key(tags)] = value


class RecordingMetrics:
    """A `create` for the exporters: makes RecordingMetric objects and keeps them by name."""

    def __init__(self) -> None:
        self.metrics: dict[str, RecordingMetric] = {}

    def __call__(self, spec: MetricSpec) -> RecordingMetric:
        metric = self.metrics[spec.name] = RecordingMetric(spec)
        return metric

    def series(self, spec: MetricSpec) -> dict[Tags, float | list[float]]:
        """Every series of `spec` recorded so far (none: {})."""
        return dict(self.metrics[spec.name].series)
