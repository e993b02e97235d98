"""Moving published checkpoints between engines (docs/design.md section 5.1): export one as an
ExportedCheckpoint, import one after checking every part of it, and count both.

Export reads a published bundle: its record in the ledger and every rank's shard (state, K/V of
all covered tokens, hidden row), as values or, from Ray rank actors, as references to the
objects each rank put (RemoteShard). Import checks the whole checkpoint first
(engine/checkpoints/import_checks.py) and changes nothing when a check fails; then it takes KV
blocks and checkpoint bytes as a capture would (CacheManager.reserve_import, evicting least
recently used checkpoints), has every rank write its shard, and publishes the bundle through
the ledger, so the next request with that prefix restores it exactly as a local one.

Shards by reference never enter this process: the header is checked here, each rank resolves
and checks its own shard and holds it (ShardsByReference.stage_shards), and only when every
rank accepted are blocks reserved and the held shards written (import_staged); any rejection
drops what the ranks hold (discard_staged), with nothing else changed.

The engine calls these between steps, with no step in flight (LLMEngine collects its steps
first), on its step thread.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from cache.cache_manager import CacheManager
from cache.checkpoint_ledger import Bundle
from cache.checkpoint_keys import CheckpointKind
from engine.checkpoints.import_checks import ImportExpectations, ImportRejection, Rejected, check_exported
from engine.checkpoints.shards import ExportShardOp, ImportShardOp, StageShardOp
from engine.checkpoints.transfer import CheckpointHeader, ExportedCheckpoint, checkpoint_digest
from engine.execution.executor import ExecutorDiedError, ModelExecutor, ShardsByReference

logger = logging.getLogger(__name__)


@dataclass
class TransferCounters:
    """Checkpoints moved in and out of this engine, cumulative."""

    exported: int = 0
    exported_bytes: int = 0  # shard tensor bytes, all ranks
    imported: int = 0  # published here
    imported_bytes: int = 0
    deduplicated: int = 0  # imports of an endpoint already published here (no-op successes)
    rejected: dict[str, int] = field(default_factory=dict)  # ImportRejection value -> count

    def copy(self) -> TransferCounters:
        return TransferCounters(self.exported, self.exported_bytes, self.imported,
                                self.imported_bytes, self.deduplicated, dict(self.rejected))


@dataclass(frozen=True)
class ImportResult:
    """What import_checkpoint did. accepted: the checkpoint is published here (now, or it was
    already: deduplicated). Otherwise `rejection` says why and the engine is unchanged (but for
    checkpoints a no_space import may have evicted)."""

    accepted: bool
    rejection: ImportRejection | None = None
    detail: str = ""
    deduplicated: bool = False
    num_tokens: int = 0
    num_bytes: int = 0  # shard tensor bytes imported (0 unless newly published)


class CheckpointExchange:
    """Export and import of published bundles for one engine.

    enabled: the engine's checkpoints are on (an import into an engine that never looks up
    checkpoints is rejected as disabled).
    """

    def __init__(
        self, cache: CacheManager, executor: ModelExecutor, expected: ImportExpectations,
        world_size: int, enabled: bool, before_write: Callable[[], None] | None = None,
    ) -> None:
        """before_write: called once an import has reserved its blocks and before the ranks
        write them (the blocks may have been a just-evicted bundle's, which the host tier
        copies out first)."""
        self.before_write = before_write
        self.cache = cache
        self.executor = executor
        self.expected = expected
        self.world_size = world_size
        self.enabled = enabled
        self.counters = TransferCounters()
        self._transfer_ids = itertools.count()  # of imports by reference (ShardStage keys)

    def export(self, namespace: tuple[str, str], token_ids: tuple[int, ...]) -> ExportedCheckpoint | None:
        """The published bundle covering exactly `token_ids` in `namespace`, every rank's shard
        as CPU tensors (or, from a ShardsByReference executor, as references to the objects
        each rank put: valid while those ranks live), or None when none is published there
        (or a rank no longer holds it). Changes nothing but the counters."""
        tokens = tuple(token_ids)
        bundle = self.cache.ledger.published_at(namespace, tokens)
        if bundle is None:
            return None
        header = self.header_for(bundle)
        shards = self.executor.export_shards(self.export_op(bundle, header))
        if any(shard is None for shard in shards):
            logger.warning("bundle %d is published but a rank holds no shard of it", bundle.bundle_id)
            return None
        exported = ExportedCheckpoint(header, tuple(shards))
        self.counters.exported += 1
        self.counters.exported_bytes += exported.nbytes
        return exported

    def header_for(self, bundle: Bundle) -> CheckpointHeader:
        """The header of `bundle` exported from this engine."""
        return CheckpointHeader(
            namespace=bundle.namespace, token_ids=bundle.token_ids,
            digest=checkpoint_digest(bundle.namespace, bundle.token_ids), kind=bundle.kind,
            owner=bundle.owner, model=self.expected.model,
            tensor_parallel_size=self.expected.tensor_parallel_size,
            block_size=self.expected.block_size, layouts=self.expected.layouts,
            kv_cache=self.expected.kv_cache,
        )

    @staticmethod
    def export_op(bundle: Bundle, header: CheckpointHeader) -> ExportShardOp:
        return ExportShardOp(bundle.bundle_id, bundle.block_ids, header.num_tokens, header.digest)

    def import_checkpoint(self, exported: object, verified: bool = False) -> ImportResult:
        """Check `exported` in full, then publish it here (see the module doc). A rejection is
        counted by reason and leaves the caches unchanged; raises ExecutorDiedError only when a
        rank is gone. verified: it never left this process (the host tier's): tensors on any
        device, checksums not recomputed."""
        rejected = check_exported(exported, self.expected, verified)
        if rejected is None and not self.enabled:
            rejected = Rejected(ImportRejection.DISABLED, "this engine's checkpoints are off")
        if rejected is not None:
            return self._reject(rejected, exported)
        assert isinstance(exported, ExportedCheckpoint)
        if exported.by_reference:
            return self._import_by_reference(exported)
        shards = list(exported.shards)
        return self._publish(exported, exported.nbytes, lambda op: self.executor.import_shards(op, shards))

    def _import_by_reference(self, exported: ExportedCheckpoint) -> ImportResult:
        """Phase one: every rank resolves and checks its shard and holds it (the first
        rejection, by rank, rejects the import); phase two: _publish has the ranks write it."""
        executor = self.executor
        if not isinstance(executor, ShardsByReference):
            return self._reject(Rejected(ImportRejection.MALFORMED, "shards by reference, and this "
                                         "engine's ranks take shards by value"), exported)
        header = exported.header
        transfer_id = next(self._transfer_ids)
        verdicts = executor.stage_shards(
            StageShardOp(transfer_id, header.digest, header.num_tokens, header.layouts), list(exported.shards))
        rejected = next((v.rejected for v in verdicts if v.rejected is not None), None)
        if rejected is not None:
            executor.discard_staged(transfer_id)
            return self._reject(rejected, exported)
        result = self._publish(exported, sum(v.nbytes for v in verdicts),
                               lambda op: executor.import_staged(op, transfer_id))
        if result.deduplicated or not result.accepted:
            executor.discard_staged(transfer_id)  # not written, or not by every rank
        return result

    def _publish(self, exported: ExportedCheckpoint, num_bytes: int,
                 write: Callable[[ImportShardOp], frozenset[int]]) -> ImportResult:
        """Publish a checked checkpoint: a no-op success when its endpoint is published here,
        else reserve blocks and bytes (or reject no_space), have the ranks `write` their shards
        into them, and publish if every rank did (else reject worker; the bundle is dropped)."""
        header = exported.header
        if self.cache.ledger.has_checkpoint(header.namespace, header.token_ids):
            self.counters.deduplicated += 1
            return ImportResult(True, deduplicated=True, num_tokens=header.num_tokens)
        reserved = self.cache.reserve_import(
            header.namespace, header.token_ids, CheckpointKind(header.kind), header.owner)
        if reserved is None:
            return self._reject(Rejected(ImportRejection.NO_SPACE, f"{header.num_tokens} tokens do not "
                                         "fit the KV blocks or checkpoint bytes"), exported)
        bundle_id, block_ids = reserved
        try:
            if self.before_write is not None:
                self.before_write()
            confirmed = write(ImportShardOp(bundle_id, block_ids, header.num_tokens))
        except ExecutorDiedError:
            self.cache.publish(bundle_id, set(), self.world_size)  # dropped: nothing to free it on
            raise
        except Exception as exc:
            logger.exception("importing bundle %d failed", bundle_id)
            confirmed, failure = frozenset(), f"{type(exc).__name__}: {exc}"
        else:
            failure = f"ranks {sorted(set(range(self.world_size)) - confirmed)} refused their shard"
        if not self.cache.publish(bundle_id, set(confirmed), self.world_size):
            # dropped: the ledger released its blocks, the ranks free what they kept next step
            return self._reject(Rejected(ImportRejection.WORKER, failure), exported)
        self.counters.imported += 1
        self.counters.imported_bytes += num_bytes
        return ImportResult(True, num_tokens=header.num_tokens, num_bytes=num_bytes)

    def _reject(self, rejected: Rejected, exported: object) -> ImportResult:
        reason = rejected.reason
        self.counters.rejected[reason.value] = self.counters.rejected.get(reason.value, 0) + 1
        logger.warning("checkpoint import rejected (%s): %s", reason.value, rejected.detail)
        tokens = getattr(getattr(exported, "header", None), "token_ids", None)
        num_tokens = len(tokens) if isinstance(tokens, tuple) else 0
        return ImportResult(False, rejection=reason, detail=rejected.detail, num_tokens=num_tokens)
