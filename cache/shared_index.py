"""The cluster's checkpoint index: which replica holds a checkpoint of which token prefix.

The records, reports, deltas and digests it exchanges are in cache/index_messages.py.
Pure bookkeeping, no Ray: deployments/cluster/index.py wraps one SharedIndex in a named
actor per application, LLM server replicas report their published and dropped bundles to it
(ReplicaReport), and each request router keeps a local mirror of it (`snapshot`, `delta`) to
pick the replica holding a prompt's longest checkpoint (deployments/cluster/router.py).

A record says "replica R holds bundle B: namespace N, covering `length` tokens whose digest is
D". The index keeps digests, never token ids: a lookup digests the prompt's prefixes only at the
lengths the namespace holds, and compares digests. A digest collision or a stale record sends a
request to a replica that does not have the checkpoint: a miss there (the engine's own index
compares exact tokens), never a wrong answer.

Versions: every change (a record put, a record removed) takes the next version number. The
index keeps the last `max_changes` changes, so a mirror at version v gets `delta(incarnation,
v)`; a mirror too far behind, or of another incarnation (the index actor restarted empty and
drew a new one), gets `snapshot()` instead.

Replicas: a replica's first report, and any report after `remove_replica` or an index restart,
must be a full one (every bundle it holds). A delta from a replica the index does not know is
refused (`ReportAck.accepted` False) and the replica answers with a full report, so anyone may
call `remove_replica` (a replica shutting down, a router that saw it go) without losing a live
replica's records for long.

Stored copies (the object-store tier, deployments/cluster/object_copies.py): a record may carry a
StoredCopy, an exported copy of its bundle that outlives the replica. Their bytes are kept
within `store_budget_bytes`: attaching one beyond it detaches the least recently used copies
first (recency: attached, or hit on any replica), and a record left with neither a replica
nor a copy goes. The index actor keeps one copy per checkpoint (namespace, length, digest):
`can_store` refuses a second before anything is put. A copy may also come with its record, for a
checkpoint its replica no longer holds (evicted from the device, then from the replica's host
tier, and passed on to this tier): the record is put with on_replica False if the index has
forgotten it, and attached to as usual if the replica's drop has not been reported yet.
Hits: replicas report how often each of their bundles was restored (ReplicaReport.hits); the
index sums them per checkpoint (`hottest_stored` ranks stored copies by them for warm starts).
Hits are not versioned changes: mirrors do not see them.

Sizes: at most `max_records` records; beyond, the oldest put goes first (a lost record costs a
miss). Not thread-safe: one owner (an actor's event loop, a router's event loop).
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from cache.checkpoint_keys import Namespace
from cache.index_messages import (
    Change,
    CheckpointRecord,
    HotCopy,
    IndexDelta,
    IndexSnapshot,
    IndexStats,
    LookupResult,
    RecordKey,
    ReplicaReport,
    ReportAck,
    StoredCopy,
    prefix_digests,
    token_digest,
)

DEFAULT_MAX_RECORDS = 65_536
DEFAULT_MAX_CHANGES = 16_384


@dataclass
class _Namespace:
    # length -> digest -> keys of the records with that length and digest
    by_length: dict[int, dict[bytes, set[RecordKey]]] = field(default_factory=dict)


class SharedIndex:
    def __init__(self, incarnation: str, max_records: int = DEFAULT_MAX_RECORDS,
                 max_changes: int = DEFAULT_MAX_CHANGES,
                 store_budget_bytes: int | None = None) -> None:
        """store_budget_bytes: the stored copies' byte budget (None: unbounded, as a mirror,
        which follows its source's detaches)."""
        if max_records < 1 or max_changes < 1:
            raise ValueError("max_records and max_changes must be >= 1")
        if store_budget_bytes is not None and store_budget_bytes < 0:
            raise ValueError("store_budget_bytes must be >= 0")
        self.store_budget_bytes = store_budget_bytes
        self.incarnation = incarnation
        self.max_records = max_records
        self.version = 0
        self._records: dict[RecordKey, CheckpointRecord] = {}  # insertion order = age
        self._namespaces: dict[Namespace, _Namespace] = {}
        self._by_replica: dict[str, set[RecordKey]] = {}  # live records (on_replica) only
        self._replicas: set[str] = set()  # replicas whose last full report was accepted
        self._changes: deque[Change] = deque(maxlen=max_changes)
        self._num_bytes = 0
        self._stored: OrderedDict[RecordKey, int] = OrderedDict()  # copies, least recent first
        self._stored_bytes = 0
        self._hits: dict[tuple[Namespace, bytes], int] = {}  # (namespace, digest) -> hits

    # ---- lookups (change nothing) -------------------------------------------------------------

    def lookup(self, namespace: Namespace, token_ids: Sequence[int], *,
               among: Collection[str] | None = None, stored: bool = True) -> LookupResult:
        """The longest prefix of `token_ids` that a qualifying record covers: one held by a
        replica (in `among`, when given) or, with `stored`, one with a stored copy. Digests
        the prompt only at the lengths this namespace's records have. Changes nothing."""
        space = self._namespaces.get(tuple(namespace))
        if space is None or not token_ids:
            return LookupResult()
        digests = prefix_digests(token_ids, space.by_length)
        for length in sorted(digests, reverse=True):
            keys = space.by_length[length].get(digests[length], ())
            records = [self._records[key] for key in keys]
            replicas = frozenset(r.replica_id for r in records if r.on_replica
                                 and (among is None or r.replica_id in among))
            copies = tuple(r.stored_copy for r in records if stored and r.stored_copy is not None)
            if replicas or copies:
                return LookupResult(length, replicas, copies)
        return LookupResult()

    def records(self) -> list[CheckpointRecord]:
        return list(self._records.values())

    def replica_records(self, replica_id: str) -> list[CheckpointRecord]:
        return [self._records[key] for key in self._by_replica.get(replica_id, ())]

    def stats(self) -> IndexStats:
        return IndexStats(records=len(self._records), num_bytes=self._num_bytes,
                          replicas=len(self._replicas), namespaces=len(self._namespaces),
                          version=self.version, stored_copies=len(self._stored),
                          stored_bytes=self._stored_bytes)

    def records_covering(self, namespace: Namespace, token_ids: Sequence[int]) -> list[CheckpointRecord]:
        """The records of checkpoints covering exactly `token_ids` (operators and tests)."""
        space = self._namespaces.get(tuple(namespace))
        if space is None or len(token_ids) not in space.by_length:
            return []
        keys = space.by_length[len(token_ids)].get(token_digest(token_ids), ())
        return [self._records[key] for key in keys]

    def hits(self, namespace: Namespace, digest: bytes) -> int:
        return self._hits.get((tuple(namespace), digest), 0)

    def hottest_stored(self, model_dir: str, kinds: Collection[str], max_count: int,
                       max_bytes: int) -> list[HotCopy]:
        """Stored copies of `model_dir`'s checkpoints of `kinds`, most hits first (then most
        recently used), as many as fit `max_count` and `max_bytes` together (a copy that
        does not fit is skipped, a smaller later one may still). Changes nothing."""
        ranked = sorted(
            (key for key in reversed(self._stored)
             if self._records[key].namespace[0] == model_dir and self._records[key].kind in kinds),
            key=lambda key: -self.hits(self._records[key].namespace, self._records[key].digest))
        chosen: list[HotCopy] = []
        total = 0
        for key in ranked:
            record = self._records[key]
            size = record.stored_copy.num_bytes
            if len(chosen) >= max_count:
                break
            if total + size > max_bytes:
                continue
            total += size
            chosen.append(HotCopy(record.namespace, record.length, record.kind,
                                  self.hits(record.namespace, record.digest), record.stored_copy))
        return chosen

    # ---- mirrors ------------------------------------------------------------------------------

    def snapshot(self) -> IndexSnapshot:
        return IndexSnapshot(self.incarnation, self.version, tuple(self._records.values()))

    def delta(self, incarnation: str | None, since: int) -> IndexDelta | None:
        """The changes after version `since`, or None when they cannot be given (another
        incarnation, `since` older than the oldest change kept, or ahead of this index): the
        caller then takes `snapshot()`."""
        if incarnation != self.incarnation or since > self.version:
            return None
        oldest = self._changes[0].version if self._changes else self.version + 1
        if since < oldest - 1:
            return None
        changes = tuple(c for c in self._changes if c.version > since)
        return IndexDelta(self.incarnation, since, self.version, changes)

    @classmethod
    def from_snapshot(cls, snapshot: IndexSnapshot) -> SharedIndex:
        """A mirror holding the snapshot's records at its version (it never evicts on its own:
        it follows the source's deltas, evictions included)."""
        index = cls(snapshot.incarnation, max_records=sys.maxsize)  # the source evicts, not a mirror
        for record in snapshot.records:
            index._put(record, log=False)
        index.version = snapshot.version
        return index

    def apply_delta(self, delta: IndexDelta) -> bool:
        """Apply another index's delta to this mirror. False (and nothing changed) when it does
        not follow on from this mirror's incarnation and version: take a snapshot."""
        if delta.incarnation != self.incarnation or delta.from_version != self.version:
            return False
        for change in delta.changes:
            if change.op == "put":
                self._put(change.record, log=False)
            else:
                self._remove(change.key, log=False)
        self.version = delta.to_version
        return True

    # ---- replicas' reports --------------------------------------------------------------------

    def apply_report(self, report: ReplicaReport) -> ReportAck:
        """Apply one replica's report (see ReplicaReport); a delta from a replica this index
        does not know, or against another incarnation, changes nothing and is refused."""
        replica = report.replica_id
        strangers = [r for r in report.published if r.replica_id != replica]
        if strangers:
            raise ValueError(f"{replica} reported a record of {strangers[0].replica_id}")
        if not report.full and (report.incarnation != self.incarnation
                                or replica not in self._replicas):
            return ReportAck(self.incarnation, accepted=False)
        if report.full:
            kept = {r.bundle_id for r in report.published}
            gone = [b for (_, b) in self._by_replica.get(replica, ()) if b not in kept]
            self._drop_from_replica(replica, gone)
            self._replicas.add(replica)
        self._drop_from_replica(replica, report.dropped)
        for bundle_id, count in report.hits:
            self._note_hits(self._records.get((replica, bundle_id)), count)
        for record in report.published:
            old = self._records.get(record.key)
            if old is None or old != record:
                if old is not None and old.stored_copy is not None and record.stored_copy is None:
                    record = replace(record, stored_copy=old.stored_copy)
                self._put(record)
        return ReportAck(self.incarnation, accepted=True)

    def remove_replica(self, replica_id: str) -> None:
        """Forget everything `replica_id` holds (records with a stored copy stay, as stored
        copies). Its next report must be a full one."""
        self._drop_from_replica(replica_id, [b for (_, b) in self._by_replica.get(replica_id, ())])
        self._replicas.discard(replica_id)
        self._by_replica.pop(replica_id, None)

    # ---- stored copies (the object-store tier) -------------------------------------------------

    def can_store(self, key: RecordKey, num_bytes: int,
                  record: CheckpointRecord | None = None) -> bool:
        """Whether a new copy of `num_bytes` for `key` is worth storing: the record exists (or,
        for a checkpoint no replica reports any more, `record` describes it), the copy fits the
        budget, and no record of the same checkpoint has a copy yet (the index actor asks
        before it puts anything)."""
        record = self._records.get(key, record)
        if record is None or record.key != key or not self._fits(num_bytes):
            return False
        space = self._namespaces.get(record.namespace)
        twins = set() if space is None else space.by_length.get(record.length, {}).get(record.digest, set())
        return not any(self._records[twin].stored_copy is not None for twin in twins - {key})

    def set_stored_copy(self, key: RecordKey, copy: StoredCopy | None,
                        record: CheckpointRecord | None = None) -> bool:
        """Attach (or, with None, detach) a stored copy to the record `key`; a record left with
        neither a replica nor a copy goes. Attaching makes room within store_budget_bytes by
        detaching the least recently used copies. `record`: the checkpoint's record when the
        index may no longer have it (one its replica evicted, reported dropped, and passed on
        to this tier): put with on_replica False if the index has no record `key`. False, and
        nothing changed, when the index has no such record (and none is given) or the copy
        alone exceeds the budget (see can_store for the one-copy-per-checkpoint rule the actor
        applies first)."""
        known = self._records.get(key)
        if known is None and copy is not None and record is not None and record.key == key:
            known = replace(record, on_replica=False)
        if known is None:
            return False
        if copy is None:
            self._detach(key)
            return True
        if not self._fits(copy.num_bytes):
            return False
        budget = self.store_budget_bytes
        self._put(replace(known, stored_copy=copy))
        self._stored.move_to_end(key)
        while budget is not None and self._stored_bytes > budget:
            self._detach(next(iter(self._stored)))
        return True

    def _fits(self, num_bytes: int) -> bool:
        return self.store_budget_bytes is None or num_bytes <= self.store_budget_bytes

    def _detach(self, key: RecordKey) -> None:
        """Forget the record's stored copy (the record goes with it if no replica holds it)."""
        record = self._records[key]
        if not record.on_replica:
            self._remove(key)
        elif record.stored_copy is not None:
            self._put(replace(record, stored_copy=None))

    def _note_hits(self, record: CheckpointRecord | None, count: int) -> None:
        """Add `count` hits to the record's checkpoint; its stored copies become most recent."""
        if record is None or count <= 0:
            return
        checkpoint = (record.namespace, record.digest)
        self._hits[checkpoint] = self._hits.get(checkpoint, 0) + count
        for key in self._namespaces[record.namespace].by_length[record.length][record.digest]:
            if key in self._stored:
                self._stored.move_to_end(key)

    # ---- internals ----------------------------------------------------------------------------

    def _drop_from_replica(self, replica_id: str, bundle_ids: Iterable[int]) -> None:
        for bundle_id in list(bundle_ids):
            key = (replica_id, bundle_id)
            record = self._records.get(key)
            if record is None or not record.on_replica:
                continue
            if record.stored_copy is not None:
                self._put(replace(record, on_replica=False))
            else:
                self._remove(key)

    def _log(self, change_op: Literal["put", "remove"], record: CheckpointRecord | None,
             key: RecordKey | None) -> None:
        self.version += 1
        self._changes.append(Change(self.version, change_op, record, key))

    def _put(self, record: CheckpointRecord, log: bool = True) -> None:
        """Add or replace `record` (it becomes the newest), then evict the oldest records while
        over max_records."""
        key = record.key
        if key in self._records:
            self._remove(key, log=False, replacing=True)
        self._records[key] = record
        if record.stored_copy is not None and key not in self._stored:
            self._stored[key] = record.stored_copy.num_bytes
            self._stored_bytes += record.stored_copy.num_bytes
        elif record.stored_copy is None and key in self._stored:
            self._stored_bytes -= self._stored.pop(key)
        elif record.stored_copy is not None:  # replaced: keep its recency, update its size
            self._stored_bytes += record.stored_copy.num_bytes - self._stored[key]
            self._stored[key] = record.stored_copy.num_bytes
        self._num_bytes += record.num_bytes
        space = self._namespaces.setdefault(record.namespace, _Namespace())
        space.by_length.setdefault(record.length, {}).setdefault(record.digest, set()).add(key)
        if record.on_replica:
            self._by_replica.setdefault(record.replica_id, set()).add(key)
        if log:
            self._log("put", record, None)
        while len(self._records) > self.max_records:
            self._remove(next(iter(self._records)), log=log)

    def _remove(self, key: RecordKey, log: bool = True, replacing: bool = False) -> None:
        """Remove the record `key`; `replacing`: _put puts it back at once (its stored copy's
        place in the LRU is kept, and so are its checkpoint's hits)."""
        record = self._records.pop(key, None)
        if record is None:
            return
        if not replacing and key in self._stored:
            self._stored_bytes -= self._stored.pop(key)
        self._num_bytes -= record.num_bytes
        space = self._namespaces[record.namespace]
        by_digest = space.by_length[record.length]
        by_digest[record.digest].discard(key)
        if not by_digest[record.digest]:
            del by_digest[record.digest]
            if not replacing:
                self._hits.pop((record.namespace, record.digest), None)
            if not by_digest:
                del space.by_length[record.length]
                if not space.by_length:
                    del self._namespaces[record.namespace]
        held = self._by_replica.get(record.replica_id)
        if held is not None:
            held.discard(key)
            if not held:
                del self._by_replica[record.replica_id]
        if log:
            self._log("remove", None, key)
