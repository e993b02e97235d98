"""The verified instruction boundary (docs/design.md section 3): where the leading system and
developer messages end in the rendered prompt, or no boundary at all.

A wrong boundary would silently corrupt answers (a checkpoint restored at the wrong token), so
this fails closed: the boundary is the length of the instructions rendered alone, accepted only
when those ids are, token for token, a proper prefix of the full rendering. Anything else
(a template that injects text after the system block or merges it into the first user turn, a
BPE merge across the seam, any exception) gives no boundary and a reason to count.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

INSTRUCTION_ROLES = ("system", "developer")


class BoundaryRejection(str, enum.Enum):
    NO_LEADING_INSTRUCTIONS = "no_leading_instructions"
    ALL_INSTRUCTIONS = "all_instructions"
    NOT_A_PREFIX = "not_a_prefix"
    RENDER_ERROR = "render_error"


@dataclass(frozen=True)
class InstructionBoundary:
    """position: tokens of the prompt covered by the leading instructions, or None;
    rejection says why there is none."""

    position: int | None
    rejection: BoundaryRejection | None = None


def find_instruction_boundary(
    tokenizer: Any, conversation: list[dict[str, Any]], prompt_ids: Sequence[int]
) -> InstructionBoundary:
    """The boundary of `conversation` (as rendered to `prompt_ids` with the generation prompt).

    Renders conversation[:k] (k = leading system/developer messages) without a generation
    prompt and checks it token by token against prompt_ids. Never raises.
    """
    k = 0
    while k < len(conversation) and conversation[k].get("role") in INSTRUCTION_ROLES:
        k += 1
    if k == 0:
        return InstructionBoundary(None, BoundaryRejection.NO_LEADING_INSTRUCTIONS)
    if k == len(conversation):
        return InstructionBoundary(None, BoundaryRejection.ALL_INSTRUCTIONS)
    try:
        prefix = tokenizer.apply_chat_template(
            conversation[:k], add_generation_prompt=False, tokenize=True, return_dict=False
        )
        prefix = [int(t) for t in prefix]
    except Exception:  # any template or tokenizer failure: no boundary
        return InstructionBoundary(None, BoundaryRejection.RENDER_ERROR)
    if 0 < len(prefix) < len(prompt_ids) and list(prompt_ids[: len(prefix)]) == prefix:
        return InstructionBoundary(len(prefix))
    return InstructionBoundary(None, BoundaryRejection.NOT_A_PREFIX)
