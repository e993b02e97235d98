"""The typed objects that cross the engine's boundaries, and nothing that acts on them.

    generation_request.py  what a caller submits (prompt ids, sampling, instruction boundary)
    sampling_params.py     how a request samples and stops, and its output-token budget
    request.py             the scheduler's record of one request's progress
    step_io.py             a step's SchedulerOutput (chunks, captures, restores) and RunnerOutput
    forward_batch.py       the batch one forward pass sees, and the caches it reads and writes
    decode_rows.py         a batch's one-token chunks laid out once for every layer (CPU path)
    host_index.py          the integer index arrays of a step, built on the host
    output_rows.py         rows of a step's output kept by reference (hidden rows, logits)

The bottom of the engine: imports nothing from engine/ but engine_config and model_config.
"""
