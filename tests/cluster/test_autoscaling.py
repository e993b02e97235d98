"""Replicas and nodes scale with load, and a replica that is scaled down drains (issue 21).

Runs autoscaling_scenario.py (a fake autoscaling Ray cluster, the app deployed from
serve_config.yaml, load, then idle; see its docstring) in a subprocess, so its Ray never
meets the pytest session's (tests/conftest.py ray_session), and checks the result it writes:

- Serve goes from one LLM server replica to two under load and back to one when idle;
- the Ray autoscaler adds a worker node for the second replica and removes it when idle;
- both replicas serve requests, the second one on the new node;
- the replica Serve stops drains: it holds requests when stopped and each of them, like
  every other request, streams all its tokens to the end. No request fails.

About a minute and a half on an idle 2-core machine; the scenario gives up after
SCENARIO_TIMEOUT_S, this test after SUBPROCESS_TIMEOUT_S.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fake_cluster import end_session

pytestmark = pytest.mark.slow

SCENARIO = Path(__file__).with_name("autoscaling_scenario.py")
REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT_S = 480


def run_scenario(result_path: Path) -> str:
    """Run the scenario to its end (or SIGTERM it at the timeout); return its output's tail.
    Whatever happened, the fake cluster it started is gone afterwards."""
    proc = subprocess.Popen([sys.executable, str(SCENARIO), str(result_path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the scenario unwinds and shuts its cluster down
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        output += f"\n[killed after {SUBPROCESS_TIMEOUT_S}s]"
    identity_path = Path(f"{result_path}.cluster")
    if identity_path.exists():  # a no-op unless the scenario died before its own shutdown
        identity = json.loads(identity_path.read_text())
        end_session(identity["sid"], identity["marker"])
        shutil.rmtree(identity["marker"], ignore_errors=True)  # the cluster's temp dir
    return output[-6000:]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    if not Path("/proc/self/environ").exists():
        pytest.skip("the fake cluster finds its processes through /proc (Linux only)")
    result_path = tmp_path_factory.mktemp("autoscaling") / "result.json"
    output = run_scenario(result_path)
    if not result_path.exists():
        pytest.fail(f"the scenario wrote no result; its output:\n{output}")
    data = json.loads(result_path.read_text())
    if data["error"] is not None:
        pytest.fail(f"the scenario failed:\n{data['error']}\n--- output:\n{output}")
    print(summary(data))
    return data


def changes(values) -> list:
    """`values` with consecutive repeats dropped: [1, 1, 2, 2, 1] -> [1, 2, 1]."""
    out = []
    for value in values:
        if not out or out[-1] != value:
            out.append(value)
    return out


def deployed_timeline(result: dict) -> list[dict]:
    """The samples from the moment the app ran with one replica on."""
    start = result["marks"]["deployed"]
    return [s for s in result["timeline"] if "error" not in s and s["t"] >= start]


def requests_per_replica(result: dict) -> Counter:
    return Counter(r["replica"] for r in result["requests"])


def drained_replica(result: dict) -> str:
    """The replica that completed a graceful shutdown (there must be exactly one)."""
    drained = [replica for replica, event in result["drain"].items()
               if event["shutdown_complete"]]
    assert len(drained) == 1, f"expected one replica to shut down, got {result['drain']}"
    return drained[0]


def in_flight_at_drain(result: dict) -> list[dict]:
    """Requests (on any replica) running when the stopped replica began its shutdown."""
    started = result["drain"][drained_replica(result)]["started"]
    return [r for r in result["requests"] if r["start"] < started < r["end"]]


def summary(result: dict) -> str:
    t0 = result["marks"]["cluster_started"]
    marks = ", ".join(f"{name} {t - t0:.1f}s" for name, t in result["marks"].items())
    steps = changes((tuple(sorted(s["replicas"].items())), len(s["nodes"]))
                    for s in result["timeline"] if "error" not in s)
    drain = ""
    for replica, event in result["drain"].items():
        held = [r for r in result["requests"] if r["start"] < event["started"] < r["end"]]
        drain += (f"; {replica} began its shutdown at {event['started'] - t0:.1f}s with "
                  f"{sum(r['replica'] == replica for r in held)} of its requests in flight "
                  f"({len(held)} on all replicas, {sum(r['ok'] for r in held)} completed), "
                  f"Serve's drain loop counted {event['ongoing_while_draining']}")
    return (f"scenario {result['elapsed_s']:.0f}s: {marks}\n"
            f"(replica states, alive nodes): {steps}\n"
            f"requests per replica: {dict(requests_per_replica(result))}{drain}")


def failure(record: dict, result: dict) -> str:
    """One failed request as a line: when it ran (seconds from the cluster's start, beside the
    phase marks), which replica served it, and what it got."""
    t0 = result["marks"]["cluster_started"]
    fields = {key: record.get(key) for key in
              ("status", "error", "done", "finish_reason", "completion_tokens", "chars",
               "replica")}
    return (f"{record['id']} {record['start'] - t0:.1f}s-{record['end'] - t0:.1f}s {fields}; "
            f"marks: " + ", ".join(f"{name} {t - t0:.1f}s"
                                   for name, t in result["marks"].items()))


def test_llm_server_replicas_go_one_two_one(result):
    running = [s["replicas"].get("RUNNING", 0) for s in deployed_timeline(result)]
    assert changes(running) == [1, 2, 1], summary(result)
    # and no flapping: no replica started after the scale-down
    wanted = [s["replicas"].get("RUNNING", 0) + s["replicas"].get("STARTING", 0)
              for s in deployed_timeline(result)]
    assert changes(wanted) == [1, 2, 1], summary(result)
    assert deployed_timeline(result)[-1]["replicas"] == {"RUNNING": 1}


def test_worker_node_added_then_removed(result):
    timeline = deployed_timeline(result)
    nodes = changes(tuple(s["nodes"]) for s in timeline)
    assert [len(n) for n in nodes] == [1, 2, 1], summary(result)
    head, with_worker, end = nodes
    assert end == head, "the head node must stay, the worker node go"
    assert set(head) < set(with_worker)


def test_both_replicas_served_requests_second_on_the_new_node(result):
    per_replica = requests_per_replica(result)
    assert None not in per_replica, "a request no replica's access log names"
    minimum = result["settings"]["min_requests_per_replica"]
    assert len(per_replica) == 2 and min(per_replica.values()) >= minimum, summary(result)
    head = deployed_timeline(result)[0]["nodes"]
    nodes = {replica: result["replica_nodes"].get(replica) for replica in per_replica}
    on_worker = [replica for replica, node in nodes.items() if node and node != head]
    assert len(on_worker) == 1, f"one replica must run on the added node: {nodes}, head {head}"
    assert on_worker[0] == drained_replica(result), "the replica on the worker node is stopped"


def test_no_request_failed(result):
    failed = [r for r in result["requests"] if not r["ok"]]
    assert result["requests"], "no request was sent"
    assert not failed, "\n".join(failure(r, result) for r in failed[:5])
    for r in result["requests"]:
        assert r["completion_tokens"] == r["max_tokens"] and r["finish_reason"] == "length"


def test_scaled_down_replica_drains_its_requests(result):
    drained = drained_replica(result)
    in_flight = in_flight_at_drain(result)
    on_drained = [r for r in in_flight if r["replica"] == drained]
    assert on_drained, (f"no request was in flight on {drained} when it began to shut down "
                        f"(Serve's routing should keep one there): {summary(result)}")
    cut = [r for r in in_flight if not r["ok"]]
    assert not cut, cut
    assert all(r["completion_tokens"] == r["max_tokens"] for r in on_drained)
    assert result["drain"][drained]["shutdown_complete"]
