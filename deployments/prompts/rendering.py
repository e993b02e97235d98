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

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deployments.prompts.cache_breakpoints import collect_breakpoints, marker_head, split_cache_markers
from deployments.prompts.exact_cuts import CutRule, encode_text
from deployments.prompts.instruction_boundary import (
    BoundaryRejection,
    VerifiedPosition,
    instruction_head,
    render_alone,
    verified_position,
)
from deployments.prompts.prefix_memory import RenderedPrefixes
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
    reused_tokens: leading prompt tokens whose ids the renderer took from its memory of
        rendered prefixes instead of tokenizing them (the rest were tokenized); not part of the
        prompt's identity (left out of ==).
    """

    token_ids: tuple[int, ...]
    instruction_boundary: int | None = None
    boundary_rejection: str | None = None
    cache_breakpoints: tuple[int, ...] = ()
    breakpoint_rejections: tuple[str, ...] = ()
    reused_tokens: int = field(default=0, compare=False)


@dataclass
class _Head:
    """Leading messages whose rendering alone gives a position: the instructions, or up to a
    cache_control marker. text: that rendering (None: the template raised); exact: text is a
    prefix of the prompt's text where CutRule cuts exactly; ids: its ids once known."""

    messages: list[dict[str, Any]]
    continue_final: bool
    memory: RenderedPrefixes
    text: str | None = None
    exact: bool = False
    ids: tuple[int, ...] | None = None


@dataclass
class ChatDraft:
    """A chat rendered to text and not yet tokenized (PromptRenderer.prepare_chat), for
    PromptRenderer.finish_chat. pending_chars: the characters finish_chat still has to
    tokenize (the prompt past its longest remembered prefix, and the heads not remembered)."""

    text: str
    instructions: _Head | BoundaryRejection
    breakpoints: list[_Head]
    start: int = 0                         # characters of text whose ids are `start_ids`
    start_ids: tuple[int, ...] = ()
    pending_chars: int = 0


@dataclass
class RenderStats:
    """A renderer's counts since it was made. chats: chats rendered; reuses: chats that started
    from a remembered prefix (the fast path); reused_tokens: prompt tokens taken from the
    memory; tokenized_tokens: prompt tokens tokenized for their chat."""

    chats: int = 0
    reuses: int = 0
    reused_tokens: int = 0
    tokenized_tokens: int = 0


class PromptRenderer:
    """One tokenizer (its chat template), the exact-cut rule proved for it (exact_cuts.py) and
    the prefix renderings it remembers (prefix_memory.py).

    A chat whose text starts with a remembered rendering (the application's instructions, a
    marked few-shot block) at a cut the rule accepts is tokenized only past it: its ids are the
    remembered ones plus those of the rest, which the rule proves equal to tokenizing the
    whole text; at any other cut, or with the rule off for this tokenizer, the whole text is
    tokenized. Each instruction or marker head is remembered as its text and ids.

    instruction_prefixes: where the instruction renderings are remembered; None: a new
    RenderedPrefixes of its own (they are one tokenizer's ids: share one only between renderers
    of the same tokenizer). The cache breakpoints' renderings are remembered apart
    (breakpoint_prefixes), so that markers on messages seen once (a conversation's latest turn)
    never push the shared instructions out. cuts: the rule (None: CutRule.of(tokenizer), a
    self-check of some tens of milliseconds). Thread-safe: the memories and stats are locked,
    the tokenizer only read.
    """

    def __init__(self, tokenizer: Any, instruction_prefixes: RenderedPrefixes | None = None,
                 cuts: CutRule | None = None) -> None:
        self.tokenizer = tokenizer
        self.instruction_prefixes = instruction_prefixes if instruction_prefixes is not None else RenderedPrefixes()
        self.breakpoint_prefixes = RenderedPrefixes()
        self.cuts = cuts if cuts is not None else CutRule.of(tokenizer)
        self.stats = RenderStats()
        self._stats_lock = threading.Lock()

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
        the dicts before anything is rendered (cache_breakpoints.py). The ids are always those
        of apply_chat_template(tokenize=True) on the conversation without markers.

        Raises InvalidRequestError (param "messages") when the template refuses the
        conversation (templates raise on roles or shapes they do not support), or a marker is
        not {"type": "ephemeral"}.
        """
        return self.finish_chat(self.prepare_chat(conversation))

    def prepare_chat(self, conversation: list[dict[str, Any]]) -> ChatDraft:
        """render_chat's first half, the templates only (a fraction of a millisecond at 8,000
        tokens): the chat and its heads rendered to text, the longest remembered head at an
        exact cut found. Raises as render_chat does."""
        conversation, markers = split_cache_markers(conversation)
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja2 TemplateError, or a template's raise_exception(...)
            raise InvalidRequestError(f"The chat template rejected the messages: {exc}", "messages")
        head = instruction_head(conversation)
        instructions = (head if isinstance(head, BoundaryRejection)
                        else _Head(head, False, self.instruction_prefixes))
        breakpoints = [_Head(marker_head(conversation, marker), marker.part is not None, self.breakpoint_prefixes)
                       for marker in markers]
        draft = ChatDraft(text, instructions, breakpoints)
        for item in self._heads(draft):
            try:
                item.text = render_alone(self.tokenizer, item.messages, item.continue_final)
            except Exception:  # no position for this head (RENDER_ERROR)
                continue
            item.exact = text.startswith(item.text) and self.cuts.exact_at(text, len(item.text))
            item.ids = item.memory.get(item.text)
            if item.exact and item.ids is not None and len(item.text) > draft.start:
                draft.start, draft.start_ids = len(item.text), item.ids
        for item in self._heads(draft):
            if item.exact and item.ids is None and len(item.text) == draft.start:
                item.ids = draft.start_ids  # the same text as the head started from
                item.memory.put(item.text, item.ids)
        draft.pending_chars = len(text) - draft.start + sum(
            len(item.text) for item in self._heads(draft)
            if item.text is not None and item.ids is None and not (item.exact and len(item.text) > draft.start))
        return draft

    def finish_chat(self, draft: ChatDraft) -> RenderedPrompt:
        """render_chat's second half: tokenize what draft.pending_chars counts, verify each
        position, remember the heads. Raises InvalidRequestError (param "messages") when the
        tokenizer fails on the prompt."""
        try:
            token_ids = self._tokenize(draft)
        except Exception as exc:
            raise InvalidRequestError(f"The chat could not be tokenized: {exc}", "messages")
        verdicts = [self._verified(item, token_ids) for item in draft.breakpoints]
        boundary = (VerifiedPosition(None, draft.instructions) if isinstance(draft.instructions, BoundaryRejection)
                    else self._verified(draft.instructions, token_ids))
        breakpoints = collect_breakpoints(verdicts)
        with self._stats_lock:
            self.stats.chats += 1
            self.stats.reuses += draft.start > 0
            self.stats.reused_tokens += len(draft.start_ids)
            self.stats.tokenized_tokens += len(token_ids) - len(draft.start_ids)
        return RenderedPrompt(
            token_ids=token_ids,
            instruction_boundary=boundary.position,
            boundary_rejection=boundary.rejection.value if boundary.rejection is not None else None,
            cache_breakpoints=breakpoints.positions,
            breakpoint_rejections=tuple(reason.value for reason in breakpoints.rejections),
            reused_tokens=len(draft.start_ids),
        )

    @staticmethod
    def _heads(draft: ChatDraft) -> list[_Head]:
        heads = [] if isinstance(draft.instructions, BoundaryRejection) else [draft.instructions]
        return heads + draft.breakpoints

    def _tokenize(self, draft: ChatDraft) -> tuple[int, ...]:
        """The prompt's ids: the remembered ids of its first draft.start characters, then the
        text between the later exact cuts and after the last one, each tokenized alone, the
        heads at those cuts given their ids and remembered. Exact by CutRule: a cut exact in
        the whole text is exact in a piece of it that contains it (the added token at the cut
        lies within the piece, else it would straddle the next cut, and a piece has fewer
        characters to straddle it)."""
        text, start, ids = draft.text, draft.start, draft.start_ids
        at_cut: dict[int, list[_Head]] = {}
        for item in self._heads(draft):
            if item.exact and len(item.text) > start:
                at_cut.setdefault(len(item.text), []).append(item)
        for cut in sorted(at_cut):
            ids += encode_text(self.tokenizer, text[start:cut])
            start = cut
            for item in at_cut[cut]:
                item.ids = ids
                item.memory.put(item.text, ids)
        return ids + encode_text(self.tokenizer, text[start:])

    def _verified(self, item: _Head, token_ids: tuple[int, ...]) -> VerifiedPosition:
        """The head's position by the one rule (verified_position), its ids tokenized alone and
        remembered when they are not known yet; RENDER_ERROR where its template or tokenizer
        raised."""
        if item.text is None:
            return VerifiedPosition(None, BoundaryRejection.RENDER_ERROR)
        if item.ids is None:
            try:
                item.ids = encode_text(self.tokenizer, item.text)
            except Exception:
                return VerifiedPosition(None, BoundaryRejection.RENDER_ERROR)
            item.memory.put(item.text, item.ids)
        return verified_position(item.ids, token_ids)

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
