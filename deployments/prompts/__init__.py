"""Turning messages into token ids without Ray: the chat template and the instruction boundary.

    rendering.py             PromptRenderer: chat messages and plain prompts -> RenderedPrompt
                             (token ids, verified instruction boundary); refusals are
                             InvalidRequestError naming the request field
    instruction_boundary.py  the verified end of the leading system/developer messages, failing
                             closed, and the instruction renderings remembered per tokenizer

The one renderer: the Renderer deployment (deployments/renderer.py) wraps a PromptRenderer, the
benchmark's in-process target (hybrid_serve_bench/engine_target.py) holds one, tests call it.
Imports only engine.interfaces and transformers: no Ray, no HTTP stack, nothing else of
deployments/ (an import contract in pyproject.toml).
"""
