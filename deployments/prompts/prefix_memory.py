"""The token ids of rendered prompt prefixes, remembered by their exact text (docs/design.md
section 3.2): an application's requests share their instructions (and a client's marked
examples or documents), so their ids are computed once, not once a request.

The key is the rendered text itself and the value its ids under one tokenizer (encode_text is
deterministic), so a remembered entry is never stale: a template whose output changes (one that
prints the date) renders another text, which is another key. One memory per tokenizer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_ENTRIES = 64
DEFAULT_TOKENS = 1 << 20  # about 40 MB of Python ints and their texts at most


class RenderedPrefixes:
    """A least-recently-used map of rendered prefix text -> its token ids, bounded by `entries`
    and by `tokens` (the sum of the remembered ids' lengths): past either, the least recently
    used are forgotten; an entry longer than `tokens` alone is not remembered. Counts its hits
    and misses. Thread-safe."""

    def __init__(self, entries: int = DEFAULT_ENTRIES, tokens: int = DEFAULT_TOKENS) -> None:
        if entries < 1 or tokens < 1:
            raise ValueError(f"entries and tokens must be >= 1, got {entries}, {tokens}")
        self.entries, self.tokens = entries, tokens
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._held = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def held_tokens(self) -> int:
        return self._held

    def get(self, text: str) -> tuple[int, ...] | None:
        """The ids remembered for exactly `text` (now the most recently used), or None."""
        with self._lock:
            ids = self._ids.get(text)
            if ids is None:
                self.misses += 1
                return None
            self.hits += 1
            self._ids.move_to_end(text)
            return ids

    def put(self, text: str, ids: tuple[int, ...]) -> None:
        """Remember `ids` as `text`'s (the caller guarantees they are encode_text(text)), then
        forget the least recently used past the bounds."""
        if len(ids) > self.tokens:
            return
        with self._lock:
            old = self._ids.pop(text, None)
            self._held -= len(old) if old is not None else 0
            self._ids[text] = ids
            self._held += len(ids)
            while len(self._ids) > self.entries or self._held > self.tokens:
                _, dropped = self._ids.popitem(last=False)
                self._held -= len(dropped)
