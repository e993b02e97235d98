"""What the scheduler asks of the cache: blocks for tokens, a state slot per request, and
checkpoints (lookup, reserve, publish).

The scheduler sees only return values (new block ids, a slot, a Hit, a bundle id, or None when
something does not fit), never the pools or the ledger themselves. When KV blocks run out,
unpinned checkpoints are evicted first (their blocks come back), in the ledger's eviction order
(cache/eviction.py); the ids of every bundle the ledger forgot are collected for the workers to
free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache.block_pool import BlockPool
from cache.checkpoint_keys import CheckpointKind, Namespace
from cache.checkpoint_ledger import Bundle, BundleListener, CheckpointLedger, Hit, PublishOutcome
from cache.eviction import EvictionOrder
from cache.state_pool import StatePool


@dataclass(frozen=True)
class PoolUsage:
    free_blocks: int
    total_blocks: int
    free_state_slots: int
    total_state_slots: int
    num_requests: int = 0
    checkpoint_only_blocks: int = 0  # referenced by checkpoints alone (evictable)
    num_checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoint_pins: int = 0  # taken by restores in progress

    @property
    def idle(self) -> bool:
        """No request holds a block, a slot or a checkpoint pin (checkpoints may still hold
        blocks)."""
        return (
            self.free_blocks + self.checkpoint_only_blocks == self.total_blocks
            and self.free_state_slots == self.total_state_slots
            and self.checkpoint_pins == 0
        )


@dataclass(frozen=True)
class BundleSizing:
    """Bytes a bundle holds outside the shared KV blocks: state + attention tail + hidden row."""

    state_bytes: int
    kv_bytes_per_token: int
    hidden_row_bytes: int

    def bundle_bytes(self, tail_tokens: int) -> int:
        return self.state_bytes + tail_tokens * self.kv_bytes_per_token + self.hidden_row_bytes


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class CacheManager:
    def __init__(
        self,
        num_blocks: int,
        num_state_slots: int,
        block_size: int,
        checkpoint_bytes: int = 0,
        sizing: BundleSizing | None = None,
        listener: BundleListener | None = None,
        order: EvictionOrder | None = None,
    ) -> None:
        """listener: told of every bundle published and every published one dropped
        (CheckpointLedger). order: the checkpoints' eviction order (default least recently
        used)."""
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.state_slots = StatePool(num_state_slots)
        self.sizing = sizing or BundleSizing(0, 0, 0)
        self.ledger = CheckpointLedger(self.blocks, block_size, checkpoint_bytes, listener, order,
                                       block_bytes=self.sizing.kv_bytes_per_token * block_size)
        self._dropped_bundles: list[int] = []

    # ------------------------------------------------------------------ blocks and slots

    def allocate_blocks(self, num_blocks_held: int, num_tokens: int, owner: str | None = None) -> list[int] | None:
        """New blocks so that a request holding `num_blocks_held` covers `num_tokens` positions.

        Evicts unpinned checkpoints (in the eviction order; those of the request's tenant
        `owner`, or above their fair share, before others: CheckpointLedger.evict_one) while
        blocks are short. Returns
        the new block ids (possibly empty), or None if they still do not fit; on None no block
        was allocated (checkpoints may have been evicted).
        """
        missing = blocks_needed(num_tokens, self.block_size) - num_blocks_held
        if missing <= 0:
            return []
        while self.blocks.num_free < missing:
            evicted = self.ledger.evict_one(owner)
            if evicted is None:
                return None
            self._dropped_bundles.append(evicted)
        return self.blocks.allocate(missing)

    def share_blocks(self, block_ids: Sequence[int]) -> None:
        """Take one more reference to blocks a restored request reads but never writes."""
        self.blocks.share(list(block_ids))

    def acquire_state_slot(self) -> int | None:
        return self.state_slots.allocate()

    def release(self, block_ids: list[int], state_slot: int | None) -> None:
        """Give back a request's block references and state slot."""
        self.blocks.release(block_ids)
        if state_slot is not None:
            self.state_slots.release(state_slot)

    # ------------------------------------------------------------------ checkpoints

    def lookup(self, namespace: Namespace, token_ids: Sequence[int]) -> Hit | None:
        """The longest published checkpoint that is an exact prefix of token_ids, pinned until
        unpin(hit.bundle_id); None when there is none."""
        return self.ledger.lookup(namespace, token_ids)

    def longest_checkpoint(self, namespace: Namespace, token_ids: Sequence[int]) -> int:
        """Tokens covered by the longest published checkpoint whose tokens are a prefix of
        `token_ids` in `namespace` (0: none). Pins, touches and counts nothing."""
        match = self.ledger.index.longest_prefix(namespace, token_ids)
        return 0 if match is None else match.num_tokens

    def unpin(self, bundle_id: int) -> None:
        self.ledger.unpin(bundle_id)

    def reserve_checkpoint(
        self,
        namespace: Namespace,
        token_ids: Sequence[int],
        kind: CheckpointKind,
        block_ids: Sequence[int],
        owner: str = "",
    ) -> int | None:
        """A pending bundle id, owned by `owner`, for a capture of token_ids by a request holding
        block_ids, or None when it is not worth it (already published there, or worth less
        than the checkpoints it would evict) or does not fit the byte budget even after the
        evictions the fair-share rule allows (CheckpointLedger.evict_until)."""
        if self.ledger.has_checkpoint(namespace, token_ids):
            return None
        num_bytes = self.sizing.bundle_bytes(len(token_ids) % self.block_size)
        evicted = self.ledger.evict_until(num_bytes, owner, newcomer=(namespace, token_ids))
        if evicted is None:
            return None
        self._dropped_bundles.extend(evicted)
        full_blocks = block_ids[: len(token_ids) // self.block_size]
        return self.ledger.reserve(namespace, token_ids, kind, num_bytes, full_blocks, owner)

    def reserve_import(
        self, namespace: Namespace, token_ids: Sequence[int], kind: CheckpointKind, owner: str = "",
    ) -> tuple[int, tuple[int, ...]] | None:
        """A pending bundle, owned by `owner`, for a checkpoint another engine captured, over
        fresh KV blocks for its full blocks: (bundle id, block ids), to be filled by the
        workers and then published (or dropped) like a capture. The bundle holds the only
        reference to those blocks.

        Evicts checkpoints for the blocks (allocate_blocks) and the bytes
        (CheckpointLedger.evict_until) as a capture would. None when they still do not fit:
        then no block is held (checkpoints may have been evicted). The caller checks that the
        endpoint is not published yet."""
        full_tokens = len(token_ids) - len(token_ids) % self.block_size
        blocks = self.allocate_blocks(0, full_tokens, owner)
        if blocks is None:
            return None
        num_bytes = self.sizing.bundle_bytes(len(token_ids) % self.block_size)
        evicted = self.ledger.evict_until(num_bytes, owner)
        bundle_id = None
        if evicted is not None:
            self._dropped_bundles.extend(evicted)
            bundle_id = self.ledger.reserve(namespace, token_ids, kind, num_bytes, blocks, owner)
        self.blocks.release(blocks)  # the bundle's references stay, if it was reserved
        return None if bundle_id is None else (bundle_id, tuple(blocks))

    def publish(self, bundle_id: int, confirmed_ranks: set[int], world_size: int) -> bool:
        """Make a captured bundle visible if every rank confirmed; False means it was dropped
        (and its worker copies must be freed)."""
        outcome = self.ledger.publish(bundle_id, confirmed_ranks, world_size)
        if outcome is not PublishOutcome.PUBLISHED:
            self._dropped_bundles.append(bundle_id)
            return False
        return True

    def take_dropped_bundles(self) -> tuple[int, ...]:
        """Ids of bundles forgotten since the last call (the workers free their tensors)."""
        dropped, self._dropped_bundles = self._dropped_bundles, []
        return tuple(dropped)

    def keep_evicted(self) -> None:
        """From now on, remember every bundle evicted (not dropped otherwise) until
        take_evicted: a lower tier copies them out before their blocks are written again."""
        if self.ledger.evicted is None:
            self.ledger.evicted = []

    def take_evicted(self) -> list[Bundle]:
        """The records of the bundles evicted since the last call (keep_evicted), oldest first.
        Their block ids still hold their K/V, and the workers their tensors, until the next step
        is submitted; nothing references them any more."""
        evicted = self.ledger.evicted or []
        if evicted:
            self.ledger.evicted = []
        return evicted

    def return_dropped_bundles(self, bundle_ids: tuple[int, ...]) -> None:
        """Bundle ids taken for a step that failed: the next take_dropped_bundles yields them
        again, so the runner still frees their tensors."""
        self._dropped_bundles = list(bundle_ids) + self._dropped_bundles

    def usage(self, num_requests: int = 0) -> PoolUsage:
        """Free blocks count blocks held by nobody; blocks referenced only by checkpoints are
        in use until those checkpoints are evicted."""
        return PoolUsage(
            free_blocks=self.blocks.num_free,
            total_blocks=self.blocks.num_blocks,
            free_state_slots=self.state_slots.num_free,
            total_state_slots=self.state_slots.num_slots,
            num_requests=num_requests,
            checkpoint_only_blocks=self.ledger.num_blocks_held_alone(),
            num_checkpoints=len(self.ledger),
            checkpoint_bytes=self.ledger.bytes_held,
            checkpoint_pins=self.ledger.num_pins,
        )
