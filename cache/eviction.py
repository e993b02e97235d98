"""The order in which a tier's checkpoints are evicted (docs/design.md section 5, Eviction).

Two orders, one interface (`EvictionOrder`): the key of each checkpoint is added when it enters
the tier, touched when it is used, removed when it leaves; iterating yields the keys least
worth keeping first. The caller skips those it may not evict (pinned, another tenant's share)
and stops when it has made room.

    lru    least recently used first.
    value  least value first, value = prefill FLOPs the checkpoint saves per byte it holds,
           halved every `half_life` touches of the tier since it was last used (Marconi,
           MLSys 2025: FLOP efficiency with recency). So a long instruction checkpoint, which
           saves far more compute per byte than a short prompt's, outlives a burst of short
           ones, and one that nobody uses any more still ages out. As in Marconi, a
           checkpoint whose tokens extend a shorter one in the tier (a prompt after its
           instructions) is worth what it saves beyond that one, per byte beyond it
           (`prefix_tokens`).

A new checkpoint that would rank below every one it has to evict is not worth taking them out
for: `below` gives only the keys it outranks (all of them for lru, where the newcomer is the
most recent).

Recency is counted in touches (adds and uses) of the tier, not in seconds, so the order is a
function of the sequence of events alone: deterministic, and independent of the load. Since
every key decays at the same rate, the order of two keys does not change while neither is
touched: a key's priority is fixed at its last touch, log2(value) + clock / half_life, and the
value order keeps them in a heap.

Pure Python.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Hashable, Protocol


class EvictionPolicy(str, Enum):
    LRU = "lru"
    VALUE = "value"


@dataclass(frozen=True)
class PrefillCost:
    """FLOPs of a prefill of n tokens: flops_per_token * n for everything a token costs alone
    (projections, MLPs, the recurrent update) plus flops_per_token_pair * n (n + 1) / 2 for the
    causal attention's query-key pairs (scores and the weighted sum of values, every attention
    layer). An estimate from the model's shapes (engine/checkpoints/prefill_cost.py): it ranks
    checkpoints, it does not time them."""

    flops_per_token: float = 1.0
    flops_per_token_pair: float = 0.0

    def flops(self, num_tokens: int) -> float:
        return self.flops_per_token * num_tokens + self.flops_per_token_pair * num_tokens * (num_tokens + 1) / 2


class EvictionOrder(Protocol):
    """Keys of a tier's checkpoints, least worth keeping first. The tier calls add when a
    checkpoint enters, touch when one is used, remove when one leaves; iteration must not
    overlap a change."""

    def add(self, key: Hashable, num_tokens: int, num_bytes: int, prefix_tokens: int = 0) -> None:
        """`key` enters: it covers num_tokens tokens, of which a shorter checkpoint of the tier
        covers prefix_tokens, and holds num_bytes beyond that one."""

    def below(self, num_tokens: int, num_bytes: int, prefix_tokens: int = 0) -> Iterator[Hashable]:
        """The keys a checkpoint with these figures, added now, would outrank, least worth
        keeping first."""

    def touch(self, key: Hashable) -> None: ...

    def remove(self, key: Hashable) -> None: ...

    def __iter__(self) -> Iterator[Hashable]: ...

    def __len__(self) -> int: ...


class LruOrder:
    """Least recently used first."""

    def __init__(self) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable, num_tokens: int, num_bytes: int, prefix_tokens: int = 0) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)

    def below(self, num_tokens: int, num_bytes: int, prefix_tokens: int = 0) -> Iterator[Hashable]:
        return iter(self._keys)

    def touch(self, key: Hashable) -> None:
        self._keys.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._keys[key]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class ValueOrder:
    """Least value first: log2(value_per_byte) + (clock at the last touch) / half_life, the
    clock counting adds and touches. Ties go to the least recently touched.

    A heap of (priority, touch number, key) with stale entries skipped: add and touch cost
    O(log n); iterating copies the heap once and pops in order."""

    def __init__(self, cost: PrefillCost, half_life: float) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.cost = cost
        self.half_life = half_life
        self._ticks = 0
        self._value: dict[Hashable, float] = {}  # key -> log2(FLOPs saved per byte)
        self._entry: dict[Hashable, tuple[float, int]] = {}  # key -> its live (priority, touch)
        self._heap: list[tuple[float, int, Hashable]] = []

    def value_per_byte(self, num_tokens: int, num_bytes: int, prefix_tokens: int = 0) -> float:
        """Prefill FLOPs saved beyond the first prefix_tokens, per byte held (bytes below 1
        count as 1)."""
        saved = self.cost.flops(num_tokens) - self.cost.flops(min(prefix_tokens, num_tokens))
        return saved / max(num_bytes, 1)

    def _log_value(self, num_tokens: int, num_bytes: int, prefix_tokens: int) -> float:
        return math.log2(max(self.value_per_byte(num_tokens, num_bytes, prefix_tokens), 1e-300))

    def add(self, key: Hashable, num_tokens: int, num_bytes: int, prefix_tokens: int = 0) -> None:
        self._value[key] = self._log_value(num_tokens, num_bytes, prefix_tokens)
        self.touch(key)

    def below(self, num_tokens: int, num_bytes: int, prefix_tokens: int = 0) -> Iterator[Hashable]:
        now = self._log_value(num_tokens, num_bytes, prefix_tokens) + self._next_tick() / self.half_life
        for key in self:
            if self._entry[key][0] >= now:
                return
            yield key

    def touch(self, key: Hashable) -> None:
        tick = self._next_tick()
        self._ticks += 1
        entry = (self._value[key] + tick / self.half_life, tick)
        self._entry[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 2 * len(self._entry) + 64:  # drop stale entries now and then
            self._heap = [(*e, k) for k, e in self._entry.items()]
            heapq.heapify(self._heap)

    def _next_tick(self) -> int:
        return self._ticks

    def remove(self, key: Hashable) -> None:
        del self._value[key], self._entry[key]

    def __iter__(self) -> Iterator[Hashable]:
        heap = list(self._heap)
        while heap:
            priority, tick, key = heapq.heappop(heap)
            if self._entry.get(key) == (priority, tick):
                yield key

    def __len__(self) -> int:
        return len(self._entry)


def make_order(policy: EvictionPolicy | str, cost: PrefillCost | None = None,
               half_life: float = 128.0) -> EvictionOrder:
    """The eviction order of `policy` (value needs the model's prefill cost; without one, the
    saved compute is the token count)."""
    if EvictionPolicy(policy) is EvictionPolicy.LRU:
        return LruOrder()
    return ValueOrder(cost or PrefillCost(), half_life)


def fair_share(held: dict[str, int], owner: str, budget_bytes: int) -> tuple[dict[str, int], float]:
    """Bytes held by each owner holding checkpoints in a tier (`held`), with `owner` added at 0
    when it holds none, and the fair share of the tier's budget: budget_bytes / the number of
    those owners."""
    holdings = {owner: 0, **held}
    return holdings, budget_bytes / len(holdings)


def choose_victims(
    order: Iterable[Hashable], shortfall: int, owner: str, held: dict[str, int], share: float,
    bytes_of: Callable[[Hashable], int], owner_of: Callable[[Hashable], str],
    evictable: Callable[[Hashable], bool],
) -> list[Hashable] | None:
    """The keys to evict, in `order`, to free `shortfall` bytes for a checkpoint of `owner`
    under the fair-share rule: `owner`'s own checkpoints may all go, another owner's only while
    that owner keeps at least `share` bytes (`held`: bytes per owner, from fair_share). Keys
    that are not `evictable` (pinned) are skipped. None when the allowed evictions do not free
    enough (then nothing should be evicted). Changes nothing but `held`."""
    victims: list[Hashable] = []
    for key in order:
        if shortfall <= 0:
            break
        if not evictable(key):
            continue
        victim_owner, num_bytes = owner_of(key), bytes_of(key)
        if victim_owner != owner and held[victim_owner] - num_bytes < share:
            continue  # it would take that owner below its share
        held[victim_owner] -= num_bytes
        victims.append(key)
        shortfall -= num_bytes
    return victims if shortfall <= 0 else None
