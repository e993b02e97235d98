"""The worker: holds the model, its KV and state tensors, and runs one step at a time.

In process it is called directly; under Ray it is the worker actor (`ray.remote(Worker)`),
one per tensor-parallel rank. It knows nothing of queues or requests beyond one
SchedulerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, SequenceChunk
from engine.loader import load_model
from engine.sampler import Sampler
from engine.step_io import RunnerOutput, SchedulerOutput


class CacheBudgetError(ValueError):
    """The configured memory budgets cannot hold what the configuration asks for."""


@dataclass(frozen=True)
class CacheCapacity:
    """What the worker allocated; the scheduler's pools are sized from it."""

    num_blocks: int
    num_state_slots: int
    block_size: int
    max_model_len: int


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        self.model, self.model_config = load_model(
            config.model_dir, dtype=getattr(torch, config.dtype), device=self.device
        )
        self.capacity = _size_caches(config, self.model, self.model_config.max_position_embeddings)
        self.caches = self.model.allocate_caches(
            num_blocks=self.capacity.num_blocks,
            block_size=self.capacity.block_size,
            num_state_slots=self.capacity.num_state_slots,
            device=self.device,
        )
        self.sampler = Sampler(seed=config.seed, device=self.device)

    def cache_capacity(self) -> CacheCapacity:
        return self.capacity

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step: forward every chunk, sample where asked, return tokens."""
        self.sampler.forget(scheduler_output.finished_request_ids)
        chunks = scheduler_output.chunks
        if not chunks:
            return RunnerOutput()
        batch = build_forward_batch(scheduler_output, self.capacity.block_size, self.device)
        hidden = self.model(batch, self.caches)  # (T, D)
        last_rows = [end - 1 for end in batch.cu_seqlens[1:]]

        output = RunnerOutput()
        for chunk, row in zip(chunks, last_rows):
            if chunk.capture_hidden:
                output.hidden_rows[chunk.request_id] = hidden[row].float().cpu()

        sampled = [(chunk, row) for chunk, row in zip(chunks, last_rows) if chunk.sample]
        if not sampled:
            return output
        logits = self.model.compute_logits(hidden[[row for _, row in sampled]])  # (n, V) fp32
        for (chunk, _), logits_row in zip(sampled, logits):
            if chunk.sampling.return_logits:
                output.logits[chunk.request_id] = logits_row.clone().cpu()
        tokens = self.sampler.sample(
            logits,
            request_ids=[chunk.request_id for chunk, _ in sampled],
            params=[chunk.sampling for chunk, _ in sampled],
            num_output_tokens=[chunk.num_output_tokens for chunk, _ in sampled],
        )
        output.sampled_token_ids = {chunk.request_id: t for (chunk, _), t in zip(sampled, tokens)}
        return output

    def read_state_slot(self, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one request's recurrent state: Mamba layer -> (conv_state, ssm_state)."""
        return {
            layer: (conv.cpu(), ssm.cpu())
            for layer, (conv, ssm) in self.caches.read_state_slot(slot).items()
        }

    def copy_state_slot(self, src_slot: int, dst_slot: int) -> None:
        self.caches.copy_state_slot(src_slot, dst_slot)


def build_forward_batch(
    scheduler_output: SchedulerOutput, block_size: int, device: torch.device
) -> ForwardBatch:
    """Flatten the scheduled chunks into one token axis with positions and KV write slots."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_seqlens = [0]
    sequence_chunks = []
    for chunk in scheduler_output.chunks:
        input_ids.extend(chunk.token_ids)
        for position in range(chunk.start_position, chunk.start_position + len(chunk.token_ids)):
            positions.append(position)
            block = chunk.block_table[position // block_size]
            slot_mapping.append(block * block_size + position % block_size)
        cu_seqlens.append(len(input_ids))
        sequence_chunks.append(
            SequenceChunk(
                state_slot=chunk.state_slot,
                start_position=chunk.start_position,
                num_tokens=len(chunk.token_ids),
                block_table=chunk.block_table,
                reset_state=chunk.reset_state,
            )
        )
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    return ForwardBatch(
        input_ids=as_tensor(input_ids),
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slot_mapping),
        chunks=tuple(sequence_chunks),
        cu_seqlens=tuple(cu_seqlens),
    )


def _size_caches(config: EngineConfig, model, model_max_len: int) -> CacheCapacity:
    """Derive block and slot counts from the byte budgets; fail clearly if they are too small."""
    max_model_len = config.max_model_len or model_max_len
    if max_model_len > model_max_len:
        raise CacheBudgetError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {model_max_len}"
        )
    num_blocks = config.kv_cache_bytes // model.kv_bytes_per_block(config.block_size)
    num_slots = min(config.max_num_seqs, config.state_cache_bytes // model.state_bytes_per_slot())
    if num_blocks * config.block_size < max_model_len:
        raise CacheBudgetError(
            f"kv_cache_bytes={config.kv_cache_bytes} holds {num_blocks} blocks of "
            f"{config.block_size} tokens, fewer than max_model_len={max_model_len}; "
            "raise kv_cache_bytes or lower max_model_len"
        )
    if num_slots < 1:
        raise CacheBudgetError(
            f"state_cache_bytes={config.state_cache_bytes} cannot hold one recurrent state slot "
            f"({model.state_bytes_per_slot()} bytes)"
        )
    return CacheCapacity(
        num_blocks=num_blocks,
        num_state_slots=num_slots,
        block_size=config.block_size,
        max_model_len=max_model_len,
    )
