"""The host tier: checkpoints evicted from the device budgets, kept in host memory (pinned on
cuda; plain memory on cpu, still a budget and tier of its own), and promoted back when a
request needs one (docs/design.md section 5, Tiers).

    device ledger evicts a bundle --demote (LLMEngine, before the step that may reuse its
        blocks)--> HostTier.add: its ExportedCheckpoint (every rank's shard: state, the K/V of
        all its tokens, hidden row), copied off the device without waiting for it
    a request's first admission --PrefixWaits.start--> HostTier.lookup: the longest
        checkpoint held here that covers more than the device holds --> HostFetch, its copy
        to the device started on a stream of its own (DeviceStaging); the request waits in the
        scheduler while the others step; the engine imports the copy as any fetched checkpoint
        (LLMEngine._import_fetched) and the request restores it
    the host budget is full --HostTier evicts in its own order--> on_evict(EvictedCheckpoint):
        the next tier (the object store, when it is on: deployments/cluster/store_demotion.py
        StoreDemotion.demote, which hands it to the replica's event loop), or gone

The tier is inclusive: a promoted checkpoint stays here, so evicting it from the device again
costs no copy. Its budget, order (LRU or value per byte, cache/eviction.py, over the bytes it
holds here) and tenants' fair shares are its own. A copy here never leaves the process unless
on_evict takes it, so its shards carry no checksum (`verified` fetches skip the import's
checksum, which would cost a pass over every byte); whoever takes it out of the process adds
them (`with_checksums`), off the step thread.

Step thread only.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cache.checkpoint_keys import Namespace
from cache.eviction import EvictionOrder, choose_victims, fair_share
from cache.radix_index import RadixIndex
from engine.checkpoints.transfer import CheckpointShard, ExportedCheckpoint, shard_checksum

logger = logging.getLogger(__name__)


@dataclass
class HostEntry:
    """A checkpoint held in the host tier. `ready`: the event its copy off the device records
    (None when the copy was synchronous); its tensors may be read on the host only after it.
    bundle_id: the device bundle it was demoted from."""

    exported: ExportedCheckpoint
    num_bytes: int
    bundle_id: int
    ready: object | None = None

    @property
    def owner(self) -> str:
        return self.exported.header.owner

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


@dataclass
class HostTierCounters:
    """What the host tier did, cumulative (EngineStats.host_tier)."""

    demoted: int = 0  # checkpoints copied here from the device
    demoted_bytes: int = 0
    already_held: int = 0  # evicted from the device while held here: no copy
    refused: int = 0  # not worth what it would evict, or larger than the budget
    promoted: int = 0  # imported back to the device
    promoted_bytes: int = 0
    promotion_failed: int = 0  # the import rejected it (no room on the device; the entry stays)
    evicted: int = 0  # out of the host budget
    passed_on: int = 0  # of those, handed to the next tier

    def copy(self) -> HostTierCounters:
        return dataclasses.replace(self)


@dataclass(frozen=True)
class EvictedCheckpoint:
    """What on_evict is given: a checkpoint the host tier evicted, its tensors on the host and
    its copy off the device finished, without checksums (with_checksums adds them: a pass over
    every byte, for the receiver to make off the step thread). bundle_id: the device bundle it
    was demoted from (unique in this engine: the ledger never reuses an id)."""

    exported: ExportedCheckpoint
    bundle_id: int


class DeviceStaging:
    """Copies a host checkpoint to `device` without blocking the step thread: on cuda on a
    stream of its own (the step's kernels go on), done when its event has passed; off cuda
    the checkpoint is used where it is."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, entry: HostEntry) -> StagedCopy:
        if self._stream is None:
            entry.wait()
            return StagedCopy(entry.exported, None)
        with torch.cuda.stream(self._stream):
            if entry.ready is not None:  # its copy off the device may still be queued
                self._stream.wait_event(entry.ready)
            shards = tuple(_to_device(shard, self.device) for shard in entry.exported.shards)
            done = torch.cuda.Event()
            done.record(self._stream)
        return StagedCopy(ExportedCheckpoint(entry.exported.header, shards), done)


class StagedCopy:
    """A checkpoint on its way to the device: done() once its copies finished."""

    def __init__(self, exported: ExportedCheckpoint, done_event: object | None) -> None:
        self._exported = exported
        self._event = done_event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> ExportedCheckpoint:
        """The checkpoint, its tensors on the device (on cuda: ordered before anything the
        current stream runs next)."""
        if self._event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self._event)
            for shard in self._exported.shards:
                for tensor in shard.tensors().values():
                    tensor.record_stream(stream)
        return self._exported


class HostTier:
    """A CheckpointSource over the checkpoints demoted from the device (see the module doc).

    budget_bytes: what the held shards may take. order: the tier's eviction order. staging:
    how a promotion reaches the device. on_evict: given each checkpoint evicted from here, e.g.
    to keep it in the object-store tier; called on the step thread, it must return at once
    (hand the work to another thread) and its exceptions cost that checkpoint only; None drops
    it. Set it before the engine serves requests. fetch_timeout_s: how long the scheduler waits
    for a promotion before recomputing.
    """

    def __init__(self, budget_bytes: int, order: EvictionOrder, staging: DeviceStaging,
                 on_evict: Callable[[EvictedCheckpoint], None] | None = None,
                 fetch_timeout_s: float = 30.0) -> None:
        self.budget_bytes = budget_bytes
        self.order = order
        self.staging = staging
        self.on_evict = on_evict
        self.fetch_timeout_s = fetch_timeout_s
        self.counters = HostTierCounters()
        self.index = RadixIndex()
        self._ids = itertools.count()
        self._entries: dict[int, HostEntry] = {}
        self._bytes_held = 0
        self._owner_bytes: dict[str, int] = {}

    # ---- reading ---------------------------------------------------------------------------

    @property
    def bytes_held(self) -> int:
        return self._bytes_held

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, namespace: Namespace, token_ids: tuple[int, ...]) -> bool:
        return self.index.get(namespace, token_ids) is not None

    def entry(self, namespace: Namespace, token_ids: tuple[int, ...]) -> HostEntry | None:
        entry_id = self.index.get(namespace, token_ids)
        return None if entry_id is None else self._entries[entry_id]

    # ---- demotion ----------------------------------------------------------------------------

    def touch_if_held(self, namespace: Namespace, token_ids: tuple[int, ...]) -> bool:
        """A checkpoint leaves the device: if it is held here already (promoted from here, or
        demoted before), count it recent and return True; no copy is needed."""
        entry_id = self.index.get(namespace, token_ids)
        if entry_id is None:
            return False
        self.order.touch(entry_id)
        self.counters.already_held += 1
        return True

    def admits(self, namespace: Namespace, token_ids: tuple[int, ...], num_bytes: int, owner: str) -> bool:
        """Whether a checkpoint of num_bytes would be kept: it fits the budget once the
        evictions the order and the tenants' shares allow are made. Changes nothing."""
        return self._victims(namespace, token_ids, num_bytes, owner) is not None

    def add(self, exported: ExportedCheckpoint, bundle_id: int, ready: object | None = None) -> bool:
        """Keep `exported` (its tensors on the host; `ready` the event its copy records),
        demoted from the device's bundle `bundle_id`, evicting what the order ranks below it;
        False, nothing changed, when it is not worth that or does not fit."""
        header = exported.header
        if self.holds(header.namespace, header.token_ids):
            return True
        num_bytes = exported.nbytes
        victims = self._victims(header.namespace, header.token_ids, num_bytes, header.owner)
        if victims is None:
            self.counters.refused += 1
            return False
        for victim in victims:
            self._evict(victim)
        entry_id = next(self._ids)
        figures = self._value_figures(header.namespace, header.token_ids, num_bytes)
        self.index.insert(header.namespace, header.token_ids, entry_id)
        self._entries[entry_id] = HostEntry(exported, num_bytes, bundle_id, ready)
        self.order.add(entry_id, *figures)
        self._bytes_held += num_bytes
        self._owner_bytes[header.owner] = self._owner_bytes.get(header.owner, 0) + num_bytes
        self.counters.demoted += 1
        self.counters.demoted_bytes += num_bytes
        return True

    # ---- promotion: the CheckpointSource contract ------------------------------------------

    def lookup(self, namespace: Namespace, token_ids: tuple[int, ...], have: int) -> HostFetch | None:
        """A promotion, already started, of the longest checkpoint here whose tokens are a
        prefix of token_ids, when it covers more than `have`; None otherwise. Never raises."""
        match = self.index.longest_prefix(namespace, token_ids)
        if match is None or match.num_tokens <= have:
            return None
        self.order.touch(match.bundle_id)
        entry = self._entries[match.bundle_id]
        return HostFetch(self, match.bundle_id, self.staging.start(entry), match.num_tokens,
                         time.monotonic() + self.fetch_timeout_s, entry.num_bytes)

    def _settled(self, entry_id: int, accepted: bool, num_bytes: int) -> None:
        """The engine's import of a promotion: published (num_bytes 0: another request's
        promotion of the same checkpoint came first), or rejected. A copy that never left the
        process passes the import's checks, so a rejection says the device had no room (its
        blocks or bytes, after the evictions allowed): the entry stays for a later request."""
        if accepted:
            self.counters.promoted += num_bytes > 0
            self.counters.promoted_bytes += num_bytes
        else:
            self.counters.promotion_failed += 1

    # ---- internals -----------------------------------------------------------------------------

    def _victims(self, namespace: Namespace, token_ids: tuple[int, ...], num_bytes: int,
                 owner: str) -> list[int] | None:
        if num_bytes > self.budget_bytes:
            return None
        shortfall = num_bytes - (self.budget_bytes - self._bytes_held)
        if shortfall <= 0:
            return []
        held, share = fair_share(self._owner_bytes, owner, self.budget_bytes)
        entries = self._entries
        return choose_victims(
            self.order.below(*self._value_figures(namespace, token_ids, num_bytes)), shortfall, owner, held,
            share, bytes_of=lambda e: entries[e].num_bytes, owner_of=lambda e: entries[e].owner,
            evictable=lambda e: True)

    def _value_figures(self, namespace: Namespace, token_ids: tuple[int, ...], num_bytes: int) -> tuple[int, int, int]:
        """(tokens, bytes, prefix tokens) for the order: the bytes a checkpoint holds here
        include the K/V of every token, so what a shorter one here already covers is not
        subtracted from them, only from the compute saved."""
        prefix = self.index.longest_prefix(namespace, token_ids[:-1]) if len(token_ids) > 1 else None
        return len(token_ids), num_bytes, 0 if prefix is None else prefix.num_tokens

    def _evict(self, entry_id: int) -> None:
        entry = self._remove(entry_id)
        self.counters.evicted += 1
        if self.on_evict is None:
            return
        try:
            entry.wait()
            self.on_evict(EvictedCheckpoint(entry.exported, entry.bundle_id))
        except Exception:  # the next tier's failure costs this checkpoint, never the step
            logger.exception("passing an evicted checkpoint on from the host tier failed")
            return
        self.counters.passed_on += 1

    def _remove(self, entry_id: int) -> HostEntry:
        entry = self._entries.pop(entry_id)
        header = entry.exported.header
        self.index.remove(header.namespace, entry_id)
        self.order.remove(entry_id)
        self._bytes_held -= entry.num_bytes
        self._owner_bytes[entry.owner] -= entry.num_bytes
        if not self._owner_bytes[entry.owner]:
            del self._owner_bytes[entry.owner]
        return entry


class HostFetch:
    """A promotion from the host tier (a CheckpointFetch): the copy to the device runs while
    the request waits in the scheduler. `verified`: the checkpoint never left this process."""

    verified = True

    def __init__(self, tier: HostTier, entry_id: int, copy: StagedCopy, num_tokens: int,
                 deadline: float, num_bytes: int) -> None:
        self._tier = tier
        self._entry_id = entry_id
        self._copy = copy
        self.num_tokens = num_tokens
        self.deadline = deadline
        self.num_bytes = num_bytes

    def done(self) -> bool:
        return self._copy.done()

    def result(self) -> ExportedCheckpoint | None:
        return self._copy.result()

    def settle(self, accepted: bool, num_bytes: int) -> None:
        self._tier._settled(self._entry_id, accepted, num_bytes)

    def abandon(self) -> None:
        """Nothing to stop: the copy finishes and is dropped with this object."""


def with_checksums(exported: ExportedCheckpoint) -> ExportedCheckpoint:
    """`exported` with each shard's checksum computed (host tensors), to leave the process."""
    digest = exported.header.digest
    shards = tuple(dataclasses.replace(shard, checksum=shard_checksum(shard.rank, digest, shard.tensors()))
                   for shard in exported.shards)
    return ExportedCheckpoint(exported.header, shards)


def _to_device(shard: CheckpointShard, device: torch.device) -> CheckpointShard:
    """A copy of `shard` on `device`, its copies queued on the current stream (non-blocking from
    pinned memory)."""
    tensors = {name: tensor.to(device, non_blocking=True) for name, tensor in shard.tensors().items()}
    return CheckpointShard(rank=shard.rank, checksum=shard.checksum, **tensors)
