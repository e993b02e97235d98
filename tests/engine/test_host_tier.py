"""The host tier in the engine (docs/design.md section 5, Tiers): a checkpoint evicted from the
device budget is demoted to host memory; a later request that needs it waits in the scheduler
while it is promoted back (the checkpoint-source admission path), restores the same state bytes
(the shards' checksums before eviction and after promotion are equal), and produces what the
same request computes from scratch. A checkpoint the host tier evicts in turn goes to its
on_evict (the object-store tier's hand-off; tests/cluster_checkpoints/test_tier_demotion.py runs
the real one), and a copy of it imported with every check restores exactly too. The host tier's
counters reach the metrics exporter as they are."""

from __future__ import annotations

import pickle

import pytest
from transformers import AutoTokenizer

from deployments.engine_metrics import EngineMetricsExporter
from deployments.metrics import (
    HOST_TIER_BYTES, HOST_TIER_CHECKPOINTS, HOST_TIER_EVENT_BYTES, HOST_TIER_EVENT_NAMES,
    HOST_TIER_EVENTS,
)
from deployments.prompts.instruction_boundary import find_instruction_boundary
from engine.checkpoints.host_tier import with_checksums
from engine.checkpoints.import_checks import expected_shard_layout
from engine.core.llm_engine import LLMEngine
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.request import RequestStatus
from engine.models.registry import load_model_config
from engine.parallel.tensor_parallel import TensorParallel
from tests.engine.conversations import render
from tests.engine.reuse_cases import GREEDY, SYSTEM, chat, run
from tests.engine.test_checkpoint_transfer import assert_exact
from tests.unit.recording_metrics import RecordingMetrics

FIRST = chat(SYSTEM, "Tell me about the river.")
SECOND = chat(SYSTEM, "And the mountain, briefly please?")
OTHER = chat("You count sheep, slowly, one by one, and never skip a sheep. " * 3, "How many tonight?")
THIRD = chat("You name the colours of the sea at dawn, at noon and at night, in order. " * 3, "Now?")


def one_checkpoint_host_bytes(*conversations) -> int:
    """A host budget that holds the largest of the conversations' instruction checkpoints (the
    K/V of all their tokens), never two."""
    config = EngineConfig()
    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    layout = expected_shard_layout(load_model_config(config.model_dir), TensorParallel.single(), config.dtype)
    return max(layout.nbytes(find_instruction_boundary(tokenizer, c, render(tokenizer, c)).position)
               for c in conversations)


def one_bundle_engine(**changes) -> LLMEngine:
    """Instruction checkpoints only, a device budget of one bundle, LRU, a host tier."""
    probe = LLMEngine(EngineConfig())
    sizing = probe.executor.cache_capacity().bundle_sizing
    config = dict(max_num_batched_tokens=40, max_num_seqs=8, checkpoint_slots=("instruction",),
                  checkpoint_cache_bytes=sizing.bundle_bytes(probe.config.block_size - 1),
                  checkpoint_eviction="lru", host_checkpoint_bytes=16 << 20)
    return LLMEngine(EngineConfig(**{**config, **changes}))


def test_an_evicted_checkpoint_comes_back_from_the_host_tier_with_the_same_bytes():
    engine = one_bundle_engine()
    namespace = (engine.config.model_dir, "tiers")
    first = run(engine, "first", FIRST, "tiers")
    instructions = first.prompt[: first.boundary]
    before = engine.export_checkpoint(namespace, instructions)
    assert before is not None

    run(engine, "other", OTHER, "tiers")  # its instruction checkpoint takes the one device slot
    stats = engine.stats()
    assert stats.checkpoints["instruction"].evicted == 1
    assert stats.host_tier.demoted == 1 and engine.host_tier.holds(namespace, tuple(instructions))
    assert engine.longest_checkpoint(namespace, instructions) == 0  # no longer on the device

    served = run(engine, "second", SECOND, "tiers")
    stats = engine.stats()
    assert served.cached == first.boundary  # restored from the promoted checkpoint
    assert stats.host_tier.promoted == 1 and stats.scheduler.fetches_restored == 1
    assert stats.host_tier.demoted == 2  # OTHER's made room for it
    after = engine.export_checkpoint(namespace, instructions)
    assert [shard.checksum for shard in after.shards] == [shard.checksum for shard in before.shards]
    scratch = run(engine, "scratch", SECOND, "tiers-scratch")  # its own instructions evict FIRST's again
    assert scratch.cached == 0
    assert_exact(served, scratch, "promoted from the host tier")
    stats = engine.stats()  # the tier is inclusive: evicting the promoted checkpoint copied nothing
    assert stats.host_tier.already_held == 1 and stats.host_tier.demoted == 2
    assert engine.pool_usage().idle
    assert_exported_host_tier(engine)


def assert_exported_host_tier(engine: LLMEngine) -> None:
    """What EngineMetricsExporter exports of the host tier equals its counters (the Prometheus
    series of deployments/metrics.py; tests/unit/test_host_tier_metrics_export.py has the rest)."""
    recorded = RecordingMetrics()
    EngineMetricsExporter(engine, create=recorded).export()
    host, stats = engine.host_tier, engine.stats()
    events = {dict(tags)["event"]: total for tags, total in recorded.series(HOST_TIER_EVENTS).items()}
    assert events == {"demoted": 2, "already_held": 1, "promoted": 1}
    assert events == {name: getattr(stats.host_tier, name) for name in HOST_TIER_EVENT_NAMES
                      if getattr(stats.host_tier, name)}
    assert recorded.series(HOST_TIER_EVENT_BYTES) == {
        (("event", "demoted"),): stats.host_tier.demoted_bytes, (("event", "promoted"),): stats.host_tier.promoted_bytes}
    assert recorded.series(HOST_TIER_BYTES) == {(): host.bytes_held} and host.bytes_held > 0
    assert recorded.series(HOST_TIER_CHECKPOINTS) == {(): 2}


def test_a_checkpoint_evicted_from_the_host_too_is_passed_on_and_restores_exactly_from_a_stored_copy():
    """Device budget one bundle, host budget one bundle: FIRST's instructions go device -> host
    -> on_evict (the object-store tier's hand-off; here a stand-in that pickles the copy, as
    the object store does). Imported back with every check (checksums included, as any copy
    from another process), the next request restores it and answers as from scratch."""
    engine = one_bundle_engine(host_checkpoint_bytes=one_checkpoint_host_bytes(FIRST, OTHER, THIRD))
    stored: list[bytes] = []
    engine.host_tier.on_evict = lambda evicted: stored.append(
        pickle.dumps((evicted.bundle_id, with_checksums(evicted.exported))))
    namespace = (engine.config.model_dir, "below")
    first = run(engine, "first", FIRST, "below")
    instructions = tuple(first.prompt[: first.boundary])
    before = engine.export_checkpoint(namespace, instructions)
    first_bundle = engine.scheduler.cache.ledger.published_at(namespace, instructions).bundle_id
    run(engine, "other", OTHER, "below")  # FIRST's: device -> host
    assert engine.host_tier.holds(namespace, instructions) and stored == []
    run(engine, "third", THIRD, "below")  # OTHER's: device -> host, FIRST's: host -> on_evict
    assert not engine.host_tier.holds(namespace, instructions)
    assert engine.longest_checkpoint(namespace, instructions) == 0
    (copy,) = stored
    bundle_id, passed_on = pickle.loads(copy)
    assert bundle_id == first_bundle and passed_on.header.token_ids == instructions
    assert [s.checksum for s in passed_on.shards] == [s.checksum for s in before.shards]
    stats = engine.stats().host_tier
    assert (stats.demoted, stats.evicted, stats.passed_on) == (2, 1, 1)

    result = engine.import_checkpoint(passed_on)  # checked in full: not `verified`
    assert result.accepted and engine.stats().transfers.imported == 1
    served = run(engine, "second", SECOND, "below")
    assert served.cached == first.boundary
    scratch = run(engine, "scratch", SECOND, "below-scratch")
    assert scratch.cached == 0
    assert_exact(served, scratch, "passed on from the host tier, then imported")
    assert engine.pool_usage().idle


def test_the_request_waits_in_the_scheduler_while_it_is_promoted():
    engine = one_bundle_engine()
    run(engine, "first", FIRST, "wait")
    run(engine, "other", OTHER, "wait")
    prompt = render(engine.tokenizer, SECOND)
    boundary = find_instruction_boundary(engine.tokenizer, SECOND, prompt).position
    engine.add_request(GenerationRequest("second", prompt, GREEDY, cache_salt="wait", instruction_boundary=boundary))
    engine.step()  # asked at its first admission, the host tier started the promotion
    request = engine.scheduler.requests["second"]
    assert request.status is RequestStatus.FETCHING and engine.scheduler.stats.fetches_started == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert request.num_cached_tokens == boundary


def test_a_checkpoint_the_host_tier_does_not_keep_is_simply_gone():
    engine = one_bundle_engine(host_checkpoint_bytes=1024)  # smaller than any checkpoint
    run(engine, "first", FIRST, "small")
    run(engine, "other", OTHER, "small")
    stats = engine.stats()
    assert stats.host_tier.refused == 1 and stats.host_tier.demoted == 0
    assert run(engine, "second", SECOND, "small").cached == 0


def test_the_host_tier_is_off_unless_configured():
    assert EngineConfig().host_checkpoint_bytes == 0
    assert LLMEngine(EngineConfig()).host_tier is None
    assert LLMEngine(EngineConfig(host_checkpoint_bytes=1 << 20, checkpoint_slots=())).host_tier is None
    with pytest.raises(ValueError, match="host_checkpoint_bytes > 0 needs tensor_parallel_size 1"):
        EngineConfig(host_checkpoint_bytes=1 << 20, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="host_checkpoint_bytes"):
        EngineConfig(host_checkpoint_bytes=-1)
