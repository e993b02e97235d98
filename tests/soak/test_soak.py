"""The soak in CI: benchmarks/soak.py for 60 s (the documented run is 30 minutes), in a
subprocess with its own Ray. It fails on any 5xx or unexpected answer, pools left busy, or
memory that grows without bound (its docstring); this test checks its verdict and the record
it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_env import SERVE_ON_TWO_CORES_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
DURATION_S = float(os.environ.get("HYBRID_SERVE_SOAK_S", "60"))  # 12 windows of 5 s


@pytest.mark.slow
@pytest.mark.timeout(int(DURATION_S) + 300)
def test_soak_serves_mixed_traffic_without_errors_or_growth(tmp_path):
    out = tmp_path / "soak.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env.update(SERVE_ON_TWO_CORES_ENV)
    run = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--duration-s", str(DURATION_S), "--port", "8232",
         "--out", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=DURATION_S + 240)
    print(run.stdout[-4000:])
    assert out.exists(), run.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["problems"] == [] and run.returncode == 0, record["problems"]
    by_kind = record["by_kind_and_status"]
    for kind in ("instruction 200", "multi_turn 200", "completion 200", "disconnect 200",
                 "bad_request 400"):
        assert by_kind.get(kind, 0) > 0, kind  # every kind of traffic was served
    assert record["engine"]["checkpoints"]["instruction"]["hit"] > 0
    assert len(record["windows"]) >= 10 and set(record["rss_mib"]["end"]) == {
        "OpenAIIngress", "Renderer", "LLMServer"}
