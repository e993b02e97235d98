"""Token counts for building workloads and counting shareable tokens.

Two counters with one interface (TokenCounter):
  TokenizerCounter  a local model directory's tokenizer and chat template: exact for that model;
  WordCounter       no model at hand: tokens = ceil(words x tokens_per_word), and a rendered
                    message prefix adds MESSAGE_OVERHEAD_TOKENS per message (role markers).
                    DEFAULT_TOKENS_PER_WORD = 1.3 is typical of English BPE vocabularies
                    (GPT-2/Llama-style); the benchmark's pseudo-English uses common words, so it
                    is a fair guess for real models, and only an estimate: hit rates computed
                    with it can be off by tens of percent (and exceed 100%). The embedded tiny
                    model's small BPE vocabulary splits these words into ~2.5 tokens each, so
                    runs against it pass --tokenizer (compare-policies always does).
"""

from __future__ import annotations

import math
from typing import Protocol

DEFAULT_TOKENS_PER_WORD = 1.3
MESSAGE_OVERHEAD_TOKENS = 4


class TokenCounter(Protocol):
    """What the workloads and the shareable accounting need to know about tokens."""

    name: str

    def count(self, text: str) -> int:
        """Tokens of a plain text (no special tokens)."""
        ...

    def prefix_tokens(self, messages: list[dict]) -> int:
        """Tokens of `messages` rendered as the start of a chat prompt (no generation prompt):
        where a cache could cut a prompt that begins with exactly these messages."""
        ...


class WordCounter:
    """Estimate: words x tokens_per_word, plus MESSAGE_OVERHEAD_TOKENS per rendered message."""

    def __init__(self, tokens_per_word: float = DEFAULT_TOKENS_PER_WORD) -> None:
        if tokens_per_word <= 0:
            raise ValueError(f"tokens_per_word must be positive, got {tokens_per_word}")
        self.tokens_per_word = tokens_per_word
        self.name = f"words x {tokens_per_word}"

    def count(self, text: str) -> int:
        return math.ceil(len(text.split()) * self.tokens_per_word)

    def prefix_tokens(self, messages: list[dict]) -> int:
        return sum(self.count(str(m.get("content") or "")) + MESSAGE_OVERHEAD_TOKENS for m in messages)


class TokenizerCounter:
    """Exact counts from a local Hugging Face model directory (tokenizer + chat template)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer
        from transformers.utils import logging

        logging.set_verbosity_error()  # no "longer than the maximum length" warnings while measuring
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.name = f"tokenizer of {model_dir}"

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def prefix_tokens(self, messages: list[dict]) -> int:
        if not messages:
            return 0
        ids = self._tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                  tokenize=True, return_dict=False)
        return len(ids)
