"""The host tier in the engine (docs/design.md section 5, Tiers): a checkpoint evicted from the
device budget is demoted to host memory; a later request that needs it waits in the scheduler
while it is promoted back (the checkpoint-source admission path), restores the same state bytes
(the shards' checksums before eviction and after promotion are equal), and produces what the
same request computes from scratch."""

from __future__ import annotations

import pytest

from deployments.prompts.instruction_boundary import find_instruction_boundary
from engine.core.llm_engine import LLMEngine
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.request import RequestStatus
from tests.engine.conversations import render
from tests.engine.reuse_cases import GREEDY, SYSTEM, chat, run
from tests.engine.test_checkpoint_transfer import assert_exact

FIRST = chat(SYSTEM, "Tell me about the river.")
SECOND = chat(SYSTEM, "And the mountain, briefly please?")
OTHER = chat("You count sheep, slowly, one by one, and never skip a sheep. " * 3, "How many tonight?")


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
