"""Metrics through Ray with two LLM server replicas: the sums Prometheus would compute from a
scrape of Ray's metrics agent equal what the clients saw, both replicas export their series, and
every metric the Grafana dashboard queries is there.

The scenario (ray_metrics_scenario.py) needs a Ray instance with a metrics export port, which
the session's Ray instance (tests/conftest.py) does not have; it runs in a subprocess so the
two never meet in one process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_env import SERVE_ON_TWO_CORES_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_dashboard import dashboard_metric_names  # noqa: E402

pytestmark = pytest.mark.e2e

SCENARIO = Path(__file__).with_name("ray_metrics_scenario.py")
REPO = SCENARIO.parents[2]
TIMEOUT_S = 300  # Ray, two replicas and the export's lag on a busy 2-core box


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ray_metrics") / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | SERVE_ON_TWO_CORES_ENV
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), str(out), str(free_port()), str(free_port())],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"scenario failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    print(f"converged after {result['seconds_to_converge']} s; totals {result['totals']}; "
          f"speculation {result['speculation']}")
    return result


def test_every_request_got_its_answer(scenario):
    assert scenario["statuses"][0] == 404  # the refused one: unknown model
    assert all(status == 200 for status in scenario["statuses"][1:])


def test_sums_over_replicas_equal_what_the_clients_saw(scenario):
    assert scenario["totals"] == scenario["expected"]


def test_both_llm_server_replicas_export_their_series(scenario):
    assert len(scenario["gauge_replicas"]) == scenario["llm_server_replicas"]
    assert len(scenario["counter_replicas"]) == scenario["llm_server_replicas"]


def test_the_scrape_has_every_metric_the_dashboard_queries(scenario):
    missing = dashboard_metric_names() - set(scenario["names"])
    assert not missing, f"the dashboard queries metrics the scrape lacks: {sorted(missing)}"


def test_speculation_counters_arrive_whole_through_ray(scenario):
    """Speculative decoding's counters (on in the scenario, n-gram): the prompt that repeats a
    span got drafts accepted, and the series summed over replicas agree with each other as the
    engine's counters do (chunks by accepted drafts sum to the chunks and the drafts accepted)."""
    counters = scenario["speculation"]
    lengths = {int(a): n for a, n in counters["lengths"].items()}
    assert counters["accepted"] > 0
    assert counters["proposed"] >= counters["accepted"] >= counters["trimmed"]
    assert sum(lengths.values()) == counters["chunks"]
    assert sum(a * n for a, n in lengths.items()) == counters["accepted"]
    assert max(lengths) <= scenario["num_speculative_tokens"]
