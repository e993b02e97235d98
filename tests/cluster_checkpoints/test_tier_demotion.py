"""Device -> host -> object store, and back: one engine (tp=1, device and host budgets of one
instruction checkpoint each) under AsyncLLMEngine, with its replica-side object-store tier
(CheckpointTier, the fetching source) and StoreDemotion (the host tier's on_evict) over a
real cluster index actor of its own and a real IndexMirror; no Serve.

FIRST's instruction checkpoint is evicted from the device (OTHER's takes its place), then from
the host (THIRD's pushes OTHER's down), handed to the event loop and stored by the index actor
with its record (the replica no longer holds it). SECOND, with FIRST's instructions, misses
the device and the host, waits while the stored copy is fetched and imported (checked in
full), restores it, and answers as the same request from scratch does.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments.prompts.instruction_boundary import find_instruction_boundary
from engine.interfaces.generation_request import GenerationRequest
from tests.engine.conversations import render
from tests.engine.reuse_cases import GREEDY, Alone
from tests.engine.test_checkpoint_transfer import assert_exact
from tests.engine.test_host_tier import FIRST, OTHER, SECOND, THIRD, one_bundle_engine, one_checkpoint_host_bytes

REPLICA = "replica-demotion"
INDEX_APP = "hybrid-serve-tier-demotion-test"


async def generate(engine, request_id: str, conversation, salt: str) -> Alone:
    """One request through the AsyncLLMEngine (the replica's path), collected."""
    tokenizer = engine.engine.tokenizer
    prompt = render(tokenizer, conversation)
    boundary = find_instruction_boundary(tokenizer, conversation, prompt).position
    result = Alone([], "", 0, [], prompt, boundary, [])
    request = GenerationRequest(request_id, prompt, GREEDY, cache_salt=salt, instruction_boundary=boundary)
    async for out in engine.generate(request):
        result.tokens += out.new_token_ids
        result.text += out.new_text
        result.cached = out.num_cached_tokens
        if out.logits is not None:
            result.logits.append(out.logits)
    return result


async def until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


@pytest.mark.timeout(300)
def test_a_checkpoint_evicted_from_device_and_host_is_restored_from_the_object_store(ray_session):
    import ray

    from deployments.cluster.fetch_policy import FetchPolicy
    from deployments.cluster.index import get_or_create_index
    from deployments.cluster.index_mirror import ActorIndexSource, IndexMirror
    from deployments.cluster.store_demotion import StoreDemotion
    from deployments.cluster.tier import CheckpointTier, TierSettings
    from engine.core.async_engine import AsyncLLMEngine

    host_bytes = one_checkpoint_host_bytes(FIRST, OTHER, THIRD)
    index = get_or_create_index(INDEX_APP, store_budget_bytes=64 << 20)
    ray.get(index.incarnation.remote(), timeout=60)  # started: its start is not timed below

    async def scenario() -> dict:
        async def connect():
            return index

        async def source():
            return ActorIndexSource(index)

        llm = one_bundle_engine(host_checkpoint_bytes=host_bytes)  # one checkpoint in each tier
        llm.record_checkpoint_events()
        engine = AsyncLLMEngine(llm)
        mirror = IndexMirror(source)
        mirror.start()
        settings = TierSettings(FetchPolicy(0.0, 1), fetch_timeout_s=30, warm_start_max_checkpoints=0,
                                warm_start_max_bytes=0)
        tier = CheckpointTier(engine, REPLICA, llm.config.model_dir, settings, mirror, connect)
        demotion = StoreDemotion(REPLICA, mirror, connect, max_pending_bytes=host_bytes)
        llm.host_tier.on_evict = demotion.demote
        await engine.add_checkpoint_source(tier)
        namespace = (llm.config.model_dir, "demoted")
        try:
            first = await generate(engine, "first", FIRST, "demoted")
            instructions = tuple(first.prompt[: first.boundary])
            published = [e for e in await engine.drain_checkpoint_events() if e.action == "published"]
            (first_bundle,) = [e.bundle_id for e in published if e.token_ids == instructions]
            await generate(engine, "other", OTHER, "demoted")  # FIRST's: device -> host
            assert llm.host_tier.holds(namespace, instructions)
            await generate(engine, "third", THIRD, "demoted")  # FIRST's: host -> object store
            assert not llm.host_tier.holds(namespace, instructions)
            await asyncio.wait_for(demotion.drained(), 30)
            await until(lambda: (mirror.lookup_stored(namespace, instructions) or LookupMiss).length
                        == len(instructions), 10, "the mirror never listed the stored copy")
            records = await index.records_covering.remote(namespace, list(instructions))
            demoted, host = demotion.stats(), llm.stats().host_tier  # SECOND and scratch demote more

            second = await generate(engine, "second", SECOND, "demoted")
            scratch = await generate(engine, "scratch", SECOND, "demoted-scratch")
            return dict(first=first, second=second, scratch=scratch, records=records,
                        first_bundle=first_bundle, demotion=demoted, host=host, tier=tier.counters,
                        stats=llm.stats())
        finally:
            demotion.close()
            tier.close()
            engine.shutdown()

    try:
        result = asyncio.run(scenario())
    finally:
        ray.kill(index, no_restart=True)
    first, second, scratch, stats = result["first"], result["second"], result["scratch"], result["stats"]
    (record,) = result["records"]
    assert record.key == (REPLICA, result["first_bundle"]) and not record.on_replica
    assert record.stored_copy is not None and record.kind == "instruction"
    assert result["demotion"].outcomes == {"stored": 1} and result["demotion"].handed == 1
    assert (result["host"].demoted, result["host"].passed_on) == (2, 1)
    assert stats.host_tier.promoted == 0  # SECOND's checkpoint came from the store, not the host
    assert second.cached == first.boundary  # restored from the stored copy
    assert result["tier"].fetched == 1 and stats.transfers.imported == 1 and not stats.transfers.rejected
    assert scratch.cached == 0
    assert_exact(second, scratch, "device -> host -> object store -> device")
    print(f"stored {result['demotion'].stored_bytes} bytes ({len(first.prompt[: first.boundary])} tokens) in "
          f"{result['demotion'].store_seconds * 1000:.1f} ms (checksums and the index's puts); fetched in "
          f"{result['tier'].fetch_seconds * 1000:.1f} ms, imported in {result['tier'].import_seconds * 1000:.1f} ms")


class LookupMiss:
    length = 0
