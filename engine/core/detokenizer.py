"""Streaming text for generated tokens: incremental detokenization and stop strings.

Two small pieces, used one after the other for every request:

    token id --IncrementalDetokenizer.add_token--> valid UTF-8 delta
             --StopStringMatcher.feed-------------> text safe to send, stopped?

IncrementalDetokenizer never emits part of a multi-byte character: a character whose bytes are
spread over several byte-level tokens is held back until its last byte arrives. Its deltas
concatenate exactly to `tokenizer.decode(output_ids, skip_special_tokens=True)` with
`clean_up_tokenization_spaces=False` (the embedded model's setting) once `flush()` has released
whatever an unfinished request still held.

StopStringMatcher cuts the text where the first stop string completes and never emits a prefix
of a stop string that a later delta might complete; it holds back at most max(len(stop)) - 1
characters, and only while they could still start a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens given to the decoder as left context: enough for decoders whose output depends on
# the previous token (SentencePiece-style leading spaces); byte-level BPE needs none.
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, one token at a time.

    Built on `tokenizers.decoders.DecodeStream`, which re-decodes a short window of ids per step
    and returns text only when the window no longer ends in an incomplete character (U+FFFD).
    Special tokens produce no text. Not thread-safe; one instance per request.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int]) -> None:
        """tokenizer: a fast tokenizer (it must expose `backend_tokenizer`).
        prompt_token_ids: the request's prompt; its last few tokens are left context, unless
        they end inside a character (a raw token-id prompt), in which case none is used, so the
        output text is always the decode of the output ids alone for byte-level tokenizers.
        """
        self._backend: Tokenizer = tokenizer.backend_tokenizer
        context = self._clean_context(list(prompt_token_ids[-CONTEXT_TOKENS:]))
        self._stream = DecodeStream(ids=context, skip_special_tokens=True)
        # Ids before the held ones (for flush), and the ids DecodeStream is still holding.
        self._anchor_ids: list[int] = context
        self._held_ids: list[int] = []
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes excluded until they complete or flush())."""
        return "".join(self._chunks)

    @property
    def has_held_tokens(self) -> bool:
        """True when some added tokens have not produced their text yet."""
        return bool(self._held_ids)

    def add_token(self, token_id: int) -> str:
        """Append one generated token; returns the text it completes ("" while it is held)."""
        chunk = self._stream.step(self._backend, token_id)
        if chunk is None:
            self._held_ids.append(token_id)
            return ""
        self._anchor_ids = (self._anchor_ids + self._held_ids + [token_id])[-CONTEXT_TOKENS:]
        self._held_ids = []
        self._chunks.append(chunk)
        return chunk

    def flush(self) -> str:
        """End of request: return the held-back text (incomplete characters become U+FFFD,
        as in tokenizer.decode). Mutates: clears the held tokens; add_token must not follow."""
        if not self._held_ids:
            return ""
        before = self._decode(self._anchor_ids)
        after = self._decode(self._anchor_ids + self._held_ids)
        self._held_ids = []
        chunk = after[len(before) :] if after.startswith(before) else self._decode(self._held_ids)
        if chunk:
            self._chunks.append(chunk)
        return chunk

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=True)

    def _clean_context(self, ids: list[int]) -> list[int]:
        """ids if their text ends on a whole character, else [] (DecodeStream needs the
        prefix text to stay a prefix once output tokens are appended)."""
        return [] if self._decode(ids).endswith(REPLACEMENT_CHAR) else ids


def find_stop(text: str, stops: Sequence[str], new_text_len: int) -> int | None:
    """Where to cut `text` for stop strings: the index where the first-completed stop string
    begins, among occurrences that end inside the last `new_text_len` characters (the new
    text); None when no stop string ends there.

    "First-completed" means the occurrence with the smallest end (on a tie, the longer one, so
    the smaller start). That is where a character-by-character scan would stop, so the cut does
    not depend on how the text was split into deltas: with stops ("abcd", "bc"), "abcd" is cut
    to "a" whether it arrives whole or one character at a time. Occurrences lying wholly in the
    older text are ignored: the caller checked those before.
    """
    old_len = len(text) - new_text_len
    best: tuple[int, int] | None = None  # (end, start)
    for stop in stops:
        # The first occurrence at or after this index is the first one that ends past old_len.
        start = text.find(stop, max(0, old_len - len(stop) + 1))
        if start >= 0 and (best is None or (start + len(stop), start) < best):
            best = (start + len(stop), start)
    return None if best is None else best[1]


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string:
    the characters a streamer must hold back because the next delta may complete a stop."""
    longest = min(len(text), max((len(s) for s in stops), default=1) - 1)
    for size in range(longest, 0, -1):
        tail = text[-size:]
        if any(stop.startswith(tail) for stop in stops):
            return size
    return 0


class StopStringMatcher:
    """Applies stop strings to a stream of text deltas.

    feed() returns the text that may be sent now and whether a stop string was hit. The stop
    string and everything after it are never returned. A tail that could be the start of a stop
    string (at most max(len(stop)) - 1 characters) is held until the next delta decides it, or
    until flush() at the end of a request that finished for another reason.
    With no stop strings, every delta passes through unchanged.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops: tuple[str, ...] = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a delta; returns (text to emit now, stopped). After a stop, returns ("", True)."""
        if self.stopped:
            return "", True
        buffer = self._held + delta
        index = find_stop(buffer, self.stops, len(delta))
        if index is not None:
            self._held = ""
            self.stopped = True
            return buffer[:index], True
        hold = stop_prefix_len(buffer, self.stops)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """End of request (length, EOS, abort): release the held tail. Mutates: clears it."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
