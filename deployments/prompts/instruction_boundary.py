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
import json
import threading
from collections import OrderedDict
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


class InstructionPrefixes:
    """The token ids of leading instruction messages rendered alone (without a generation
    prompt), remembered by the messages' content; past `capacity` the least recently used is
    forgotten. An application's requests share their instructions, so those are rendered and
    tokenized once instead of once a request: at 8,000 instruction tokens that was half of
    render_chat's time (benchmarks/render_time.py). The ids are one tokenizer's: one instance
    per tokenizer. A remembered rendering is used only where it is, token for token, a proper
    prefix of the full rendering; otherwise the instructions are rendered again and that
    rendering replaces it, so a template whose output changes between calls (one that prints
    the date) costs one render when it changes and never corrupts or loses the boundary; a
    template that gives no boundary renders them every time, as without this memory.
    Thread-safe."""

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def ids(
        self, tokenizer: Any, instructions: list[dict[str, Any]], prompt_ids: Sequence[int],
    ) -> tuple[int, ...]:
        """`instructions` rendered alone and tokenized: the remembered rendering where it is a
        proper token prefix of `prompt_ids` (their full rendering), else rendered now and
        remembered; raises what the template raises (and remembers nothing then)."""
        key = json.dumps(instructions, sort_keys=True, ensure_ascii=False, default=str)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
        if ids is not None and _is_proper_prefix(ids, prompt_ids):
            return ids
        ids = _render_alone(tokenizer, instructions)
        with self._lock:
            self._ids[key] = ids
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)
        return ids


def _render_alone(tokenizer: Any, instructions: list[dict[str, Any]]) -> tuple[int, ...]:
    return tuple(map(int, tokenizer.apply_chat_template(
        instructions, add_generation_prompt=False, tokenize=True, return_dict=False)))


def _is_proper_prefix(prefix: tuple[int, ...], prompt_ids: Sequence[int]) -> bool:
    return 0 < len(prefix) < len(prompt_ids) and tuple(prompt_ids[: len(prefix)]) == prefix


def find_instruction_boundary(
    tokenizer: Any, conversation: list[dict[str, Any]], prompt_ids: Sequence[int],
    prefixes: InstructionPrefixes | None = None,
) -> InstructionBoundary:
    """The boundary of `conversation` (as rendered to `prompt_ids` with the generation prompt).

    Renders conversation[:k] (k = leading system/developer messages) without a generation
    prompt, or takes that rendering from `prefixes` (which renders again a remembered one that
    is not a prefix), and checks it token by token against prompt_ids. Never raises.
    """
    k = 0
    while k < len(conversation) and conversation[k].get("role") in INSTRUCTION_ROLES:
        k += 1
    if k == 0:
        return InstructionBoundary(None, BoundaryRejection.NO_LEADING_INSTRUCTIONS)
    if k == len(conversation):
        return InstructionBoundary(None, BoundaryRejection.ALL_INSTRUCTIONS)
    try:
        instructions = conversation[:k]
        prefix = (prefixes.ids(tokenizer, instructions, prompt_ids) if prefixes is not None
                  else _render_alone(tokenizer, instructions))
    except Exception:  # any template or tokenizer failure: no boundary
        return InstructionBoundary(None, BoundaryRejection.RENDER_ERROR)
    if _is_proper_prefix(prefix, prompt_ids):
        return InstructionBoundary(len(prefix))
    return InstructionBoundary(None, BoundaryRejection.NOT_A_PREFIX)
