"""The host tier on one CUDA device (engine/checkpoints/host_tier.py): an evicted checkpoint is
copied into pinned host memory without waiting for the step in flight, promoted back by copies
on a stream of its own while its request waits in the scheduler, restores the same bytes
(checksums before eviction and after promotion equal) and serves what the engine computes from
scratch. The CPU test of the same path: tests/engine/test_host_tier.py."""

from __future__ import annotations

import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.engine_config import EngineConfig
from tests.engine.reuse_cases import SYSTEM, chat, run
from tests.engine.test_checkpoint_transfer import assert_exact

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FIRST = chat(SYSTEM, "Tell me about the river.")
SECOND = chat(SYSTEM, "And the mountain, briefly please?")
OTHER = chat("You count sheep, slowly, one by one, and never skip a sheep. " * 3, "How many tonight?")


def test_a_checkpoint_demoted_to_pinned_memory_is_promoted_exactly():
    base = dict(device="cuda", max_model_len=512, max_num_batched_tokens=512, kv_cache_bytes=32 << 20,
                state_cache_bytes=32 << 20, checkpoint_slots=("instruction",), checkpoint_eviction="lru")
    probe = LLMEngine(EngineConfig(**base))
    one_bundle = probe.executor.cache_capacity().bundle_sizing.bundle_bytes(probe.config.block_size - 1)
    del probe
    engine = LLMEngine(EngineConfig(**base, checkpoint_cache_bytes=one_bundle, host_checkpoint_bytes=64 << 20))
    namespace = (engine.config.model_dir, "gpu-tiers")
    first = run(engine, "first", FIRST, "gpu-tiers")
    instructions = tuple(first.prompt[: first.boundary])
    before = engine.export_checkpoint(namespace, instructions)

    run(engine, "other", OTHER, "gpu-tiers")
    entry = engine.host_tier.entry(namespace, instructions)
    assert entry is not None and engine.stats().host_tier.demoted == 1
    assert all(t.is_pinned() for t in entry.exported.shards[0].tensors().values())

    served = run(engine, "second", SECOND, "gpu-tiers")
    assert served.cached == first.boundary and engine.stats().host_tier.promoted == 1
    after = engine.export_checkpoint(namespace, instructions)
    assert [s.checksum for s in after.shards] == [s.checksum for s in before.shards]
    entry.wait()
    scratch = run(engine, "scratch", SECOND, "gpu-tiers-scratch")
    assert scratch.cached == 0
    assert_exact(served, scratch, "promoted from pinned memory")
    assert engine.pool_usage().idle


def test_the_staged_copy_lands_on_the_device():
    engine = LLMEngine(EngineConfig(device="cuda", max_model_len=512, kv_cache_bytes=32 << 20,
                                    state_cache_bytes=32 << 20, checkpoint_slots=("instruction",),
                                    host_checkpoint_bytes=64 << 20))
    first = run(engine, "first", FIRST, "staged")
    instructions = first.prompt[: first.boundary]
    exported = engine.export_checkpoint((engine.config.model_dir, "staged"), instructions)
    assert engine.host_tier.add(exported, bundle_id=0)
    fetch = engine.host_tier.lookup((engine.config.model_dir, "staged"), tuple(first.prompt), have=0)
    while not fetch.done():
        pass
    staged = fetch.result()
    for name, tensor in staged.shards[0].tensors().items():
        assert tensor.device.type == "cuda"
        assert torch.equal(tensor.cpu(), exported.shards[0].tensors()[name])
