"""The engine with an FP8 KV cache on one CUDA device (kv_cache_dtype fp8_e4m3, the embedded tiny
model in fp32, per-head scales from kv_cache_scales.json): its blocks are FP8 and twice as many
for the same budget; requests restored from checkpoints (an instruction checkpoint taken inside
the prefill pass, a conversation's response checkpoint, a checkpoint moved from another FP8
engine, one demoted to pinned host memory and promoted back) give what the same requests give
computed from scratch in that engine; and checkpoints never cross KV formats (FP8 into a
model-dtype engine, the reverse, or FP8 of other scales: rejected as kv_cache).

Restored and from-scratch K/V come out of different passes and agree in fp32 to about 1e-7;
where a value lies that close to the midpoint between two FP8 values the two store neighbouring
codes. One such byte moves the tiny model's logits by up to 6.5e-4 relative (measured on the
CPU path, one key byte changed by one code at a time), so logits here must agree within
FP8_LOGITS_RTOL and a different greedy token is allowed only where the from-scratch top-2 gap is
within what that tolerance can move (a near-tie, counted and printed).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.checkpoints.import_checks import ImportRejection
from engine.core.llm_engine import LLMEngine
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig
from engine.kernels.attention_reference import storage_view
from engine.parallel.kv_cache_format import SCALES_FILE
from tests.engine.reuse_cases import SYSTEM, Alone, chat, instruction_reuse, multi_turn, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FP8_LOGITS_RTOL = 2e-3
# per layer and head; the tiny model's |K| and |V| reach about 8 to 11 (median 1.5): every
# value / scale stays within FP8's 448
SCALES = {"k_scale": {"2": [0.05, 0.125], "5": 0.03}, "v_scale": {"2": 0.04, "5": [0.025, 0.07]}}
FIRST = chat(SYSTEM, "Tell me about the river.")
SECOND = chat(SYSTEM, "And the mountain, briefly please?")
OTHER = chat("You count sheep, slowly, one by one, and never skip a sheep. " * 3, "How many tonight?")


def config(model_dir, **changes) -> EngineConfig:
    settings = dict(model_dir=str(model_dir), device="cuda", max_model_len=512, max_num_batched_tokens=512,
                    kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20, kv_cache_dtype="fp8_e4m3")
    return EngineConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with kv_cache_scales.json holding SCALES."""
    directory = tmp_path_factory.mktemp("fp8") / "tiny"
    shutil.copytree(DEFAULT_MODEL_DIR, directory)
    (directory / SCALES_FILE).write_text(json.dumps(SCALES))
    return directory


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return LLMEngine(config(model_dir))


@pytest.fixture(scope="module")
def auto_engine(model_dir) -> LLMEngine:
    """The same engine with K/V in the model dtype (fp32)."""
    return LLMEngine(config(model_dir, kv_cache_dtype="auto"))


def assert_fp8_exact(served: Alone, scratch: Alone, label: str) -> int:
    """Greedy tokens equal and logits within FP8_LOGITS_RTOL, but past a near-tie (the
    from-scratch top-2 gap within 2 x FP8_LOGITS_RTOL of the largest logit), where the rest is
    not compared; returns the near-ties (0 or 1)."""
    for position, (got, want) in enumerate(zip(served.tokens, scratch.tokens)):
        reference = scratch.logits[position]
        bound = 2 * FP8_LOGITS_RTOL * float(reference.abs().max())
        if got != want:
            top2 = torch.topk(reference, 2).values
            gap = float(top2[0] - top2[1])
            assert gap < bound, f"{label}: position {position} is {got} restored, {want} from scratch (gap {gap:.3g})"
            print(f"{label}: near-tie at position {position} (gap {gap:.3g} < {bound:.3g}); rest not compared")
            return 1
        error = float((served.logits[position] - reference).abs().max() / reference.abs().max())
        assert error <= FP8_LOGITS_RTOL, f"{label}: logits at {position} differ by {error:.2e} relative"
    assert len(served.tokens) == len(scratch.tokens), f"{label}: lengths differ"
    return 0


def test_fp8_blocks_hold_twice_the_blocks_with_the_model_dirs_scales(engine, auto_engine):
    caches = engine.executor.caches
    assert caches.kv_stack.dtype == torch.float8_e4m3fn
    assert torch.equal(caches.kv_scale[2][0].cpu(), torch.tensor([0.05, 0.125]))  # layer 2's key scales
    assert torch.equal(caches.kv_scale[5][1].cpu(), torch.tensor([0.025, 0.07]))  # layer 5's value scales
    auto = auto_engine.executor
    assert auto.caches.kv_stack.dtype == torch.float32 and not auto.caches.kv_scale
    # the same kv_cache_bytes: FP8 takes 1 byte an element against fp32's 4 (bf16's 2: twice)
    assert engine.executor.cache_capacity().num_blocks == 4 * auto.cache_capacity().num_blocks


def test_restored_requests_give_what_scratch_gives(engine):
    near_ties = 0
    first, second, scratch = instruction_reuse(engine, "fp8-instructions")
    assert second.cached == first.boundary and scratch.cached == 0
    near_ties += assert_fp8_exact(second, scratch, "instruction checkpoint")
    first, second, scratch = multi_turn(engine, "fp8-turns")
    assert second.cached >= len(first.prompt) and scratch.cached == 0
    near_ties += assert_fp8_exact(second, scratch, "response checkpoint")
    assert near_ties <= 1
    assert engine.pool_usage().idle


def test_fp8_is_close_to_the_model_dtype_cache(engine, auto_engine):
    """Not exact (FP8 rounds each K/V element to 4 significant bits), but close: a wrong scale
    or a head's scale applied to another would move the logits far more."""
    got, want = run(engine, "close-fp8", FIRST, "close"), run(auto_engine, "close-auto", FIRST, "close")
    error = float((got.logits[0] - want.logits[0]).abs().max() / want.logits[0].abs().max())
    print(f"first-token logits, FP8 against fp32 K/V: {error:.2e} relative; tokens equal: {got.tokens == want.tokens}")
    assert 0 < error < 5e-2


def test_checkpoints_cross_only_between_engines_of_one_kv_format(engine, auto_engine, model_dir):
    first = run(engine, "x-first", FIRST, "x-fp8")
    exported = engine.export_checkpoint((engine.config.model_dir, "x-fp8"), first.prompt[: first.boundary])
    assert exported.shards[0].kv.dtype == torch.float8_e4m3fn and exported.header.kv_cache.startswith("fp8_e4m3:")

    auto = auto_engine
    assert auto.import_checkpoint(exported).rejection is ImportRejection.KV_CACHE
    auto_first = run(auto, "x-auto-first", FIRST, "x-auto")
    from_auto = auto.export_checkpoint((auto.config.model_dir, "x-auto"), auto_first.prompt[: auto_first.boundary])
    assert engine.import_checkpoint(from_auto).rejection is ImportRejection.KV_CACHE

    other = LLMEngine(config(model_dir))  # the same scales file: the same format
    assert other.import_checkpoint(exported).accepted
    served = run(other, "x-served", SECOND, "x-fp8")
    scratch = run(other, "x-scratch", SECOND, "x-fp8-scratch")
    assert served.cached == first.boundary and scratch.cached == 0
    assert assert_fp8_exact(served, scratch, "moved between FP8 engines") == 0
    del other

    (model_dir / SCALES_FILE).write_text(json.dumps({"k_scale": {"2": 0.5}}))
    try:
        rescaled = LLMEngine(config(model_dir))
    finally:
        (model_dir / SCALES_FILE).write_text(json.dumps(SCALES))
    assert rescaled.import_checkpoint(exported).rejection is ImportRejection.KV_CACHE


def test_an_fp8_checkpoint_demoted_to_host_memory_is_promoted_byte_for_byte(engine, model_dir):
    one_bundle = engine.executor.cache_capacity().bundle_sizing.bundle_bytes(engine.config.block_size - 1)
    tiered = LLMEngine(config(model_dir, checkpoint_slots=("instruction",), checkpoint_eviction="lru",
                              checkpoint_cache_bytes=one_bundle, host_checkpoint_bytes=64 << 20))
    namespace = (tiered.config.model_dir, "fp8-tiers")
    first = run(tiered, "first", FIRST, "fp8-tiers")
    instructions = tuple(first.prompt[: first.boundary])
    before = tiered.export_checkpoint(namespace, instructions)
    run(tiered, "other", OTHER, "fp8-tiers")
    entry = tiered.host_tier.entry(namespace, instructions)
    assert entry is not None and tiered.stats().host_tier.demoted == 1
    assert entry.exported.shards[0].kv.dtype == torch.float8_e4m3fn

    served = run(tiered, "second", SECOND, "fp8-tiers")
    assert served.cached == first.boundary and tiered.stats().host_tier.promoted == 1
    after = tiered.export_checkpoint(namespace, instructions)
    assert [s.checksum for s in after.shards] == [s.checksum for s in before.shards]
    assert torch.equal(storage_view(after.shards[0].kv), storage_view(before.shards[0].kv))
    entry.wait()
    scratch = run(tiered, "scratch", SECOND, "fp8-tiers-scratch")
    assert assert_fp8_exact(served, scratch, "promoted from pinned memory") == 0
    assert tiered.pool_usage().idle
