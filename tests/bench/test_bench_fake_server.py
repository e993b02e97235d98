"""The benchmark against minimal OpenAI-compatible endpoints: plain HTTP servers in a thread.
FakeOpenAI streams a fixed SSE reply, with a role-only first chunk and usage without
prompt_tokens_details: the report must say "not reported" (never 0) and TTFT must be taken at
the first content chunk. PrefixCacheOpenAI is a perfect prefix cache over the embedded model's
token ids: the hit rates must be at most 100%, and exactly 100% on shared instructions, with
the tokenizer taken from the server's GET /v1/models. No Ray."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.engine_config import DEFAULT_MODEL_DIR
from hybrid_serve_bench import cli
from hybrid_serve_bench.accounting import TokenTrie
from hybrid_serve_bench.client import RECORD_FIELDS
from hybrid_serve_bench.tokens import TokenizerCounter

ROLE_TO_CONTENT_S = 0.2  # the server waits this long between the role chunk and the first content


class FakeOpenAI(BaseHTTPRequestHandler):
    bodies: list[dict] = []
    root: str | None = str(DEFAULT_MODEL_DIR)  # the model dir its GET /v1/models names

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        if self.path != "/v1/models":
            self.send_error(404)
            return
        card = {"id": "fake-model", "object": "model", **({"root": self.root} if self.root else {})}
        payload = json.dumps({"object": "list", "data": [card]})
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
        time.sleep(self.role_to_content_s)
        event(chunk({"content": "Hel"}))
        event(chunk({"content": "lo"}))
        event(chunk({}, "length"))
        event({"id": "x", "object": "chat.completion.chunk", "model": "fake-model", "choices": [],
               "usage": self.usage(body, "Hello")})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    role_to_content_s = ROLE_TO_CONTENT_S

    def usage(self, body: dict, reply: str) -> dict:
        return {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}


class PrefixCacheOpenAI(FakeOpenAI):
    """A perfect prefix cache: renders the prompt with the embedded model's tokenizer and chat
    template, reports the longest prefix any earlier request of its cache_salt computed (its
    prompt, or its prompt and reply but the reply's last token) as cached tokens."""

    role_to_content_s = 0.0
    counter = TokenizerCounter(str(DEFAULT_MODEL_DIR))
    caches: dict[str, TokenTrie] = {}
    lock = threading.Lock()

    def usage(self, body: dict, reply: str) -> dict:
        ids = self.counter.chat_ids(body["messages"], add_generation_prompt=True)
        output = self.counter._tokenizer.encode(reply, add_special_tokens=False)
        with self.lock:
            cache = self.caches.setdefault(body.get("cache_salt", ""), TokenTrie())
            cached = min(cache.longest_prefix(ids), len(ids) - 1)  # the last one is computed
            cache.insert(ids + tuple(output[:-1]))
        return {"prompt_tokens": len(ids), "completion_tokens": len(output),
                "total_tokens": len(ids) + len(output), "prompt_tokens_details": {"cached_tokens": cached}}


def _serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)  # a free port: xdist runs two
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def fake_server():
    server, url = _serve(FakeOpenAI)
    yield url
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def prefix_cache_server():
    server, url = _serve(PrefixCacheOpenAI)
    yield url
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
        assert r["render_s"] is None  # no Server-Timing header
        assert (r["prompt_tokens"], r["completion_tokens"]) == (12, 2)
        # the first content is written ROLE_TO_CONTENT_S after the request arrived (a causal
        # bound, not a timing guess); the role chunk, sent at once, must not count as TTFT
        assert r["ttft_s"] >= ROLE_TO_CONTENT_S
        assert r["first_chunk_s"] < r["ttft_s"]
    for row in result["summary"]:
        assert row["cached_tokens"] is None and row["token_hit_rate"] is None
        assert row["render_p50_ms"] is None
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


def test_hit_rates_count_the_served_models_tokens_and_stay_within_100(prefix_cache_server, tmp_path):
    """No --tokenizer: the bench counts with the model dir the server names. The old default,
    words x 1.3, is far from this tokenizer's count (its small vocabulary splits the words into
    ~2.5 tokens each), which printed rates near 200%; a perfect cache must read 100%."""
    cli.main(["run", "--base-url", prefix_cache_server, "--workload", "shared-instructions",
              "multi-turn", "agent-loop", "--systems", "2", "--instruction-tokens", "200",
              "--requests", "6", "--user-tokens", "10-20", "--conversations", "2", "--turns", "3",
              "--agents", "2", "--agent-turns", "3", "--developer-tokens", "150", "--max-tokens", "2",
              "--concurrency", "2", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["token_counter"] == f"tokenizer of {DEFAULT_MODEL_DIR.resolve()}"
    assert all(r["counted_prompt_tokens"] == r["prompt_tokens"] for r in result["records"])
    rates = {row["workload"]: row["token_hit_rate"] for row in result["summary"]}
    assert all(0 < rate <= 1.0 for rate in rates.values()), rates
    assert rates["shared-instructions"] == 1.0
    text = "System policy 0: always report the refund status before the audit"
    assert PrefixCacheOpenAI.counter.count(text) > 1.5 * 1.3 * len(text.split())  # why 1.3 was 2x off
    report = (tmp_path / "report.md").read_text()
    assert "100.0%" in report


def test_without_a_tokenizer_the_bench_refuses_rather_than_estimates(fake_server, tmp_path, monkeypatch):
    monkeypatch.setattr(FakeOpenAI, "root", "/nowhere/model")
    with pytest.raises(SystemExit, match=r"cannot count tokens for http://127.0.0.1:\d+: .*root: "
                                         r"/nowhere/model.*Pass --tokenizer DIR"):
        cli.main(["run", "--base-url", fake_server, "--workload", "no-sharing", "--requests", "1",
                  "--out-dir", str(tmp_path)])
    assert not (tmp_path / "bench.json").exists()


def test_report_refuses_to_redraw_a_hit_rate_above_100(prefix_cache_server, tmp_path):
    """A bench.json of the words x 1.3 days (198.8%) is not drawn again as it is."""
    cli.main(["run", "--base-url", prefix_cache_server, "--workload", "shared-instructions",
              "--systems", "1", "--instruction-tokens", "40", "--requests", "2", "--user-tokens", "5-10",
              "--max-tokens", "2", "--out-dir", str(tmp_path)])
    path = tmp_path / "bench.json"
    result = json.loads(path.read_text())
    result["summary"][0]["token_hit_rate"] = 1.988
    result["token_counter"] = "words x 1.3"
    path.write_text(json.dumps(result))
    with pytest.raises(SystemExit, match=r"198\.8%\): its shareable tokens were counted by words x 1\.3"):
        cli.main(["report", str(path)])


def test_without_cache_salts_a_later_pass_may_restore_what_an_earlier_one_sent(prefix_cache_server,
                                                                               tmp_path):
    """The second rate's pass sends the same prompts to the same cache: everything it restores
    was sent by the first pass, so it is shareable (one tracker per target for the run)."""
    cli.main(["run", "--base-url", prefix_cache_server, "--workload", "shared-instructions",
              "--systems", "1", "--instruction-tokens", "40", "--requests", "3", "--user-tokens", "5-10",
              "--max-tokens", "2", "--rate", "closed", "50", "--no-cache-salt", "--out-dir", str(tmp_path)])
    first, second = json.loads((tmp_path / "bench.json").read_text())["summary"]
    assert first["token_hit_rate"] == 1.0
    assert 0.95 < second["token_hit_rate"] <= 1.0  # the cache computes each prompt's last token
    assert second["shareable_tokens"] > first["shareable_tokens"]  # whole prompts, from pass one
