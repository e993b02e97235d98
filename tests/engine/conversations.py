"""Random conversations for checkpoint tests: shared system prompts, varied user turns."""

from __future__ import annotations

import random

WORDS = (
    "the a model state cache token prompt answer question system user assistant hybrid layer "
    "attention mamba recurrent block checkpoint restore exact output logits greedy sample "
    "river mountain city number seven twelve blue green quick slow write read explain list "
    "why how when where carefully briefly please thanks code python function return value "
    "über café naïve 東京 数据 🙂 résumé"
).split()


def random_text(rng: random.Random, min_words: int, max_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), "\n")
    return " ".join(words)


def system_prompts(rng: random.Random, count: int) -> list[str]:
    return [random_text(rng, 20, 70) for _ in range(count)]


def render(tokenizer, conversation: list[dict]) -> list[int]:
    return [int(t) for t in tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False)]
