"""Chat messages and plain prompts -> the exact token ids the engine sees, with the verified
instruction boundary (instruction_boundary.py) and cache breakpoints (cache_breakpoints.py);
no Ray, no HTTP stack.

PromptRenderer is the one renderer: the Renderer deployment (deployments/renderer.py) holds one
per replica, the benchmark's in-process target (hybrid_serve_bench/engine_target.py) one per
engine, and tests call it directly, so all three turn the same messages into the same ids and
boundary and breakpoints. Its refusals are InvalidRequestError naming the request field ("messages" or
"prompt"), which the API answers with HTTP 400 (deployments/http/errors.py, as_api_error).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deployments.prompts.cache_breakpoints import find_cache_breakpoints, split_cache_markers
from deployments.prompts.instruction_boundary import RenderedPrefixes, find_instruction_boundary
from engine.interfaces.sampling_params import InvalidRequestError


@dataclass(frozen=True)
class RenderedPrompt:
    """What the LLM server receives: the prompt's token ids, where its instructions end and
    where the client's cache_control markers are.

    token_ids: the full prompt, chat template and generation prompt included.
    instruction_boundary: tokens covered by the leading system/developer messages, verified to
        be an exact token prefix (0 < boundary < len(token_ids)); None when there is none.
    boundary_rejection: why a chat prompt has no boundary (a BoundaryRejection value, counted
        by the ingress); None when it has one, and for raw completion prompts (never checked).
    cache_breakpoints: the verified positions of the messages' cache_control markers, sorted
        and unique, each an exact proper token prefix of token_ids; () when none.
    breakpoint_rejections: one reason (a BoundaryRejection value, counted by the ingress) per
        marker dropped because its position could not be verified.
    """

    token_ids: tuple[int, ...]
    instruction_boundary: int | None = None
    boundary_rejection: str | None = None
    cache_breakpoints: tuple[int, ...] = ()
    breakpoint_rejections: tuple[str, ...] = ()


class PromptRenderer:
    """One tokenizer (its chat template) and the prefix renderings it remembers.

    instruction_prefixes: where the instruction renderings are remembered; None: a new
    RenderedPrefixes of its own (they are one tokenizer's ids: share one only between renderers
    of the same tokenizer and template). The cache breakpoints' renderings are remembered apart
    (breakpoint_prefixes), so that markers on messages seen once (a conversation's latest turn)
    never push the shared instructions out. Thread-safe as RenderedPrefixes is; the tokenizer
    is only read.
    """

    def __init__(self, tokenizer: Any, instruction_prefixes: RenderedPrefixes | None = None) -> None:
        self.tokenizer = tokenizer
        self.instruction_prefixes = instruction_prefixes if instruction_prefixes is not None else RenderedPrefixes()
        self.breakpoint_prefixes = RenderedPrefixes()

    @classmethod
    def from_pretrained(cls, model_dir: str) -> PromptRenderer:
        """The renderer of the tokenizer in `model_dir` (transformers' AutoTokenizer)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir))

    def render_chat(self, conversation: list[dict[str, Any]]) -> RenderedPrompt:
        """A chat prompt: the messages (dicts with role, content and any other field the template
        reads, as the OpenAI API sends them) through the chat template with the assistant
        generation prompt, tokenized, with their instruction boundary and the positions of
        their cache_control markers, found on the same dicts (both fail closed, never raise:
        no position and the reason when it cannot be verified). The markers are taken out of
        the dicts before anything is rendered (cache_breakpoints.py).

        Raises InvalidRequestError (param "messages") when the template refuses the
        conversation (templates raise on roles or shapes they do not support), or a marker is
        not {"type": "ephemeral"}.
        """
        conversation, markers = split_cache_markers(conversation)
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # jinja2 TemplateError, or a template's raise_exception(...)
            raise InvalidRequestError(f"The chat template rejected the messages: {exc}", "messages")
        token_ids = tuple(map(int, ids))
        boundary = find_instruction_boundary(self.tokenizer, conversation, token_ids, self.instruction_prefixes)
        breakpoints = find_cache_breakpoints(self.tokenizer, conversation, markers, token_ids,
                                             self.breakpoint_prefixes)
        return RenderedPrompt(
            token_ids=token_ids,
            instruction_boundary=boundary.position,
            boundary_rejection=boundary.rejection.value if boundary.rejection is not None else None,
            cache_breakpoints=breakpoints.positions,
            breakpoint_rejections=tuple(reason.value for reason in breakpoints.rejections),
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
