"""Every request ends with one structured line in the ingress replica's log: its id, status,
token counts and timings, and never its text (deployments/http/request_log.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from deployments.http.request_log import PREFIX, RequestRecord

MODEL_NAME = "hybrid-serve-tiny"
SECRET_TEXT = "zebra-violet-8842"  # in the prompt; must never reach the log


def test_a_record_renders_as_one_json_line():
    line = RequestRecord("cmpl-1", status="ok", finish_reason="length", prompt_tokens=9,
                         cached_tokens=4, output_tokens=3, ttft_s=0.012345, duration_s=0.5,
                         render_s=0.00123).line()
    assert line.startswith(PREFIX) and "\n" not in line
    fields = json.loads(line[len(PREFIX):])
    assert abs(fields.pop("end_time") - time.time()) < 60
    assert fields == {"request_id": "cmpl-1", "status": "ok", "http_status": None,
                      "finish_reason": "length", "prompt_tokens": 9, "cached_tokens": 4,
                      "output_tokens": 3, "ttft_s": 0.0123, "duration_s": 0.5, "render_s": 0.0012}


def ingress_log_records(ray_session) -> list[dict]:
    """Every request record in the ingress replica logs of this Ray session."""
    from ray._private import worker  # where this session writes its logs

    records = []
    logs = Path(worker._global_node.get_logs_dir_path()) / "serve"
    for path in logs.glob("replica_*OpenAIIngress*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if PREFIX in line:
                records.append(json.loads(line[line.index(PREFIX) + len(PREFIX):].strip()))
    return records


def wait_for_records(ray_session, matches, count: int, timeout_s: float = 30.0) -> list[dict]:
    """At least `count` records for which matches(record) holds (Serve writes them to its log
    file a moment after the response)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [r for r in ingress_log_records(ray_session) if matches(r)]
        if len(found) >= count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"fewer than {count} matching {PREFIX.strip()} lines within {timeout_s} s")


def test_finished_and_refused_requests_are_logged_without_their_text(ray_session, client):
    done = client.completions.create(model=MODEL_NAME, prompt=f"Say {SECRET_TEXT} twice.",
                                     max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    (record,) = wait_for_records(ray_session, lambda r: r["request_id"] == done.id, 1)
    assert record["status"] == "ok" and record["finish_reason"] == "length"
    assert record["prompt_tokens"] == done.usage.prompt_tokens
    assert record["output_tokens"] == done.usage.completion_tokens == 3
    assert 0 < record["ttft_s"] <= record["duration_s"]
    assert 0 < record["render_s"] < record["ttft_s"]  # the prompt's tokenizing, inside the TTFT

    sent = time.time()

    def refused_at_the_edge(r):  # no id was given to it; logged after it was sent
        return (r["request_id"] is None and r["http_status"] == 400 and r["status"] == "error"
                and r["end_time"] >= sent - 1)

    with pytest.raises(openai.BadRequestError):  # out-of-vocabulary token ids
        client.completions.create(model=MODEL_NAME, prompt=[10**9], max_tokens=2)
    wait_for_records(ray_session, refused_at_the_edge, 1)

    from ray._private import worker

    logs = Path(worker._global_node.get_logs_dir_path()) / "serve"
    scanned = {path.name: path.read_text(errors="replace") for path in logs.glob("*.log")}
    # the scan must cover the file that logged the request (else it proves nothing)
    assert any(done.id in text for text in scanned.values()), \
        f"the request's record is in none of the {len(scanned)} Serve log files scanned"
    assert [name for name, text in scanned.items() if SECRET_TEXT in text] == []
