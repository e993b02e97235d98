"""Running the model: one worker per tensor-parallel rank and the executors that drive them.

    executor.py               the ModelExecutor protocol the engine drives, and the in-process one
    multiprocess_executor.py  ranks in worker processes (torch.distributed), rank 0 broadcasts
    rank_worker.py            one rank's side of the multiprocess executor
    worker.py                 a rank's model, caches and forward routes: execute a SchedulerOutput
    loader.py                 reading a Hugging Face directory into a sharded model
    sampler.py                sampling from a step's logits
    token_readback.py         copying sampled tokens back to the host without waiting

May import everything in engine/ below core/; imports no Ray (the Ray rank actors are
deployments/worker_group.py).
"""
