"""The engine's checkpoint event feed on the embedded model: what a request captures is
reported as published, what eviction takes as dropped, in order, through LLMEngine and
AsyncLLMEngine alike."""

from __future__ import annotations

import asyncio

from engine.core.async_engine import AsyncLLMEngine
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.core.llm_engine import LLMEngine
from tests.engine.conversations import render
from tests.engine.reuse_cases import GREEDY, SYSTEM, chat, run


def test_a_request_reports_its_published_checkpoints():
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=40))
    engine.record_checkpoint_events()
    done = run(engine, "e1", chat(SYSTEM, "Tell me about the river."), salt="events")
    events = engine.drain_checkpoint_events()
    assert [e.action for e in events] == ["published"] * 3
    by_kind = {e.kind: e for e in events}
    assert set(by_kind) == {"instruction", "prompt", "response"}
    instruction = by_kind["instruction"]
    assert instruction.token_ids == tuple(done.prompt[: done.boundary])
    assert instruction.namespace == (engine.config.model_dir, "events")
    assert by_kind["prompt"].token_ids == tuple(done.prompt)
    ledger = engine.scheduler.cache.ledger
    for event in events:
        bundle = ledger.get(event.bundle_id)
        assert bundle.token_ids == event.token_ids and bundle.num_bytes == event.num_bytes > 0
    assert engine.drain_checkpoint_events() == []
    # A repeat of the request restores and captures nothing new: no event.
    run(engine, "e2", chat(SYSTEM, "Tell me about the river."), salt="events")
    assert engine.drain_checkpoint_events() == []


def test_an_engine_nobody_reports_for_records_nothing():
    engine = LLMEngine(EngineConfig())
    run(engine, "n1", chat(SYSTEM, "First question."), salt="quiet")
    run(engine, "n2", chat(SYSTEM, "Second question."), salt="quiet")  # restores: a hit
    assert engine.stats().num_checkpoints > 0
    assert engine.drain_checkpoint_events() == [] and engine.drain_checkpoint_hits() == {}
    engine.record_checkpoint_events()
    run(engine, "n3", chat(SYSTEM, "Third question."), salt="quiet")
    assert engine.drain_checkpoint_hits() and engine.drain_checkpoint_events()


def test_eviction_reports_the_dropped_bundles():
    probe = LLMEngine(EngineConfig())
    per_bundle = probe.executor.model.state_bytes_per_slot() + 16 * 1024
    engine = LLMEngine(EngineConfig(checkpoint_cache_bytes=3 * per_bundle))
    engine.record_checkpoint_events()
    for i in range(4):
        run(engine, f"v{i}", chat(SYSTEM + str(i), f"question {i}"), "evict")
    events = engine.drain_checkpoint_events()
    published = [e.bundle_id for e in events if e.action == "published"]
    dropped = [e.bundle_id for e in events if e.action == "dropped"]
    assert dropped and set(dropped) <= set(published)
    for bundle_id in dropped:  # reported after it was published
        actions = [e.action for e in events if e.bundle_id == bundle_id]
        assert actions == ["published", "dropped"]
    held = set(published) - set(dropped)
    ledger = engine.scheduler.cache.ledger
    assert {b for b in held if ledger.get(b) is not None} == held
    assert len(held) == engine.stats().num_checkpoints
    assert engine.stats().checkpoint_events_lost == 0


def test_the_async_engine_drains_between_steps():
    async def scenario() -> tuple[list, list]:
        engine = AsyncLLMEngine(LLMEngine(EngineConfig()))
        engine.engine.record_checkpoint_events()
        try:
            prompt = render(engine.engine.tokenizer, chat(SYSTEM, "Async?"))
            request = GenerationRequest("a1", prompt, GREEDY, cache_salt="async")
            async for _ in engine.generate(request):
                pass
            # the response checkpoint is taken by a step after the request's last output
            events = []
            for _ in range(200):
                events += await engine.drain_checkpoint_events()
                if len(events) >= 2 and not engine.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            return events, await engine.drain_checkpoint_events()
        finally:
            engine.shutdown()

    events, after = asyncio.run(scenario())
    assert sorted(e.kind for e in events) == ["prompt", "response"]  # no boundary given
    assert all(e.action == "published" and e.namespace[1] == "async" for e in events)
    assert after == []
