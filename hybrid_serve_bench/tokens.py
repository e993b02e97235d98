"""Token counts and token ids, with the served model's tokenizer and chat template.

The benchmark never estimates tokens: the shareable-token denominator of the hit rate is a
count of the server's own prompt tokens, so a counter that is not the served model's tokenizer
makes rates meaningless (words x 1.3 once printed 198.8%). The counter is, in order: --tokenizer
DIR; else the served model directory that the server names in GET /v1/models (`root`, which
hybrid-serve and vLLM both report) when that directory exists on this machine; compare-policies
uses its own model dir. Without one, the CLI refuses (served_tokenizer_dir, cli.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class TokenCounter(Protocol):
    """What the workloads and the shareable accounting need to know about tokens."""

    name: str

    def count(self, text: str) -> int:
        """Tokens of a plain text (no special tokens)."""
        ...

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool) -> tuple[int, ...]:
        """The token ids of `messages` rendered by the chat template: with the generation prompt,
        the prompt a server computes for a request; without it, a conversation whose last
        message is a reply, as a later turn resends it."""
        ...


class TokenizerCounter:
    """Exact counts from a local Hugging Face model directory (tokenizer + chat template)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer
        from transformers.utils import logging

        if not has_tokenizer(model_dir):
            raise ValueError(f"{model_dir} is not a local directory with a tokenizer "
                             f"(none of {', '.join(TOKENIZER_FILES)})")
        logging.set_verbosity_error()  # no "longer than the maximum length" warnings while measuring
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.name = f"tokenizer of {model_dir}"

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool) -> tuple[int, ...]:
        if not messages:
            return ()
        ids = self._tokenizer.apply_chat_template(without_cache_control(messages),
                                                  add_generation_prompt=add_generation_prompt,
                                                  tokenize=True, return_dict=False)
        return tuple(map(int, ids))


def without_cache_control(messages: list[dict]) -> list[dict]:
    """`messages` without their cache_control markers (on messages and content parts): a server
    that honours them, as hybrid-serve does, renders the messages without them, so its prompt
    ids are the template's rendering of these."""
    def strip(item):
        return {k: v for k, v in item.items() if k != "cache_control"} if isinstance(item, dict) else item

    return [{**strip(m), **({"content": [strip(p) for p in m["content"]]} if isinstance(m.get("content"), list)
                            else {})} for m in messages]


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether `model_dir` is a directory on this machine with tokenizer files."""
    path = Path(model_dir)
    return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES)


def served_root(identity: dict, model: str) -> str | None:
    """The `root` (model directory) of `model`'s card in a GET /v1/models answer, or None."""
    cards = identity.get("data") if isinstance(identity, dict) else None
    for card in cards if isinstance(cards, list) else []:
        if isinstance(card, dict) and card.get("id") == model and isinstance(card.get("root"), str):
            return card["root"]
    return None


def served_tokenizer_dir(identity: dict, model: str) -> str | None:
    """The served model directory (served_root) when it has tokenizer files on this machine."""
    root = served_root(identity, model)
    return str(Path(root).resolve()) if root is not None and has_tokenizer(root) else None
