"""Turning messages into token ids without Ray: the chat template, the instruction boundary and
the cache breakpoints.

    rendering.py             PromptRenderer: chat messages and plain prompts -> RenderedPrompt
                             (token ids, verified instruction boundary and cache breakpoints);
                             refusals are InvalidRequestError naming the request field
    instruction_boundary.py  the verified end of the leading system/developer messages, failing
                             closed, the rule every verified position follows, and the
                             prefix renderings remembered per tokenizer
    cache_breakpoints.py     the clients' cache_control markers on messages and text parts, and
                             their positions verified by the same rule (or dropped, with why)

The one renderer: the Renderer deployment (deployments/renderer.py) wraps a PromptRenderer, the
benchmark's in-process target (hybrid_serve_bench/engine_target.py) holds one, tests call it.
Imports only engine.interfaces and transformers: no Ray, no HTTP stack, nothing else of
deployments/ (an import contract in pyproject.toml).
"""
