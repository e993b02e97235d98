"""The in-process target (hybrid_serve_bench/engine_target.py): the embedded tiny model's engine
driven by the runner with no Ray and no HTTP, and the TTFT rule on a scripted engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from engine.engine_config import EngineConfig
from engine.core.output_processor import RequestOutput
from hybrid_serve_bench.client import RECORD_FIELDS, ChatRequest
from hybrid_serve_bench.engine_target import EngineChat, engine_targets, warm_up
from hybrid_serve_bench.runner import RunSettings, run_workloads
from hybrid_serve_bench.tokens import TokenizerCounter
from hybrid_serve_bench.workloads import Sizes, build_workloads

SMALL = Sizes(seed=1, systems=1, instruction_tokens=120, requests=3, user_tokens=(10, 20),
              conversations=1, turns=2, agents=1, agent_turns=2, developer_tokens=50, examples=1)


def test_engine_target_records_match_the_http_clients_and_report_cached_tokens():
    config = EngineConfig(max_model_len=1024)
    counter = TokenizerCounter(config.model_dir)
    workloads = build_workloads(["shared-instructions"], SMALL, counter)
    slots = [(), ("prompt", "response", "instruction")]
    with engine_targets(slots, config) as (targets, configs):
        assert [c["checkpoint_slots"] for c in configs] == slots
        asyncio.run(warm_up(targets, [workloads[0].conversations[0].turns[0].new_messages]))
        records, passes = asyncio.run(run_workloads(
            targets, workloads, [None], RunSettings(concurrency=1, max_tokens=3, rounds=1,
                                                    cache_salt="t"), counter))
        assert all(len(t.chat.render_s) == 4 for t in targets)  # warm-up + 3 requests
        rendered = sorted(s for t in targets for s in t.chat.render_s[1:])
    assert sorted(r["render_s"] for r in records) == rendered  # each record's own render time
    assert len(records) == 6 and all(tuple(r) == RECORD_FIELDS for r in records)
    assert all(r["error"] is None and r["completion_tokens"] == 3 for r in records)
    assert all(0 <= r["first_chunk_s"] <= r["ttft_s"] <= r["e2e_s"] for r in records)
    by = {label: [r for r in records if r["target"] == label]
          for label in ("[]", "[prompt, response, instruction]")}
    assert [r["cached_tokens"] for r in by["[]"]] == [0, 0, 0]
    # the instruction checkpoint (at the boundary, >= the 120 instruction tokens) is restored
    # by the second and third requests; the warm-up's salt kept its checkpoints apart
    cached = [r["cached_tokens"] for r in by["[prompt, response, instruction]"]]
    assert cached[0] == 0 and all(c >= 120 for c in cached[1:])
    first = records[0]["conversation"]
    assert all(r["shareable_tokens"] >= 120 for r in records if r["conversation"] != first)


@dataclass
class _ScriptedEngine:
    """An AsyncLLMEngine stand-in: yields `texts` as outputs, one every `gap_s`."""

    tokenizer: object
    texts: tuple[str, ...]
    gap_s: float = 0.03

    @property
    def engine(self):
        return self

    async def generate(self, request):
        for i, text in enumerate(self.texts):
            if i:
                await asyncio.sleep(self.gap_s)
            last = i == len(self.texts) - 1
            yield RequestOutput(request.request_id, (5,), text, last, "length" if last else None,
                                len(request.prompt_token_ids), i + 1, num_cached_tokens=7)


@pytest.mark.parametrize("at_first_token", [False, True])
def test_ttft_is_the_first_output_with_text_unless_asked_for_the_first_token(at_first_token):
    tokenizer = TokenizerCounter(EngineConfig().model_dir)._tokenizer
    chat = EngineChat(_ScriptedEngine(tokenizer, ("", "", "hi", " there")), at_first_token)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    result = asyncio.run(chat(ChatRequest("m", messages, 4)))
    assert result.error is None and result.reply == "hi there"
    assert result.cached_tokens == 7 and result.completion_tokens == 4
    if at_first_token:
        assert result.ttft_s == result.first_chunk_s
    else:
        assert result.ttft_s >= result.first_chunk_s + 0.05  # two gaps after the first output
    empty = asyncio.run(EngineChat(_ScriptedEngine(tokenizer, ("", "")), at_first_token)(
        ChatRequest("m", messages, 2)))
    assert (empty.error is None) == at_first_token  # no text at all: an error, as over HTTP
