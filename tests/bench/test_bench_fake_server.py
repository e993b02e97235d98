"""The benchmark against a second, minimal OpenAI-compatible endpoint: a plain HTTP server in a
thread that streams a fixed SSE reply, with a role-only first chunk and usage without
prompt_tokens_details. The report must say "not reported" (never 0) and TTFT must be taken at
the first content chunk. No Ray."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybrid_serve_bench import cli
from hybrid_serve_bench.client import RECORD_FIELDS

ROLE_TO_CONTENT_S = 0.2  # the server waits this long between the role chunk and the first content


class FakeOpenAI(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        if self.path != "/v1/models":
            self.send_error(404)
            return
        payload = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload.encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def event(payload):
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        def chunk(delta, finish=None):
            return {"id": "x", "object": "chat.completion.chunk", "model": "fake-model",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        event(chunk({"role": "assistant", "content": ""}))
        time.sleep(ROLE_TO_CONTENT_S)
        event(chunk({"content": "Hel"}))
        event(chunk({"content": "lo"}))
        event(chunk({}, "length"))
        event({"id": "x", "object": "chat.completion.chunk", "model": "fake-model", "choices": [],
               "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


@pytest.fixture(scope="module")
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)  # a free port: xdist runs two
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_report_says_not_reported_and_ttft_skips_the_role_chunk(fake_server, tmp_path, capsys):
    FakeOpenAI.bodies.clear()
    cli.main(["run", "--base-url", fake_server, "--workload", "shared-instructions", "few-shot",
              "--systems", "2", "--instruction-tokens", "40", "--requests", "4", "--examples", "1",
              "--user-tokens", "5-10", "--max-tokens", "2", "--concurrency", "2",
              "--rate", "closed", "50", "--no-cache-salt", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())

    assert result["targets"][0]["model"] == "fake-model"  # from GET /v1/models
    assert result["targets"][0]["server_models"]["data"][0]["id"] == "fake-model"
    assert len(FakeOpenAI.bodies) == 2 * 4 * 2
    body = FakeOpenAI.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "cache_salt" not in body and body["ignore_eos"] is True

    records = result["records"]
    assert len(records) == 16 and all(tuple(r) == RECORD_FIELDS for r in records)
    for r in records:
        assert r["error"] is None
        assert r["cached_tokens"] is None  # not reported is not 0
        assert (r["prompt_tokens"], r["completion_tokens"]) == (12, 2)
        # the first content is written ROLE_TO_CONTENT_S after the request arrived (a causal
        # bound, not a timing guess); the role chunk, sent at once, must not count as TTFT
        assert r["ttft_s"] >= ROLE_TO_CONTENT_S
        assert r["first_chunk_s"] < r["ttft_s"]
    for row in result["summary"]:
        assert row["cached_tokens"] is None and row["token_hit_rate"] is None
        assert row["prompt_tokens_computed"] is None
        assert row["shareable_tokens"] > 0

    report = (tmp_path / "report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| http://127.0.0.1")]
    assert len(rows) == 4
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[9] == "not reported" and cells[10] == "not reported"  # computed, hit rate
        assert "0.0%" not in line
    assert "not reported" in capsys.readouterr().out


def test_report_redraws_from_the_json(fake_server, tmp_path):
    cli.main(["run", "--base-url", fake_server, "--workload", "no-sharing", "--requests", "2",
              "--instruction-tokens", "20", "--user-tokens", "5-10", "--max-tokens", "2",
              "--out-dir", str(tmp_path)])
    before = json.loads((tmp_path / "bench.json").read_text())
    for png in tmp_path.glob("*.png"):
        png.unlink()
    (tmp_path / "report.md").unlink()
    cli.main(["report", str(tmp_path / "bench.json")])
    assert json.loads((tmp_path / "bench.json").read_text()) == before
    assert "| not reported |" in (tmp_path / "report.md").read_text()
    assert len(list(tmp_path.glob("*.png"))) == 4
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in tmp_path.glob("*.png"))
