"""The verified instruction boundary (docs/design.md section 3): where the leading system and
developer messages end in the rendered prompt, or no boundary at all; and the rule behind it,
which the cache breakpoints (cache_breakpoints.py) follow too.

A wrong boundary would silently corrupt answers (a checkpoint restored at the wrong token), so
this fails closed: the boundary is the length of the instructions rendered alone, accepted only
when those ids are, token for token, a proper prefix of the full rendering (verified_prefix).
Anything else (a template that injects text after the system block or merges it into the first
user turn, a BPE merge across the seam, any exception) gives no boundary and a reason to count.
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
class VerifiedPosition:
    """position: tokens of the prompt covered (by the leading instructions, or up to a cache
    breakpoint), or None; rejection says why there is none."""

    position: int | None
    rejection: BoundaryRejection | None = None


class RenderedPrefixes:
    """The token ids of a conversation's leading messages rendered alone (without a generation
    prompt, or up to the end of the last one's content with continue_final), remembered by the
    messages' content; past `capacity` the least recently used is forgotten. An application's
    requests share their instructions (and a client's marked few-shot examples or documents),
    so those are rendered and tokenized once instead of once a request: at 8,000 instruction
    tokens that was half of render_chat's time (benchmarks/render_time.py). The ids are one
    tokenizer's: one instance per tokenizer. A remembered rendering is used only where it is,
    token for token, a proper prefix of the full rendering; otherwise the messages are
    rendered again and that rendering replaces it, so a template whose output changes between
    calls (one that prints the date) costs one render when it changes and never corrupts or
    loses the boundary; a template that gives no boundary renders them every time, as without
    this memory. Thread-safe."""

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def ids(
        self, tokenizer: Any, head: list[dict[str, Any]], prompt_ids: Sequence[int],
        continue_final: bool = False,
    ) -> tuple[int, ...]:
        """`head` rendered alone and tokenized (_render_alone): the remembered rendering where
        it is a proper token prefix of `prompt_ids` (the full rendering), else rendered now and
        remembered; raises what the template raises (and remembers nothing then)."""
        key = json.dumps([continue_final, head], sort_keys=True, ensure_ascii=False, default=str)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
        if ids is not None and _is_proper_prefix(ids, prompt_ids):
            return ids
        ids = _render_alone(tokenizer, head, continue_final)
        with self._lock:
            self._ids[key] = ids
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)
        return ids


def _render_alone(tokenizer: Any, head: list[dict[str, Any]], continue_final: bool = False) -> tuple[int, ...]:
    """`head` through the chat template without a generation prompt, tokenized; with
    continue_final, cut at the end of the last message's content (transformers'
    continue_final_message: no end-of-turn tokens after it)."""
    options = {"continue_final_message": True} if continue_final else {}
    return tuple(map(int, tokenizer.apply_chat_template(
        head, add_generation_prompt=False, tokenize=True, return_dict=False, **options)))


def _is_proper_prefix(prefix: tuple[int, ...], prompt_ids: Sequence[int]) -> bool:
    return 0 < len(prefix) < len(prompt_ids) and tuple(prompt_ids[: len(prefix)]) == prefix


def verified_prefix(
    tokenizer: Any, head: list[dict[str, Any]], prompt_ids: Sequence[int],
    prefixes: RenderedPrefixes | None = None, continue_final: bool = False,
) -> VerifiedPosition:
    """The one rule for a position inside a chat prompt: render `head` (the conversation's
    leading messages, the last one cut at the end of its content with continue_final) alone,
    or take that rendering from `prefixes`, and accept its length only when it is, token for
    token, a proper prefix of `prompt_ids` (the full rendering with the generation prompt).
    Otherwise no position: RENDER_ERROR for any exception of the template or tokenizer,
    NOT_A_PREFIX for a rendering that is not a proper prefix. Never raises."""
    try:
        prefix = (prefixes.ids(tokenizer, head, prompt_ids, continue_final) if prefixes is not None
                  else _render_alone(tokenizer, head, continue_final))
    except Exception:  # any template or tokenizer failure: no position
        return VerifiedPosition(None, BoundaryRejection.RENDER_ERROR)
    if _is_proper_prefix(prefix, prompt_ids):
        return VerifiedPosition(len(prefix))
    return VerifiedPosition(None, BoundaryRejection.NOT_A_PREFIX)


def find_instruction_boundary(
    tokenizer: Any, conversation: list[dict[str, Any]], prompt_ids: Sequence[int],
    prefixes: RenderedPrefixes | None = None,
) -> VerifiedPosition:
    """The boundary of `conversation` (as rendered to `prompt_ids` with the generation prompt):
    conversation[:k] (k = leading system/developer messages) through verified_prefix, with
    `prefixes` as its memory. Never raises.
    """
    k = 0
    while k < len(conversation) and conversation[k].get("role") in INSTRUCTION_ROLES:
        k += 1
    if k == 0:
        return VerifiedPosition(None, BoundaryRejection.NO_LEADING_INSTRUCTIONS)
    if k == len(conversation):
        return VerifiedPosition(None, BoundaryRejection.ALL_INSTRUCTIONS)
    return verified_prefix(tokenizer, conversation[:k], prompt_ids, prefixes)
