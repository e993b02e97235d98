"""A stand-in for the object-store tier below the host tier, without Ray (for
benchmarks/checkpoint_tiers.py on the GPU machine, which has no Ray).

What it keeps of the real path (deployments/cluster/store_demotion.py, deployments/cluster/
tier.py): the host tier's on_evict returns at once and a worker thread adds the checksums and
serialises the copy (pickle, as Ray's put does); it is a CheckpointSource asked after the host
tier, whose fetch deserialises on the worker thread while the request waits in the scheduler;
the engine imports the copy checked in full (`verified` False: checksums recomputed). What it
leaves out: the Ray object store's own copy and transfer (shared memory on one node, the
network between nodes), the index actor's call and the mirror's lag. No budget: it keeps every
checkpoint it is given.
"""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from cache.checkpoint_keys import Namespace
from cache.radix_index import RadixIndex
from engine.checkpoints.host_tier import EvictedCheckpoint, with_checksums
from engine.checkpoints.transfer import ExportedCheckpoint


class InProcessStore:
    def __init__(self, fetch_timeout_s: float = 30.0) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="in-process-store")
        self._lock = threading.Lock()  # the index and copies: the step thread and the worker
        self._index = RadixIndex()
        self._copies: dict[int, bytes] = {}
        self._next_id = 0
        self.fetch_timeout_s = fetch_timeout_s
        self.stored = 0
        self.stored_bytes = 0  # pickled bytes
        self.fetched = 0
        self.restore_seconds: list[float] = []  # lookup to the import's settle, per fetch imported

    def demote(self, evicted: EvictedCheckpoint) -> None:
        """HostTier.on_evict: queued for the worker thread; returns at once."""
        self._pool.submit(self._put, evicted.exported)

    def drain(self) -> None:
        """Wait for every copy queued so far."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def lookup(self, namespace: Namespace, token_ids: tuple[int, ...], have: int) -> StoreFetch | None:
        """CheckpointSource: the longest stored copy covering more than `have`, its
        deserialisation started on the worker thread."""
        with self._lock:
            match = self._index.longest_prefix(namespace, token_ids)
            if match is None or match.num_tokens <= have:
                return None
            data = self._copies[match.bundle_id]
        return StoreFetch(self, self._pool.submit(pickle.loads, data), match.num_tokens,
                          time.monotonic() + self.fetch_timeout_s)

    def _put(self, exported: ExportedCheckpoint) -> None:
        data = pickle.dumps(with_checksums(exported), protocol=pickle.HIGHEST_PROTOCOL)
        header = exported.header
        with self._lock:
            if self._index.get(header.namespace, header.token_ids) is not None:
                return
            copy_id, self._next_id = self._next_id, self._next_id + 1
            self._index.insert(header.namespace, header.token_ids, copy_id)
            self._copies[copy_id] = data
            self.stored += 1
            self.stored_bytes += len(data)


class StoreFetch:
    """A CheckpointFetch of the stand-in: a copy from "another process", checked in full."""

    verified = False

    def __init__(self, store: InProcessStore, future: Future, num_tokens: int, deadline: float) -> None:
        self._store = store
        self._future = future
        self._started = time.perf_counter()
        self.num_tokens = num_tokens
        self.deadline = deadline

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> ExportedCheckpoint | None:
        return None if self._future.exception() is not None else self._future.result()

    def settle(self, accepted: bool, num_bytes: int) -> None:
        if accepted:
            self._store.fetched += 1
            self._store.restore_seconds.append(time.perf_counter() - self._started)

    def abandon(self) -> None:
        """Nothing to stop."""
