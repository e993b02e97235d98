"""The paged driver numerics and tensor-parallel tests share: requests with a state slot and a
block table, fed through one ForwardBatch per step the way engine.worker builds it, without the
scheduler (so a test chooses chunk sizes and batch mixes directly)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.interfaces.forward_batch import ForwardBatch, SequenceChunk


@dataclass
class Request:
    """What the engine tracks per request: its state slot, KV blocks and tokens computed."""

    state_slot: int
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0


class PagedRunner:
    """Feeds chunks of several requests through one ForwardBatch, like the engine's worker."""

    def __init__(
        self, model, num_blocks: int = 48, block_size: int = 16,
        num_slots: int = 4, seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.caches = model.allocate_caches(num_blocks, block_size, num_slots)
        generator = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=generator).tolist()

    @torch.no_grad()
    def step(self, work: list[tuple[Request, list[int]]]) -> list[torch.Tensor]:
        """Run each request's next tokens; returns each chunk's logits (n_i, vocab) fp32.

        A request with nothing computed starts from a zero state (reset_state); any other
        continues from its slot.
        """
        input_ids, positions, slot_mapping, chunks, cu_seqlens = [], [], [], [], [0]
        for request, tokens in work:
            start = request.num_computed
            end = start + len(tokens)
            while len(request.block_table) * self.block_size < end:
                request.block_table.append(self.free_blocks.pop())
            for position in range(start, end):
                block = request.block_table[position // self.block_size]
                slot_mapping.append(block * self.block_size + position % self.block_size)
            input_ids += tokens
            positions += range(start, end)
            chunks.append(
                SequenceChunk(
                    state_slot=request.state_slot,
                    start_position=start,
                    num_tokens=len(tokens),
                    block_table=tuple(request.block_table),
                    reset_state=start == 0,
                )
            )
            cu_seqlens.append(len(input_ids))
            request.num_computed = end
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        batch = ForwardBatch(
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slot_mapping),
            chunks=tuple(chunks),
            cu_seqlens=tuple(cu_seqlens),
        )
        logits = self.model.compute_logits(self.model(batch, self.caches))
        return [logits[a:b] for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]

    def run_in_chunks(self, request: Request, tokens: list[int], sizes: list[int]) -> torch.Tensor:
        """Feed `tokens` alone in chunks of `sizes` (the rest in a last chunk); (len, vocab) logits."""
        outputs, offset = [], 0
        for size in [*sizes, len(tokens) - sum(sizes)]:
            if size > 0:
                outputs += self.step([(request, tokens[offset : offset + size])])
                offset += size
        return torch.cat(outputs)
