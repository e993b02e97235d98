"""The benchmark's pure parts: workloads from a seed, shareable-token accounting, percentiles and
summary rows, usage parsing. No server, no Ray."""

from __future__ import annotations

import pytest

from hybrid_serve_bench.accounting import ShareableTracker
from hybrid_serve_bench.client import cached_tokens_of, server_render_s, sse_data
from hybrid_serve_bench.stats import SUMMARY_FIELDS, RestoredBeyondShareable, percentile, summarize_pass
from hybrid_serve_bench.workloads import WORKLOAD_KINDS, Sizes, build_workloads, make_text

from tests.bench.word_tokenizer import WordTokenizer

COUNTER = WordTokenizer()  # one token a word: sizes are checkable by hand
SMALL = Sizes(seed=3, systems=2, instruction_tokens=60, requests=6, user_tokens=(10, 20),
              conversations=2, turns=3, turn_user_tokens=(5, 10), agents=2, agent_turns=3,
              developer_tokens=150, tool_result_tokens=(5, 10), examples=2, example_tokens=10,
              documents=2, document_tokens=40)


def test_workloads_are_a_function_of_the_seed():
    first = build_workloads(list(WORKLOAD_KINDS), SMALL, COUNTER)
    again = build_workloads(list(WORKLOAD_KINDS), SMALL, COUNTER)
    other = build_workloads(list(WORKLOAD_KINDS), Sizes(**{**SMALL.__dict__, "seed": 4}), COUNTER)
    assert first == again
    for a, b in zip(first, other):
        assert a.conversations != b.conversations, a.name


def test_workload_shapes_follow_the_sizes():
    by = {w.name: w for w in build_workloads(list(WORKLOAD_KINDS), SMALL, COUNTER)}
    shared = by["shared-instructions"]
    assert shared.num_requests == 6
    systems = [c.turns[0].new_messages[0]["content"] for c in shared.conversations]
    assert len(set(systems)) == 2 and systems[0] == systems[2] == systems[4]
    assert all(COUNTER.count(s) <= 60 for s in systems)
    users = [c.turns[0].new_messages[1]["content"] for c in shared.conversations]
    assert len(set(users)) == 6 and all(COUNTER.count(u) <= 20 for u in users)
    multi = by["multi-turn"]
    assert [len(c.turns) for c in multi.conversations] == [3, 3]
    assert all(t.keep_reply for c in multi.conversations for t in c.turns)
    agent = by["agent-loop"]
    developer = agent.conversations[0].turns[0].new_messages[0]
    assert developer["role"] == "developer" and "search_orders" in developer["content"]
    assert agent.conversations[1].turns[0].new_messages[0] == developer
    assert [m["role"] for m in agent.conversations[0].turns[1].new_messages] == ["assistant", "user"]
    few = by["few-shot"]
    heads = {tuple(m["content"] for m in c.turns[0].new_messages[:-1]) for c in few.conversations}
    assert len(heads) == 1 and len(next(iter(heads))) == 1 + 2 * 2
    lone = by["no-sharing"]
    assert len({c.turns[0].new_messages[0]["content"] for c in lone.conversations}) == 6


def test_marked_workloads_are_their_unmarked_twins_with_cache_control_markers():
    by = {w.name: w for w in build_workloads(list(WORKLOAD_KINDS), SMALL, COUNTER)}
    mark = {"type": "ephemeral"}
    for name, marked_at in (("few-shot", (-2, None)), ("document-qa", (-1, 0))):
        plain, marked = by[name], by[f"{name}-marked"]
        assert marked.kind == f"{name}-marked" and marked.num_requests == plain.num_requests
        for p, m in zip(plain.conversations, marked.conversations):
            sent_plain, sent_marked = p.turns[0].new_messages, m.turns[0].new_messages
            message, part = marked_at
            target = sent_marked[message] if part is None else sent_marked[message]["content"][part]
            assert target["cache_control"] == mark
            unmarked = [{k: v for k, v in msg.items() if k != "cache_control"} for msg in sent_marked]
            if part is not None:
                unmarked[message] = {**unmarked[message], "content": [
                    {k: v for k, v in q.items() if k != "cache_control"} for q in unmarked[message]["content"]]}
            assert unmarked == list(sent_plain)
            assert "cache_control" not in str(sent_plain)
    documents = [c.turns[0].new_messages[1]["content"][0]["text"] for c in by["document-qa"].conversations]
    assert len(set(documents)) == 2 and documents[0] == documents[2] != documents[1]
    assert all(38 <= COUNTER.count(d) <= 40 for d in documents)


def test_shareable_document_qa_counts_the_document_after_its_first_use():
    workload = build_workloads(["document-qa-marked"], SMALL, COUNTER)[0]
    shareable = _shareable_of(workload, ShareableTracker(COUNTER))
    documents = [c.turns[0].new_messages[1]["content"][0]["text"] for c in workload.conversations]
    system = workload.conversations[0].turns[0].new_messages[0]["content"]
    # the first of each document shares the system message, the user role and "Document"; later
    # ones also the document and the "Question" word every question opens with
    opening = COUNTER.count(system) + 2 + 1
    assert shareable[:2] == [0, opening + 1]
    assert shareable[2:] == [opening + COUNTER.count(d) + 1 for d in documents[2:]]


def test_the_tokenizer_counter_renders_the_messages_without_their_markers():
    from engine.engine_config import DEFAULT_MODEL_DIR
    from hybrid_serve_bench.tokens import TokenizerCounter

    counter = TokenizerCounter(str(DEFAULT_MODEL_DIR))
    workloads = {w.name: w for w in build_workloads(["document-qa", "document-qa-marked"], SMALL, counter)}
    plain = list(workloads["document-qa"].conversations[0].turns[0].new_messages)
    marked = list(workloads["document-qa-marked"].conversations[0].turns[0].new_messages)
    assert plain != marked
    assert counter.chat_ids(marked, True) == counter.chat_ids(plain, True)


def test_instruction_length_sweep_names_each_length():
    names = [w.name for w in build_workloads(["shared-instructions"], SMALL, COUNTER, [30, 60])]
    assert names == ["shared-instructions@30", "shared-instructions@60"]


def test_make_text_fits_the_token_count():
    import random

    for n in (1, 7, 100, 500):
        text = make_text(random.Random(n), n, COUNTER, "Lead:")
        assert n - 1 <= COUNTER.count(text) <= n
        assert text.startswith("Lead:")


def _shareable_of(workload, tracker):
    """Each single-turn request's shareable tokens, sent one after the other."""
    shareable = []
    for conversation in workload.conversations:
        ids = tracker.prompt_ids(list(conversation.turns[0].new_messages))
        shareable.append(tracker.shareable_tokens(ids))
        tracker.record_sent(ids)
    return shareable


def test_shareable_shared_instructions_counts_the_system_prompt_after_its_first_use():
    workload = build_workloads(["shared-instructions"], SMALL, COUNTER)[0]
    shareable = _shareable_of(workload, ShareableTracker(COUNTER))
    systems = [c.turns[0].new_messages[0]["content"] for c in workload.conversations]
    # the first request shares nothing, the first of the second system prompt its opening
    # (role, "System policy"); every later one its system message (role, words, end), the
    # user role token and "Question" (user messages are "Question {i}: ...")
    assert shareable[:2] == [0, 3]
    assert shareable[2:] == [COUNTER.count(s) + 2 + 2 for s in systems[2:]]


def test_shareable_multi_turn_includes_the_reply_it_resends():
    tracker = ShareableTracker(COUNTER)
    turn1 = [{"role": "user", "content": "a b c"}]
    ids1 = tracker.prompt_ids(turn1)
    assert tracker.shareable_tokens(ids1) == 0
    tracker.record_sent(ids1)
    tracker.record_reply(turn1, "x y")
    turn2 = [*turn1, {"role": "assistant", "content": "x y"}, {"role": "user", "content": "d"}]
    # user a b c END, assistant x y END, then the next user role token matches nothing
    assert tracker.shareable_tokens(tracker.prompt_ids(turn2)) == (3 + 2) + (2 + 2)
    other_reply = [*turn1, {"role": "assistant", "content": "x z"}, {"role": "user", "content": "d"}]
    assert tracker.shareable_tokens(tracker.prompt_ids(other_reply)) == (3 + 2) + 2  # up to "x"


def test_shareable_no_sharing_is_only_the_common_opening():
    workload = build_workloads(["no-sharing"], SMALL, COUNTER)[0]
    shareable = _shareable_of(workload, ShareableTracker(COUNTER))
    assert shareable == [0] + [3] * (len(shareable) - 1)  # role, "Unique policy"; then {i}: differs


def test_shareable_sums_do_not_depend_on_the_order_requests_arrive_in():
    """Which of two requests that share a prefix restores it depends on arrival order; the
    pass's sum does not (accounting.py), so restored <= shareable holds for the sums."""
    import itertools
    from dataclasses import replace

    workload = build_workloads(["shared-instructions"], SMALL, COUNTER)[0]
    orders = itertools.islice(itertools.permutations(workload.conversations), 0, 720, 37)
    totals = {sum(_shareable_of(replace(workload, conversations=order), ShareableTracker(COUNTER)))
              for order in orders}
    assert len(totals) == 1


def test_percentile_is_nearest_rank():
    values = list(range(100, 0, -1))  # 1..100, unsorted
    assert percentile(values, 50) == 50
    assert percentile(values, 95) == 95
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile([1, 2, 3, 4], 51) == 3
    assert percentile([7.5], 99) == 7.5
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 0)


def _record(ttft, prompt=100, cached=None, shareable=0, completion=4, error=None, render=None):
    return {"ttft_s": ttft, "itl_s": 0.01, "e2e_s": (ttft or 0) + 0.05, "render_s": render,
            "prompt_tokens": prompt, "counted_prompt_tokens": prompt, "cached_tokens": cached,
            "shareable_tokens": shareable, "completion_tokens": completion,
            "error": error}


def test_render_time_is_the_median_of_what_was_reported():
    rows = [summarize_pass("t", "w", None, records, 1.0, 150) for records in (
        [_record(0.1, render=0.004), _record(0.1, render=0.002), _record(0.1), _record(0.1, render=0.003)],
        [_record(0.1), _record(0.1)],
        [_record(0.1, render=0.001, error="boom"), _record(0.1, render=0.005)])]
    assert [row["render_p50_ms"] for row in rows] == [pytest.approx(3.0), None, pytest.approx(5.0)]


def test_server_timing_parsing():
    from deployments.http.streaming import server_timing

    assert server_render_s(server_timing(0.00123)["Server-Timing"]) == pytest.approx(0.00123)
    assert server_timing(None) == {}
    assert server_render_s('db;dur=3, render;desc="x";dur=2.5') == pytest.approx(0.0025)
    for header in (None, "", "render", "render;desc=x", "render;dur=abc", "db;dur=3"):
        assert server_render_s(header) is None, header


def test_summary_row_keeps_not_reported_apart_from_zero():
    row = summarize_pass("t", "w", None, [_record(0.1, shareable=50), _record(0.2, shareable=50)],
                         wall_s=2.0, target_ttft_ms=150)
    assert tuple(row) == SUMMARY_FIELDS
    assert row["cached_tokens"] is None and row["prompt_tokens_computed"] is None
    assert row["token_hit_rate"] is None
    zero = summarize_pass("t", "w", None, [_record(0.1, cached=0, shareable=50)], 1.0, 150)
    assert zero["cached_tokens"] == 0 and zero["token_hit_rate"] == 0.0
    assert zero["prompt_tokens_computed"] == 100


def test_a_pass_that_restores_more_than_was_shareable_is_refused_not_reported_above_100():
    # what words x 1.3 did with the tiny model's tokenizer (~2.5 tokens a word): 198.8%
    records = [_record(0.1, cached=994, shareable=500), _record(0.1, cached=0, shareable=0)]
    with pytest.raises(RestoredBeyondShareable, match="994 cached tokens but only 500"):
        summarize_pass("t", "w", None, records, wall_s=1.0, target_ttft_ms=150)
    records[0]["counted_prompt_tokens"] = 40  # the server counted 100: another tokenizer
    with pytest.raises(RestoredBeyondShareable, match="server 100 tokens, the bench's tokenizer 40"):
        summarize_pass("t", "w", None, records, wall_s=1.0, target_ttft_ms=150)
    row = summarize_pass("t", "w", None, [_record(0.1, cached=500, shareable=500)], 1.0, 150)
    assert row["token_hit_rate"] == 1.0


def test_summary_row_math():
    records = [_record(0.1, cached=40, shareable=50), _record(0.3, cached=50, shareable=50),
               _record(None, prompt=None, error="HTTP 500")]
    row = summarize_pass("t", "w", 2.0, records, wall_s=4.0, target_ttft_ms=200)
    assert (row["requests"], row["errors"]) == (3, 1)
    assert row["ttft_p50_ms"] == pytest.approx(100) and row["ttft_p99_ms"] == pytest.approx(300)
    assert row["prompt_tokens"] == 200 and row["cached_tokens"] == 90
    assert row["prompt_tokens_computed"] == 110
    assert row["token_hit_rate"] == pytest.approx(0.9)
    assert row["output_tok_s"] == pytest.approx(8 / 4.0)
    assert row["requests_s"] == pytest.approx(0.5)
    assert row["goodput_rps"] == pytest.approx(0.25)  # one of two under 200 ms


def test_usage_parsing():
    assert cached_tokens_of(None) is None
    assert cached_tokens_of({"prompt_tokens": 5}) is None
    assert cached_tokens_of({"prompt_tokens_details": None}) is None
    assert cached_tokens_of({"prompt_tokens_details": {}}) is None
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": 0}}) == 0
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": 17}}) == 17
    assert sse_data('data: {"a": 1}') == '{"a": 1}'
    assert sse_data('data:{"a": 1}') == '{"a": 1}'
    assert sse_data(": keep-alive") is None and sse_data("event: x") is None
