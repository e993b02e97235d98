"""Request-boundary checkpoints inside one engine (docs/design.md sections 2 and 5).

    policy.py          the scheduler's side: which checkpoint to restore at admission, where to
                       capture, when a capture is published
    in_flight.py       captures about to be published, a source requests wait on instead of
                       recomputing the prefix
    capture_events.py  what was captured, published, restored and evicted, for metrics and the
                       cluster index
    bundle_store.py    the worker's side: gather a request's state into a bundle, scatter it back
    shards.py          one rank's part of a bundle as a transferable shard
    transfer.py        the exported format of a checkpoint (header, shards, digest)
    import_checks.py   what an import is checked for before it touches any cache
    host_tier.py       the host tier: checkpoints evicted from the device, promoted back
    prefill_cost.py    the prefill compute a checkpoint saves (the value eviction order's)

May import interfaces/, parallel/, kernels/ and cache/; never execution/, routes/ or core/.
"""
