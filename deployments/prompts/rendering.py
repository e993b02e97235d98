"""Chat messages and plain prompts -> the exact token ids the engine sees, with the verified
instruction boundary (instruction_boundary.py); no Ray, no HTTP stack.

PromptRenderer is the one renderer: the Renderer deployment (deployments/renderer.py) holds one
per replica, the benchmark's in-process target (hybrid_serve_bench/engine_target.py) one per
engine, and tests call it directly, so all three turn the same messages into the same ids and
boundary. Its refusals are InvalidRequestError naming the request field ("messages" or
"prompt"), which the API answers with HTTP 400 (deployments/http/errors.py, as_api_error).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deployments.prompts.instruction_boundary import InstructionPrefixes, find_instruction_boundary
from engine.interfaces.sampling_params import InvalidRequestError


@dataclass(frozen=True)
class RenderedPrompt:
    """What the LLM server receives: the prompt's token ids and where its instructions end.

    token_ids: the full prompt, chat template and generation prompt included.
    instruction_boundary: tokens covered by the leading system/developer messages, verified to
        be an exact token prefix (0 < boundary < len(token_ids)); None when there is none.
    boundary_rejection: why a chat prompt has no boundary (a BoundaryRejection value, counted
        by the ingress); None when it has one, and for raw completion prompts (never checked).
    """

    token_ids: tuple[int, ...]
    instruction_boundary: int | None = None
    boundary_rejection: str | None = None


class PromptRenderer:
    """One tokenizer (its chat template) and the instruction renderings it remembers.

    instruction_prefixes: where those renderings are remembered; None: a new InstructionPrefixes
    of its own (they are one tokenizer's ids: share one only between renderers of the same
    tokenizer and template). Thread-safe as InstructionPrefixes is; the tokenizer is only read.
    """

    def __init__(self, tokenizer: Any, instruction_prefixes: InstructionPrefixes | None = None) -> None:
        self.tokenizer = tokenizer
        self.instruction_prefixes = instruction_prefixes if instruction_prefixes is not None else InstructionPrefixes()

    @classmethod
    def from_pretrained(cls, model_dir: str) -> PromptRenderer:
        """The renderer of the tokenizer in `model_dir` (transformers' AutoTokenizer)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir))

    def render_chat(self, conversation: list[dict[str, Any]]) -> RenderedPrompt:
        """A chat prompt: the messages (dicts with role, content and any other field the template
        reads, as the OpenAI API sends them) through the chat template with the assistant
        generation prompt, tokenized, and their instruction boundary, found on the same dicts
        (fails closed, never raises: no boundary and the reason when it cannot be verified).

        Raises InvalidRequestError (param "messages") when the template refuses the
        conversation (templates raise on roles or shapes they do not support).
        """
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # jinja2 TemplateError, or a template's raise_exception(...)
            raise InvalidRequestError(f"The chat template rejected the messages: {exc}", "messages")
        token_ids = tuple(map(int, ids))
        boundary = find_instruction_boundary(self.tokenizer, conversation, token_ids, self.instruction_prefixes)
        return RenderedPrompt(
            token_ids=token_ids,
            instruction_boundary=boundary.position,
            boundary_rejection=boundary.rejection.value if boundary.rejection is not None else None,
        )

    def tokenize_prompt(self, prompt: str | Sequence[int]) -> RenderedPrompt:
        """A raw completion prompt, with no boundary: text is tokenized without special tokens,
        ids pass through. Raises InvalidRequestError (param "prompt") for text that tokenizes
        to nothing or an id beyond the vocabulary."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            if not ids:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            return RenderedPrompt(token_ids=tuple(ids))
        vocab_size = len(self.tokenizer)
        if any(t >= vocab_size for t in prompt):
            raise InvalidRequestError(f"token ids must be < vocabulary size {vocab_size}", "prompt")
        return RenderedPrompt(token_ids=tuple(prompt))
