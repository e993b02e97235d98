"""Pure-Python bookkeeping of what the caches hold: KV block and recurrent-state slot pools, the
radix index of checkpoints per namespace, the checkpoint ledger (pending, published, pinned,
evicted) and its eviction orders (LRU, value per byte), the cache manager the scheduler asks,
and the cluster-wide checkpoint index with its messages. Imports nothing of this project and no torch: testable anywhere.
"""
