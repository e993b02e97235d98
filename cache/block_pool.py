"""A pool of fixed-size KV blocks with reference counts (pure Python).

Block ids are ints in [0, num_blocks). A block is free when its reference count is zero.
Shared ownership (several requests, or a request and a checkpoint, holding the same block)
is expressed by incrementing the count; the block returns to the free list when the last
holder releases it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` free blocks (each with ref count 1), or None if fewer are free.

        Never allocates partially: on None nothing changed.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Add one reference to each block; ValueError, with nothing changed, if one is free."""
        if not self.all_allocated(blocks):
            free = next(block for block in blocks if self._ref_counts[block] <= 0)
            raise ValueError(f"block {free} is free and cannot be shared")
        ref_counts = self._ref_counts
        for block in blocks:
            ref_counts[block] += 1

    def all_allocated(self, blocks: Sequence[int]) -> bool:
        """Whether every block has a reference (True for none). A C loop: a long prompt's
        checkpoint covers hundreds of blocks, on the step thread before its first launch."""
        return min(map(self._ref_counts.__getitem__, blocks), default=1) > 0

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free."""
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise ValueError(f"block {block} released more often than allocated")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
