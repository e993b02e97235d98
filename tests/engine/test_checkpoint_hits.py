"""The engine's hit counts (what the cluster tier calls hot) and its local longest-checkpoint
query (what a replica compares with a stored copy before fetching), on the embedded model."""

from __future__ import annotations

from engine.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from tests.engine.conversations import render
from tests.engine.reuse_cases import SYSTEM, chat, run


def test_hits_are_counted_per_bundle_and_drained_apart_from_the_events():
    engine = LLMEngine(EngineConfig())
    engine.record_checkpoint_events()
    first = run(engine, "h1", chat(SYSTEM, "First question."), salt="hits")
    events = engine.drain_checkpoint_events()
    assert engine.drain_checkpoint_hits() == {}  # nothing restored yet
    instruction = next(e for e in events if e.kind == "instruction")
    run(engine, "h2", chat(SYSTEM, "Second question."), salt="hits")
    run(engine, "h3", chat(SYSTEM, "Third question."), salt="hits")
    assert engine.drain_checkpoint_hits() == {instruction.bundle_id: 2}
    assert engine.drain_checkpoint_hits() == {}
    assert all(e.action == "published" for e in engine.drain_checkpoint_events())
    assert first.boundary == len(instruction.token_ids)


def test_longest_checkpoint_reads_without_pinning_or_counting():
    engine = LLMEngine(EngineConfig())
    done = run(engine, "l1", chat(SYSTEM, "A question."), salt="longest")
    namespace = (engine.config.model_dir, "longest")
    other = render(engine.tokenizer, chat(SYSTEM, "Another one, longer."))
    before = engine.stats().checkpoints["instruction"].hit
    assert engine.longest_checkpoint(namespace, other) == done.boundary
    assert engine.longest_checkpoint(namespace, done.prompt) == len(done.prompt)
    assert engine.longest_checkpoint((engine.config.model_dir, "elsewhere"), other) == 0
    assert engine.longest_checkpoint(namespace, other[: done.boundary - 1]) == 0
    assert engine.stats().checkpoints["instruction"].hit == before
    assert engine.scheduler.cache.ledger.num_pins == 0
    assert engine.drain_checkpoint_hits() == {}
