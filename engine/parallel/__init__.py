"""What one tensor-parallel rank holds.

    tensor_parallel.py  the rank's process group and its collectives (gloo on CPU, NCCL on GPU)
    shard_layout.py     how a model's heads, channels and projections split across ranks
    cache_capacity.py   how many KV blocks and recurrent state slots a rank's budgets hold
    kv_cache_format.py  how the KV blocks store K/V (model dtype or FP8) and FP8's static scales
    memory_budget.py    the budgets themselves: bytes given, or a share of free memory

Imports only engine_config, model_config and cache/ (for block geometry); layers, models and
every package above may import it.
"""
