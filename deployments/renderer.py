"""Renderer deployment: chat template + tokenizer, CPU only, scales independently of the model.

It turns API input into the exact token ids the engine will see, and for chat requests the
verified instruction boundary (docs/design.md section 3, deployments.instruction_boundary). It never
touches the engine, so prompt counts in `usage` are by construction the ids rendered here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray import serve
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from deployments.http.errors import APIError
from deployments.prompts.instruction_boundary import InstructionPrefixes, find_instruction_boundary
from deployments.http.protocol import ChatMessage


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


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage],
    prefixes: InstructionPrefixes | None = None,
) -> RenderedPrompt:
    """Apply the model's chat template with the assistant generation prompt and tokenize, then
    find the instruction boundary on the same conversation dicts (fails closed, never raises;
    the instructions rendered alone taken from `prefixes` when given).

    Raises APIError(400) when the template refuses the conversation (templates raise on roles
    or shapes they do not support).
    """
    conversation = [m.model_dump(exclude_none=True) for m in messages]
    try:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:  # jinja2 TemplateError, or a template's raise_exception(...)
        raise APIError.bad_request(f"The chat template rejected the messages: {exc}", "messages")
    token_ids = tuple(map(int, ids))
    boundary = find_instruction_boundary(tokenizer, conversation, token_ids, prefixes)
    return RenderedPrompt(
        token_ids=token_ids,
        instruction_boundary=boundary.position,
        boundary_rejection=boundary.rejection.value if boundary.rejection is not None else None,
    )


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int]) -> RenderedPrompt:
    """A raw completion prompt: text is tokenized without special tokens, ids pass through."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            raise APIError.bad_request("prompt must not be empty", "prompt")
        return RenderedPrompt(token_ids=tuple(ids))
    vocab_size = len(tokenizer)
    if any(t >= vocab_size for t in prompt):
        raise APIError.bad_request(f"token ids must be < vocabulary size {vocab_size}", "prompt")
    return RenderedPrompt(token_ids=tuple(prompt))


@serve.deployment
class Renderer:
    """Holds one tokenizer per replica, and the instruction renderings it remembers
    (InstructionPrefixes). Methods are called through a DeploymentHandle."""

    def __init__(self, model_dir: str) -> None:
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._instruction_prefixes = InstructionPrefixes()

    def render_chat(self, messages: list[ChatMessage]) -> RenderedPrompt:
        return render_chat(self._tokenizer, messages, self._instruction_prefixes)

    def tokenize_prompt(self, prompt: str | list[int]) -> RenderedPrompt:
        return tokenize_prompt(self._tokenizer, prompt)
