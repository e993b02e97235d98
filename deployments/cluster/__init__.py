"""Sharing checkpoints between replicas (docs/design.md section 6.2).

    index.py          the cluster-wide CheckpointIndex actor: which replica holds what
    index_mirror.py   a replica's local copy of the index, kept fresh by deltas
    reporter.py       a replica's reports of its published and evicted checkpoints
    router.py         checkpoint-aware routing of requests to replicas
    prompt_key.py     what routing reads of a request (a module of its own: router.py is
                      pickled by value)
    ingress_router.py the lean path's ingress request router: HAProxy asks it which replica
    tier.py           the object-store tier: copies of checkpoints any replica can import
    store_demotion.py what the replica's host tier evicts, stored in the object-store tier
    object_copies.py  a stored checkpoint copy as separate Ray objects
    fetch_policy.py   when fetching a copy beats recomputing its prefix
    rank_shards.py    a Ray rank actor's side of moving shards through the object store

May import engine/, cache/, deployments/metrics.py, http/ and prompts/; never the deployments
themselves.
"""
