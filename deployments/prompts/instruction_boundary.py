"""The verified instruction boundary (docs/design.md section 3): where the leading system and
developer messages end in the rendered prompt, or no boundary at all; and the rule behind it,
which the cache breakpoints (cache_breakpoints.py) follow too.

A wrong boundary would silently corrupt answers (a checkpoint restored at the wrong token), so
this fails closed: the boundary is the length of the instructions rendered alone, accepted only
when those ids are, token for token, a proper prefix of the full rendering (verified_position).
Anything else (a template that injects text after the system block or merges it into the first
user turn, a BPE merge across the seam, any exception) gives no boundary and a reason to count.
PromptRenderer (rendering.py) applies the same rule with the renderings' ids remembered.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deployments.prompts.exact_cuts import encode_text

INSTRUCTION_ROLES = ("system", "developer")


class BoundaryRejection(str, enum.Enum):
    NO_LEADING_INSTRUCTIONS = "no_leading_instructions"
    ALL_INSTRUCTIONS = "all_instructions"
    NOT_A_PREFIX = "not_a_prefix"
    RENDER_ERROR = "render_error"


@dataclass(frozen=True)
class VerifiedPosition:
    """position: tokens of the prompt covered (by the leading instructions, or up to a cache
    breakpoint), or None; rejection says why there is none."""

    position: int | None
    rejection: BoundaryRejection | None = None


def render_alone(tokenizer: Any, head: list[dict[str, Any]], continue_final: bool = False) -> str:
    """`head` (a conversation's leading messages) through the chat template without a generation
    prompt, as text; with continue_final, cut at the end of the last message's content
    (transformers' continue_final_message: no end-of-turn tokens after it). Raises what the
    template raises."""
    options = {"continue_final_message": True} if continue_final else {}
    return tokenizer.apply_chat_template(head, add_generation_prompt=False, tokenize=False, **options)


def verified_position(prefix_ids: Sequence[int], prompt_ids: Sequence[int]) -> VerifiedPosition:
    """The one rule for a position inside a chat prompt: `prefix_ids` (a head rendered alone,
    tokenized) give the position len(prefix_ids) only when they are, token for token, a proper
    prefix of `prompt_ids` (the full rendering with the generation prompt); otherwise
    NOT_A_PREFIX."""
    if 0 < len(prefix_ids) < len(prompt_ids) and tuple(prompt_ids[: len(prefix_ids)]) == tuple(prefix_ids):
        return VerifiedPosition(len(prefix_ids))
    return VerifiedPosition(None, BoundaryRejection.NOT_A_PREFIX)


def verified_prefix(
    tokenizer: Any, head: list[dict[str, Any]], prompt_ids: Sequence[int], continue_final: bool = False,
) -> VerifiedPosition:
    """`head` rendered alone (render_alone) and tokenized (encode_text, as apply_chat_template
    tokenizes), through verified_position; RENDER_ERROR for any exception of the template or
    tokenizer. Never raises."""
    try:
        prefix = encode_text(tokenizer, render_alone(tokenizer, head, continue_final))
    except Exception:  # any template or tokenizer failure: no position
        return VerifiedPosition(None, BoundaryRejection.RENDER_ERROR)
    return verified_position(prefix, prompt_ids)


def instruction_head(conversation: list[dict[str, Any]]) -> list[dict[str, Any]] | BoundaryRejection:
    """conversation[:k], k the leading system/developer messages; NO_LEADING_INSTRUCTIONS when
    k == 0, ALL_INSTRUCTIONS when every message is one (nothing follows them)."""
    k = 0
    while k < len(conversation) and conversation[k].get("role") in INSTRUCTION_ROLES:
        k += 1
    if k == 0:
        return BoundaryRejection.NO_LEADING_INSTRUCTIONS
    if k == len(conversation):
        return BoundaryRejection.ALL_INSTRUCTIONS
    return conversation[:k]


def find_instruction_boundary(
    tokenizer: Any, conversation: list[dict[str, Any]], prompt_ids: Sequence[int],
) -> VerifiedPosition:
    """The boundary of `conversation` (as rendered to `prompt_ids` with the generation prompt):
    its instruction_head through verified_prefix. Never raises."""
    head = instruction_head(conversation)
    if isinstance(head, BoundaryRejection):
        return VerifiedPosition(None, head)
    return verified_prefix(tokenizer, head, prompt_ids)
