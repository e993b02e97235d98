"""Turning messages into token ids without Ray: the chat template, the instruction boundary and
the cache breakpoints.

    rendering.py             PromptRenderer: chat messages and plain prompts -> RenderedPrompt
                             (token ids, verified instruction boundary and cache breakpoints);
                             refusals are InvalidRequestError naming the request field
    instruction_boundary.py  the verified end of the leading system/developer messages, failing
                             closed, and the rule every verified position follows
    cache_breakpoints.py     the clients' cache_control markers on messages and text parts, and
                             their positions verified by the same rule (or dropped, with why)
    prefix_memory.py         the token ids of rendered prefixes, remembered by their exact text
    exact_cuts.py            where a rendered prompt can be tokenized in two pieces with exactly
                             the ids of the whole, proved per tokenizer or not used

The one renderer: the Renderer deployment (deployments/renderer.py) wraps a PromptRenderer, the
benchmark's in-process target (hybrid_serve_bench/engine_target.py) holds one, tests call it.
Imports only engine.interfaces and transformers: no Ray, no HTTP stack, nothing else of
deployments/ (an import contract in pyproject.toml).
"""
