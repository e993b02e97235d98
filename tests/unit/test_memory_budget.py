"""Cache budgets from memory (engine/parallel/memory_budget.py): the free-memory probes on cpu and
(mocked) cuda, the split, explicit bytes winning, and the sizing of the default serve_config.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from deployments.config import parse_app_config
from engine.engine_config import DEFAULT_BUDGET_BYTES, DEFAULT_MODEL_DIR, EngineConfig
from engine.models.registry import load_model_config
from engine.parallel import memory_budget
from engine.parallel.cache_capacity import (
    CacheBudgetError, check_cache_budgets, kv_bytes_per_block, size_caches, state_bytes_per_slot,
)
from engine.parallel.memory_budget import (
    CHECKPOINT_SHARE, CPU_RAM_SHARE, HOST_TIER_SHARE, KV_SHARE, STATE_SHARE, FreeMemory, cache_budgets, free_memory,
    rank_free_memory,
)
from engine.parallel.shard_layout import rank_shard_layout
from engine.parallel.tensor_parallel import TensorParallel

GIB = 1 << 30
REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = load_model_config(str(DEFAULT_MODEL_DIR))
SINGLE = TensorParallel.single()


def tiny_sizes(dtype=torch.float32, block_size=16) -> tuple[int, int]:
    """(bytes of one KV block, bytes of one state slot) of the embedded model."""
    layout = rank_shard_layout(TINY, SINGLE)
    return kv_bytes_per_block(TINY, layout, dtype, block_size), state_bytes_per_slot(TINY, layout, dtype)


@pytest.fixture
def meminfo(tmp_path, monkeypatch):
    """A /proc/meminfo saying 8 GiB are available."""
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       33554432 kB\nMemFree:         1000 kB\nMemAvailable:    {8 * GIB // 1024} kB\n")
    monkeypatch.setattr(memory_budget, "MEMINFO", path)
    return path


def test_cpu_free_memory_is_a_share_of_the_available_ram(meminfo):
    assert memory_budget.available_ram_bytes() == 8 * GIB
    memory = free_memory(torch.device("cpu"))
    assert memory == FreeMemory(device_bytes=int(CPU_RAM_SHARE * 8 * GIB), host_bytes=8 * GIB)
    assert rank_free_memory(torch.device("cpu"), SINGLE) == memory


def test_without_meminfo_the_physical_ram_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_budget, "MEMINFO", tmp_path / "missing")
    assert memory_budget.available_ram_bytes() > 0


def test_gpu_free_memory_is_what_the_weights_left_with_the_allocators_unused_reserve(meminfo, monkeypatch):
    device = torch.device("cuda", 0)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: asked.append(d) or (60 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 5 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 3 * GIB)  # the weights
    assert free_memory(device) == FreeMemory(device_bytes=62 * GIB, host_bytes=8 * GIB)
    assert asked == [device]


def test_the_split_of_memory_utilization():
    _, slot = tiny_sizes()
    config = EngineConfig(device="cuda", memory_utilization=0.5, max_num_seqs=16)
    budgets = cache_budgets(config, slot, FreeMemory(device_bytes=10 * GIB, host_bytes=64 * GIB))
    total = 5 * GIB
    assert budgets.state_bytes == 16 * slot  # capped: more slots than max_num_seqs are never used
    assert budgets.kv_bytes == int(KV_SHARE * total + STATE_SHARE * total - 16 * slot)  # with the state's surplus
    assert budgets.checkpoint_bytes == int(CHECKPOINT_SHARE * total)
    assert budgets.host_checkpoint_bytes == int(0.5 * HOST_TIER_SHARE * 64 * GIB)  # of the host's RAM
    assert set(budgets.from_memory) == {"kv_cache_bytes", "state_cache_bytes", "checkpoint_cache_bytes",
                                        "host_checkpoint_bytes"}
    assert budgets.kv_bytes + budgets.state_bytes + budgets.checkpoint_bytes <= total
    two_ranks = cache_budgets(EngineConfig(memory_utilization=0.5, tensor_parallel_size=2), slot,
                              FreeMemory(device_bytes=10 * GIB, host_bytes=64 * GIB))
    assert two_ranks.host_checkpoint_bytes == 0  # the host tier needs one rank


def test_a_small_memory_gives_the_state_only_its_share():
    _, slot = tiny_sizes()
    total = 100 * slot
    budgets = cache_budgets(EngineConfig(memory_utilization=1.0, max_num_seqs=64), slot,
                            FreeMemory(device_bytes=total, host_bytes=0))
    assert budgets.state_bytes == int(STATE_SHARE * total)  # 10 slots' worth, fewer than 64 needed
    assert budgets.kv_bytes == int(KV_SHARE * total)


def test_budgets_given_in_bytes_win_over_memory_utilization():
    _, slot = tiny_sizes()
    config = EngineConfig(memory_utilization=0.9, kv_cache_bytes=123 << 20, checkpoint_cache_bytes=0)
    budgets = cache_budgets(config, slot, FreeMemory(device_bytes=4 * GIB, host_bytes=0))
    assert (budgets.kv_bytes, budgets.checkpoint_bytes) == (123 << 20, 0)
    assert budgets.from_memory == ("state_cache_bytes", "host_checkpoint_bytes")
    everything = EngineConfig(memory_utilization=0.9, kv_cache_bytes=1 << 20, state_cache_bytes=2 << 20,
                              checkpoint_cache_bytes=3 << 20, host_checkpoint_bytes=0)
    assert cache_budgets(everything, slot, None).from_memory == ()  # no memory needed


def test_without_memory_utilization_unset_budgets_are_the_default():
    config = EngineConfig()
    assert (config.kv_cache_bytes, config.state_cache_bytes, config.checkpoint_cache_bytes) == (DEFAULT_BUDGET_BYTES,) * 3
    assert config.host_checkpoint_bytes == 0  # off
    assert EngineConfig(memory_utilization=0.5).kv_cache_bytes is None  # the worker sizes it
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="memory_utilization"):
            EngineConfig(memory_utilization=bad)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        EngineConfig(kv_cache_bytes=0)


def test_gpu_sizing_from_mocked_free_memory():
    block, slot = tiny_sizes(torch.bfloat16)
    config = EngineConfig(device="cuda", dtype="bfloat16", memory_utilization=0.9, max_num_seqs=64)
    capacity = size_caches(config, TINY, SINGLE, FreeMemory(device_bytes=2 * GIB, host_bytes=64 * GIB))
    total = 0.9 * 2 * GIB
    assert capacity.num_state_slots == 64 and capacity.max_model_len == 4096
    assert capacity.num_blocks == int(KV_SHARE * total + STATE_SHARE * total - 64 * slot) // block
    assert capacity.checkpoint_bytes == int(CHECKPOINT_SHARE * total)
    assert capacity.host_checkpoint_bytes == int(0.9 * HOST_TIER_SHARE * 64 * GIB)
    with pytest.raises(CacheBudgetError, match="kv_cache_bytes from memory_utilization=0.9 .* raise memory_utilization"):
        size_caches(config, TINY, SINGLE, FreeMemory(device_bytes=1 << 20, host_bytes=0))


def test_cpu_sizing_from_the_available_ram(meminfo):
    block, slot = tiny_sizes()
    config = EngineConfig(memory_utilization=0.2)
    capacity = size_caches(config, TINY, SINGLE, free_memory(torch.device("cpu")))
    total = 0.2 * CPU_RAM_SHARE * 8 * GIB
    assert capacity.num_blocks == int(KV_SHARE * total + STATE_SHARE * total - 16 * slot) // block
    assert capacity.checkpoint_bytes == int(CHECKPOINT_SHARE * total)


def test_the_build_check_leaves_budgets_from_memory_to_the_worker():
    check_cache_budgets(EngineConfig(memory_utilization=0.01), TINY)  # no memory known: not sized
    with pytest.raises(CacheBudgetError, match="max_model_len 8192 exceeds"):
        check_cache_budgets(EngineConfig(memory_utilization=0.5, max_model_len=8192), TINY)


def test_the_default_serve_config_serves_the_whole_context_of_the_embedded_model(meminfo, monkeypatch):
    """serve_config.yaml sizes its budgets from memory and leaves max_model_len to the model:
    with as little as 2 GiB of RAM available its KV blocks hold requests of the 4,096 tokens of
    the model's context, and it has a state slot for every sequence."""
    monkeypatch.setattr(memory_budget, "MEMINFO", meminfo)
    meminfo.write_text(f"MemAvailable:    {2 * GIB // 1024} kB\n")
    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    engine = parse_app_config(config["applications"][0]["args"]).engine
    assert engine.memory_utilization is not None and engine.max_model_len is None
    capacity = size_caches(engine, TINY, SINGLE, free_memory(torch.device("cpu")))
    assert capacity.max_model_len == TINY.max_position_embeddings == 4096
    assert capacity.num_state_slots == engine.max_num_seqs
    assert capacity.num_blocks * capacity.block_size >= 4096
    check_cache_budgets(engine, TINY)
