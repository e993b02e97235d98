"""Eviction by value against LRU in the engine (docs/design.md section 5, Eviction): the same
mixed workload (short prompts repeated, long instructions shared by new user messages) under
the same checkpoint budget, one request at a time, so the runs are deterministic."""

from __future__ import annotations

import random

from engine.core.llm_engine import LLMEngine
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
INSTRUCTION_TOKENS = 600
SHORT_TOKENS = 40
BUDGET_BUNDLES = 6  # what checkpoint_cache_bytes holds


def mixed_workload(seed: int = 0, rounds: int = 3, num_long: int = 3, num_short: int = 8):
    """(prompt, instruction boundary or None) in arrival order: each round asks every long
    instruction once with a new user message, and between two of them every short prompt
    twice in a row (the same words in every round)."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(2, 2048) for _ in range(n)]  # noqa: E731
    instructions = [tokens(INSTRUCTION_TOKENS) for _ in range(num_long)]
    shorts = [tokens(SHORT_TOKENS) for _ in range(num_short)]
    requests = []
    for _ in range(rounds):
        for instruction in instructions:
            requests.append((instruction + tokens(12), INSTRUCTION_TOKENS))
            requests += [(short, None) for short in shorts for _ in range(2)]
    return requests


def run_workload(eviction: str, budget: int) -> tuple[int, int, int]:
    """(prompt tokens restored, computed, evictions) of the workload under `eviction`."""
    engine = LLMEngine(EngineConfig(checkpoint_slots=("prompt", "instruction"), checkpoint_cache_bytes=budget,
                                    checkpoint_eviction=eviction, async_scheduling=False))
    for i, (prompt, boundary) in enumerate(mixed_workload()):
        engine.add_request(GenerationRequest(f"r{i}", prompt, ONE_TOKEN, instruction_boundary=boundary))
        while engine.has_unfinished_requests():
            engine.step()
    stats = engine.stats()
    assert engine.pool_usage().idle
    assert stats.num_checkpoints <= BUDGET_BUNDLES
    evicted = sum(counters.evicted for counters in stats.checkpoints.values())
    return stats.scheduler.prompt_tokens_restored, stats.scheduler.prompt_tokens_computed, evicted


def test_value_eviction_saves_more_prefill_than_lru_with_the_same_budget():
    probe = LLMEngine(EngineConfig())
    sizing = probe.executor.cache_capacity().bundle_sizing
    budget = BUDGET_BUNDLES * sizing.bundle_bytes(probe.config.block_size - 1)  # any tail fits
    lru = run_workload("lru", budget)
    value = run_workload("value", budget)
    print(f"restored / computed / evicted: lru {lru}, value {value}")
    assert lru[0] + lru[1] == value[0] + value[1]  # the same prompts
    assert lru[2] > 0 and value[2] > 0  # the budget binds for both
    # LRU cycles through more checkpoints than it holds and loses the instructions between
    # their uses; value keeps them, which saves far more prefill than the short prompts
    assert value[0] > lru[0] + 2 * INSTRUCTION_TOKENS
