"""Renderer deployment: chat template + tokenizer, CPU only, scales independently of the model.

It turns API input into the exact token ids the engine will see, and for chat requests the
verified instruction boundary and cache breakpoints (docs/design.md section 3), with the Ray-free PromptRenderer
(deployments/prompts/rendering.py) that the benchmark's in-process target and tests call too.
It never touches the engine, so prompt counts in `usage` are by construction the ids rendered
here.
"""

from __future__ import annotations

from ray import serve

from deployments.http.protocol import ChatMessage
from deployments.prompts.rendering import PromptRenderer, RenderedPrompt


@serve.deployment
class Renderer:
    """A PromptRenderer per replica (one tokenizer, and the instruction renderings it
    remembers). Methods are called through a DeploymentHandle; they raise what PromptRenderer
    raises (InvalidRequestError: HTTP 400)."""

    def __init__(self, model_dir: str) -> None:
        self._prompts = PromptRenderer.from_pretrained(model_dir)

    def render_chat(self, messages: list[ChatMessage]) -> RenderedPrompt:
        return self._prompts.render_chat([m.model_dump(exclude_none=True) for m in messages])

    def tokenize_prompt(self, prompt: str | list[int]) -> RenderedPrompt:
        return self._prompts.tokenize_prompt(prompt)
