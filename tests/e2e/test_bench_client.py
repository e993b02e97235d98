"""hybrid-serve-bench's client against the running app (the session's Serve app, all four
checkpoint slots): cached_tokens parsed from the streamed usage, TTFT at the first content
chunk, the result JSON's schema, and the report's plots. Small sizes: the e2e app's context is
512 tokens."""

from __future__ import annotations

import json

from hybrid_serve_bench import cli
from hybrid_serve_bench.client import RECORD_FIELDS
from hybrid_serve_bench.report import RESULT_FIELDS
from hybrid_serve_bench.stats import SUMMARY_FIELDS
from hybrid_serve_bench.tokens import TokenizerCounter
from hybrid_serve_bench.workloads import Sizes, build_workloads

from tests.e2e.conftest import BASE_URL, E2E_CONFIG, MODEL_NAME

TARGET_FIELDS = ("label", "base_url", "model", "server_models")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SIZES = Sizes(systems=2, instruction_tokens=120, requests=6, user_tokens=(20, 40))  # as below


def test_bench_client_against_the_app(serve_app, tmp_path):
    cli.main(["run", "--base-url", BASE_URL, "--workload", "shared-instructions", "multi-turn",
              "--systems", "2",
              "--instruction-tokens", "120", "--requests", "6", "--user-tokens", "20-40",
              "--conversations", "1", "--turns", "3", "--max-tokens", "4", "--concurrency", "1",
              "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())

    # the schema: exact key sets at every level
    assert tuple(result) == RESULT_FIELDS
    assert result["mode"] == "run" and result["command"].startswith("hybrid-serve-bench run ")
    assert [tuple(t) for t in result["targets"]] == [TARGET_FIELDS]
    assert result["targets"][0]["model"] == MODEL_NAME  # taken from GET /v1/models
    assert result["targets"][0]["server_models"]["data"][0]["id"] == MODEL_NAME
    assert all(tuple(r) == RECORD_FIELDS for r in result["records"])
    assert [tuple(row) for row in result["summary"]] == [SUMMARY_FIELDS] * 2

    records = {w: [r for r in result["records"] if r["workload"] == w]
               for w in ("shared-instructions", "multi-turn")}
    assert len(records["shared-instructions"]) == 6 and len(records["multi-turn"]) == 3
    for r in result["records"]:
        assert r["error"] is None
        assert isinstance(r["cached_tokens"], int)  # parsed from the streamed usage
        assert r["first_chunk_s"] <= r["ttft_s"] <= r["e2e_s"]
        assert 0 < r["render_s"] < r["ttft_s"]  # the server's Server-Timing header
        assert r["completion_tokens"] == 4

    # one at a time, so each system prompt's instruction checkpoint exists before its reuse:
    # the first request of each restores nothing, every later one exactly its system prompt
    # (the chat template's rendering of the system message alone); shareable is the longest
    # token prefix an earlier prompt had: the system prompt, then the template tokens that
    # open the user message and its first word ("Question"), which no checkpoint ends at
    counter = TokenizerCounter(E2E_CONFIG.engine.model_dir)
    shared = records["shared-instructions"]
    assert all(r["counted_prompt_tokens"] == r["prompt_tokens"] for r in result["records"])
    assert [r["cached_tokens"] for r in shared[:2]] == [0, 0]
    workload = build_workloads(["shared-instructions"], SIZES, counter)[0]
    conversations = {c.key: c for c in workload.conversations}
    for r in shared[2:]:
        system = conversations[r["conversation"]].turns[0].new_messages[:1]
        assert r["cached_tokens"] == len(counter.chat_ids(list(system), add_generation_prompt=False))
        assert r["cached_tokens"] < r["shareable_tokens"] <= r["cached_tokens"] + 8
    row = next(row for row in result["summary"] if row["workload"] == "shared-instructions")
    assert 0.9 < row["token_hit_rate"] < 1.0
    assert row["prompt_tokens_computed"] == row["prompt_tokens"] - row["cached_tokens"]

    # multi-turn resends the history: later turns restore at least the previous prompt
    turns = records["multi-turn"]
    assert turns[0]["cached_tokens"] == 0
    assert all(0 < t["cached_tokens"] <= t["prompt_tokens"] for t in turns[1:])

    for name in ("ttft_by_workload.png", "hit_rate_by_policy.png",
                 "ttft_vs_instruction_length.png", "ttft_vs_rate.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, name
    report = (tmp_path / "report.md").read_text()
    assert f"{100 * row['token_hit_rate']:.1f}%" in report and "ttft_by_workload.png" in report
