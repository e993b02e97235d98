"""Client-directed checkpoints (docs/design.md section 3): the `cache_control` markers a chat
request puts on messages and on text content parts, and the prompt position of each, verified by
the instruction boundary's rule (instruction_boundary.verified_prefix) or dropped.

A marker is `{"type": "ephemeral"}` (Anthropic's Messages API convention) under the key
"cache_control" of a message or of one of its text parts. It says "what comes up to here is
shared by later requests": on a message, up to the end of that message (its end-of-turn tokens
included); on a content part, up to the end of that part's text. The markers are taken out of
the messages before the chat template sees them, so a marked conversation renders to the same
token ids as the same conversation without markers, and the two share checkpoints.

Each marker's position is the length of the conversation rendered alone up to it (for a part:
the messages before, then its message with its parts up to the marked one, cut at the end of
that text, `continue_final_message`), accepted only when those ids are a proper token prefix of
the full prompt. Otherwise the marker is dropped and its reason (not_a_prefix, render_error)
comes back to be counted: fail closed, never an approximate position.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from deployments.prompts.instruction_boundary import BoundaryRejection, VerifiedPosition, verified_prefix
from engine.interfaces.sampling_params import InvalidRequestError

CACHE_CONTROL = "cache_control"
EPHEMERAL = {"type": "ephemeral"}  # the one marker accepted


@dataclass(frozen=True)
class CacheMarker:
    """Where a client put a cache_control marker: messages[message], and within its list
    content the text part `part` (None: the whole message)."""

    message: int
    part: int | None = None


@dataclass(frozen=True)
class CacheBreakpoints:
    """positions: the accepted markers' prompt positions, sorted and unique; rejections: one
    reason per dropped marker, in the conversation's order."""

    positions: tuple[int, ...] = ()
    rejections: tuple[BoundaryRejection, ...] = ()


def split_cache_markers(
    conversation: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], tuple[CacheMarker, ...]]:
    """The conversation without its cache_control keys (new dicts; the caller's are not
    changed), and the markers found, in order. A marker that is None counts as absent.
    Raises InvalidRequestError (param "messages") for a marker other than {"type":
    "ephemeral"}: the HTTP edge validates it already (deployments/http/protocol.py), callers
    without it (the benchmark's in-process target) get the same refusal."""
    stripped: list[dict[str, Any]] = []
    markers: list[CacheMarker] = []
    for m, message in enumerate(conversation):
        message = dict(message)
        whole = _marked(message.pop(CACHE_CONTROL, None), f"messages[{m}]")
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            parts = []
            for p, part in enumerate(content):
                if isinstance(part, dict):
                    part = dict(part)
                    if _marked(part.pop(CACHE_CONTROL, None), f"messages[{m}].content[{p}]"):
                        markers.append(CacheMarker(m, p))
                parts.append(part)
            message["content"] = parts
        if whole:
            markers.append(CacheMarker(m))
        stripped.append(message)
    return stripped, tuple(markers)


def _marked(value: Any, where: str) -> bool:
    if value is None:
        return False
    if value != EPHEMERAL:
        raise InvalidRequestError(f'{where}.cache_control must be {{"type": "ephemeral"}}, got {value!r}',
                                  "messages")
    return True


def marker_head(conversation: list[dict[str, Any]], marker: CacheMarker) -> list[dict[str, Any]]:
    """The messages a marker covers, to render alone: up to its message; for a part, that
    message's parts up to the marked one (rendered with continue_final = marker.part is not
    None)."""
    head = conversation[: marker.message + 1]
    if marker.part is not None:
        message = conversation[marker.message]
        head = [*head[:-1], {**message, "content": list(message["content"][: marker.part + 1])}]
    return head


def find_cache_breakpoints(
    tokenizer: Any, conversation: list[dict[str, Any]], markers: Sequence[CacheMarker],
    prompt_ids: Sequence[int],
) -> CacheBreakpoints:
    """The verified position of each marker in `conversation` (without markers, as
    split_cache_markers leaves it, rendered to `prompt_ids` with the generation prompt), by
    verified_prefix. Never raises."""
    return collect_breakpoints(
        verified_prefix(tokenizer, marker_head(conversation, marker), prompt_ids,
                        continue_final=marker.part is not None)
        for marker in markers)


def collect_breakpoints(verdicts: Iterable[VerifiedPosition]) -> CacheBreakpoints:
    """The markers' verdicts, in the conversation's order, as CacheBreakpoints."""
    positions: set[int] = set()
    rejections: list[BoundaryRejection] = []
    for verdict in verdicts:
        if verdict.position is None:
            rejections.append(verdict.rejection)
        else:
            positions.add(verdict.position)
    return CacheBreakpoints(tuple(sorted(positions)), tuple(rejections))
