"""Demotion: the bundles the device's ledger evicts are copied into the host tier before the
next step may write their KV blocks again (docs/design.md section 5, Tiers).

The ledger keeps the records of the bundles it evicts (CacheManager.keep_evicted); their blocks
are free in the block pool but nothing has written them yet, and the worker still holds their
tensors: both change only when the next step is submitted (a new request's chunk, the
dropped_bundle_ids the worker frees) or an import writes its blocks. LLMEngine therefore calls
`demote_evicted` just before every submit and before an import writes (CheckpointExchange's
before_write). Each one the host tier would keep is copied off the device by the executor
without waiting for the step in flight (DemotesToHost), its header built as an export's.
"""

from __future__ import annotations

import logging

from cache.cache_manager import CacheManager
from engine.checkpoints.host_tier import HostTier
from engine.checkpoints.transfer import ExportedCheckpoint
from engine.core.checkpoint_exchange import CheckpointExchange
from engine.execution.executor import DemotesToHost

logger = logging.getLogger(__name__)


class HostDemotion:
    def __init__(self, cache: CacheManager, executor: DemotesToHost, exchange: CheckpointExchange,
                 host: HostTier) -> None:
        self.cache = cache
        self.executor = executor
        self.exchange = exchange
        self.host = host
        cache.keep_evicted()

    def demote_evicted(self) -> None:
        """Copy every bundle evicted since the last call into the host tier, but those it holds
        already (counted recent there) and those it would not keep. A failed copy is logged and
        costs only that checkpoint. Step thread, before the next submit."""
        layouts = self.exchange.expected.layouts
        for bundle in self.cache.take_evicted():
            namespace, tokens = bundle.namespace, bundle.token_ids
            if self.host.touch_if_held(namespace, tokens):
                continue
            num_bytes = sum(layout.nbytes(len(tokens)) for layout in layouts)
            if not self.host.admits(namespace, tokens, num_bytes, bundle.owner):
                self.host.counters.refused += 1
                continue
            header = self.exchange.header_for(bundle)
            try:
                shards, ready = self.executor.demote_shards(self.exchange.export_op(bundle, header))
            except Exception:
                logger.exception("copying evicted bundle %d to the host tier failed", bundle.bundle_id)
                continue
            if any(shard is None for shard in shards):
                logger.warning("evicted bundle %d: a rank holds no shard of it", bundle.bundle_id)
                continue
            self.host.add(ExportedCheckpoint(header, tuple(shards)), bundle.bundle_id, ready)
