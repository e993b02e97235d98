"""The engine's step loop and what it moves: requests in, tokens out.

    llm_engine.py           LLMEngine: schedule -> execute -> update -> emit, one step at a time
    scheduler.py            which chunks of which requests run in a step, admission, preemption
    async_engine.py         the asyncio face of the engine (a background step loop, streams)
    output_processor.py     stop strings, detokenized deltas, finished requests
    detokenizer.py          incremental detokenization
    checkpoint_exchange.py  exporting and importing published checkpoints between engines
    host_demotion.py        copying the checkpoints the device evicts into the host tier

May import every other package of engine/ and cache/; nothing below imports it.
"""
