"""What the cluster's checkpoint index (cache/shared_index.py) exchanges with its users.

Records (what a replica's published bundle is, as the index knows it), replica reports and
their acks, lookup answers, the versioned changes a mirror replays (IndexDelta) or the whole
index at a version (IndexSnapshot), stats, and warm-start candidates (HotCopy). All frozen
dataclasses, pure Python, no Ray: they cross actor boundaries as they are.

Digests: the index keeps blake2b digests of token ids, never the ids; `token_digest` is a whole
sequence's, `prefix_digests` several prefixes' in one pass. The bytes hashed are the ids as
little-endian int64s, so every host digests the same prompt the same way.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Literal

from cache.checkpoint_keys import CheckpointKind, Namespace

RecordKey = tuple[str, int]  # (replica id, bundle id)

DIGEST_BYTES = 16


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64s, the same bytes on every host."""
    data = array("q", token_ids)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def token_digest(token_ids: Sequence[int]) -> bytes:
    """The digest of a whole token sequence (what a record carries)."""
    return blake2b(_token_bytes(token_ids), digest_size=DIGEST_BYTES).digest()


def prefix_digests(token_ids: Sequence[int], lengths: Iterable[int]) -> dict[int, bytes]:
    """{L: token_digest(token_ids[:L])} for every L in `lengths` with 0 < L <= len(token_ids),
    in one pass over the tokens (the hash state is copied at each length)."""
    wanted = sorted({n for n in lengths if 0 < n <= len(token_ids)})
    hasher = blake2b(digest_size=DIGEST_BYTES)
    digests: dict[int, bytes] = {}
    done = 0
    for n in wanted:
        hasher.update(_token_bytes(token_ids[done:n]))
        done = n
        digests[n] = hasher.copy().digest()
    return digests


@dataclass(frozen=True)
class StoredCopy:
    """Where an exported copy of a bundle lies in the object-store tier (issue 20, point 2).

    `locator` is whatever the import side needs to fetch it (e.g. per-rank object refs); the
    index stores and returns it, never looks inside. `num_bytes`: the copy's size."""

    locator: object
    num_bytes: int


@dataclass(frozen=True)
class CheckpointRecord:
    """One published bundle of one replica, as the index knows it.

    on_replica: False once the replica dropped the bundle (or went away) while a stored copy
    of it remains; such a record serves lookups that accept stored copies only."""

    namespace: Namespace
    digest: bytes  # token_digest of the covered token ids
    length: int  # number of covered tokens
    kind: CheckpointKind
    num_bytes: int
    replica_id: str
    bundle_id: int
    stored_copy: StoredCopy | None = None
    on_replica: bool = True

    @property
    def key(self) -> RecordKey:
        return (self.replica_id, self.bundle_id)


@dataclass(frozen=True)
class ReplicaReport:
    """What one replica tells the index, in one call.

    full: `published` is everything the replica holds now (its records not in it go);
    otherwise `published` and `dropped` (bundle ids) are the changes since its last accepted
    report, against index incarnation `incarnation`."""

    replica_id: str
    incarnation: str | None
    published: tuple[CheckpointRecord, ...] = ()
    dropped: tuple[int, ...] = ()
    full: bool = False
    hits: tuple[tuple[int, int], ...] = ()  # (bundle id, restores since the last report)


@dataclass(frozen=True)
class ReportAck:
    """The index's answer: accepted False means "send a full report" (the index restarted, or
    forgot the replica); `incarnation` is the index's current one."""

    incarnation: str
    accepted: bool


@dataclass(frozen=True)
class LookupResult:
    """The longest checkpoint prefix of a prompt: `length` tokens (0: none), the replicas that
    hold it and its stored copies."""

    length: int = 0
    replica_ids: frozenset[str] = frozenset()
    stored_copies: tuple[StoredCopy, ...] = ()


@dataclass(frozen=True)
class Change:
    """One versioned change: `record` put (added or replaced), or the record `key` removed."""

    version: int
    op: Literal["put", "remove"]
    record: CheckpointRecord | None = None
    key: RecordKey | None = None


@dataclass(frozen=True)
class IndexDelta:
    """The changes after `from_version` up to `to_version`, oldest first."""

    incarnation: str
    from_version: int
    to_version: int
    changes: tuple[Change, ...]


@dataclass(frozen=True)
class IndexSnapshot:
    """Every record at `version`."""

    incarnation: str
    version: int
    records: tuple[CheckpointRecord, ...]


@dataclass(frozen=True)
class IndexStats:
    records: int
    num_bytes: int  # bytes of the bundles the records describe (on replicas or stored)
    replicas: int
    namespaces: int
    version: int
    stored_copies: int = 0
    stored_bytes: int = 0  # the object-store tier's size (StoredCopy.num_bytes summed)


@dataclass(frozen=True)
class HotCopy:
    """A stored copy ranked for a warm start: the checkpoint it holds and its hits."""

    namespace: Namespace
    length: int
    kind: str
    hits: int
    copy: StoredCopy
