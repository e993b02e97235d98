"""What the scheduler-side cache knows about each checkpoint bundle (pure Python).

A bundle is the saved state of one request at one token position (docs/design.md section 2). The tensors
(conv and SSM states, attention tail, hidden row) live in the workers under the bundle id; the
ledger records what the scheduler needs to decide about them: namespace, token ids, kind, bytes
held, the full KV blocks referenced, pins and recency.

Life of a bundle:
  reserve -> PENDING: holds one BlockPool reference per full KV block and its bytes; invisible.
  publish -> PUBLISHED (every rank confirmed, endpoint new): visible to lookup, in the radix index.
          -> dropped (a rank missing, or a duplicate endpoint). A capture that failed or was
             abandoned is published with no confirmations, so it is dropped the same way.
  lookup pins a published bundle until unpin; evict_one / evict_until drop unpinned published ones
  in the ledger's eviction order (cache/eviction.py: least recently used, or least prefill
  compute saved per byte with recency), each tenant (owner) keeping its fair share of the budget
  against other tenants (evict_until).
A BundleListener given to the ledger hears of every bundle that becomes visible and of every
visible one that goes (engine/checkpoints/capture_events.py turns that into the engine's event feed);
pending bundles that never publish are not reported.
Dropping a bundle releases its block references and its bytes; the workers may then free its
tensors. The block references are taken at reserve, not at publish: the capturing request may
finish and release its own blocks before the ranks confirm, and a block must not be reused while
a bundle might still become visible over it. Because every bundle, pending or published, holds a
reference to each of its blocks, the BlockPool never frees a block a bundle depends on: KV
pressure is relieved by evicting whole bundles (CacheManager.allocate_blocks), never by taking a
block from under one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from cache.block_pool import BlockPool
from cache.checkpoint_keys import CheckpointKind, Namespace
from cache.eviction import EvictionOrder, LruOrder, choose_victims, fair_share
from cache.radix_index import BundleId, RadixIndex


class BundleState(Enum):
    PENDING = "pending"  # reserved, capture not yet confirmed; invisible
    PUBLISHED = "published"  # visible to lookups


class PublishOutcome(Enum):
    PUBLISHED = "published"  # visible from now on
    UNCONFIRMED = "unconfirmed"  # some rank did not confirm: dropped
    DUPLICATE = "duplicate"  # the endpoint was already published: dropped, the existing one kept


@dataclass
class Bundle:
    """The ledger's record of one bundle. Read it; only the ledger changes it."""

    bundle_id: BundleId
    namespace: Namespace
    token_ids: tuple[int, ...]
    kind: CheckpointKind
    num_bytes: int  # everything held for it outside shared KV blocks: states, attention tail, hidden row
    block_ids: tuple[int, ...]  # full KV blocks of tokens [0, p - p mod B); one reference each
    state: BundleState = BundleState.PENDING
    pin_count: int = 0
    owner: str = ""  # the tenant whose request captured it (evict_until's fair share)


class BundleListener(Protocol):
    """Told, on the thread that changes the ledger, when a bundle becomes visible to lookups,
    when a visible one is dropped (evicted) and when lookup returns one (a hit). Must not call
    back into the ledger."""

    def published(self, bundle: Bundle) -> None: ...

    def dropped(self, bundle: Bundle) -> None: ...

    def hit(self, bundle: Bundle) -> None: ...


@dataclass(frozen=True)
class Hit:
    """A pinned bundle to restore: share `block_ids`, copy tail and state, then unpin."""

    bundle_id: BundleId
    num_tokens: int
    kind: CheckpointKind
    block_ids: tuple[int, ...]


@dataclass
class KindCounters:
    captured: int = 0  # published
    hit: int = 0  # returned by lookup
    evicted: int = 0  # dropped by evict_one / evict_until
    deduplicated: int = 0  # dropped at publish, endpoint already present
    dropped: int = 0  # never published: a rank did not confirm (or the capture was abandoned)


class CheckpointLedger:
    def __init__(
        self, blocks: BlockPool, block_size: int, budget_bytes: int,
        listener: BundleListener | None = None, order: EvictionOrder | None = None,
        block_bytes: int = 0,
    ) -> None:
        """order: the eviction order of published bundles (default least recently used); it
        is told what each bundle covers beyond the longest published bundle that is a prefix
        of it, and the bytes it holds beyond that one: its own bytes plus `block_bytes` per
        full KV block past that one's (_value_figures)."""
        if block_size < 1 or budget_bytes < 0:
            raise ValueError(f"bad block_size {block_size} or budget_bytes {budget_bytes}")
        self.blocks = blocks
        self.listener = listener
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.index = RadixIndex()
        self.counters = {kind: KindCounters() for kind in CheckpointKind}
        self._bundles: dict[BundleId, Bundle] = {}
        self.order: EvictionOrder = order if order is not None else LruOrder()  # published ones
        self.block_bytes = block_bytes
        # the bundles evict_one / evict_until dropped, for a lower tier to take (keep_evicted)
        self.evicted: list[Bundle] | None = None
        self._bundle_refs: Counter[int] = Counter()  # block -> references bundles hold (> 0)
        self._next_id = 0
        self._bytes_held = 0
        # per owner: bytes held and bundles held (owners with none are left out)
        self._owner_bytes: dict[str, int] = {}
        self._owner_bundles: dict[str, int] = {}

    # ---- reading (changes nothing) -----------------------------------------------------------

    @property
    def bytes_held(self) -> int:
        """Bytes of pending and published bundles."""
        return self._bytes_held

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self._bytes_held

    @property
    def num_pins(self) -> int:
        """Pins held by restores in progress (lookup without its unpin yet)."""
        return sum(bundle.pin_count for bundle in list(self._bundles.values()))

    def __len__(self) -> int:
        """Number of bundles the ledger knows, pending ones included."""
        return len(self._bundles)

    def get(self, bundle_id: BundleId) -> Bundle | None:
        return self._bundles.get(bundle_id)

    def bundles_for_block(self, block_id: int) -> frozenset[BundleId]:
        """Ids of the bundles (pending or published) holding a reference to `block_id` (a scan
        of every bundle: for tests and diagnostics)."""
        return frozenset(b.bundle_id for b in list(self._bundles.values()) if block_id in b.block_ids)

    def num_blocks_held_alone(self) -> int:
        """Blocks whose every reference belongs to a bundle (freed if those are dropped)."""
        return sum(  # over a copy: metrics and pool_usage read while the step thread runs
            1 for block, held in list(self._bundle_refs.items()) if self.blocks.ref_count(block) == held
        )

    def published_at(self, namespace: Namespace, token_ids: Sequence[int]) -> Bundle | None:
        """The published bundle at exactly `token_ids` in `namespace`, or None. Changes nothing
        (no pin, no recency, no hit counted)."""
        bundle_id = self.index.get(namespace, token_ids)
        return None if bundle_id is None else self._bundles[bundle_id]

    def has_checkpoint(self, namespace: Namespace, token_ids: Sequence[int]) -> bool:
        """Whether a published bundle sits at exactly `token_ids` (capturing it again is wasted)."""
        return self.index.get(namespace, token_ids) is not None

    # ---- two-phase publication ---------------------------------------------------------------

    def reserve(
        self,
        namespace: Namespace,
        token_ids: Sequence[int],
        kind: CheckpointKind,
        num_bytes: int,
        block_ids: Sequence[int],
        owner: str = "",
    ) -> BundleId | None:
        """A new PENDING bundle id, owned by `owner`, invisible to lookups, or None if
        `num_bytes` does not fit.

        `block_ids` are the full KV blocks of the first len(token_ids) // block_size tokens, all
        allocated; each gets one BlockPool reference now. Call evict_until(num_bytes) first to
        make room. On None or ValueError nothing changed.
        """
        tokens = tuple(token_ids)
        blocks = tuple(block_ids)
        if not tokens or num_bytes < 0:
            raise ValueError("a bundle covers at least one token and holds >= 0 bytes")
        if len(blocks) != len(tokens) // self.block_size or len(set(blocks)) != len(blocks):
            need = len(tokens) // self.block_size
            raise ValueError(f"{len(tokens)} tokens need exactly {need} distinct full blocks")
        if not self.blocks.all_allocated(blocks):
            raise ValueError("a bundle can only reference allocated blocks")
        if num_bytes > self.free_bytes:
            return None
        self.blocks.share(blocks)
        bundle = Bundle(self._next_id, namespace, tokens, CheckpointKind(kind), num_bytes, blocks,
                        owner=owner)
        self._next_id += 1
        self._bundles[bundle.bundle_id] = bundle
        self._bundle_refs.update(blocks)  # Counter.update counts in C
        self._bytes_held += num_bytes
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + num_bytes
        self._owner_bundles[owner] = self._owner_bundles.get(owner, 0) + 1
        return bundle.bundle_id

    def publish(self, bundle_id: BundleId, confirmed_ranks: set[int], world_size: int) -> PublishOutcome:
        """Make a pending bundle visible if and only if ranks 0 .. world_size-1 all confirmed it.

        Fails closed: a missing (or unknown) rank, or an endpoint that is already published (that
        one is kept and touched), drops the bundle and releases its references; the outcome says
        which. Raises ValueError if `bundle_id` is not pending.
        """
        bundle = self._pending(bundle_id)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        counters = self.counters[bundle.kind]
        if set(confirmed_ranks) != set(range(world_size)):
            self._drop(bundle)
            counters.dropped += 1
            return PublishOutcome.UNCONFIRMED
        figures = self._value_figures(bundle.namespace, bundle.token_ids, bundle.num_bytes)
        existing = self.index.insert(bundle.namespace, bundle.token_ids, bundle_id)
        if existing is not None:
            self._drop(bundle)
            self._touch(self._bundles[existing])
            counters.deduplicated += 1
            return PublishOutcome.DUPLICATE
        bundle.state = BundleState.PUBLISHED
        self.order.add(bundle_id, *figures)
        counters.captured += 1
        if self.listener is not None:
            self.listener.published(bundle)
        return PublishOutcome.PUBLISHED

    # ---- lookup and pinning --------------------------------------------------------------------

    def lookup(self, namespace: Namespace, prompt_ids: Sequence[int]) -> Hit | None:
        """The published bundle with the longest exact token prefix of `prompt_ids`, pinned.

        A bundle covering the whole prompt is returned too. On a hit the bundle (and therefore
        its blocks) cannot be evicted until unpin(bundle_id); it becomes most recently used and
        is counted as a hit (and the listener told). None changes nothing.
        """
        match = self.index.longest_prefix(namespace, prompt_ids)
        if match is None:
            return None
        bundle = self._bundles[match.bundle_id]
        bundle.pin_count += 1
        self._touch(bundle)
        self.counters[bundle.kind].hit += 1
        if self.listener is not None:
            self.listener.hit(bundle)
        return Hit(bundle.bundle_id, match.num_tokens, bundle.kind, bundle.block_ids)

    def unpin(self, bundle_id: BundleId) -> None:
        """Release one pin taken by lookup (once the restore copied what it needed)."""
        bundle = self._bundles.get(bundle_id)
        if bundle is None or bundle.pin_count <= 0:
            raise ValueError(f"bundle {bundle_id} is not pinned")
        bundle.pin_count -= 1

    # ---- eviction --------------------------------------------------------------------------------

    def evict_one(self, owner: str | None = None) -> BundleId | None:
        """Drop the first unpinned published bundle of the eviction order; its id, or None if
        there is none.

        With `owner` (a request of that tenant needs KV blocks), the bundles the fair-share rule
        of evict_until lets it evict go first; only when there is none does another go, since a
        running request comes before any checkpoint. Releases the bundle's block references
        (the caller may then find blocks freed in the BlockPool).
        """
        unpinned = (self._bundles[b] for b in self.order if self._bundles[b].pin_count == 0)
        victim = next(unpinned, None)
        if victim is None:
            return None
        if owner is not None and victim.owner != owner:  # look for one the rule allows
            held, share = self._holdings(owner)
            allowed = (b for b in unpinned if b.owner == owner or held[b.owner] - b.num_bytes >= share)
            if held[victim.owner] - victim.num_bytes < share:
                victim = next(allowed, victim)
        self._evict(victim)
        return victim.bundle_id

    def evict_until(self, bytes_needed: int, owner: str = "",
                    newcomer: tuple[Namespace, Sequence[int]] | None = None) -> list[BundleId] | None:
        """Evict unpinned bundles in the eviction order until free_bytes >= bytes_needed, for a
        capture owned by `owner`, under the fair-share rule: `owner`'s own bundles may all be
        evicted, another owner's only while that owner keeps at least its fair share of the
        budget, budget_bytes / the number of owners holding bundles (`owner` counted). So a
        tenant whose checkpoints fit its share never loses them to another tenant's captures;
        with one owner (no API keys) the order alone decides. `newcomer` (namespace, token ids):
        the capture the room is for; only bundles the order ranks below it may go
        (EvictionOrder.below), so a capture worth less than what it would evict is not taken.

        Returns the evicted ids, in eviction order (empty if there was room already), or None
        when the evictions allowed would not make room: then nothing was evicted. Pinned and
        pending bundles are never evicted.
        """
        shortfall = bytes_needed - self.free_bytes
        if shortfall <= 0:
            return []
        held, share = self._holdings(owner)
        bundles = self._bundles
        order = self.order if newcomer is None else self.order.below(
            *self._value_figures(newcomer[0], tuple(newcomer[1]), bytes_needed))
        victims = choose_victims(
            order, shortfall, owner, held, share,
            bytes_of=lambda b: bundles[b].num_bytes, owner_of=lambda b: bundles[b].owner,
            evictable=lambda b: bundles[b].pin_count == 0)
        if victims is None:
            return None
        for bundle_id in victims:
            self._evict(bundles[bundle_id])
        return victims

    def _value_figures(self, namespace: Namespace, token_ids: tuple[int, ...], num_bytes: int) -> tuple[int, int, int]:
        """(tokens, bytes held beyond the prefix, prefix tokens) of a bundle at token_ids
        holding num_bytes, for the eviction order: the prefix is the longest published bundle
        that covers fewer of its tokens (0 without one), and the bytes count its own plus
        block_bytes per full block past the prefix's. Reads the index only."""
        prefix = self.index.longest_prefix(namespace, token_ids[:-1]) if len(token_ids) > 1 else None
        prefix_tokens = 0 if prefix is None else prefix.num_tokens
        blocks = len(token_ids) // self.block_size - prefix_tokens // self.block_size
        return len(token_ids), num_bytes + blocks * self.block_bytes, prefix_tokens

    # ---- internals -------------------------------------------------------------------------------

    def _holdings(self, owner: str) -> tuple[dict[str, int], float]:
        """Bytes held by each owner holding bundles, and by `owner` (maybe 0), and the fair
        share of the budget: budget_bytes / the number of those owners. O(owners)."""
        return fair_share(self._owner_bytes, owner, self.budget_bytes)

    def _pending(self, bundle_id: BundleId) -> Bundle:
        bundle = self._bundles.get(bundle_id)
        if bundle is None or bundle.state is not BundleState.PENDING:
            raise ValueError(f"bundle {bundle_id} is not pending")
        return bundle

    def _touch(self, bundle: Bundle) -> None:
        """`bundle` was just used (the eviction order counts it recent)."""
        self.order.touch(bundle.bundle_id)

    def _evict(self, bundle: Bundle) -> None:
        assert bundle.pin_count == 0 and bundle.state is BundleState.PUBLISHED
        self.counters[bundle.kind].evicted += 1
        if self.evicted is not None:
            self.evicted.append(bundle)
        self._drop(bundle)

    def _drop(self, bundle: Bundle) -> None:
        """Forget `bundle`: out of the index and LRU, block references and bytes released; the
        listener hears of it if it was published."""
        assert bundle.pin_count == 0
        if bundle.state is BundleState.PUBLISHED:
            self.index.remove(bundle.namespace, bundle.bundle_id)
            self.order.remove(bundle.bundle_id)
            if self.listener is not None:
                self.listener.dropped(bundle)
        refs = self._bundle_refs
        for block in bundle.block_ids:
            refs[block] -= 1
            if not refs[block]:
                del refs[block]
        self.blocks.release(list(bundle.block_ids))
        self._bytes_held -= bundle.num_bytes
        self._owner_bytes[bundle.owner] -= bundle.num_bytes
        self._owner_bundles[bundle.owner] -= 1
        if not self._owner_bundles[bundle.owner]:
            del self._owner_bundles[bundle.owner], self._owner_bytes[bundle.owner]
        del self._bundles[bundle.bundle_id]
