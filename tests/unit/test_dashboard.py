"""The Grafana dashboard (dashboards/hybrid_serve.json) queries only metrics the application
exports (deployments/metrics.py), under the names Prometheus scrapes from Ray.

tests/metrics/test_ray_metrics.py checks that a real scrape has every one of them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from deployments.metrics import METRICS, exported_names

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "hybrid_serve.json"

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "inf", "nan"}
LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana label_values() query) reads:
    identifiers that are not functions, keywords, label names or Grafana variables."""
    names = set(LABEL_VALUES.findall(expr))
    expr = LABEL_VALUES.sub(" ", expr)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)  # Grafana variables
    expr = re.sub(r"(?<![\w:])\d[\d.]*(?:[eE][+-]?\d+)?", " ", expr)  # numbers
    for match in re.finditer(r"[A-Za-z_:][\w:]*", expr):
        rest = expr[match.end():].lstrip()
        if not rest.startswith("(") and match.group().lower() not in PROMQL_WORDS:
            names.add(match.group())
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def dashboard_metric_names() -> set[str]:
    """Every metric name the dashboard's queries read (also used by test_ray_metrics.py)."""
    return {name for expr in dashboard_queries() for name in metric_names(expr)}


def test_the_extractor_finds_metric_names_and_nothing_else():
    expr = ('histogram_quantile(0.95, sum by (le) (rate(ray_a_bucket{application=~"$app", '
            'le!="x"}[$__rate_interval]))) / ignoring(kind) group_left sum(ray_b) '
            '+ scalar(sum(rate(ray_c_total[5m]))) * 1e3')
    assert metric_names(expr) == {"ray_a_bucket", "ray_b", "ray_c_total"}
    assert metric_names("label_values(ray_d, application)") == {"ray_d"}


def test_every_dashboard_query_reads_exported_metrics():
    used = dashboard_metric_names()
    assert used, "the dashboard queries no metric"
    assert used <= exported_names(), f"not exported: {sorted(used - exported_names())}"


@pytest.mark.parametrize("panel", ["Checkpoint hit rate", "Prompt tokens restored vs computed",
                                   "Time to first token", "Throughput (output tokens/s)",
                                   "Pool usage", "Engine queues", "Request rate by status",
                                   "Speculative decoding acceptance rate"])
def test_the_dashboard_has_the_panel(panel):
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert panel in titles


def test_time_to_first_token_panel_shows_p50_and_p95():
    panel = next(p for p in json.loads(DASHBOARD.read_text())["panels"]
                 if p["title"] == "Time to first token")
    exprs = [t["expr"] for t in panel["targets"]]
    assert any(e.startswith("histogram_quantile(0.5,") for e in exprs)
    assert any(e.startswith("histogram_quantile(0.95,") for e in exprs)


def test_exported_names_follow_prometheus_suffixes():
    names = exported_names()
    for spec in METRICS:
        base = "ray_" + spec.name
        if spec.kind == "counter":
            assert base + "_total" in names and base not in names
        elif spec.kind == "histogram":
            assert {base + "_bucket", base + "_count", base + "_sum"} <= names
        else:
            assert base in names
    assert len({spec.name for spec in METRICS}) == len(METRICS)
