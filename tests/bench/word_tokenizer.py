"""A token counter for tests whose counts are checkable by hand: one token a word, and a chat
template that opens each message with a role token and closes it with END (the generation
prompt is the assistant role token); list contents are their text parts' words, and any
cache_control marker is ignored. Token ids are stable per word within a process."""

from __future__ import annotations

ROLE_IDS = {"system": -1, "developer": -2, "user": -3, "assistant": -4}
END = -9


class WordTokenizer:
    name = "one token a word (tests)"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def _word_ids(self, text: str) -> list[int]:
        return [self._ids.setdefault(word, len(self._ids)) for word in text.split()]

    def count(self, text: str) -> int:
        return len(text.split())

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool) -> tuple[int, ...]:
        ids: list[int] = []
        for m in messages:
            content = m.get("content") or ""
            if isinstance(content, list):  # text parts, joined by a newline (as the tiny model's template)
                content = "\n".join(part["text"] for part in content)
            ids += [ROLE_IDS[m["role"]], *self._word_ids(content), END]
        return tuple(ids + ([ROLE_IDS["assistant"]] if add_generation_prompt else []))
