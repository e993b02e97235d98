"""What the scheduler asks of the cache: blocks for tokens, a state slot per request.

The scheduler sees only return values (new block ids, a slot, or None when it does not fit),
never the pools themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from cache.block_pool import BlockPool
from cache.state_pool import StatePool


@dataclass(frozen=True)
class PoolUsage:
    free_blocks: int
    total_blocks: int
    free_state_slots: int
    total_state_slots: int
    num_requests: int = 0


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class CacheManager:
    def __init__(self, num_blocks: int, num_state_slots: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.state_slots = StatePool(num_state_slots)

    def allocate_blocks(self, num_blocks_held: int, num_tokens: int) -> list[int] | None:
        """New blocks so that a request holding `num_blocks_held` covers `num_tokens` positions.

        Returns the new block ids (possibly empty), or None if they do not fit; on None
        nothing was allocated.
        """
        missing = blocks_needed(num_tokens, self.block_size) - num_blocks_held
        if missing <= 0:
            return []
        return self.blocks.allocate(missing)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a new request needing `num_tokens` positions now fits (a slot and blocks)."""
        return (
            self.state_slots.num_free > 0
            and self.blocks.num_free >= blocks_needed(num_tokens, self.block_size)
        )

    def acquire_state_slot(self) -> int | None:
        return self.state_slots.allocate()

    def release(self, block_ids: list[int], state_slot: int | None) -> None:
        """Give back a request's blocks and state slot."""
        self.blocks.release(block_ids)
        if state_slot is not None:
            self.state_slots.release(state_slot)

    def usage(self, num_requests: int = 0) -> PoolUsage:
        return PoolUsage(
            free_blocks=self.blocks.num_free,
            total_blocks=self.blocks.num_blocks,
            free_state_slots=self.state_slots.num_free,
            total_state_slots=self.state_slots.num_slots,
            num_requests=num_requests,
        )
