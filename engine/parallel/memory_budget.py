"""The cache budgets of one rank: the byte settings, or a share of free memory
(EngineConfig.memory_utilization), split between KV blocks, recurrent state and checkpoints.

With memory_utilization u, each budget not given in bytes comes from memory:

    device memory  on cuda: what the device has free once the weights are loaded (the caching
                   allocator's unused reserve counted as free); on cpu: CPU_RAM_SHARE of the
                   RAM available (MemAvailable), since there the caches share RAM with the
                   weights, activations, the other processes and Ray's object store
    total          u * device memory; the rest (1 - u) is left for activations, CUDA graphs
                   and the allocator
    state          STATE_SHARE of the total, at most what max_num_seqs state slots need (more
                   slots are never used); what it does not need goes to the KV blocks
    KV blocks      KV_SHARE of the total, plus the state's surplus
    checkpoints    CHECKPOINT_SHARE of the total (state, attention tail and hidden row of the
                   checkpoints on the device; their full KV blocks are in the KV budget)
    host tier      u * HOST_TIER_SHARE of the RAM available: checkpoints evicted from the
                   device (engine/checkpoints/host_tier.py); a budget of its own on cpu too;
                   off (0) with more than one rank

A budget given in bytes is taken as it is and the others keep their shares (nothing is
redistributed but the state's surplus). With tensor parallelism every rank takes the smallest
free memory of all ranks, so that all of them size the same number of blocks and slots.
Without memory_utilization every budget not given is DEFAULT_BUDGET_BYTES (EngineConfig), and
the host tier is off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.engine_config import EngineConfig
from engine.parallel.tensor_parallel import TensorParallel

CPU_RAM_SHARE = 0.25
HOST_TIER_SHARE = 0.25
KV_SHARE, STATE_SHARE, CHECKPOINT_SHARE = 0.5, 0.1, 0.4
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class FreeMemory:
    """What a rank may size its budgets from: device bytes free (after the weights) and host RAM
    available."""

    device_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class CacheBudgets:
    """One rank's budgets in bytes; `from_memory` names those that came from memory_utilization."""

    kv_bytes: int
    state_bytes: int
    checkpoint_bytes: int
    host_checkpoint_bytes: int
    from_memory: tuple[str, ...] = ()


def available_ram_bytes() -> int:
    """RAM the kernel says can be taken without swapping (MemAvailable in MEMINFO), else the
    physical RAM."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_memory(device: torch.device) -> FreeMemory:
    """This process's FreeMemory on `device` (call it after the weights are loaded)."""
    host = available_ram_bytes()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        unused_reserve = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return FreeMemory(device_bytes=free + unused_reserve, host_bytes=host)
    return FreeMemory(device_bytes=int(CPU_RAM_SHARE * host), host_bytes=host)


def rank_free_memory(device: torch.device, tp: TensorParallel) -> FreeMemory:
    """free_memory of this rank, the smallest of all ranks' (every rank must size alike)."""
    memory = free_memory(device)
    device_bytes, host_bytes = tp.min_over_ranks((memory.device_bytes, memory.host_bytes), device)
    return FreeMemory(device_bytes, host_bytes)


def needs_free_memory(config: EngineConfig) -> bool:
    """Whether some budget comes from memory (memory_utilization is set and a budget is not
    given in bytes)."""
    return config.memory_utilization is not None and None in (
        config.kv_cache_bytes, config.state_cache_bytes, config.checkpoint_cache_bytes,
        config.host_checkpoint_bytes)


def cache_budgets(config: EngineConfig, state_slot_bytes: int, memory: FreeMemory | None) -> CacheBudgets:
    """The budgets of the module doc. `memory` may be None only when no budget comes from
    memory (needs_free_memory is False)."""
    if not needs_free_memory(config):
        return CacheBudgets(config.kv_cache_bytes, config.state_cache_bytes, config.checkpoint_cache_bytes,
                            config.host_checkpoint_bytes)
    if memory is None:
        raise ValueError("memory_utilization needs the free memory of the device")
    total = config.memory_utilization * memory.device_bytes
    derived = []

    def pick(given: int | None, name: str, share: float) -> int:
        if given is not None:
            return given
        derived.append(name)
        return int(share)

    state_needed = state_slot_bytes * config.max_num_seqs
    state = pick(config.state_cache_bytes, "state_cache_bytes", min(STATE_SHARE * total, state_needed))
    surplus = STATE_SHARE * total - state if config.state_cache_bytes is None else 0
    kv = pick(config.kv_cache_bytes, "kv_cache_bytes", KV_SHARE * total + surplus)
    checkpoint = pick(config.checkpoint_cache_bytes, "checkpoint_cache_bytes", CHECKPOINT_SHARE * total)
    host_share = HOST_TIER_SHARE if config.tensor_parallel_size == 1 else 0.0
    host = pick(config.host_checkpoint_bytes, "host_checkpoint_bytes",
                config.memory_utilization * host_share * memory.host_bytes)
    return CacheBudgets(kv, state, checkpoint, host, tuple(derived))
